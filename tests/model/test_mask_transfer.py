"""The structured-output mask's way to the device (model/executor/runner.py): a step with no
constrained row builds and copies no mask (its call key says so, its host arrays hold a zero-width
one, and the program reads a resident all-allowed mask instead), a constrained step still copies
its masks, both run the one compiled program of their bucket, and the tokens are the same either
way. A step split in two (`forward`, then `sample`, so the host computes its masks while the
device runs the forward pass) gives what the one call gives, for every kind of row, and the
warm-up compiles its programs: a forward pass per bucket and a sampler per sequence-slot count.
One tiny random-weight Llama, an 8-slot bucket (and a 4-slot one) of 2 sequence slots."""

import dataclasses

import numpy as np
import pytest

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.batching.sampling import SamplingArrays, greedy_sampling
from meshserve.batching.structured import mask_words
from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import CompileCounter, ModelRunner, RunnerConfig
from meshserve.model.transformer import model_from_params
from tests.conftest import random_params

ROWS = [([5, 6, 7], 0, [2]), ([8, 9], 0, [3])]  # 5 tokens: the 8-slot bucket, 2 sequences


@pytest.fixture(scope="module")
def runner():
    config = ModelConfig.preset("tiny-llama")
    model = model_from_params(config, random_params(config))
    return ModelRunner(model, RunnerConfig(num_pages=8, page_size=4, max_num_seqs=2,
                                           max_num_batched_tokens=8, max_pages_per_seq=2,
                                           overlap_masks=True))


def _plan():
    return sub_batch_from_rows(ROWS, page_size=4)


def _sampling(runner, masks=None):
    """Greedy rows; `masks`, when given, one list of allowed ids per row (None: all allowed),
    every row constrained."""
    arrays = greedy_sampling(len(ROWS))
    if masks is None:
        return arrays
    words = mask_words(runner.model_config.vocab_size)
    allowed = np.full((len(ROWS), words), -1, np.int32)
    for row, ids in enumerate(masks):
        if ids is not None:
            bits = np.zeros(32 * words, np.uint8)
            bits[ids] = 1
            allowed[row] = np.packbits(bits, bitorder="little").view(np.int32)
    return dataclasses.replace(arrays, allowed=allowed,
                               is_constrained=np.ones(len(ROWS), np.bool_))


def test_an_unconstrained_step_carries_no_mask_and_a_constrained_one_does(runner):
    words = mask_words(runner.model_config.vocab_size)
    plain = runner.host_call([_plan()], [_sampling(runner)])
    assert plain.key == (8, 0, 0)
    assert plain.arrays[1].allowed.shape == (2, 0)  # nothing to build, nothing to copy
    constrained = runner.host_call([_plan()], [_sampling(runner, [None, [7]])])
    assert constrained.key == (8, 0, 1)
    assert constrained.arrays[1].allowed.shape == (2, words)
    for key in (plain.key, constrained.key):  # what a follower rebuilds from the key
        assert runner.template(key)[1].allowed.shape == runner.host_call(
            [_plan()], [_sampling(runner, None if key[2] == 0 else [None, None])]
        ).arrays[1].allowed.shape


def test_tokens_are_the_same_with_and_without_the_mask_and_one_program_serves_both(runner):
    runner.warmup([(8, 0)], progress=False)
    with CompileCounter() as compiles:
        (plain,) = runner.run_step([_plan()], [_sampling(runner)])
        (all_allowed,) = runner.run_step([_plan()], [_sampling(runner, [None, None])])
        forced = [(int(plain.tokens[0]) + 1) % runner.model_config.vocab_size, 7]
        (masked,) = runner.run_step([_plan()], [_sampling(runner, [[forced[0]], [forced[1]]])])
        (again,) = runner.run_step([_plan()], [_sampling(runner)])
    assert compiles.count == 0
    np.testing.assert_array_equal(all_allowed.tokens, plain.tokens)
    np.testing.assert_allclose(all_allowed.logprobs, plain.logprobs, atol=1e-6)
    np.testing.assert_array_equal(again.tokens, plain.tokens)
    assert masked.tokens.tolist() == forced  # a constrained step still gets its masks
    assert list(runner._allow_all) == [(2, mask_words(runner.model_config.vocab_size))]


def test_warmup_names_both_calls_of_each_bucket(runner):
    assert runner.warmup([(8, 0)], progress=False) == [(8, 0, 1), (8, 0, 0)]


# -- the split step: forward pass, then sampling -------------------------------------------------

def _columns(runner, **columns) -> SamplingArrays:
    """Two rows: greedy, then `columns` (per-row lists; `allowed`: allowed ids per row, None for
    all, every row then constrained)."""
    arrays = greedy_sampling(len(ROWS), history_width=5)
    if "allowed" in columns:
        masks = _sampling(runner, columns.pop("allowed"))
        arrays = dataclasses.replace(arrays, allowed=masks.allowed,
                                     is_constrained=masks.is_constrained)
    for name, values in columns.items():
        columns[name] = np.asarray(values, getattr(arrays, name).dtype)
    return dataclasses.replace(arrays, **columns)


SAMPLING = {
    "greedy, one row masked": dict(allowed=[[7, 300, 301], None]),
    "seeded, top-k and top-p, masked": dict(
        temperature=[0.9, 1.3], top_k=[0, 40], top_p=[0.9, 1.0], min_p=[0.0, 0.05],
        seeds=[7, 8], steps=[3, 0], allowed=[None, list(range(100, 400))]),
    "penalties, min_tokens, logprobs": dict(
        repetition_penalty=[1.3, 1.0], frequency_penalty=[0.0, 0.5], presence_penalty=[0.2, 0.0],
        history=[[5, 6, 7, 5, 6], [8, 9, 8, -1, -1]],
        history_is_output=[[False, False, False, True, True], [False, False, True, False, False]],
        min_tokens=[2, 0], banned_ids=[[1], [1]], num_logprobs=[3, 2]),
}


def _steps():
    """Sub-batches of a step: two prompts; the same with prompt logprobs; and a prompt chunk
    beside a decode (after the first)."""
    prompts = _plan()
    with_targets = sub_batch_from_rows(ROWS, page_size=4, targets=[[6, 7, 8], [9, 10]])
    chunk = sub_batch_from_rows([([11, 12, 13], 0, [4])], page_size=4)
    decode = sub_batch_from_rows([([20], 3, [2])], page_size=4)
    return {"prompts": [prompts], "prompt logprobs": [with_targets], "mixed": [chunk, decode]}


def _spread(arrays: SamplingArrays, sub_batches) -> list[SamplingArrays]:
    """`arrays`' two rows for the step's sub-batches: both in one, or one each."""
    if len(sub_batches) == 1:
        return [arrays]
    return [SamplingArrays(**{f.name: getattr(arrays, f.name)[row:row + 1]
                              for f in dataclasses.fields(SamplingArrays)}) for row in (0, 1)]


@pytest.mark.parametrize("kind", list(SAMPLING))
def test_a_split_step_computes_what_the_one_call_computes(runner, kind):
    keys = [(8, 0), (8, 1), (4, 0)]
    runner.warmup(keys, progress=False)  # the one call's programs and the split step's
    arrays = _columns(runner, **SAMPLING[kind])
    with CompileCounter() as compiles:
        for name, sub_batches in _steps().items():
            sampling = _spread(arrays, sub_batches)
            want = runner.run_step(sub_batches, sampling)
            got = runner.sample(runner.forward(sub_batches), sampling)
            for g, w in zip(got, want):
                for field in dataclasses.fields(w):
                    a, b = getattr(g, field.name), getattr(w, field.name)
                    assert (a is None) == (b is None), (name, field.name)
                    if a is not None:
                        np.testing.assert_array_equal(a, b, err_msg=f"{name}: {field.name}")
    assert compiles.count == 0


def test_the_warmup_compiles_the_split_steps_programs():
    """Per bucket key a step and a forward pass; per sequence-slot count a sampler (both
    buckets here have 2 slots); `num_programs` counts the whole set the same way."""
    config = ModelConfig.preset("tiny-llama")
    runner = ModelRunner(model_from_params(config, random_params(config)), RunnerConfig(
        num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_pages_per_seq=2,
        overlap_masks=True))
    with CompileCounter() as compiles:
        runner.warmup([(8, 0), (4, 0)], progress=False)
    assert compiles.count == 2 + 2 + 1
    assert runner.config.sampling_rows() == [1, 2]
    assert runner.num_programs() == 5 + 5 + 2  # buckets 1, 2, 4, 8 and prompt logprobs
    unset = dataclasses.replace(runner.config, overlap_masks=None)  # on unless on the CPU
    assert not unset.overlaps_masks(platform="cpu") and unset.overlaps_masks(platform="gpu")
