"""The Llama and GPT-2 families as Flax NNX modules, and the layer scan that runs them.

Layers are stacked: every per-layer weight has a leading `layers` axis of size L, and `run_layers`
applies them with one `lax.scan`. Pipeline stages later split that axis.

The Llama modules are every dense family of the llama architecture: the config's switches pick
the norm (x * w, or Gemma's x * (1 + w)), the gated MLP's activation, q/k norms, sandwich norms,
embedding scaling, soft-capping, the query scale and the window. Layers differ only in whether
they slide (and then may have their own RoPE): the scan carries one flag per layer.

A model sees a step as flattened tokens `[N]` with their positions, plus an attention context
(`RaggedContext` for serving, `DenseContext` for the reference). It does not know how tokens were
batched or where pages live.

Parameter paths (`embed/embedding`, `layers/attn/q/kernel`, ...) are the canonical layout that the
loaders produce; `meshserve.model.canonical.expected_shapes` lists them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model import native_dot
from meshserve.model.attention import NO_WINDOW, AttentionSpec
from meshserve.model.config import ModelConfig
from meshserve.model.layers import Dense, Embed, LayerNorm, RMSNorm, apply_rope, rope_tables
from meshserve.model.moe import MoeMLP
from meshserve.model.quantized_kernel import layer_stacked_kernels, read_layers_in_place
from meshserve.model.quantized_weights import install as install_quantized


class LlamaAttention(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        self.config = c
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
        norm = dict(eps=c.norm_eps, dtype=c.dtype, rngs=rngs, stack=stack, axis="head_dim",
                    one_plus=c.norm_kind == "rms_one_plus")
        self.q_norm = RMSNorm(h, **norm) if c.qk_norm else None
        self.k_norm = RMSNorm(h, **norm) if c.qk_norm else None

    def __call__(self, x, ctx, layer, rope, sliding, adapters=None):
        q, k = self.q(x, adapters), self.k(x, adapters)  # [N, H, h], [N, K, h]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = layer_rope(rope, sliding)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, ctx = ctx.attend(q, k, self.v(x, adapters), layer, self.spec(sliding))
        return self.o(out, adapters), ctx

    def spec(self, sliding) -> AttentionSpec:
        c = self.config
        window = jnp.where(sliding, c.sliding_window, NO_WINDOW) if c.sliding_window else None
        return AttentionSpec(window=window, scale=c.query_scale, softcap=c.attn_logit_softcap)


def layer_rope(rope, sliding):
    """The layer's (cos, sin): the sliding layers' own when the model has them."""
    full, local = rope
    if local is None:
        return full
    return jax.tree.map(lambda f, l: jnp.where(sliding, l, f), full, local)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU (Gemma) with the tanh GELU."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, f = c.hidden_size, c.intermediate_size
        self.activation = c.mlp_activation
        self.gate = Dense("nd,df->nf", (d, f), ("embed", "ffw"), **kw)
        self.up = Dense("nd,df->nf", (d, f), ("embed", "ffw"), **kw)
        self.down = Dense("nf,fd->nd", (f, d), ("ffw", "embed"), **kw)

    def __call__(self, x, adapters=None):
        gated = ACTIVATIONS[self.activation](self.gate(x, adapters)) * self.up(x, adapters)
        return self.down(gated, adapters)


class LlamaBlock(nnx.Module):
    """Pre-norm attention and MLP; with `sandwich_norms` (Gemma) each output is normed too."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        norm = dict(eps=c.norm_eps, dtype=c.dtype, rngs=rngs, stack=stack,
                    one_plus=c.norm_kind == "rms_one_plus")
        self.attn_norm = RMSNorm(c.hidden_size, **norm)
        self.attn = LlamaAttention(c, rngs=rngs, stack=stack)
        self.post_attn_norm = RMSNorm(c.hidden_size, **norm) if c.sandwich_norms else None
        self.mlp_norm = RMSNorm(c.hidden_size, **norm)
        mlp = GatedMLP if c.moe is None else MoeMLP  # a mixture of experts: model/moe.py
        self.mlp = mlp(c, rngs=rngs, stack=stack)
        self.post_mlp_norm = RMSNorm(c.hidden_size, **norm) if c.sandwich_norms else None

    def __call__(self, x, ctx, layer, rope, sliding, adapters=None):
        """`adapters`: each token's LoRA adapter, one-hot [N, S] (`meshserve.model.lora`), or
        None for the base model alone."""
        h, ctx = self.attn(self.attn_norm(x), ctx, layer, rope, sliding, adapters)
        x = x + _normed(self.post_attn_norm, h)
        return x + _normed(self.post_mlp_norm, self.mlp(self.mlp_norm(x), adapters)), ctx


def _normed(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    return x if norm is None else norm(x)


class GPT2Attention(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, h = c.hidden_size, c.head_dim
        self.qkv = Dense("nd,dcqh->ncqh", (d, 3, c.num_heads, h),
                         ("embed", "qkv", "heads", "head_dim"), bias_dims=3, **kw)
        self.o = Dense("nqh,qhd->nd", (c.num_heads, h, d), ("heads", "head_dim", "embed"),
                       bias_dims=1, **kw)

    def __call__(self, x, ctx, layer, rope, sliding):
        del rope, sliding
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

    def __call__(self, x, ctx, layer, rope, sliding, adapters=None):
        assert adapters is None, "LoRA serves the llama architecture only"
        h, ctx = self.attn(self.attn_norm(x), ctx, layer, rope, sliding)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), ctx


class Llama(nnx.Module):
    """Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3 and SmolLM2; Mixtral, Qwen2-MoE and
    Qwen3-MoE with `config.moe`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype,
                           rngs=rngs)
        self.layers = LlamaBlock(c, rngs=rngs, stack=(c.num_layers,))
        self.final_norm = RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, rngs=rngs,
                                  one_plus=c.norm_kind == "rms_one_plus")
        self.lm_head = None if c.tie_embeddings else Dense(
            "...d,dv->...v", (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype=c.dtype,
            rngs=rngs)

    def embed_tokens(self, tokens, positions):
        del positions
        return self.embed.scaled(tokens) if self.config.scale_embeddings else self.embed(tokens)

    def position_tables(self, positions):
        """(full, local): RoPE tables of the full layers, and of the sliding ones when they
        have their own base (Gemma 3), else None."""
        local = rope_tables(self.config, positions, local=True) \
            if self.config.local_rope_theta else None
        return rope_tables(self.config, positions), local

    def logits(self, x):
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        cap = self.config.final_logit_softcap
        if cap:
            logits = cap * jnp.tanh(logits.astype(jnp.float32) / cap)
        return logits


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


def apply_layers(model, x: jax.Array, positions: jax.Array, ctx, constrain=None,
                 sliding: jax.Array | None = None, adapters: jax.Array | None = None):
    """Applies every layer of `model` to the residual stream x [N, D]. -> (hidden [N, D], ctx).

    The stacked layers run under one `lax.scan`. A pipeline stage passes a model holding only its
    own layers: layer ids (which index the KV cache) are then local to the stage, and `sliding`
    [num_layers] bool says which of them slide (`stage_sliding_flags`); by default the model's
    own layers' flags. `adapters`, each token's LoRA adapter as a one-hot [N, S]
    (`meshserve.model.lora.token_selection`), reaches every layer's projections; their slabs are
    layer weights, so the scan slices them like the rest.

    With native kernels on, the scan does not slice the quantized kernels stacked over the layers
    alone (`layer_stacked_kernels`): each layer gets their whole stacks and its index
    (`read_layers_in_place`), and a native kernel reads the layer's codes where they lie, where
    XLA would copy each layer's slice into a buffer of its own before every call; any other path
    slices the layer out as the scan would. A stack of layers of different formats
    (`MixedKernel`) is always passed so: each layer reads its own part of it.
    """
    constrain = constrain or (lambda x, axes: x)
    rope = model.position_tables(positions)
    graphdef, layer_params = nnx.split(model.layers)
    in_place = layer_stacked_kernels(model.layers, native=native_dot.active())
    stacks = ()
    if in_place:
        graphdef, kernel_stacks, layer_params = nnx.split(
            model.layers, lambda path, _: any(path[:len(k)] == k for k in in_place), ...)
        stacks = (kernel_stacks,)
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]  # a mixed stack's parts are shorter

    def one_layer(carry, xs):
        x, ctx = carry
        params, layer, sliding = xs
        block = nnx.merge(graphdef, *stacks, params)
        read_layers_in_place(block, in_place, layer)
        x, ctx = block(x, ctx, layer, rope, sliding, adapters)
        return (constrain(x, RESIDUAL_AXES), ctx), None

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    if sliding is None:
        sliding = jnp.asarray(sliding_flags(model.config, num_layers))
    (x, ctx), _ = jax.lax.scan(one_layer, (x, ctx), (layer_params, layer_ids, sliding))
    return x, ctx


def stage_sliding_flags(config: ModelConfig, stage: jax.Array, num_stages: int) -> jax.Array:
    """[num_layers // num_stages] bool: which layers of stage `stage`'s share of the whole
    (padded) stack of `config` slide, so each stage's layers keep their own AttentionSpec."""
    per_stage = config.num_layers // num_stages
    flags = jnp.asarray(sliding_flags(config, config.num_layers))
    return jax.lax.dynamic_slice_in_dim(flags, stage * per_stage, per_stage)


def sliding_flags(config: ModelConfig, num_layers: int) -> np.ndarray:
    """[num_layers] bool: which of the stack's layers attend through the window. A stack shorter
    than the model (a pipeline stage's share) is only possible when every layer is alike."""
    flags = config.sliding_layers
    if num_layers != len(flags):
        if len(set(flags)) > 1:
            raise ValueError(f"{config.name} mixes sliding and full layers: a pipeline "
                             "stage's share of the layers needs its flags passed "
                             "(stage_sliding_flags)")
        flags = flags[:1] * num_layers
    return np.asarray(flags, bool)


def param_paths(model) -> dict[str, tuple[int, ...]]:
    """Canonical "/"-joined path -> shape of every weight of a (possibly abstract) model."""
    _, state = nnx.split(model)
    return {_path_key(path): tuple(var.shape) for path, var in nnx.to_flat_state(state)}


def model_from_params(config: ModelConfig, params: Mapping[str, Any]) -> Llama | GPT2:
    """A model whose weights are `params` (canonical paths, as the loaders return them); a
    kernel given as a `QuantizedArray` becomes a quantized kernel
    (`meshserve.model.quantized_kernel`)."""
    model = abstract_model(config)
    shapes = param_paths(model)
    _check_param_keys(set(shapes), set(params))
    for key, shape in shapes.items():
        if tuple(params[key].shape) != shape:
            raise ValueError(f"weight {key} has shape {tuple(params[key].shape)}, "
                             f"expected {shape} for model {config.name}")
    install_quantized(model, params)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if _path_key(path) in params:  # the quantized kernels' arrays are in place already
            var.set_value(jnp.asarray(params[_path_key(path)], dtype=var.dtype))
    return nnx.merge(graphdef, state)


def for_context(model, max_model_len: int):
    """`model` for sequences of up to `max_model_len` tokens: the same weights (no copy) under
    `config.for_context`, which only LongRoPE's choice of factors reads; `model` itself when
    that changes nothing."""
    config = model.config.for_context(max_model_len)
    if config == model.config:
        return model
    _, state = nnx.split(model)
    return model_from_params(config, {_path_key(path): var.get_value()
                                      for path, var in nnx.to_flat_state(state)})


def _path_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _check_param_keys(expected: set[str], given: set[str]) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
