"""The Llama and GPT-2 families as Flax NNX modules, and the layer scan that runs them.

Layers are stacked: every per-layer weight has a leading `layers` axis of size L, and `run_layers`
applies them with one `lax.scan`. Pipeline stages later split that axis.

A model sees a step as flattened tokens `[N]` with their positions, plus an attention context
(`PagedContext` for serving, `DenseContext` for the reference). It does not know how tokens were
batched or where pages live.

Parameter paths (`embed/embedding`, `layers/attn/q/kernel`, ...) are the canonical layout that the
loaders produce; `meshserve.model.loaders.expected_shapes` lists them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.model.config import ModelConfig
from meshserve.model.layers import Dense, Embed, LayerNorm, RMSNorm, apply_rope, rope_tables
from meshserve.model.moe import MoeMLP


class LlamaAttention(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        bias = 2 if c.qkv_bias else 0
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack, bias_dims=bias)
        d, h = c.hidden_size, c.head_dim
        self.q = Dense("nd,dqh->nqh", (d, c.num_heads, h), ("embed", "heads", "head_dim"), **kw)
        self.k = Dense("nd,dkh->nkh", (d, c.num_kv_heads, h), ("embed", "kv_heads", "head_dim"),
                       **kw)
        self.v = Dense("nd,dkh->nkh", (d, c.num_kv_heads, h), ("embed", "kv_heads", "head_dim"),
                       **kw)
        self.o = Dense("nqh,qhd->nd", (c.num_heads, h, d), ("heads", "head_dim", "embed"),
                       dtype=c.dtype, rngs=rngs, stack=stack)
        norm = dict(eps=c.norm_eps, dtype=c.dtype, rngs=rngs, stack=stack, axis="head_dim")
        self.q_norm = RMSNorm(h, **norm) if c.qk_norm else None
        self.k_norm = RMSNorm(h, **norm) if c.qk_norm else None

    def __call__(self, x, ctx, layer, rope):
        cos, sin = rope
        q, k = self.q(x), self.k(x)  # [N, H, h], [N, K, h]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, ctx = ctx.attend(q, k, self.v(x), layer)
        return self.o(out), ctx


class SwiGLU(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, f = c.hidden_size, c.intermediate_size
        self.gate = Dense("nd,df->nf", (d, f), ("embed", "ffw"), **kw)
        self.up = Dense("nd,df->nf", (d, f), ("embed", "ffw"), **kw)
        self.down = Dense("nf,fd->nd", (f, d), ("ffw", "embed"), **kw)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        norm = dict(eps=c.norm_eps, dtype=c.dtype, rngs=rngs, stack=stack)
        self.attn_norm = RMSNorm(c.hidden_size, **norm)
        self.attn = LlamaAttention(c, rngs=rngs, stack=stack)
        self.mlp_norm = RMSNorm(c.hidden_size, **norm)
        mlp = SwiGLU if c.moe is None else MoeMLP  # a mixture of experts: model/moe.py
        self.mlp = mlp(c, rngs=rngs, stack=stack)

    def __call__(self, x, ctx, layer, rope):
        h, ctx = self.attn(self.attn_norm(x), ctx, layer, rope)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), ctx


class GPT2Attention(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, h = c.hidden_size, c.head_dim
        self.qkv = Dense("nd,dcqh->ncqh", (d, 3, c.num_heads, h),
                         ("embed", "qkv", "heads", "head_dim"), bias_dims=3, **kw)
        self.o = Dense("nqh,qhd->nd", (c.num_heads, h, d), ("heads", "head_dim", "embed"),
                       bias_dims=1, **kw)

    def __call__(self, x, ctx, layer, rope):
        del rope
        qkv = self.qkv(x)  # [N, 3, H, h]
        out, ctx = ctx.attend(qkv[:, 0], qkv[:, 1], qkv[:, 2], layer)
        return self.o(out), ctx


class GeluMLP(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, f = c.hidden_size, c.intermediate_size
        self.up = Dense("nd,df->nf", (d, f), ("embed", "ffw"), bias_dims=1, **kw)
        self.down = Dense("nf,fd->nd", (f, d), ("ffw", "embed"), bias_dims=1, **kw)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class GPT2Block(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        norm = dict(eps=c.norm_eps, dtype=c.dtype, rngs=rngs, stack=stack)
        self.attn_norm = LayerNorm(c.hidden_size, **norm)
        self.attn = GPT2Attention(c, rngs=rngs, stack=stack)
        self.mlp_norm = LayerNorm(c.hidden_size, **norm)
        self.mlp = GeluMLP(c, rngs=rngs, stack=stack)

    def __call__(self, x, ctx, layer, rope):
        h, ctx = self.attn(self.attn_norm(x), ctx, layer, rope)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), ctx


class Llama(nnx.Module):
    """Llama, Mistral, Qwen2 and SmolLM2; Mixtral and Qwen2-MoE with `config.moe`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype,
                           rngs=rngs)
        self.layers = LlamaBlock(c, rngs=rngs, stack=(c.num_layers,))
        self.final_norm = RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, rngs=rngs)
        self.lm_head = None if c.tie_embeddings else Dense(
            "...d,dv->...v", (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype=c.dtype,
            rngs=rngs)

    def embed_tokens(self, tokens, positions):
        del positions
        return self.embed(tokens)

    def position_tables(self, positions):
        return rope_tables(self.config, positions)

    def logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.embed.attend(x)
        return self.lm_head(x)


class GPT2(nnx.Module):
    """GPT-2 and the GPT-3 shapes."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype,
                           rngs=rngs)
        self.pos_embed = Embed(c.max_position_embeddings, c.hidden_size, ("positions", "embed"),
                               dtype=c.dtype, rngs=rngs)
        self.layers = GPT2Block(c, rngs=rngs, stack=(c.num_layers,))
        self.final_norm = LayerNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, rngs=rngs)

    def embed_tokens(self, tokens, positions):
        return self.embed(tokens) + self.pos_embed(positions)

    def position_tables(self, positions):
        return None

    def logits(self, x):
        return self.embed.attend(self.final_norm(x))


ARCH_CLASSES = {"llama": Llama, "gpt2": GPT2}
RESIDUAL_AXES = ("tokens", "embed")


def create_model(config: ModelConfig, *, seed: int = 0) -> Llama | GPT2:
    """A model with random weights (std 0.02 matrices, unit norms)."""
    return ARCH_CLASSES[config.arch](config, rngs=nnx.Rngs(params=seed))


def abstract_model(config: ModelConfig) -> Llama | GPT2:
    """The model's structure with `ShapeDtypeStruct` leaves: no memory is allocated."""
    return nnx.eval_shape(lambda: create_model(config))


def run_layers(model, tokens: jax.Array, positions: jax.Array, ctx, constrain=None):
    """Embeds flattened tokens [N] and applies every layer. -> (hidden [N, D], ctx).

    `constrain(x, logical_axes)`, when given, pins the residual stream's sharding between layers
    (under tensor parallelism: replicated, so each layer ends in one all-reduce).
    """
    constrain = constrain or (lambda x, axes: x)
    x = constrain(model.embed_tokens(tokens, positions), RESIDUAL_AXES)  # [N, D]
    return apply_layers(model, x, positions, ctx, constrain)


def apply_layers(model, x: jax.Array, positions: jax.Array, ctx, constrain=None):
    """Applies every layer of `model` to the residual stream x [N, D]. -> (hidden [N, D], ctx).

    The stacked layers run under one `lax.scan`. A pipeline stage passes a model holding only its
    own layers: layer ids (which index the KV cache) are then local to the stage.
    """
    constrain = constrain or (lambda x, axes: x)
    rope = model.position_tables(positions)
    graphdef, layer_params = nnx.split(model.layers)

    def one_layer(carry, xs):
        x, ctx = carry
        params, layer = xs
        x, ctx = nnx.merge(graphdef, params)(x, ctx, layer, rope)
        return (constrain(x, RESIDUAL_AXES), ctx), None

    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    (x, ctx), _ = jax.lax.scan(one_layer, (x, ctx), (layer_params, layer_ids))
    return x, ctx


def param_paths(model) -> dict[str, tuple[int, ...]]:
    """Canonical "/"-joined path -> shape of every weight of a (possibly abstract) model."""
    _, state = nnx.split(model)
    return {_path_key(path): tuple(var.shape) for path, var in nnx.to_flat_state(state)}


def model_from_params(config: ModelConfig, params: Mapping[str, Any]) -> Llama | GPT2:
    """A model whose weights are `params` (canonical paths, as the loaders return them)."""
    graphdef, state = nnx.split(abstract_model(config))
    flat = nnx.to_flat_state(state)
    _check_param_keys({_path_key(path) for path, _ in flat}, set(params))
    for path, var in flat:
        value = params[_path_key(path)]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"weight {_path_key(path)} has shape {tuple(value.shape)}, "
                             f"expected {tuple(var.shape)} for model {config.name}")
        var.set_value(jnp.asarray(value, dtype=var.dtype))
    return nnx.merge(graphdef, state)


def _path_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _check_param_keys(expected: set[str], given: set[str]) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
