"""From a mesh and the rules table to the `DeviceLayout` that the model runner applies.

`prepare(model, mesh_config)` is the one entry point the engine uses: it checks the mesh against
the model, pads heads when `model` does not divide them and layers when `stage` does not, adds
the LoRA slabs when the engine serves adapters, builds the mesh, splits a mixture's experts
(`meshserve.sharding.experts`), and derives every
sharding (weights, KV pages, per-row step arrays, activations) from the weights' logical axes and
`DEFAULT_RULES`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshserve.model.executor.device_layout import DeviceLayout
from meshserve.model.lora import LoraShape, with_lora
from meshserve.model.quantized_weights import uniform_layers
from meshserve.sharding.experts import split_experts
from meshserve.sharding.head_padding import pad_heads
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.pipeline_stages import pad_layers
from meshserve.sharding.rules import DEFAULT_RULES, KV_CACHE_AXES, ROW_AXIS, ShardingRules


@dataclasses.dataclass(frozen=True)
class Prepared:
    model: nnx.Module  # with heads padded where needed
    layout: DeviceLayout
    replicated: dict[str, list[str]]  # weight -> logical axes left unsplit (indivisible)


def prepare(model: nnx.Module, mesh_config: MeshConfig | str | None = None, *,
            rules: ShardingRules = DEFAULT_RULES,
            devices: Sequence[jax.Device] | None = None,
            lora: LoraShape | None = None) -> Prepared:
    """`lora`, when given, adds the LoRA slabs (`meshserve.model.lora.with_lora`) to the padded
    model, so their shardings follow from the rules like every weight's: split over `stage` by
    their layer axis (identity layers included) and over `model` as their projection is."""
    mesh_config = MeshConfig.coerce(mesh_config)
    mesh_config.check_model(model.config)
    if mesh_config.stage > 1:  # stages split the layer axis: a mixed stack becomes one stack
        model = uniform_layers(model)
    model = pad_layers(pad_heads(model, mesh_config.model), mesh_config.stage)
    if lora is not None:
        model = with_lora(model, lora)
    mesh = mesh_config.make_mesh(devices)
    model = split_experts(model, mesh, rules)
    layout = device_layout(model, mesh, rules)
    _, state = nnx.split(model)
    replicated = {}
    for path, var in nnx.to_flat_state(state):
        dims = rules.replicated_dims(var.axes, var.shape, mesh)
        if dims:
            replicated["/".join(map(str, path))] = dims
    if replicated:
        listed = ", ".join(f"{key} ({'/'.join(dims)})" for key, dims in replicated.items())
        warnings.warn(f"mesh {mesh_config}: these weights do not divide over their mesh axes "
                      f"and are replicated instead, which costs memory: {listed}", stacklevel=2)
    return Prepared(model=model, layout=layout, replicated=replicated)


def device_layout(model: nnx.Module, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                  ) -> DeviceLayout:
    """Every sharding the runner needs, derived from logical axes and `rules` alone."""
    _, state = nnx.split(model)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    params = jax.tree.map(
        lambda var: NamedSharding(mesh, rules.spec(var.axes, var.shape, mesh)), state,
        is_leaf=is_var)
    c = model.config
    cache_shape = (c.num_layers, c.num_kv_heads, None, None, c.head_dim)
    replica_axes = rules.replica_axes()
    cache_spec = _spec_with_sizes(rules, KV_CACHE_AXES, cache_shape, mesh)
    auto_axes = tuple(a for a in mesh.axis_names if a not in replica_axes)

    def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        spec = rules.spec(axes, x.shape, mesh, only=auto_axes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return DeviceLayout(
        mesh=mesh, params=params,
        cache=NamedSharding(mesh, cache_spec),
        rows=NamedSharding(mesh, rules.spec((ROW_AXIS,))),
        cache_manual=rules.spec(KV_CACHE_AXES, only=replica_axes),
        rows_manual=rules.spec((ROW_AXIS,), only=replica_axes),
        replica_axes=replica_axes,
        num_replicas=_size(mesh, replica_axes),
        constrain=constrain,
    )


def _spec_with_sizes(rules: ShardingRules, axes, shape, mesh: Mesh) -> PartitionSpec:
    """Like `rules.spec` with a shape, where None in `shape` means "sized to divide"."""
    known = [dim if dim is not None else mesh.size for dim in shape]
    return rules.spec(axes, known, mesh)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return size
