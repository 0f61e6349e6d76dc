"""The fixed-batch greedy loop: page assignment, stop ids, and input checks."""

import numpy as np
import pytest

from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.greedy_reference import generate_greedy
from tests.conftest import random_params


@pytest.fixture(scope="module")
def runner():
    config = ModelConfig.preset("tiny-llama")
    return ModelRunner(model_from_params(config, random_params(config)), RunnerConfig(
        num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_pages_per_seq=8))


def test_batched_rows_equal_rows_run_alone(runner):
    prompts = [[3, 4, 5], list(range(10, 30)), [7]]  # the second prompt needs three chunks
    together = generate_greedy(runner, prompts, max_new_tokens=6)
    for prompt, row in zip(prompts, together):
        (alone,) = generate_greedy(runner, [prompt], max_new_tokens=6)
        assert row.token_ids == alone.token_ids
        np.testing.assert_allclose(row.logprobs, alone.logprobs, atol=1e-5)


def test_stop_token_ends_a_row(runner):
    (free,) = generate_greedy(runner, [[1, 2, 3]], max_new_tokens=5)
    stop = free.token_ids[1]
    (stopped,) = generate_greedy(runner, [[1, 2, 3]], max_new_tokens=5, stop_token_ids=[stop])
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


@pytest.mark.parametrize("prompts, max_new, message", [
    ([[]], 4, "at least one token"),
    ([[1]] * 5, 4, "exceed max_rows"),
    ([[1] * 30], 4, "exceeds the context"),
    ([[1] * 28] * 4, 4, "needs 32 KV pages"),
])
def test_requests_that_cannot_fit_are_rejected(runner, prompts, max_new, message):
    with pytest.raises(ValueError, match=message):
        generate_greedy(runner, prompts, max_new_tokens=max_new)
