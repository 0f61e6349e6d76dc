"""The device sampler against numpy references and empirical frequencies over many seeded draws.

Many draws of one logits row are one batch: the row repeated with the same seed and steps
0..n-1, so each row gets its own key and the batch path itself is what is checked. Shapes are
shared between tests (4096 x 12 for draws, history padded to 8, banned ids to 4) so the file
compiles few programs.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from meshserve.batching.sampling import COLUMNS, SamplingArrays, greedy_sampling
from meshserve.model.executor.sampler import apply_penalties, device_sampling, sample

_SAMPLE = jax.jit(sample, static_argnames="num_top_logprobs")
_PENALISE = jax.jit(apply_penalties)
_DRAWS, _VOCAB = 4096, 12
_NUCLEUS = np.array([0.5, 0.3, 0.15, 0.05])
_ORDER = np.array([2, 0, 3, 1])  # token ids of the nucleus probabilities, most likely first


def _sampling(rows: int, *, history=None, history_is_output=None, min_tokens=None,
              banned_ids=None, **fields) -> SamplingArrays:
    base = greedy_sampling(rows)
    updates = {name: np.broadcast_to(np.asarray(value, getattr(base, name).dtype), (rows,)).copy()
               for name, value in fields.items()}
    if history is not None:
        updates["history"] = np.asarray(history, np.int32)
        updates["history_is_output"] = np.asarray(history_is_output, bool)
    return device_sampling(dataclasses.replace(base, **updates), min_tokens=min_tokens,
                           banned_ids=banned_ids, history_width=8, banned_width=4)


def _run(logits, s: SamplingArrays, k: int = 5):
    logits = np.asarray(logits, np.float32)
    k = min(k, logits.shape[-1])
    return jax.device_get(_SAMPLE(logits, s, num_top_logprobs=k))


def _draws(row, n: int = _DRAWS, *, seed: int = 7, **fields) -> np.ndarray:
    """Tokens of n draws of one logits row: same seed, steps 0..n-1."""
    logits = np.tile(np.asarray(row, np.float32), (n, 1))
    fields.setdefault("temperature", 1.0)
    return _run(logits, _sampling(n, seeds=seed, steps=np.arange(n), **fields)).tokens


def _nucleus_logits() -> np.ndarray:
    """The nucleus probabilities at token ids `_ORDER`; the other 8 tokens are impossible."""
    logits = np.full(_VOCAB, -np.inf, np.float32)
    logits[_ORDER] = np.log(_NUCLEUS)
    return logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _entropy(tokens: np.ndarray) -> float:
    freq = np.bincount(tokens) / len(tokens)
    freq = freq[freq > 0]
    return float(-(freq * np.log(freq)).sum())


def test_greedy_rows_take_argmax_with_raw_logprobs_and_top_k():
    logits = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32) * 3
    out = _run(logits, _sampling(8, num_logprobs=5))
    ref = _log_softmax(logits)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    np.testing.assert_allclose(out.logprobs, ref[np.arange(8), out.tokens], atol=1e-5)
    top = np.argsort(-logits, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, top, -1), atol=1e-5)
    assert out.tokens.dtype == np.int32 and out.top_ids.dtype == np.int32
    assert out.top_ids.shape == (8, 5) and _run(logits, _sampling(8), k=0).top_ids.shape == (8, 0)


def test_top_logprobs_are_computed_only_on_steps_where_a_row_returns_them():
    logits = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32) * 3
    ref = _log_softmax(logits)
    none = _run(logits, _sampling(8))  # no row asks: the top-K is skipped
    assert not none.top_ids.any() and not none.top_logprobs.any()
    np.testing.assert_array_equal(none.tokens, logits.argmax(-1))
    np.testing.assert_allclose(none.logprobs, ref[np.arange(8), none.tokens], atol=1e-5)
    one = _run(logits, _sampling(8, num_logprobs=[-1] * 7 + [0]))  # 0: the chosen token's rank
    np.testing.assert_array_equal(one.top_ids, np.argsort(-logits, axis=-1)[:, :5])


def test_logprobs_are_raw_under_penalties_and_temperature():
    logits = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    s = _sampling(8, temperature=[0.0, 0.5, 2.0, 1, 1, 0, 3, 0.1], top_k=[0, 4, 0, 0, 1, 0, 2, 0],
                  repetition_penalty=1.5, presence_penalty=0.7, history=[[0, 1], [2, 3], [4, -1],
                  [5, 6], [7, 8], [9, 9], [10, 11], [12, 13]], history_is_output=[[True, True]] * 8,
                  num_logprobs=5)
    out = _run(logits, s)
    ref = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(8), out.tokens], atol=1e-5)
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref, -1)[:, :5], atol=1e-5)


def test_mixed_batch_leaves_greedy_rows_alone():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, 64)).astype(np.float32)
    mixed = _sampling(8, temperature=[0, 1.0, 0, 0.7, 0, 1.3, 0, 2], top_k=[0, 5, 0, 0, 0, 2, 0, 0],
                      top_p=[1, 1, 1, 0.8, 1, 1, 1, 1], min_p=[0, 0, 0, 0, 0, 0.1, 0, 0],
                      seeds=rng.integers(0, 2**32, 8), steps=[3, 1, 4, 1, 5, 9, 2, 6])
    out = _run(logits, mixed)
    greedy = [0, 2, 4, 6]
    np.testing.assert_array_equal(out.tokens[greedy], logits[greedy].argmax(-1))
    np.testing.assert_array_equal(out.tokens[greedy], _run(logits, _sampling(8)).tokens[greedy])


def test_seeded_draw_depends_only_on_seed_step_and_row():
    rng = np.random.default_rng(3)
    n = 24
    logits = rng.normal(size=(n, 64)).astype(np.float32)
    seeds = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 1000, n)
    alone = np.array([_run(logits[i:i + 1], _sampling(1, temperature=1.0, seeds=seeds[i],
                                                      steps=steps[i])).tokens[0]
                      for i in range(4)])
    base = _run(logits, _sampling(n, temperature=1.0, seeds=seeds, steps=steps)).tokens
    np.testing.assert_array_equal(base[:4], alone)
    # Reversed, interleaved with neighbours of other parameters, in a larger batch.
    m = 2 * n + 5
    order = rng.permutation(m)[:n]
    big_logits = rng.normal(size=(m, 64)).astype(np.float32)
    big_logits[order] = logits[::-1]
    fields = dict(temperature=rng.uniform(0, 2, m), top_k=rng.integers(0, 5, m),
                  seeds=rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32),
                  steps=rng.integers(0, 1000, m))
    fields["temperature"][order], fields["top_k"][order] = 1.0, 0
    fields["seeds"][order], fields["steps"][order] = seeds[::-1], steps[::-1]
    moved = _run(big_logits, _sampling(m, **fields)).tokens
    np.testing.assert_array_equal(moved[order], base[::-1])


def test_different_seeds_and_steps_draw_differently():
    flat = np.zeros((_DRAWS, _VOCAB), np.float32)
    uniform = np.full(_VOCAB, 1 / _VOCAB)
    across_seeds = _run(flat, _sampling(_DRAWS, temperature=1.0, seeds=np.arange(_DRAWS))).tokens
    np.testing.assert_allclose(np.bincount(across_seeds, minlength=_VOCAB) / _DRAWS, uniform,
                               atol=0.02)
    one_seed, other_seed = _draws(flat[0], seed=1), _draws(flat[0], seed=2)
    np.testing.assert_allclose(np.bincount(one_seed, minlength=_VOCAB) / _DRAWS, uniform,
                               atol=0.02)
    assert np.mean(one_seed != other_seed) > 0.85  # independent draws differ 11/12 of the time


def test_top_k_keeps_only_the_k_largest_and_k1_is_greedy():
    row = np.random.default_rng(4).normal(size=_VOCAB).astype(np.float32)
    top3 = set(np.argsort(-row)[:3].tolist())
    assert set(_draws(row, top_k=3).tolist()) == top3
    assert set(_draws(row, top_k=1, temperature=5.0).tolist()) == {int(row.argmax())}
    assert len(set(_draws(row, top_k=_VOCAB).tolist())) == _VOCAB  # k >= V is off


@pytest.mark.parametrize("top_p, kept", [(0.45, 1), (0.7, 2), (0.9, 3), (0.99, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, kept):
    # Mass ranked above each token: 0, 0.5, 0.8, 0.95. A token is kept while that is < top_p.
    assert set(_draws(_nucleus_logits(), top_p=top_p).tolist()) == set(_ORDER[:kept].tolist())


@pytest.mark.parametrize("min_p, kept", [(0.0, 4), (0.2, 3), (0.5, 2), (0.7, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_top_prob(min_p, kept):
    assert set(_draws(_nucleus_logits(), min_p=min_p).tolist()) == set(_ORDER[:kept].tolist())


@pytest.mark.parametrize("fields, kept", [
    (dict(top_k=2, top_p=0.6), 1),  # after top-k the probs are 0.625, 0.375: top-p sees those
    (dict(top_k=3, top_p=0.99), 3),
    (dict(top_k=3, min_p=0.2), 3),
    (dict(top_p=0.9, min_p=0.5), 2),
])
def test_filters_compose_top_k_then_top_p_then_min_p(fields, kept):
    assert set(_draws(_nucleus_logits(), **fields).tolist()) == set(_ORDER[:kept].tolist())


def test_unfiltered_draws_follow_the_softmax():
    row = np.random.default_rng(5).normal(size=_VOCAB).astype(np.float32)
    freq = np.bincount(_draws(row), minlength=_VOCAB) / _DRAWS
    np.testing.assert_allclose(freq, np.exp(_log_softmax(row)), atol=0.03)


def test_temperature_flattens_when_high_and_sharpens_when_low():
    row = np.random.default_rng(6).normal(size=_VOCAB).astype(np.float32) * 2
    cold, warm, hot = (_entropy(_draws(row, temperature=t)) for t in (0.3, 1.0, 3.0))
    assert cold < warm < hot


def test_penalties_follow_history_and_ignore_padding():
    logits = np.array([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0]], np.float32)
    history = [[0, 1, 2, 2, 3, -1, -1]]  # prompt 0, 1; output 2, 2, 3; -1 padding
    is_output = [[False, False, True, True, True, True, False]]
    s = _sampling(1, repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5,
                  history=history, history_is_output=is_output)
    out = np.asarray(_PENALISE(logits, s))
    expected = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.2 - 0.5, 0.5 / 2 - 0.1 - 0.5, 3.0, -1.0]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def test_neutral_penalties_leave_logits_unchanged():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(1, 6)).astype(np.float32)
    s = _sampling(1, history=rng.integers(-1, 6, (1, 7)),
                  history_is_output=rng.integers(0, 2, (1, 7)))
    np.testing.assert_array_equal(np.asarray(_PENALISE(logits, s)), logits)


def test_penalties_change_the_greedy_choice():
    logits = np.array([[1.0, 0.9, 0.0]] * 3 + [[0.9, 0.0, 1.0]], np.float32)
    history = [[0, -1], [0, -1], [0, -1], [-1, -1]]
    is_output = [[True, False], [False, False], [False, False], [True, True]]
    s = _sampling(4, presence_penalty=[0.2, 0.2, 0.0, 0.2], repetition_penalty=[1, 1, 1.2, 1],
                  history=history, history_is_output=is_output)
    # Presence counts output only (row 1's 0 is prompt); repetition counts the prompt too; a -1
    # must not wrap around to the last token (row 3).
    np.testing.assert_array_equal(_run(logits, s).tokens, [1, 0, 1, 2])


def test_banned_ids_are_masked_until_min_tokens():
    eos, stop = 3, 5
    n = 4
    logits = np.tile(np.array([0, 1, 0, 9, 0, 8, 0, 0], np.float32), (2 * n, 1))
    steps = np.tile(np.arange(n), 2)
    s = _sampling(2 * n, temperature=np.repeat([0.0, 1.0], n), steps=steps, seeds=11,
                  min_tokens=np.full(2 * n, 2), banned_ids=np.tile([[eos, stop, -1]], (2 * n, 1)))
    tokens = _run(logits, s).tokens
    assert not set(tokens[steps < 2].tolist()) & {eos, stop}
    np.testing.assert_array_equal(tokens[:n], [1, 1, eos, eos])  # greedy: best allowed token


def test_min_tokens_never_masks_a_whole_row():
    s = _sampling(2, temperature=[0.0, 1.0], min_tokens=[1, 1], banned_ids=[[0, 1], [1, 0]])
    out = _run(np.array([[0.0, 1.0]] * 2, np.float32), s)
    assert out.tokens[0] == 1 and out.tokens[1] in (0, 1)  # masking is dropped, not applied
    assert np.all(np.isfinite(out.logprobs))


def test_extreme_logits_give_no_nan():
    row = np.array([-1e30, 1e30, 3e38, -3e38, 0.0, 1e30, -np.inf, 5.0], np.float32)
    n = 8
    s = _sampling(n, temperature=[0, 1e-3, 0.5, 1, 5, 100, 1, 1], top_k=[0, 0, 2, 0, 3, 0, 0, 1],
                  top_p=[1, 0.9, 1, 0.5, 1, 0.01, 1, 1], min_p=[0, 0, 0.3, 0, 0, 0, 0.9, 0],
                  repetition_penalty=[1, 0.5, 2, 1, 1, 0.5, 1, 1], frequency_penalty=1e30,
                  history=np.tile([[0, 1, 2, 3]], (n, 1)), history_is_output=np.ones((n, 4)),
                  seeds=np.arange(n))
    out = _run(np.tile(row, (n, 1)), s, k=4)
    for field in dataclasses.fields(out):
        assert not np.isnan(getattr(out, field.name)).any(), field.name
    assert np.all(np.isfinite(out.logprobs)) and np.all(row[out.tokens] > -np.inf)


def test_compiles_once_per_shape():
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    fn = jax.jit(functools.partial(sample, num_top_logprobs=5))
    rng = np.random.default_rng(8)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for call in range(3):
            s = _sampling(4, temperature=rng.uniform(0, 2, 4), top_k=rng.integers(0, 9, 4),
                          seeds=rng.integers(0, 2**31, 4), steps=[call] * 4,
                          history=rng.integers(-1, 16, (4, 3)),
                          history_is_output=rng.integers(0, 2, (4, 3)))
            jax.block_until_ready(fn(rng.normal(size=(4, 16)).astype(np.float32), s))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert len(compiles) == 1 and fn._cache_size() == 1


def test_device_sampling_pads_to_neutral_greedy_rows():
    base = greedy_sampling(2, history_width=2)
    arrays = dataclasses.replace(base, temperature=np.array([1.0, 0.5], np.float32),
                                 history=np.array([[4, 5], [6, -1]], np.int32))
    s = jax.device_get(device_sampling(arrays, min_tokens=np.array([3, 0]),
                                       banned_ids=np.array([[2], [2]]), rows=4,
                                       history_width=5, banned_width=3))
    assert s.history.shape == s.history_is_output.shape == (4, 5) and s.banned_ids.shape == (4, 3)
    np.testing.assert_array_equal(s.temperature, [1.0, 0.5, 0, 0])
    np.testing.assert_array_equal(s.history[:, 2:], -1)
    np.testing.assert_array_equal(s.banned_ids[:, 1:], -1)
    np.testing.assert_array_equal(s.min_tokens, [3, 0, 0, 0])
    assert s.seeds.dtype == np.uint32 and s.top_p[3] == 1 and s.repetition_penalty[3] == 1
    default = device_sampling(base)
    assert default.min_tokens.shape == (2,) and default.banned_ids.shape == (2, 1)


def test_device_sampling_reads_stop_masking_from_the_plan_arrays():
    arrays = dataclasses.replace(greedy_sampling(2), min_tokens=np.array([2, 0], np.int32),
                                 banned_ids=np.array([[7, -1], [8, 9]], np.int32))
    s = jax.device_get(device_sampling(arrays))
    np.testing.assert_array_equal(s.min_tokens, [2, 0])
    np.testing.assert_array_equal(s.banned_ids, [[7, -1], [8, 9]])
    override = jax.device_get(device_sampling(arrays, min_tokens=np.array([5, 5])))
    np.testing.assert_array_equal(override.min_tokens, [5, 5])


def test_sampling_arrays_are_a_pytree_of_their_columns():
    arrays = greedy_sampling(3, history_width=2)
    leaves, treedef = jax.tree.flatten(arrays)
    assert len(leaves) == len(COLUMNS)
    for leaf, name in zip(leaves, COLUMNS):
        assert leaf is getattr(arrays, name)
    # Inside jax the leaves need not be arrays of one row count: unflattening skips the checks.
    counts = jax.jit(lambda s: jax.tree.map(lambda a: a.shape[0] * 2, s))(arrays)
    assert isinstance(counts, SamplingArrays) and counts.steps == 6
    assert jax.tree.unflatten(treedef, leaves).history.shape == (3, 2)
