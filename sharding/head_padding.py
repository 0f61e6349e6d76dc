"""Padding attention heads so that they divide over the `model` axis, exactly.

Grouped-query attention with K kv heads and G = H / K query heads per kv head cannot split over a
`model` size that does not divide K (SmolLM2: K = 3, so model = 2 or 4). Two ways out:

- replicate the K/V projections and the KV pages on every device: only possible when `model` is a
  multiple of K, and it multiplies KV memory by model / K;
- pad: add kv heads up to K' (the next multiple of `model`) and query heads up to H' = K' * G, all
  with zero weights.

meshserve pads, because it works for every `model` size, keeps one code path, and is exact: a
padded query head reads only its own padded kv head (query head j reads kv head j // G, and the
new heads come after the real ones), and its output meets all-zero rows of the o projection, so it
adds exactly 0 to every real output. The cost is K' / K times the KV memory and attention work
(SmolLM2, model = 2: 4 / 3). A padded model is an ordinary model with a larger `num_heads`, so
nothing downstream knows.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.config import ModelConfig
from meshserve.model.quantized_weights import model_weights
from meshserve.model.transformer import model_from_params


def padded_head_counts(config: ModelConfig, model_size: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) after padding the kv heads up to a multiple of `model_size`."""
    kv_heads = -(-config.num_kv_heads // model_size) * model_size
    return kv_heads * (config.num_heads // config.num_kv_heads), kv_heads


def needs_head_padding(config: ModelConfig, model_size: int) -> bool:
    return padded_head_counts(config, model_size) != (config.num_heads, config.num_kv_heads)


def pad_heads(model: nnx.Module, model_size: int) -> nnx.Module:
    """The same model with zero-weight heads appended so both head counts divide `model_size`."""
    config = model.config
    if not needs_head_padding(config, model_size):
        return model
    padded = padded_config(config, model_size)
    params = model_weights(model, lambda value, axes: pad_array(value, axes, padded))
    return model_from_params(padded, params)


def padded_config(config: ModelConfig, model_size: int) -> ModelConfig:
    if not needs_head_padding(config, model_size):
        return config
    if config.arch != "llama":
        raise ValueError(f"head padding needs grouped-query attention (llama family), "
                         f"not {config.arch}")
    num_heads, num_kv_heads = padded_head_counts(config, model_size)
    return config.replace(num_heads=num_heads, num_kv_heads=num_kv_heads)


def pad_array(value, axes: tuple[str, ...], padded: ModelConfig):
    """`value` (numpy or jax) with zeros appended on its `heads` and `kv_heads` dimensions up to
    the padded config's counts; unchanged when nothing pads."""
    sizes = {"heads": padded.num_heads, "kv_heads": padded.num_kv_heads}
    widths = [(0, sizes[axis] - dim if axis in sizes else 0) for axis, dim in zip(axes, value.shape)]
    if not any(w for _, w in widths):
        return value
    return (np if isinstance(value, np.ndarray) else jnp).pad(value, widths)
