"""The structured-output mask on device: only allowed tokens are chosen, greedy or sampled, the
raw logprobs stay the model's, the mask comes before the penalties and the min-tokens ban, and a
batch with no constrained row samples exactly as before. One shape for the whole file (8 rows,
a 40-token vocabulary: two mask words, the sign bit included)."""

import dataclasses

import jax
import numpy as np

from meshserve.batching.sampling import greedy_sampling
from meshserve.batching.structured import allowed_ids, mask_words
from meshserve.model.executor.sampler import device_sampling, sample

_SAMPLE = jax.jit(sample, static_argnames="num_top_logprobs")
_ROWS, _VOCAB = 8, 40


def _mask(ids) -> np.ndarray:
    bits = np.zeros(32 * mask_words(_VOCAB), np.uint8)
    bits[list(ids)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _run(logits, allowed=None, **fields):
    base = greedy_sampling(_ROWS)
    updates = {name: np.broadcast_to(np.asarray(value, getattr(base, name).dtype),
                                     (_ROWS,)).copy() for name, value in fields.items()}
    if allowed is not None:
        updates["allowed"] = np.asarray(allowed, np.int32)
        updates["is_constrained"] = np.any(updates["allowed"] != -1, axis=1)
    arrays = device_sampling(dataclasses.replace(base, **updates), history_width=4,
                             banned_width=2, mask_width=mask_words(_VOCAB))
    return jax.device_get(_SAMPLE(np.asarray(logits, np.float32), arrays, num_top_logprobs=3))


def _logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(_ROWS, _VOCAB)).astype(np.float32) * 3


def test_the_packing_is_the_one_the_host_reads():
    assert allowed_ids(_mask([0, 31, 32, 39])).tolist() == [0, 31, 32, 39]


def test_greedy_rows_take_the_best_allowed_token_and_keep_raw_logprobs():
    logits = _logits()
    allowed = [[3, 31, 35], [31], [0, 39], [32], list(range(_VOCAB)), [7], [8, 9], [38]]
    got = _run(logits, np.stack([_mask(ids) for ids in allowed]), temperature=0.0,
               num_logprobs=3)  # rows asking for logprobs: the top-K is computed
    raw = jax.nn.log_softmax(logits, axis=-1)
    for row, ids in enumerate(allowed):
        assert got.tokens[row] == ids[int(np.argmax(logits[row, ids]))]
        np.testing.assert_allclose(got.logprobs[row], raw[row, got.tokens[row]], atol=1e-5)
    np.testing.assert_array_equal(got.top_ids, np.argsort(-logits, axis=-1)[:, :3])


def test_sampled_rows_draw_only_allowed_tokens():
    logits = np.tile(np.zeros(_VOCAB, np.float32), (_ROWS, 1))
    ids = [1, 30, 31, 33]
    seen = set()
    for seed in range(12):
        got = _run(logits, np.tile(_mask(ids), (_ROWS, 1)), temperature=1.0, seeds=seed,
                   steps=np.arange(_ROWS))
        seen |= set(got.tokens.tolist())
    assert seen == set(ids)


def test_the_mask_comes_before_penalties_and_the_min_tokens_ban():
    logits = _logits(1)
    eos = 5
    # Only EOS is allowed, and min_tokens bans it: the constraint wins (the row keeps a token).
    got = _run(logits, np.tile(_mask([eos]), (_ROWS, 1)), temperature=0.0, min_tokens=3,
               repetition_penalty=2.0)
    assert got.tokens.tolist() == [eos] * _ROWS


def test_no_constrained_row_samples_as_without_the_column():
    logits = _logits(2)
    fields = dict(temperature=np.linspace(0, 1.5, _ROWS), top_k=5, seeds=3,
                  steps=np.arange(_ROWS))
    neutral = _run(logits, np.full((_ROWS, mask_words(_VOCAB)), -1), **fields)
    one_word = _run(logits, None, **fields)  # the host's 1-word column, padded
    np.testing.assert_array_equal(neutral.tokens, one_word.tokens)
    everything = _run(logits, np.tile(_mask(range(_VOCAB)), (_ROWS, 1)), **fields)
    np.testing.assert_array_equal(everything.tokens, neutral.tokens)
