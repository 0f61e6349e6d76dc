"""One call from a model name or path to a ready model and its tokenizer.

`load_pretrained` accepts:
- a known name (`smollm2-135m-instruct`), fetched once into the cache;
- a local `.gguf` file, or an HF directory (`config.json` + safetensors);
- a meshserve checkpoint directory (`meshserve convert`), restored with its tokenizer;
- a preset name (`tiny-llama`, `llama-2-7b`, ...), which gives random weights and no tokenizer,
  for tests, benchmarks and planning.

`quantization` (`meshserve.model.quant_formats.SCHEMES`) is what float kernels become, and it is
applied here, on every source alike: a checkpoint's kernels are quantized as they are read, one
at a time (GGUF blocks that fit are kept as they are: `scheme_plans`), and `quantize_model` then
quantizes whatever is still float (a preset's weights, a meshserve checkpoint's float kernels).
Kernels a checkpoint already holds quantized stay so whatever it says.

`placement` puts each weight on the devices as it is read (`meshserve.sharding.sharded_loading`
places them on a mesh); without one, weights go to JAX's default device. Presets are made on
the default device whatever the placement (a runner reshards them).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.model import gguf_reader
from meshserve.model.loading.checkpoint import load_checkpoint, read_tokenizer
from meshserve.model.config import PRESETS, ModelConfig
from meshserve.model.loading.hub import ModelFiles, resolve_model
from meshserve.model.loading import load_weights
from meshserve.model.quant_formats import (KernelPlan, MixedArray, QuantizedArray, check_scheme,
                                           scheme_plan)
from meshserve.model.quantized_weights import (kernel_formats, quantizable_kernels,
                                               quantize_model, file_block_plans)
from meshserve.model.tokenizer import Tokenizer
from meshserve.model.transformer import abstract_model, create_model, model_from_params


@dataclasses.dataclass(frozen=True)
class Pretrained:
    config: ModelConfig
    model: nnx.Module
    tokenizer: Tokenizer | None


class Placement(Protocol):
    """Where a loader puts the weights: each tensor is placed as soon as it is read."""

    @property
    def platform(self) -> str:
        """The devices' platform ("cpu", "gpu", ...), which the quantization plans follow."""
        ...

    def __call__(self, config: ModelConfig, key: str, array: Any) -> Any:
        """One finished canonical tensor of `config`'s model, placed."""
        ...

    def model(self, config: ModelConfig, params: Mapping[str, Any]) -> nnx.Module:
        """The model of the placed `params` (its config may differ: padded heads)."""
        ...

    def restore(self, directory: str | os.PathLike, dtype: str) -> nnx.Module:
        """A meshserve checkpoint's model, restored straight into place."""
        ...


def load_pretrained(name_or_path: str, *, dtype: str = "float32", seed: int = 0,
                    cache_dir: str | os.PathLike | None = None,
                    quantization: str = "none", placement: Placement | None = None,
                    native_kernels: bool = False) -> Pretrained:
    check_scheme(quantization)  # an unknown scheme fails here, before any file is read
    if name_or_path in PRESETS:
        config = ModelConfig.preset(name_or_path, dtype=dtype)
        model, tokenizer = create_model(config, seed=seed), None
    else:
        platform = None if placement is None else placement.platform
        plans = scheme_plans(quantization, platform=platform, native=native_kernels)
        files = resolve_model(name_or_path, cache_dir=cache_dir)
        if files.kind == "orbax":
            model, tokenizer = _restore(files.path, dtype, placement)
        else:
            model, tokenizer = _read(files, dtype, plans, placement), load_tokenizer(files)
            gguf_reader.release()  # every tensor is copied out: the file's pages can go
    model = quantize_model(model, quantization)  # kernels loaded quantized stay
    return Pretrained(config=model.config, model=model, tokenizer=tokenizer)


def _restore(directory, dtype: str, placement: Placement | None
             ) -> tuple[nnx.Module, Tokenizer | None]:
    if placement is None:
        _, model, tokenizer = load_checkpoint(directory, dtype=dtype)
        return model, tokenizer
    return placement.restore(directory, dtype), read_tokenizer(directory)


def _read(files: ModelFiles, dtype: str, plans, placement: Placement | None) -> nnx.Module:
    config, params = load_weights(files, dtype=dtype, place=placement or _on_default_device,
                                  plans=plans)
    if placement is None:
        return model_from_params(config, params)
    return placement.model(config, params)


def _on_default_device(config: ModelConfig, key: str, array: Any) -> Any:
    """One finished tensor put on JAX's default device as soon as it is read, so that its host
    copy goes at once: loading holds one tensor on the host at a time, not every weight twice."""
    del config, key
    if isinstance(array, (QuantizedArray, MixedArray)):
        return array.map(jnp.asarray)
    return jnp.asarray(array)


def scheme_plans(scheme: str, platform: str | None = None, *, native: bool = False):
    """The loaders' `plans` for `scheme` on `platform` (default: JAX's default backend's):
    config -> {kernel key: KernelPlan}; None for "none". `native`: the engine will run native
    kernels, which read a kept LM head's codes themselves (`file_block_plans`)."""
    check_scheme(scheme)
    if scheme == "none":
        return None
    platform = platform or jax.default_backend()

    def plans(config: ModelConfig) -> dict[str, KernelPlan]:
        model = abstract_model(config)
        kernel_formats(model, scheme)  # checks that the float kernels divide into groups
        return {**{key: scheme_plan(scheme, n, out, platform=platform, native=native)
                   for key, (_, n, out) in quantizable_kernels(model).items()},
                **file_block_plans(model, scheme, platform, native=native)}

    return plans


def load_tokenizer(files: ModelFiles) -> Tokenizer | None:
    if files.kind == "gguf":
        return Tokenizer.from_gguf(files.path)
    if files.tokenizer_path is not None:
        return Tokenizer.from_file(files.tokenizer_path)
    return None
