"""The paged steps against full recomputation, and the compile-once guarantee of the runner."""

import dataclasses

import jax
import numpy as np
import pytest

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import CompileCounter, ModelRunner, RunnerConfig
from meshserve.model.transformer import model_from_params
from tests.conftest import random_params
from tests.model.paged import PagedStepper


def _model(preset):
    config = ModelConfig.preset(preset)
    return model_from_params(config, random_params(config))


def _pages(rng, num_rows, pages_each, num_pages):
    ids = rng.permutation(np.arange(1, num_pages))[: num_rows * pages_each]
    return [list(ids[i * pages_each:(i + 1) * pages_each]) for i in range(num_rows)]


# Pages of 1 token (every token a page) and of 8 (a chunk of 16 spans two pages, the prompt
# ends mid-page and decode crosses into the next): what pages of 16 do, and more.
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("page_size", [1, 8])
def test_chunked_prefill_then_decode_equals_dense(preset, page_size):
    rng = np.random.default_rng(page_size)
    model = _model(preset)
    seq_len, chunk = 45, 16
    tokens = rng.integers(0, model.config.vocab_size, (2, seq_len))
    pages_each = -(-seq_len // page_size)
    stepper = PagedStepper(model, page_size=page_size, num_pages=1 + 2 * pages_each + 3)
    pages = _pages(rng, 2, pages_each, 1 + 2 * pages_each)
    dense = stepper.dense(tokens)
    prompt_len = 37  # prefill in chunks of 16, 16, 5; then decode one token at a time
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        (out,) = stepper.run(([(tokens[r, start:end], start, pages[r]) for r in range(2)], None))
        np.testing.assert_allclose(out.logits[:2], dense[:, end - 1], atol=1e-5, rtol=1e-5)
    for pos in range(prompt_len, seq_len):
        (out,) = stepper.run(([(tokens[r, pos:pos + 1], pos, pages[r]) for r in range(2)], None))
        np.testing.assert_allclose(out.logits[:2], dense[:, pos], atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_in_one_step_equal_separate_steps():
    rng = np.random.default_rng(0)
    model = _model("tiny-llama")
    tokens = rng.integers(0, model.config.vocab_size, (2, 30))
    dense = PagedStepper(model, page_size=4, num_pages=20).dense(tokens)
    stepper = PagedStepper(model, page_size=4, num_pages=20)
    pages = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    stepper.run(([(tokens[0, :20], 0, pages[0])], None))  # row 0 is decoding by now
    prefill, decode = stepper.run(
        ([(tokens[1, :12], 0, pages[1])], None),  # row 1: first prefill chunk
        ([(tokens[0, 20:21], 20, pages[0])], None),  # row 0: one decode token
    )
    np.testing.assert_allclose(prefill.logits[0], dense[1, 11], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(decode.logits[0], dense[0, 20], atol=1e-5, rtol=1e-5)
    (after,) = stepper.run(([(tokens[1, 12:13], 12, pages[1])], None))
    np.testing.assert_allclose(after.logits[0], dense[1, 12], atol=1e-5, rtol=1e-5)


def test_prompt_logprobs_match_dense_log_softmax():
    rng = np.random.default_rng(1)
    model = _model("tiny-gpt2")
    tokens = rng.integers(0, model.config.vocab_size, (1, 21))
    stepper = PagedStepper(model, page_size=8, num_pages=8)
    (out,) = stepper.run(([(tokens[0, :20], 0, [3, 5, 7])], [tokens[0, 1:21]]))
    dense = stepper.dense(tokens[:, :20])[0]
    want = jax.nn.log_softmax(dense, axis=-1)[np.arange(20), tokens[0, 1:21]]
    np.testing.assert_allclose(out.prompt_logprobs[0, :20], want, atol=1e-5, rtol=1e-5)


def test_runner_compiles_one_program_per_token_bucket():
    """Rows, prompt widths and context lengths never cost a compile: only the token bucket."""
    runner = ModelRunner(_model("tiny-llama"), RunnerConfig(
        num_pages=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_pages_per_seq=8))
    assert runner.config.token_buckets == (1, 2, 4, 8, 16, 32)
    assert runner.config.step_keys() == [(t, 0) for t in (1, 2, 4, 8, 16, 32)] + [
        (16, 1), (32, 1)]
    plan = lambda rows: sub_batch_from_rows(rows, page_size=4)  # noqa: E731
    runner.run_step([plan([([1] * 11, 0, [1, 2, 3])])])
    with CompileCounter() as same_bucket:
        runner.run_step([plan([([1] * 9, 5, [1, 2, 3, 4])])])  # 9 tokens: the 16-slot bucket
        runner.run_step([plan([([1] * 3, 0, [5]), ([2] * 4, 3, [6, 7]), ([3], 27, [1] * 7)]),
                        plan([([4], 14, [8, 9, 10, 11])])])  # 4 rows, 9 tokens, mixed
    with CompileCounter() as new_bucket:
        runner.run_step([plan([([1], 14, [1, 2, 3, 4])] * 3)])  # 3 tokens: the 4-slot bucket
    assert same_bucket.count == 0
    assert new_bucket.count == 1
    assert runner.step_key([plan([([1], 0, [1])] * 3)]) == (4, 0)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens=32"):
        runner.step_key([plan([([1] * 20, 0, [1] * 5)] * 2)])


def test_padding_and_company_do_not_disturb_a_row():
    """A row's token and logprob are the same alone, in a wider bucket, beside other rows, and
    as a lockstep row padded to a wider sub-batch (the static baseline)."""
    model = _model("tiny-llama")
    config = RunnerConfig(num_pages=16, page_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                          max_pages_per_seq=4)
    alone, padded = ModelRunner(model, config), ModelRunner(model, config)
    rows = [([5, 6, 7], 0, [2, 3])]
    plan = sub_batch_from_rows(rows, page_size=4)
    (want,) = alone.run_step([plan])
    assert alone.step_key([plan]) == (4, 0)
    three = sub_batch_from_rows(rows + [([8], 0, [4]), ([9, 9], 0, [5])], page_size=4)
    (three_out,) = padded.run_step([three])
    assert padded.step_key([three]) == (8, 0)
    lockstep = dataclasses.replace(three, lockstep=True)  # every row takes 3 slots
    (lockstep_out,) = padded.run_step([lockstep])
    assert padded.padded_tokens([lockstep]) == 16
    for got in (three_out, lockstep_out):
        assert got.tokens[0] == want.tokens[0]
        np.testing.assert_allclose(got.logprobs[0], want.logprobs[0], atol=1e-5)
    np.testing.assert_array_equal(lockstep_out.tokens, three_out.tokens)


def test_bfloat16_model_tracks_float32():
    config = ModelConfig.preset("tiny-llama")
    params = random_params(config)
    f32 = PagedStepper(model_from_params(config, params), page_size=4, num_pages=8)
    bf16_model = model_from_params(config.replace(dtype="bfloat16"), params)
    assert bf16_model.layers.attn.q.kernel[...].dtype == jax.numpy.bfloat16
    bf16 = PagedStepper(bf16_model, page_size=4, num_pages=8)
    assert bf16.cache.k.dtype == jax.numpy.bfloat16
    tokens = np.arange(1, 12)[None]
    (out,) = bf16.run(([(tokens[0], 0, [1, 2, 3])], None))
    want = f32.dense(tokens)[0, -1]
    assert out.logits.dtype == np.float32
    np.testing.assert_allclose(out.logits[0], want, atol=0.1 * np.abs(want).max())


def test_compile_counter_counts_programs_loaded_from_the_persistent_cache_once(tmp_path):
    from meshserve.model.executor.runner import enable_compilation_cache

    previous = jax.config.jax_compilation_cache_dir
    enable_compilation_cache(tmp_path)
    try:
        add = lambda n: jax.jit(lambda x: x + n)  # noqa: E731  a fresh function each call
        with CompileCounter() as first:
            add(3)(np.ones(7, np.float32)).block_until_ready()
        jax.clear_caches()
        with CompileCounter() as second:
            add(3)(np.ones(7, np.float32)).block_until_ready()
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert (first.count, first.num_cache_hits) == (1, 0)
    assert (second.count, second.num_cache_hits) == (1, 1)
