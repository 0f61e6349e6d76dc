"""The device sampler: per-row sampling of the next token from one sub-batch's logits.

`sample` is a pure, jit-friendly function of `(logits [B, V], SamplingArrays)`: the plan's host
type, registered here as a pytree, holding device arrays. Every row carries its own parameters,
so one call mixes greedy, temperature, top-k, top-p and min-p rows. The pipeline (vLLM's
semantics):

1. Logprobs, of the chosen token and of the top-K, come from the raw model distribution:
   `log_softmax(logits)` before any penalty, mask, temperature or filter. The top-K is computed
   only on steps where some row returns logprobs (`num_logprobs >= 0`); otherwise it is zeros.
2. Structured output: tokens outside a row's `allowed` mask (a packed bitmask, all bits set
   for an unconstrained row) get -inf, so everything after it chooses among allowed tokens only.
3. Penalties: repetition over the prompt and output in `history` (divide positive logits, multiply
   the others), then frequency (minus f times the output count) and presence (minus p once per
   output token seen).
4. Stop masking: while `steps < min_tokens`, the row's `banned_ids` get -inf (unless that would
   mask the whole row).
5. Rows with temperature <= 0 take the argmax of the logits so far.
6. Other rows: divide by temperature, keep the logits at or above one threshold per row (the
   largest of the top-k, top-p and min-p thresholds, each computed on one descending sort), and
   draw with `jax.random.categorical`.

Invariants: float32 throughout; the top token of a row always survives the filters, so no row is
all -inf and nothing divides 0 by 0; a row's key is `fold_in(key(seed), step)`, so its draw
depends only on (seed, step, its own logits), never on batch company, row index or batch size.
History and banned ids use -1 as padding; padding never touches a logit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.batching.sampling import COLUMNS, SamplingArrays, pad_sampling

_NEG_INF = float("-inf")
_F32_MAX = float(np.finfo(np.float32).max)

# The host's `SamplingArrays` is the device type too: registered here as a pytree (batching/ stays
# jax-free), so its one table of columns is the only list of sampling fields. Unflattening skips
# the host shape checks of `__post_init__`: inside jax transformations the leaves may be tracers,
# shardings or placeholders.
def _unflatten_sampling(_, leaves) -> SamplingArrays:
    arrays = object.__new__(SamplingArrays)
    for name, leaf in zip(COLUMNS, leaves):
        object.__setattr__(arrays, name, leaf)
    return arrays


jax.tree_util.register_pytree_with_keys(
    SamplingArrays,
    lambda a: ([(jax.tree_util.GetAttrKey(name), getattr(a, name)) for name in COLUMNS], None),
    _unflatten_sampling,
    lambda a: ([getattr(a, name) for name in COLUMNS], None))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32, raw logprob of the chosen token
    top_ids: jax.Array  # [B, K] int32, most likely tokens of the raw distribution, descending
    top_logprobs: jax.Array  # [B, K] float32


def device_sampling(arrays: SamplingArrays, *, sharding=None, **padding) -> SamplingArrays:
    """`host_sampling(arrays, **padding)` moved to device in one `device_put`."""
    return jax.device_put(host_sampling(arrays, **padding), sharding)


def host_sampling(arrays: SamplingArrays, *, min_tokens: np.ndarray | None = None,
                  banned_ids: np.ndarray | None = None, rows: int | None = None,
                  history_width: int | None = None, banned_width: int | None = None,
                  mask_width: int | None = None,
                  index: np.ndarray | None = None) -> SamplingArrays:
    """`arrays` padded to fixed shapes when asked (`pad_sampling`), every column in its dtype.

    `min_tokens` and `banned_ids`, when given, replace those of `arrays`. `rows`,
    `history_width`, `banned_width` and `mask_width` (the words of the vocabulary's packed mask,
    `mask_words`) pad to those sizes (so compiled shapes stay bucketed) with neutral greedy rows
    and neutral columns. Row i goes to padded row `index[i]` (default: in order).
    """
    overrides = {name: np.asarray(value) for name, value in (("min_tokens", min_tokens),
                                                              ("banned_ids", banned_ids))
                 if value is not None}
    arrays = dataclasses.replace(arrays, **overrides) if overrides else arrays
    return pad_sampling(arrays, rows=rows, index=index,
                        widths={"history": history_width, "banned": banned_width,
                                "vocab_words": mask_width})


def sample(logits: jax.Array, s: SamplingArrays, *, num_top_logprobs: int = 0,
           replica_axes: tuple[str, ...] = ()) -> Sampled:
    """Samples one token per row of `logits` [B, V] (float32); K = `num_top_logprobs` is static.

    Under a shard_map over `replica_axes`, every replica takes the same branch of each shortcut
    (the penalties, the min-tokens mask, the all-greedy one): see `_any_on_some_replica`.
    """
    raw = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
    # Steps where no row is constrained, no row has a penalty, or no row is under min_tokens,
    # skip that pass over the vocabulary (the penalties' scatters into [B, V] counts cost as
    # much as the lm_head at batch 32). An all-greedy batch skips the sort over the vocabulary
    # that the filters need, and a step where no row returns logprobs skips the top-K.
    has_mask, has_penalty, has_min_tokens, has_sampled, has_logprobs = _any_on_some_replica([
        jnp.any(s.is_constrained),
        jnp.any((s.repetition_penalty != 1) | (s.presence_penalty != 0)
                | (s.frequency_penalty != 0)),
        jnp.any(s.steps < s.min_tokens), jnp.any(s.temperature > 0),
        jnp.any(s.num_logprobs >= 0)], replica_axes)
    top_logprobs, top_ids = jax.lax.cond(  # [B, K]
        has_logprobs, lambda: tuple(jax.lax.top_k(raw, num_top_logprobs)),
        lambda: (jnp.zeros((raw.shape[0], num_top_logprobs), raw.dtype),
                 jnp.zeros((raw.shape[0], num_top_logprobs), jnp.int32)))
    adjusted = jax.lax.cond(has_mask, lambda: mask_disallowed(logits, s.allowed),
                            lambda: logits)  # [B, V]
    adjusted = jax.lax.cond(has_penalty, lambda: apply_penalties(adjusted, s),
                            lambda: adjusted)
    adjusted = jax.lax.cond(has_min_tokens, lambda: mask_banned(adjusted, s),
                            lambda: adjusted)  # [B, V]
    greedy = jnp.argmax(adjusted, axis=-1)  # [B]
    all_greedy = jnp.logical_not(has_sampled)
    drawn = jax.lax.cond(
        all_greedy, lambda: greedy,
        lambda: draw(apply_filters(scale(adjusted, s.temperature), s), s.seeds, s.steps))  # [B]
    tokens = jnp.where(s.temperature <= 0, greedy, drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]  # [B]
    return Sampled(tokens=tokens, logprobs=chosen, top_ids=top_ids.astype(jnp.int32),
                   top_logprobs=top_logprobs)


def _any_on_some_replica(flags: list[jax.Array], replica_axes: tuple[str, ...]
                         ) -> list[jax.Array]:
    """Each boolean flag ORed over the shard_map replicas, so that every replica takes the same
    branch of a `lax.cond` (collectives inside diverging branches would wait on each other
    forever). One scalar collective carries them all: flag i counts in base R + 1, R replicas."""
    if not replica_axes:
        return flags
    base = jax.lax.psum(1, replica_axes) + 1  # a count of replicas never reaches it
    packed = sum(flag.astype(jnp.int32) * base ** i for i, flag in enumerate(flags))
    total = jax.lax.psum(packed, replica_axes)
    return [(total // base ** i) % base > 0 for i in range(len(flags))]


def mask_disallowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf where bit `t % 32` of word `t // 32` of a row's `allowed` [B, W] (int32) is clear.

    A row whose mask allows nothing is left as it is: the host ends such a request before it
    is planned (`batching/structured.py`), and padding rows are all ones. Words missing past W
    allow everything, as the neutral padding of the column does."""
    rows, vocab_size = logits.shape
    missing = -(-vocab_size // 32) - allowed.shape[1]
    if missing > 0:
        allowed = jnp.pad(allowed, ((0, 0), (0, missing)), constant_values=-1)
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    unpacked = (allowed[:, :, None] >> bits) & 1  # [B, W, 32]
    is_allowed = unpacked.reshape(rows, -1)[:, :vocab_size] != 0  # [B, V]
    masked = jnp.where(is_allowed, logits, _NEG_INF)
    keeps_some = jnp.any(is_allowed, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(keeps_some, masked, logits)


def token_counts(ids: jax.Array, weights: jax.Array, vocab_size: int) -> jax.Array:
    """Per-row counts [B, V] (int32) of `ids` [B, H], each weighted by `weights` [B, H] (bool)."""
    rows = jnp.arange(ids.shape[0])[:, None]  # [B, 1]
    valid = (ids >= 0) & weights
    # -1 would wrap to the last token, so padding goes out of bounds and is dropped.
    safe = jnp.where(valid, ids, vocab_size)  # [B, H]
    counts = jnp.zeros((ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, safe].add(1, mode="drop")


def apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Repetition (prompt and output), then frequency and presence (output only) penalties."""
    vocab_size = logits.shape[-1]
    seen = token_counts(s.history, jnp.ones_like(s.history_is_output), vocab_size) > 0  # [B, V]
    output = token_counts(s.history, s.history_is_output, vocab_size)  # [B, V]
    rep = s.repetition_penalty[:, None]  # [B, 1]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    penalised = jnp.where(seen, repeated, logits)
    penalised = penalised - s.frequency_penalty[:, None] * output.astype(jnp.float32)
    penalised = penalised - s.presence_penalty[:, None] * (output > 0).astype(jnp.float32)
    return jnp.minimum(penalised, _F32_MAX)  # a penalty below 1 must not overflow to +inf


def mask_banned(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """-inf at `banned_ids` for rows with `steps < min_tokens`; a row is never masked whole."""
    vocab_size = logits.shape[-1]
    active = (s.steps < s.min_tokens)[:, None]  # [B, 1]
    banned = token_counts(s.banned_ids, jnp.broadcast_to(active, s.banned_ids.shape),
                          vocab_size) > 0  # [B, V]
    masked = jnp.where(banned, _NEG_INF, logits)
    keeps_some = jnp.any(masked > _NEG_INF, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(keeps_some, masked, logits)


def scale(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """(logits - row max) / temperature: <= 0 everywhere, the top token at 0, never +inf.

    Greedy rows (temperature <= 0) are scaled by 1; their draw is discarded.
    """
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]  # [B, 1]
    return (logits - top) / safe_t


def top_k_threshold(sorted_logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """[B] the k-th largest logit of each row; -inf where top_k is 0 (off) or >= V."""
    vocab_size = sorted_logits.shape[-1]
    on = (top_k > 0) & (top_k < vocab_size)
    index = jnp.clip(top_k - 1, 0, vocab_size - 1)[:, None]  # [B, 1]
    kth = jnp.take_along_axis(sorted_logits, index, axis=-1)[:, 0]
    return jnp.where(on, kth, _NEG_INF)


def top_p_threshold(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B] the smallest logit of the nucleus; -inf where top_p >= 1 (off).

    The nucleus is the shortest prefix of the descending order whose probability mass reaches
    top_p (inclusive: a token is kept while the mass strictly above it is < top_p). The top token
    is always kept.
    """
    probs = _softmax(sorted_logits)  # [B, V]
    total = jnp.cumsum(probs, axis=-1)  # [B, V]
    above = jnp.pad(total[:, :-1], ((0, 0), (1, 0)))  # [B, V] mass of the tokens ranked above
    kept = jnp.maximum(jnp.sum(above < top_p[:, None], axis=-1), 1)  # [B]
    last = jnp.take_along_axis(sorted_logits, (kept - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(top_p < 1, last, _NEG_INF)


def min_p_threshold(sorted_logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """[B] log(min_p * max prob) in logit space: prob >= min_p * max_prob iff logit >= this."""
    return sorted_logits[:, 0] + jnp.log(jnp.maximum(min_p, 0.0))


def apply_filters(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """Top-k, then top-p over the top-k survivors, then min-p; the rest become -inf.

    One descending sort serves all three; each yields a per-row logit threshold, and a token is
    kept when it is at or above all of them (ties with a threshold are kept).
    """
    ranked = jnp.sort(scaled, axis=-1, descending=True)  # [B, V]
    k_floor = top_k_threshold(ranked, s.top_k)  # [B]
    ranked = jnp.where(ranked >= k_floor[:, None], ranked, _NEG_INF)
    floor = jnp.maximum(k_floor, top_p_threshold(ranked, s.top_p))
    floor = jnp.maximum(floor, min_p_threshold(ranked, s.min_p))
    floor = jnp.minimum(floor, ranked[:, 0])[:, None]  # [B, 1] the top token always survives
    return jnp.where(scaled >= floor, scaled, _NEG_INF)


def draw(logits: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """[B] one categorical draw per row, keyed by fold_in(key(seed), step) of that row."""
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
        seeds, steps)
    return jax.vmap(jax.random.categorical)(keys, logits)


def _softmax(logits: jax.Array) -> jax.Array:
    """Softmax of rows whose max is finite; an all -inf row gives zeros instead of NaN."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
