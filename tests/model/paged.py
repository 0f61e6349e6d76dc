"""A driver of the ragged step's layers for tests that compare logits, not sampled tokens.

Rows go through a real `ModelRunner`'s flattening (`host_call`) and its KV cache, then through
the parts of `ragged_step` (`embed`, `ragged_layers`) with the portable attention; what comes back
is each row's logits at its last new token, and the logprobs of its targets when given.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.batching.sampling import greedy_sampling
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.executor.steps import (embed, forward_dense, last_logits, prompt_logprobs,
                                            ragged_layers)


@dataclasses.dataclass(frozen=True)
class RowLogits:
    logits: np.ndarray  # [B, V] at each row's last new token
    prompt_logprobs: np.ndarray | None = None  # [B, T] logprob of each row's targets


class PagedStepper:
    """Runs steps of (tokens, cached, pages) rows against one paged cache."""

    def __init__(self, model, *, page_size, num_pages):
        self.runner = ModelRunner(model, RunnerConfig(
            num_pages=num_pages, page_size=page_size, max_num_seqs=8, max_num_batched_tokens=128,
            max_pages_per_seq=64, attention="jnp"))
        self.page_size = page_size
        self.graphdef = self.runner.graphdef
        self.step = jax.jit(functools.partial(_forward, self.graphdef,
                                              block_pages=self.runner.config.block_pages),
                            donate_argnums=(1,))

    @property
    def cache(self):
        return self.runner.cache

    def run(self, *sub_batches) -> list[RowLogits]:
        plans = [sub_batch_from_rows(rows, page_size=self.page_size, targets=targets)
                 for rows, targets in sub_batches]
        call = self.runner.host_call(plans, [greedy_sampling(p.num_rows) for p in plans])
        batch, _ = call.arrays
        (logits, chosen), self.runner.cache = self.step(self.runner.params, self.runner.cache,
                                                        jax.device_put(batch))
        logits = np.asarray(logits)
        return [RowLogits(logits=logits[seqs],
                          prompt_logprobs=None if chosen is None else np.asarray(chosen)[slots])
                for seqs, slots in zip(call.seq_index, call.token_index)]

    def dense(self, tokens):
        tokens = np.asarray(tokens, np.int32)
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1])
        return np.asarray(forward_dense(self.graphdef, self.runner.params, jnp.asarray(tokens),
                                        lengths))


def _forward(graphdef, params, cache, batch, *, block_pages):
    model = nnx.merge(graphdef, params)
    hidden, cache = ragged_layers(model, embed(model, batch), cache, batch, attention="jnp",
                                  block_pages=block_pages)
    chosen = None
    if batch.targets is not None:
        all_logits = model.logits(hidden).astype(jnp.float32)
        chosen, _, _ = prompt_logprobs(all_logits, batch.targets, 1)
    return (last_logits(model, hidden, batch), chosen), cache
