"""Loading a model straight onto a mesh.

`load_sharded(name, mesh)` is `load_pretrained` with a `MeshPlacement`: the checkpoint is read
one canonical tensor at a time, and each tensor is padded (heads, when `model` needs it), then
placed with `jax.make_array_from_callback`, so each device receives only its own shard. The host
tensor is dropped before the next one is read. The host therefore never holds more than one
full tensor, and no device ever holds a full copy of a split weight.

An orbax checkpoint directory (`meshserve convert`) is restored straight into the rules'
shardings, each device reading only its shard, whatever mesh it was saved from. Heads that need
padding are restored replicated over `model` (they do not divide) and padded on device.

A quantized kernel (`quantization`) is placed array by array: its codes and scales carry the
float kernel's logical axes (`meshserve.model.quantized_kernel.quantized_axes`), so they split
alike. A stack of layers of different formats (`MixedArray`) is placed part by part; where
pipeline stages split the layer axis it becomes one stack first (`uniform_stack`: the format
that holds each layer), since parts of unequal length cannot split over the stages.

Presets (random weights, for tests and benchmarks) are created on one device and resharded by
the runner.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshserve.model.loading.checkpoint import read_checkpoint_config, read_manifest, restore_params
from meshserve.model.config import ModelConfig
from meshserve.model.loading.pretrained import Pretrained, load_pretrained
from meshserve.model.quant_formats import MixedArray, QuantizedArray, uniform_stack
from meshserve.model.quantized_kernel import quantized_axes
from meshserve.model.quantized_weights import grouped_params, stored_weights, uniform_layers
from meshserve.model.transformer import abstract_model, model_from_params
from meshserve.sharding.head_padding import pad_array, pad_heads, padded_config
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules


def load_sharded(name_or_path: str, mesh_config: MeshConfig | str | None, *,
                 dtype: str = "float32", seed: int = 0, cache_dir=None,
                 rules: ShardingRules = DEFAULT_RULES, mesh: Mesh | None = None,
                 quantization: str = "none", native_kernels: bool = False) -> Pretrained:
    """Like `load_pretrained`, with every weight already placed on the mesh's devices, split by
    `rules`, and heads padded for `mesh_config.model`. The model config of the result is the
    padded one."""
    placement = MeshPlacement(MeshConfig.coerce(mesh_config), rules, mesh)
    return load_pretrained(name_or_path, dtype=dtype, seed=seed, cache_dir=cache_dir,
                           quantization=quantization, placement=placement,
                           native_kernels=native_kernels)


class MeshPlacement:
    """The loaders' placement on a mesh (`meshserve.model.loading.pretrained.Placement`): called with
    each canonical tensor, it pads it and puts each device's shard there. The mesh is made when
    first needed."""

    def __init__(self, mesh_config: MeshConfig, rules: ShardingRules = DEFAULT_RULES,
                 mesh: Mesh | None = None):
        self.mesh_config, self.rules, self._mesh = mesh_config, rules, mesh
        self.padded: ModelConfig | None = None
        self._axes: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}

    @functools.cached_property
    def mesh(self) -> Mesh:
        return self._mesh or self.mesh_config.make_mesh()

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def __call__(self, config: ModelConfig, key: str, array: np.ndarray | QuantizedArray
                 ) -> jax.Array | QuantizedArray:
        if self.padded is None:
            self.mesh_config.check_model(config)
            self.padded = padded_config(config, self.mesh_config.model)
            self._axes = _weight_axes(self.padded)
        axes, _ = self._axes[key]
        if isinstance(array, MixedArray) and self.mesh_config.stage > 1:
            array = uniform_stack(array)  # the stages split the layer axis: one stack
        if isinstance(array, (QuantizedArray, MixedArray)):
            named = quantized_axes(array.format, axes)
            return array.from_arrays({name: self._place(part, named[name])
                                      for name, part in array.arrays().items()}, array.format)
        return self._place(array, axes)

    def model(self, config: ModelConfig, params: Mapping[str, Any]) -> nnx.Module:
        """The model of the placed params: its config has the padded heads."""
        return model_from_params(self.padded, params)

    def restore(self, directory, dtype: str) -> nnx.Module:
        """A meshserve checkpoint restored into the rules' shardings, heads padded on device."""
        config = read_checkpoint_config(directory).replace(dtype=dtype)
        self.mesh_config.check_model(config)
        formats = read_manifest(directory).quantized
        shardings = {key: NamedSharding(self.mesh, self.rules.spec(axes, shape, self.mesh))
                     for key, (axes, shape, _)
                     in stored_weights(abstract_model(config), formats).items()}
        params = grouped_params(restore_params(directory, config, shardings), formats)
        model = model_from_params(config, params)
        if self.mesh_config.stage > 1:  # as `__call__` places them: stages need one stack
            model = uniform_layers(model)
        return pad_heads(model, self.mesh_config.model)

    def _place(self, array: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        array = pad_array(array, axes, self.padded)
        sharding = NamedSharding(self.mesh, self.rules.spec(axes, array.shape, self.mesh))
        # Each shard is a copy: on CPU a device buffer may alias its host array, and a view would
        # keep the whole host tensor alive.
        return jax.make_array_from_callback(array.shape, sharding,
                                            lambda index: array[index].copy())


def _weight_axes(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Canonical key -> (logical axes, shape) of every weight of `config`'s model."""
    _, state = nnx.split(abstract_model(config))
    return {"/".join(map(str, path)): (var.axes, tuple(var.shape))
            for path, var in nnx.to_flat_state(state)}
