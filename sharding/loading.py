"""Loading a model straight onto a mesh.

`load_sharded(name, mesh)` reads the checkpoint one canonical tensor at a time. Each tensor is
padded (heads, when `model` needs it), then placed with `jax.make_array_from_callback`, so each
device receives only its own shard. The host tensor is dropped before the next one is read.
The host therefore never holds more than one full tensor, and no device ever holds a full copy
of a split weight.

An orbax checkpoint directory (`meshserve convert`) is restored straight into the rules'
shardings, each device reading only its shard, whatever mesh it was saved from. Heads that need
padding are restored replicated over `model` (they do not divide) and padded on device.

A quantized kernel (`quantization`) is placed array by array: its codes and scales carry the
float kernel's logical axes (`meshserve.model.quant.quantized_axes`), so they split alike.

Presets (random weights, for tests and benchmarks) are created on one device and resharded by
the runner.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshserve.model.checkpoint import (read_checkpoint_config, read_manifest, read_tokenizer,
                                        restore_params)
from meshserve.model.config import PRESETS, ModelConfig
from meshserve.model.hub import resolve_model
from meshserve.model.loaders import load_weights
from meshserve.model.pretrained import Pretrained, load_pretrained, load_tokenizer
from meshserve.model.quant import (grouped_params, quantize_model, quantized_axes,
                                   scheme_plans, stored_weights)
from meshserve.model.quantization import QuantizedArray
from meshserve.model.transformer import abstract_model, model_from_params
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.padding import pad_array, pad_heads, padded_config
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules


def load_sharded(name_or_path: str, mesh_config: MeshConfig | str | None, *,
                 dtype: str = "float32", seed: int = 0, cache_dir=None,
                 rules: ShardingRules = DEFAULT_RULES, mesh: Mesh | None = None,
                 quantization: str = "none") -> Pretrained:
    """Like `load_pretrained`, with every weight already placed on the mesh's devices, split by
    `rules`, and heads padded for `mesh_config.model`. The model config of the result is the
    padded one."""
    mesh_config = MeshConfig.coerce(mesh_config)
    if name_or_path in PRESETS:
        return load_pretrained(name_or_path, dtype=dtype, seed=seed, quantization=quantization)
    mesh = mesh or mesh_config.make_mesh()
    # an unknown scheme fails here, before any file is read
    plans = scheme_plans(quantization, platform=mesh.devices.flat[0].platform)
    files = resolve_model(name_or_path, cache_dir=cache_dir)
    if files.kind == "orbax":
        pretrained = _restore_checkpoint(files.path, mesh_config, mesh, rules, dtype)
        return dataclasses.replace(pretrained,
                                   model=quantize_model(pretrained.model, quantization))
    placer = _Placer(mesh_config, mesh, rules)
    config, params = load_weights(files, dtype=dtype, place=placer, plans=plans)
    model = model_from_params(placer.padded, params)
    return Pretrained(config=model.config, model=model, tokenizer=load_tokenizer(files))


def _restore_checkpoint(directory, mesh_config: MeshConfig, mesh: Mesh, rules: ShardingRules,
                        dtype: str) -> Pretrained:
    config = read_checkpoint_config(directory).replace(dtype=dtype)
    mesh_config.check_model(config)
    formats = read_manifest(directory).quantized
    shardings = {key: NamedSharding(mesh, rules.spec(axes, shape, mesh)) for key, (axes, shape, _)
                 in stored_weights(abstract_model(config), formats).items()}
    params = grouped_params(restore_params(directory, config, shardings), formats)
    model = model_from_params(config, params)
    model = pad_heads(model, mesh_config.model)
    return Pretrained(config=model.config, model=model, tokenizer=read_tokenizer(directory))


def _weight_axes(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Canonical key -> (logical axes, shape) of every weight of `config`'s model."""
    _, state = nnx.split(abstract_model(config))
    return {"/".join(map(str, path)): (var.axes, tuple(var.shape))
            for path, var in nnx.to_flat_state(state)}


class _Placer:
    """`place(config, key, array)` for the loaders: pad, then put each device's shard there."""

    def __init__(self, mesh_config: MeshConfig, mesh: Mesh, rules: ShardingRules):
        self.mesh_config, self.mesh, self.rules = mesh_config, mesh, rules
        self.padded: ModelConfig | None = None
        self._axes: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}

    def __call__(self, config: ModelConfig, key: str, array: np.ndarray | QuantizedArray
                 ) -> jax.Array | QuantizedArray:
        if self.padded is None:
            self.mesh_config.check_model(config)
            self.padded = padded_config(config, self.mesh_config.model)
            self._axes = _weight_axes(self.padded)
        axes, _ = self._axes[key]
        if isinstance(array, QuantizedArray):
            named = quantized_axes(array.format, axes)
            return dataclasses.replace(array, **{name: self._place(part, named[name])
                                                 for name, part in array.arrays().items()})
        return self._place(array, axes)

    def _place(self, array: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        array = pad_array(array, axes, self.padded)
        sharding = NamedSharding(self.mesh, self.rules.spec(axes, array.shape, self.mesh))
        # Each shard is a copy: on CPU a device buffer may alias its host array, and a view would
        # keep the whole host tensor alive.
        return jax.make_array_from_callback(array.shape, sharding,
                                            lambda index: array[index].copy())
