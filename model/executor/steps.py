"""The compiled step: pure functions of (params, KV cache, step arrays).

`ragged_step` is what serving runs: one flat batch of tokens (prefill chunks and decodes mixed,
`RaggedBatch`) against the paged cache, each sequence's next token sampled on device. It is three
parts, which a pipeline stage also runs on its own (`meshserve.model.executor.pipeline_runner`):
stage 0 embeds (`embed`), every stage runs its slice of the layers (`ragged_layers`), and the last
stage samples (`ragged_outputs`). Attention goes through `RaggedContext.attend`, so every
attention backend serves both.

`ragged_forward` is the same step up to its sampling, whose logits stay on the device for a call
of `sample` of their own: a step with structured output runs as those two calls, so the host
computes the rows' masks while the device runs the forward pass (`meshserve.model.executor.runner`).
Both compute what `ragged_step` computes, op for op.

`forward_dense` recomputes a whole padded batch with full causal attention and no cache. It exists
to check the paged path.

The KV cache is argument 1 of the step and is donated by the runner, so XLA updates pages in
place.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.batching.sampling import SamplingArrays
from meshserve.model.attention import KVCache, RaggedBatch, dense_context, ragged_context
from meshserve.model.executor.sampler import Sampled, sample
from meshserve.model.lora import lora_shape, token_selection
from meshserve.model.transformer import RESIDUAL_AXES, apply_layers, run_layers


def forward_dense(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
                  lengths: jax.Array) -> jax.Array:
    """Full recomputation: tokens [B, T] right-padded, lengths [B] -> logits [B, T, V] (f32)."""
    model = nnx.merge(graphdef, params)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    hidden, _ = run_layers(model, tokens.reshape(-1), positions.reshape(-1),
                           dense_context(lengths, width))
    return model.logits(hidden).astype(jnp.float32).reshape(rows, width, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedOutput:
    """A ragged step's result: each sequence's sampled token, and prompt logprobs when asked.
    A forward pass (`ragged_forward`) holds each sequence's logits instead of its token."""

    sampled: Sampled | None  # [S] rows
    prompt_logprobs: jax.Array | None = None  # [T] logprob of targets[t] after token t
    prompt_top_ids: jax.Array | None = None  # [T, K]
    prompt_top_logprobs: jax.Array | None = None  # [T, K]
    logits: jax.Array | None = None  # [S, V] float32, at each sequence's last token


def ragged_step(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, batch: RaggedBatch,
                sampling: SamplingArrays, *, num_top_logprobs: int, attention: str,
                block_pages: int, constrain=None, replica_axes: tuple[str, ...] = ()
                ) -> tuple[RaggedOutput, KVCache]:
    """One serving step over a flat batch of tokens against the paged cache, then each
    sequence's next token sampled on device. `attention` names the backend
    (`meshserve.model.attention.ATTENTION_BACKENDS`)."""
    model = nnx.merge(graphdef, params)
    x = embed(model, batch, constrain)
    hidden, cache = ragged_layers(model, x, cache, batch, attention=attention,
                                  block_pages=block_pages, constrain=constrain)
    out = ragged_outputs(model, hidden, batch, sampling, num_top_logprobs=num_top_logprobs,
                         replica_axes=replica_axes)
    return out, cache


def ragged_forward(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache,
                   batch: RaggedBatch, *, num_top_logprobs: int, attention: str,
                   block_pages: int, constrain=None) -> tuple[RaggedOutput, KVCache]:
    """`ragged_step` without its sampling: the logits at each sequence's last token (`logits`),
    and the prompt logprobs when the batch has targets. `sample` then draws from the logits
    what `ragged_step` draws."""
    model = nnx.merge(graphdef, params)
    x = embed(model, batch, constrain)
    hidden, cache = ragged_layers(model, x, cache, batch, attention=attention,
                                  block_pages=block_pages, constrain=constrain)
    out = RaggedOutput(sampled=None, logits=last_logits(model, hidden, batch))  # [S, V]
    return with_prompt_logprobs(out, model, hidden, batch, num_top_logprobs), cache


def embed(model, batch: RaggedBatch, constrain=None) -> jax.Array:
    """The residual stream's start: the batch's tokens embedded. -> [T, D]"""
    constrain = constrain or (lambda x, axes: x)
    return constrain(model.embed_tokens(batch.tokens, batch.positions), RESIDUAL_AXES)


def ragged_layers(model, x: jax.Array, cache: KVCache, batch: RaggedBatch, *, attention: str,
                  block_pages: int, constrain=None, sliding: jax.Array | None = None
                  ) -> tuple[jax.Array, KVCache]:
    """`model`'s layers on the residual stream x [T, D], reading and writing `cache`.
    -> (hidden [T, D], cache)

    A pipeline stage passes a model and a cache holding only its own layers, and `sliding`,
    which of them slide (see `meshserve.model.transformer.apply_layers`)."""
    ctx = ragged_context(cache, batch, backend=attention, block_pages=block_pages)
    hidden, ctx = apply_layers(model, x, batch.positions, ctx, constrain, sliding,
                               adapters=_adapter_selection(model, batch))
    return hidden, KVCache(k=ctx.k, v=ctx.v)


def _adapter_selection(model, batch: RaggedBatch) -> jax.Array | None:
    """Each token's LoRA adapter as a one-hot [T, S], when the model serves adapters."""
    if batch.adapters is None:
        return None
    shape = lora_shape(model)
    assert shape is not None, "a step with adapters needs a model with LoRA slabs"
    return token_selection(batch.adapters, shape.num_slots)


def ragged_outputs(model, hidden: jax.Array, batch: RaggedBatch, sampling: SamplingArrays, *,
                   num_top_logprobs: int, replica_axes: tuple[str, ...] = (),
                   place_logits: Callable[[jax.Array], jax.Array] | None = None
                   ) -> RaggedOutput:
    """Each sequence's next token sampled from the logits at its last token, and the prompt
    logprobs of every token when the batch has targets. `place_logits`, when given, pins the
    sharding of every logits array before it is sampled or ranked (see the pipeline)."""
    place_logits = place_logits or (lambda logits: logits)
    logits = place_logits(last_logits(model, hidden, batch))  # [S, V]
    sampled = sample(logits, sampling, num_top_logprobs=num_top_logprobs,
                     replica_axes=replica_axes)
    return with_prompt_logprobs(RaggedOutput(sampled=sampled), model, hidden, batch,
                                num_top_logprobs, place_logits)


def with_prompt_logprobs(out: RaggedOutput, model, hidden: jax.Array, batch: RaggedBatch,
                         num_top_logprobs: int,
                         place_logits: Callable[[jax.Array], jax.Array] | None = None
                         ) -> RaggedOutput:
    """`out` with the prompt logprobs of every token when the batch has targets."""
    if batch.targets is None:
        return out
    place_logits = place_logits or (lambda logits: logits)
    all_logits = place_logits(model.logits(hidden).astype(jnp.float32))  # [T, V]
    chosen, top_ids, top_logprobs = prompt_logprobs(all_logits, batch.targets,
                                                    num_top_logprobs)
    return dataclasses.replace(out, prompt_logprobs=chosen, prompt_top_ids=top_ids,
                               prompt_top_logprobs=top_logprobs)


def last_logits(model, hidden: jax.Array, batch: RaggedBatch) -> jax.Array:
    """hidden [T, D] -> the logits at each sequence's last token [S, V], float32."""
    last = jnp.take_along_axis(hidden, batch.last[:, None], axis=0)  # [S, D]
    return model.logits(last).astype(jnp.float32)


def prompt_logprobs(logits: jax.Array, targets: jax.Array, num_top: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [T, V], targets [T] -> the logprob of each target [T], and the top `num_top` ids
    [T, K] and logprobs [T, K] of each token's distribution."""
    all_logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(all_logprobs, targets[:, None], axis=-1)[:, 0]  # [T]
    top_logprobs, top_ids = jax.lax.top_k(all_logprobs, num_top)  # [T, K]
    return chosen, top_ids.astype(jnp.int32), top_logprobs
