"""The structured-output mask's way to the device (model/executor/runner.py): a step with no
constrained row builds and copies no mask (its call key says so, its host arrays hold a zero-width
one, and the program reads a resident all-allowed mask instead), a constrained step still copies
its masks, both run the one compiled program of their bucket, and the tokens are the same either
way. One tiny random-weight Llama, one 4-slot bucket."""

import dataclasses

import numpy as np
import pytest

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.batching.sampling import greedy_sampling
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
                                           max_num_batched_tokens=8, max_pages_per_seq=2))


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
