"""The one table from logical axes to mesh axes, and the partition specs derived from it.

Every weight declares its logical axes where it is created (`meshserve.model.layers.param`); the KV
cache, the per-row step arrays and the activations have theirs here. A strategy is a table:

    logical axis   mesh axis   why
    batch          data        each replica computes its own rows
    pages          data        ... and reads and writes only its own slice of the page pool
    heads          model       column-parallel q (and k, v: kv_heads), row-parallel o
    kv_heads       model       KV pages split by head, next to the heads that read them
    ffw            model       column-parallel gate/up, row-parallel down
    vocab          model       vocabulary-parallel embedding and lm_head
    layers         stage       each pipeline stage holds its share of the layers (and their KV)
    expert         model       expert parallelism: each device holds E / m whole experts
    embed, head_dim, positions, qkv, page_slot, tokens   replicated
    expert_ffw, router                                   replicated (experts are whole; the
                                                         router is small and every device routes)
    lora_slots, lora_rank                                replicated: a LoRA slab's A and B split
                                                         only on the axes of the kernel they
                                                         modify (`meshserve.model.lora`)

This is Megatron tensor parallelism: XLA inserts one all-reduce after o and one after down in each
layer, plus the vocabulary collectives of the embedding lookup and the sampler; no weight is ever
gathered. A mixture of experts adds one all-reduce per layer that combines the experts' partial
outputs (`meshserve.sharding.experts`), in place of down's. A different strategy is a different
table, not an edit to the model: mapping `expert` to None and `expert_ffw` to `model` splits
every expert's width instead.

A dimension that does not divide over its mesh axis is replicated instead (correct, but it costs
memory); `ShardingRules.spec` reports which. Heads are the exception: they are padded to divide
(`meshserve.sharding.head_padding`), because replicating them would replicate the whole attention.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from jax.sharding import Mesh, PartitionSpec

from meshserve.sharding.mesh import AXES

# Logical axes of the arrays that are not weights.
KV_CACHE_AXES = ("layers", "kv_heads", "pages", "page_slot", "head_dim")  # [L, K, P, S, h]
ROW_AXIS = "batch"  # the leading axis of every per-row step array
RESIDUAL_AXES = ("tokens", "embed")  # the residual stream [N, D] between layers
LOGITS_AXES = ("batch", "vocab")  # [B, V]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None: replicated). Unknown logical axes are replicated."""

    table: Mapping[str, str | None]

    def __post_init__(self):
        for logical, mesh_axis in self.table.items():
            if mesh_axis is not None and mesh_axis not in AXES:
                raise ValueError(f"rule {logical!r} -> {mesh_axis!r}: mesh axes are {AXES}")

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else self.table.get(logical)

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh: Mesh | None = None, *, only: Sequence[str] | None = None) -> PartitionSpec:
        """The partition spec of an array with these logical axes.

        Raises ValueError when two of its logical axes land on one mesh axis. With `shape` and
        `mesh`, a dimension that does not divide over its mesh axis is left replicated. With
        `only`, mesh axes outside it are dropped (a shard_map's manual axes).
        """
        mapped = [self.mesh_axis(a) for a in axes]
        used = [m for m in mapped if m is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {tuple(axes)} put two dimensions on one mesh axis: "
                             f"{tuple(mapped)}")
        assert (shape is None) == (mesh is None), "divisibility needs both the shape and the mesh"
        if shape is not None:
            mapped = [m if m is None or dim % mesh.shape[m] == 0 else None
                      for m, dim in zip(mapped, shape)]
        if only is not None:
            mapped = [m if m in only else None for m in mapped]
        while mapped and mapped[-1] is None:
            mapped.pop()
        return PartitionSpec(*mapped)

    def replicated_dims(self, axes: Sequence[str | None], shape: Sequence[int],
                        mesh: Mesh) -> list[str]:
        """Logical axes that this table would split but that `shape` cannot divide on `mesh`."""
        return [a for a, dim in zip(axes, shape)
                if self.mesh_axis(a) is not None and dim % mesh.shape[self.mesh_axis(a)]]

    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the batch: the step runs per replica over these."""
        axis = self.mesh_axis(ROW_AXIS)
        return () if axis is None else (axis,)


DEFAULT_RULES = ShardingRules({
    "batch": "data",
    "pages": "data",
    "heads": "model",
    "kv_heads": "model",
    "ffw": "model",
    "vocab": "model",
    "layers": "stage",
    "expert": "model",
    "expert_ffw": None,
    "router": None,
    "embed": None,
    "head_dim": None,
    "positions": None,
    "qkv": None,
    "page_slot": None,
    "tokens": None,
    "lora_slots": None,
    "lora_rank": None,
})
