"""A small driver of `forward_step` for tests that compare logits, not sampled tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.attention import init_kv_cache
from meshserve.model.runner import pad_sub_batch
from meshserve.model.steps import forward_dense, forward_step


class PagedStepper:
    """Runs forward_step on plans built from (tokens, cached, pages) rows."""

    def __init__(self, model, *, page_size, num_pages):
        c = model.config
        self.page_size = page_size
        self.graphdef, self.params = nnx.split(model)
        self.cache = init_kv_cache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                   num_pages=num_pages, page_size=page_size,
                                   head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self.step = jax.jit(functools.partial(forward_step, self.graphdef), donate_argnums=(1,))

    def run(self, *sub_batches):
        batches = []
        for rows, targets in sub_batches:
            plan = sub_batch_from_rows(rows, page_size=self.page_size, targets=targets)
            batches.append(pad_sub_batch(plan, (plan.num_rows + 1, plan.tokens.shape[1],
                                                plan.page_table.shape[1] + 1)))
        outputs, self.cache = self.step(self.params, self.cache, tuple(batches))
        return outputs

    def dense(self, tokens):
        tokens = np.asarray(tokens, np.int32)
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1])
        return np.asarray(forward_dense(self.graphdef, self.params, jnp.asarray(tokens), lengths))
