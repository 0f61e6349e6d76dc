"""The compiled steps: pure functions of (params, KV cache, step arrays).

`forward_step` runs one serving step over a tuple of sub-batches (prefill chunks, decodes, or both)
against the paged cache and returns, per sub-batch, the logits at each row's last new token and,
when targets are given, the logprobs of the prompt tokens. `greedy_step` adds argmax sampling on
device, so a step copies only token ids and logprobs back to the host.

`forward_dense` recomputes a whole padded batch with full causal attention and no cache. It exists
to check the paged path.

The KV cache is argument 1 of every paged step and is donated by the runner, so XLA updates pages
in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.model.attention import KVCache, SubBatch, dense_context, paged_context
from meshserve.model.transformer import run_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SubBatchOutput:
    logits: jax.Array  # [B, V] float32, at each row's last new token
    prompt_logprobs: jax.Array | None = None  # [B, T] logprob of targets[b, t] after token t


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledOutput:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32, logprob of the chosen token
    prompt_logprobs: jax.Array | None = None  # [B, T]


def forward_step(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache,
                 batches: tuple[SubBatch, ...]) -> tuple[tuple[SubBatchOutput, ...], KVCache]:
    model = nnx.merge(graphdef, params)
    tokens = jnp.concatenate([b.tokens.reshape(-1) for b in batches])  # [N]
    positions = jnp.concatenate([b.positions.reshape(-1) for b in batches])  # [N]
    hidden, ctx = run_layers(model, tokens, positions, paged_context(cache, batches))
    outputs, start = [], 0
    for b in batches:
        rows, width = b.shape
        sub_hidden = hidden[start:start + rows * width].reshape(rows, width, -1)  # [B, T, D]
        outputs.append(_sub_batch_output(model, sub_hidden, b))
        start += rows * width
    return tuple(outputs), KVCache(k=ctx.k, v=ctx.v)


def _sub_batch_output(model, hidden: jax.Array, b: SubBatch) -> SubBatchOutput:
    last = jnp.maximum(b.num_new - 1, 0)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = model.logits(last_hidden).astype(jnp.float32)  # [B, V]
    if b.targets is None:
        return SubBatchOutput(logits=logits)
    all_logprobs = jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(all_logprobs, b.targets[..., None], axis=-1)[..., 0]  # [B, T]
    return SubBatchOutput(logits=logits, prompt_logprobs=chosen)


def greedy_step(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache,
                batches: tuple[SubBatch, ...]) -> tuple[tuple[SampledOutput, ...], KVCache]:
    outputs, cache = forward_step(graphdef, params, cache, batches)
    return tuple(_greedy(o) for o in outputs), cache


def _greedy(out: SubBatchOutput) -> SampledOutput:
    tokens = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)  # [B]
    logprobs = jax.nn.log_softmax(out.logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampledOutput(tokens=tokens, logprobs=chosen, prompt_logprobs=out.prompt_logprobs)


def forward_dense(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
                  lengths: jax.Array) -> jax.Array:
    """Full recomputation: tokens [B, T] right-padded, lengths [B] -> logits [B, T, V] (f32)."""
    model = nnx.merge(graphdef, params)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    hidden, _ = run_layers(model, tokens.reshape(-1), positions.reshape(-1),
                           dense_context(lengths, width))
    return model.logits(hidden).astype(jnp.float32).reshape(rows, width, -1)
