"""Expert parallelism: which mesh axes split a mixture of experts, set on its MLP modules.

The rules table names two logical axes of the routed experts' weights (`meshserve.model.moe`):

    expert      the experts themselves: each device along its mesh axis holds E / m whole
                experts and computes only the assignments routed to them (expert parallelism)
    expert_ffw  each expert's width: each device holds a slice of every expert (tensor
                parallelism inside the experts)

`split_experts` reads where the table puts them on a mesh and records it on the model's MoE
modules as an `ExpertSplit`; the MLP then runs its experts under `jax.shard_map` over those axes
and adds the devices' partial outputs with one `psum`: the token exchange, one all-reduce of
[tokens, D] per layer in the partitioned HLO. An axis is used only when it has more than one
device and divides the dimension, every array of the experts' weights included (a quantized
stack's scales and super scales hold one entry per 16 to 256 of its width), since each device
computes with its own slice of them; otherwise the weights stay replicated, as the rules table
leaves them, and nothing is exchanged. The axes must be ones the step leaves to the compiler:
not a replica axis (the rows are split there) and not the pipeline's layer axis.

The model is not changed in place: the result shares the weights of the model it is given.
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from meshserve.model.moe import ExpertSplit
from meshserve.sharding.rules import ShardingRules


def split_experts(model: nnx.Module, mesh: Mesh, rules: ShardingRules) -> nnx.Module:
    """`model` with its experts split over `mesh` as `rules` say (unchanged without experts or
    without a mesh axis that splits them)."""
    config = model.config
    if config.moe is None:
        return model
    reserved = set(rules.replica_axes()) | {rules.mesh_axis("layers")}
    expert_axis = _splitting_axis(rules, "expert", config.moe.num_experts, mesh, reserved)
    width_axis = _splitting_axis(rules, "expert_ffw", config.intermediate_size, mesh, reserved)
    if width_axis is not None and not _widths_divide(model, mesh.shape[width_axis]):
        width_axis = None
    if expert_axis is None and width_axis is None:
        return model
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)  # new modules over the same weights
    model.layers.mlp.split = ExpertSplit(mesh, expert_axis, width_axis)
    return model


def _widths_divide(model: nnx.Module, parts: int) -> bool:
    """Whether every weight along the experts' width (`expert_ffw`: float kernels, codes,
    scales, super scales) splits into `parts` equal slices."""
    _, state = nnx.split(model)
    for _, var in nnx.to_flat_state(state):
        axes = tuple(getattr(var, "axes", None) or ())
        if "expert_ffw" in axes and var.shape[axes.index("expert_ffw")] % parts:
            return False
    return True


def _splitting_axis(rules: ShardingRules, logical: str, size: int, mesh: Mesh,
                    reserved: set[str | None]) -> str | None:
    axis = rules.mesh_axis(logical)
    if axis is None or mesh.shape[axis] == 1 or size % mesh.shape[axis]:
        return None
    if axis in reserved:
        raise ValueError(f"rule {logical!r} -> {axis!r}: experts split over a mesh axis that "
                         f"the step maps rows or layers over; map {logical!r} to an axis the "
                         f"compiler partitions (such as 'model')")
    return axis
