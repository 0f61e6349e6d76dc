"""`DeviceLayout`: where the runners' arrays live and how their steps are partitioned.

`meshserve.sharding.layout` builds one from a mesh and the sharding rules; the runners
(`meshserve.model.executor.runner`, `meshserve.model.executor.pipeline_runner`) apply it. Both
import it from here, so neither depends on the other. Without a layout a runner runs on the
default device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """Where the runner's arrays live and how its step is partitioned."""

    mesh: Mesh
    params: Any  # a NamedSharding per weight: a pytree prefix of the params state
    cache: NamedSharding  # K and V [L, K, P, S, h]
    rows: NamedSharding  # the leading axis of every per-row step array
    cache_manual: PartitionSpec  # the cache's spec over the replica axes (shard_map)
    rows_manual: PartitionSpec  # the rows' spec over the replica axes (shard_map)
    replica_axes: tuple[str, ...]  # mesh axes the step is mapped over; () for none
    num_replicas: int
    constrain: Callable[[jax.Array, tuple[str, ...]], jax.Array] | None = None
