"""Building blocks of the transformer: weights with logical axes, norms, embeddings and RoPE.

Every weight is declared once, by `param`, with its shape and its logical axes side by side. The
axis names are the vocabulary that `meshserve.sharding` maps onto mesh axes:

    layers    the stacked layer axis (pipeline stages split it)
    embed     the model width D
    heads     query heads H        kv_heads   key/value heads K
    head_dim  per-head width h     ffw        MLP width F
    vocab     vocabulary V         positions  learned position table (GPT-2)
    qkv       the fused q/k/v selector of GPT-2 (size 3)

Modules here know only shapes. Nothing in this file decides placement or batching.

Einsum letters used throughout model/: b batch, t tokens of a sequence, n flattened tokens of a
step, d embed, f ffw, v vocab, k kv heads, g query heads per kv head, q/h heads and head_dim,
s key positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.config import ModelConfig, RopeScaling
from meshserve.model.quantized_kernel import MixedKernel, QuantizedKernel, quantized_matmul
from meshserve.model.quantized_table import table_logits, table_rows


def normal_init(stddev: float):
    def init(key, shape, dtype):
        return (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return init


def constant_init(value: float):
    def init(key, shape, dtype):
        del key
        return jnp.full(shape, value, dtype)

    return init


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], *,
          dtype: str, init=normal_init(0.02), stack: tuple[int, ...] = ()) -> nnx.Param:
    """One weight: its shape and logical axes, with an optional leading stack of layers."""
    assert len(shape) == len(axes), (shape, axes)
    full_shape = stack + shape
    full_axes = ("layers",) * len(stack) + axes
    return nnx.Param(init(rngs.params(), full_shape, jnp.dtype(dtype)), axes=full_axes)


class Dense(nnx.Module):
    """A weight applied by one einsum, with an optional bias over the output axes. The kernel is
    a float `nnx.Param` or a `QuantizedKernel` (`meshserve.model.quantized_kernel`); either reads
    the same. A model served with LoRA gives its targeted projections a `lora` slab
    (`meshserve.model.lora`), whose delta for each token's own adapter is added to the output
    when the step selects adapters (`adapters`, one-hot [N, S])."""

    def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *,
                 bias_dims: int = 0, dtype: str, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 init=normal_init(0.02)):
        self.spec = spec
        self.kernel = param(rngs, shape, axes, dtype=dtype, init=init, stack=stack)
        self.bias = param(rngs, shape[-bias_dims:], axes[-bias_dims:], dtype=dtype,
                          init=constant_init(0.0), stack=stack) if bias_dims else None
        self.lora = nnx.data(None)  # a `LoraSlab`, set by `meshserve.model.lora.with_lora`

    def __call__(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
        if isinstance(self.kernel, (QuantizedKernel, MixedKernel)):
            y = quantized_matmul(self.spec, x, self.kernel)
        else:
            y = _flat_matmul(self.spec, x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None and adapters is not None:
            y = y + self.lora(x, adapters).astype(y.dtype)
        return y


def _flat_matmul(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, kernel)`, with several contracted axes merged into one.

    Given "nqh,qhd->nd", XLA:CPU transposes the weight into a layout it prefers and copies it
    every step; flattening (q, h) on both sides (a free reshape of row-major arrays) hands it a
    plain matmul instead. Only the contracted axes merge: the leading one may be split over the
    mesh, which survives the merge, while merging output axes could move a split axis inward.
    """
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    contracted = "".join(axis for axis in lhs if axis in rhs)
    n = len(contracted)
    if n < 2 or not lhs.endswith(contracted) or not rhs.startswith(contracted):
        return jnp.einsum(spec, x, kernel)
    with jax.named_scope(spec):  # the HLO still names the projection by its einsum
        x = x.reshape(*x.shape[:x.ndim - n], math.prod(x.shape[x.ndim - n:]))
        kernel = kernel.reshape(math.prod(kernel.shape[:n]), *kernel.shape[n:])
        m = next(a for a in "abcdefghijklmnopqrstuvwxyz" if a not in spec)  # the merged axis
        return jnp.einsum(f"{lhs[:len(lhs) - n]}{m},{m}{rhs[n:]}->{out}", x, kernel)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. `one_plus` scales by (1 + w), Gemma's kind, whose stored
    weights are offsets from 1 (they start at 0)."""

    def __init__(self, dim: int, *, eps: float, dtype: str, rngs: nnx.Rngs,
                 stack: tuple[int, ...] = (), one_plus: bool = False, axis: str = "embed"):
        self.eps = eps
        self.one_plus = one_plus
        self.scale = param(rngs, (dim,), (axis,), dtype=dtype,
                           init=constant_init(0.0 if one_plus else 1.0), stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.one_plus:
            scale = scale + 1.0
        return (x32 * scale).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype: str, rngs: nnx.Rngs,
                 stack: tuple[int, ...] = ()):
        self.eps = eps
        self.scale = param(rngs, (dim,), ("embed",), dtype=dtype, init=constant_init(1.0),
                           stack=stack)
        self.bias = param(rngs, (dim,), ("embed",), dtype=dtype, init=constant_init(0.0),
                          stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Embed(nnx.Module):
    """A table of one row per id. The table is a float `nnx.Param`, or a `QuantizedKernel` kept
    in a file's own blocks (`meshserve.model.quantized_table`); either reads the same."""

    def __init__(self, num_embeddings: int, dim: int, axes: tuple[str, str], *, dtype: str,
                 rngs: nnx.Rngs, init=normal_init(0.02)):
        self.dtype = dtype
        self.embedding = param(rngs, (num_embeddings, dim), axes, dtype=dtype, init=init)

    def __call__(self, ids: jax.Array) -> jax.Array:
        if isinstance(self.embedding, QuantizedKernel):
            return table_rows(self.embedding.array(), ids, jnp.dtype(self.dtype))
        return jnp.take(self.embedding[...], ids, axis=0)

    def scaled(self, ids: jax.Array) -> jax.Array:
        """The embeddings times sqrt(width), the factor rounded to the weights' dtype as Gemma
        rounds it (sqrt(3072) is 55.5 in bfloat16)."""
        x = self(ids)
        return x * jnp.asarray(math.sqrt(x.shape[-1]), x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """The tied output projection: x [..., D] -> logits [..., V]."""
        if isinstance(self.embedding, QuantizedKernel):
            return table_logits(x, self.embedding.array())
        return jnp.einsum("...d,vd->...v", x, self.embedding[...])


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [rotary_dim/2] of HF's rotary embedding, with its scaling rules."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if scaling.long_context else scaling.short_factor
        return inv_freq / np.asarray(factors, np.float64)
    return inv_freq


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, blended, scaled)


def rope_tables(config: ModelConfig, positions: jax.Array, *, local: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [..., rotary_dim/2] in float32 for the given integer positions; `local`: the
    sliding layers' own, unscaled RoPE (`config.local_rope_theta`)."""
    if local:
        theta, scaling = config.local_rope_theta, RopeScaling()
    else:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv_freq = rope_inv_freq(config.rotary_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    # LongRoPE's attention factor scales cos and sin, so q.k by its square.
    factor = scaling.attention_factor if scaling.rope_type == "longrope" else 1.0
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF rotate_half rotary embedding of the leading 2 * cos.shape[-1] dimensions; the rest of
    each head passes through (partial rotary). x [N, heads, h]; cos/sin [N, r/2]."""
    x32 = x.astype(jnp.float32)
    rotary = 2 * cos.shape[-1]
    x1, x2, rest = jnp.split(x32, [rotary // 2, rotary], axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)
