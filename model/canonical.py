"""The canonical params: every key and shape a model of a config holds, and how a checkpoint's
tensors become them.

`params` map "/"-joined names to arrays in meshserve's canonical layout, which
`expected_shapes(config)` defines and the model code reads (`meshserve.model.transformer`).
Invariants of every loader's result:

- the keys are exactly those of `expected_shapes(config)`, with exactly those shapes; per-layer
  weights are stacked on a leading layer axis;
- kernels are laid out input first (`[D, H, h]`, `[F, D]`, ...), never as HF's `[out, in]`;
- Q and K follow HF's rotate_half RoPE layout (GGUF llama files, whose Q and K rows llama.cpp
  permutes for its interleaved RoPE, are un-permuted by `meshserve.model.families.llama`);
- every array has the requested dtype and is finite (`check_params`).

A family (`meshserve.model.families`) says how its checkpoints fill these keys with a
`CheckpointLayout`: per key, the tensor's name and the `Conversion` from its stored layout.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import ml_dtypes
import numpy as np

from meshserve.model.config import ModelConfig
from meshserve.model.quant_formats import MixedArray, QuantizedArray

NUMPY_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}

Convert = Callable[[np.ndarray], np.ndarray]


# --- The canonical keys and shapes --------------------------------------------------------------


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every param key of `config`'s model and its shape; per-layer keys start with "layers/"."""
    if config.arch == "gpt2":
        return _gpt2_shapes(config)
    return _llama_shapes(config)


def _llama_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    H, K, h = c.num_heads, c.num_kv_heads, c.head_dim
    shapes = {
        "embed/embedding": (V, D),
        "layers/attn_norm/scale": (L, D),
        "layers/attn/q/kernel": (L, D, H, h),
        "layers/attn/k/kernel": (L, D, K, h),
        "layers/attn/v/kernel": (L, D, K, h),
    }
    if c.qk_norm:
        shapes.update({"layers/attn/q_norm/scale": (L, h), "layers/attn/k_norm/scale": (L, h)})
    if c.qkv_bias:
        shapes.update({
            "layers/attn/q/bias": (L, H, h),
            "layers/attn/k/bias": (L, K, h),
            "layers/attn/v/bias": (L, K, h),
        })
    if c.sandwich_norms:
        shapes.update({"layers/post_attn_norm/scale": (L, D),
                       "layers/post_mlp_norm/scale": (L, D)})
    shapes.update({
        "layers/attn/o/kernel": (L, H, h, D),
        "layers/mlp_norm/scale": (L, D),
    })
    if c.moe is None:
        shapes.update({
            "layers/mlp/gate/kernel": (L, D, F),
            "layers/mlp/up/kernel": (L, D, F),
            "layers/mlp/down/kernel": (L, F, D),
        })
    else:
        shapes.update(moe_shapes(c))
    shapes["final_norm/scale"] = (D,)
    if not c.tie_embeddings:
        shapes["lm_head/kernel"] = (D, V)
    return shapes


def moe_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The mixture-of-experts MLP of every layer (`meshserve.model.moe`)."""
    L, D, F, E = c.num_layers, c.hidden_size, c.intermediate_size, c.moe.num_experts
    shapes = {
        "layers/mlp/router/kernel": (L, D, E),
        "layers/mlp/experts/gate": (L, E, D, F),
        "layers/mlp/experts/up": (L, E, D, F),
        "layers/mlp/experts/down": (L, E, F, D),
    }
    S = c.moe.shared_expert_size
    if S:
        shapes.update({
            "layers/mlp/shared/gate/kernel": (L, D, S),
            "layers/mlp/shared/up/kernel": (L, D, S),
            "layers/mlp/shared/down/kernel": (L, S, D),
            "layers/mlp/shared/scale/kernel": (L, D, 1),
        })
    return shapes


def _gpt2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    P, H, h = c.max_position_embeddings, c.num_heads, c.head_dim
    return {
        "embed/embedding": (V, D),
        "pos_embed/embedding": (P, D),
        "layers/attn_norm/scale": (L, D),
        "layers/attn_norm/bias": (L, D),
        "layers/attn/qkv/kernel": (L, D, 3, H, h),
        "layers/attn/qkv/bias": (L, 3, H, h),
        "layers/attn/o/kernel": (L, H, h, D),
        "layers/attn/o/bias": (L, D),
        "layers/mlp_norm/scale": (L, D),
        "layers/mlp_norm/bias": (L, D),
        "layers/mlp/up/kernel": (L, D, F),
        "layers/mlp/up/bias": (L, F),
        "layers/mlp/down/kernel": (L, F, D),
        "layers/mlp/down/bias": (L, D),
        "final_norm/scale": (D,),
        "final_norm/bias": (D,),
    }


# --- Checks -------------------------------------------------------------------------------------


def check_params(config: ModelConfig, params: Mapping[str, Any], *,
                 values: bool = True) -> None:
    """Raises ValueError unless `params` has exactly `config`'s keys and shapes, all finite
    (finiteness only with `values`, for host arrays)."""
    expected = expected_shapes(config)
    missing = [key for key in expected if key not in params]
    if missing:
        raise ValueError(
            f"params lack {missing[0]!r} (expected shape {expected[missing[0]]}); "
            f"{len(missing)} expected keys are missing in all"
        )
    extra = [key for key in params if key not in expected]
    if extra:
        raise ValueError(
            f"params have key {extra[0]!r} (shape {np.shape(params[extra[0]])}) that a "
            f"{config.arch} config with qkv_bias={config.qkv_bias}, "
            f"tie_embeddings={config.tie_embeddings} does not use"
        )
    for key, shape in expected.items():
        actual = _shape(params[key])
        if actual != shape:
            raise ValueError(f"param {key!r} has shape {actual}, but the config expects {shape}")
        if values:
            check_finite(key, params[key])


def _shape(value: Any) -> tuple[int, ...]:
    return (tuple(value.shape) if isinstance(value, (QuantizedArray, MixedArray))
            else tuple(np.shape(value)))


def check_finite(key: str, array: np.ndarray | QuantizedArray | MixedArray) -> None:
    if isinstance(array, (QuantizedArray, MixedArray)):
        for name, part in array.arrays().items():
            if not name.endswith("values"):
                check_finite(key, part)
        return
    if not np.isfinite(array).all():
        raise ValueError(
            f"param {key!r} has NaN or infinite values; the checkpoint is damaged, or its "
            f"values overflow {np.asarray(array).dtype} (load it as float32 or bfloat16)"
        )


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype that stores params of meshserve dtype `dtype`."""
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {tuple(NUMPY_DTYPES)}")
    return NUMPY_DTYPES[dtype]


def require_dtype(dtype: str) -> None:
    """Fails fast, before any file is read, on a dtype meshserve cannot store params in."""
    numpy_dtype(dtype)


# --- From a checkpoint's tensors to the canonical params -----------------------------------------


class Checkpoint(Protocol):
    """The tensors of one checkpoint: their names and shapes, and a way to read each one."""

    origin: str
    names: frozenset[str]

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Conversion:
    """How one checkpoint tensor becomes one canonical param (one layer of it, if stacked)."""

    source_shape: tuple[int, ...]
    convert: Convert


def _none(name: str) -> bool:
    del name
    return False


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How one checkpoint fills the canonical params of `config`.

    `names` maps each canonical key to its tensor's name, with `{i}` for the layer (and `{{e}}`
    for an expert, where HF stores each expert apart); `conversions` maps it to the tensor's
    `Conversion`. Keys the config does not use may be listed: only `expected_shapes(config)`'s
    are read. `ignored` says which of the checkpoint's other tensors are not params (buffers,
    copies of a tied head, what the config was read from); any other tensor is refused.
    """

    config: ModelConfig  # as the checkpoint's tensors complete it (a GGUF's tied head, ...)
    names: Mapping[str, str]
    conversions: Mapping[str, Conversion]
    ignored: Callable[[str], bool] = _none


def identity(w: np.ndarray) -> np.ndarray:
    return w


def transposed(w: np.ndarray) -> np.ndarray:
    return w.T


def swap_last_two(w: np.ndarray) -> np.ndarray:
    return w.swapaxes(-1, -2)


def reshaped(*shape: int) -> Convert:
    return lambda w: w.reshape(shape)


def transposed_reshaped(*shape: int) -> Convert:
    return lambda w: w.T.reshape(shape)


def fused_rows(start: int, stop: int, then: Convert) -> Convert:
    """Rows `start:stop` of a fused tensor, then `then`."""
    return lambda w: then(w[start:stop])
