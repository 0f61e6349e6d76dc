"""Verification of drafted tokens against the target's distribution: exact rejection sampling.

The engine's n-gram drafts are deterministic: their draft distribution q is one-hot on the
drafted token x. Rejection sampling then accepts x with min(1, p(x) / q(x)) = p(x) and, on
rejection, draws from normalize(max(p - q, 0)), which is p with x removed. Drawing y ~ p with
the ordinary sampler and accepting iff y == x has exactly that law (P(accept) = p(x); given a
rejection, y is p conditioned on y != x), so the engine verifies by sampling every position
with `meshserve.model.executor.sampler.sample` and comparing on the host
(`meshserve.batching.speculative`): p is the request's own distribution after every sampling
transform (structured mask, penalties, min_tokens, temperature, top-k, top-p, min-p), computed
by the same code as without speculation, and outputs stay token-identical to it for a seed.

`rejection_sample` is the general rule, for drafts with a distribution of their own (a draft
model that samples): one verification position per row, p and q given as probabilities. Pure
and jit-friendly; `tests/model/test_speculative_sampling.py` checks both forms statistically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshserve.model.executor.sampler import apply_filters, scale


def target_probs(adjusted: jax.Array, s) -> jax.Array:
    """p [B, V]: the distribution `sample` draws from for rows with temperature > 0, given its
    logits after the mask, penalties and stop masking (`adjusted`) and the rows'
    `SamplingArrays` `s`: scaled by the temperature, filtered by top-k, top-p and min-p,
    normalised (the very functions `sample` applies)."""
    return jax.nn.softmax(apply_filters(scale(adjusted, s.temperature), s), axis=-1)


def rejection_sample(p: jax.Array, q: jax.Array, drafts: jax.Array, key: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """Verifies one drafted token per row. p, q [B, V] (the target's and the draft's
    distributions at that position), drafts [B] (drawn from q). Returns (accepted [B] bool, the
    row's token [B]): the draft when accepted, else a draw from normalize(max(p - q, 0)).

    Accept x with probability min(1, p(x) / q(x)); the residual has mass exactly where p
    exceeds q, so the token returned is distributed as p whatever q is."""
    accept_key, residual_key = jax.random.split(key)
    rows = jnp.arange(p.shape[0])
    p_x, q_x = p[rows, drafts], q[rows, drafts]  # [B]
    u = jax.random.uniform(accept_key, p_x.shape)
    accepted = u * q_x < p_x  # u < p(x) / q(x), without dividing by a zero q(x)
    residual = jnp.maximum(p - q, 0.0)  # [B, V]
    # p == q leaves no residual, and then every draft is accepted: any token will do.
    logits = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
    logits = jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), logits, 0.0)
    corrected = jax.random.categorical(residual_key, logits, axis=-1)
    return accepted, jnp.where(accepted, drafts, corrected).astype(jnp.int32)
