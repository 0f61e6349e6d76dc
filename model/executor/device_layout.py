"""`DeviceLayout`: where the runners' arrays live and how their steps are partitioned.

`meshserve.sharding.layout` builds one from a mesh and the sharding rules; the runners
(`meshserve.model.executor.runner`, `meshserve.model.executor.pipeline_runner`) apply it with the
functions here: `to_devices` puts host arrays where the layout says, `jit_step` and `jit_rows`
jit a step's functions over it, `output_sharding` says where results land. Both runners import
them from here, so neither depends on the other. Without a layout a runner runs on the default
device.
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


def to_devices(tree, sharding):
    """`tree`'s numpy leaves on device, placed by `sharding` (None: the default device).

    One `device_put` moves a whole tree (`jnp.asarray` would compile a conversion per shape).
    With several processes each one builds only its own devices' shards from its copy of the
    (identical) host arrays: `device_put` would first compare the copies across processes, a
    collective per transfer.
    """
    if sharding is None or jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index]), tree)


def jit_step(fn: Callable, layout: DeviceLayout | None, *, num_row_args: int) -> Callable:
    """`fn(params, cache, *row_args) -> (out, cache)` jitted, its cache donated; with a layout,
    mapped over the replica axes, the weights and cache placed as the layout says and every row
    argument and `out` split by rows."""
    if layout is None:
        return jax.jit(fn, donate_argnums=(1,))
    if layout.replica_axes:
        rows, cache = layout.rows_manual, layout.cache_manual
        fn = jax.shard_map(fn, mesh=layout.mesh,
                           in_specs=(PartitionSpec(), cache, *[rows] * num_row_args),
                           out_specs=(rows, cache), axis_names=set(layout.replica_axes),
                           check_vma=False)
    return jax.jit(fn, in_shardings=(layout.params, layout.cache, *[layout.rows] * num_row_args),
                   out_shardings=(output_sharding(layout, layout.rows), layout.cache),
                   donate_argnums=(1,))


def jit_rows(fn: Callable, layout: DeviceLayout | None, *, num_row_args: int) -> Callable:
    """`fn(*row_args) -> out` jitted, every argument and result split by rows; with a layout,
    mapped over the replica axes."""
    if layout is None:
        return jax.jit(fn)
    if layout.replica_axes:
        rows = layout.rows_manual
        fn = jax.shard_map(fn, mesh=layout.mesh, in_specs=(rows,) * num_row_args,
                           out_specs=rows, axis_names=set(layout.replica_axes), check_vma=False)
    return jax.jit(fn, in_shardings=(layout.rows,) * num_row_args,
                   out_shardings=output_sharding(layout, layout.rows))


def output_sharding(layout: DeviceLayout, sharding: NamedSharding) -> NamedSharding:
    """Where a step's sampled tokens land: `sharding`, or every device when the mesh spans
    several processes, so that process 0 can read every row."""
    if jax.process_count() == 1:
        return sharding
    return NamedSharding(layout.mesh, PartitionSpec())
