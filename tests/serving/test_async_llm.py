"""`AsyncLLM` and `LLM.generate_stream` on the arithmetic runner (`tests/serving/fake_runner.py`):
exact tokens, partial outputs as tokens arrive, cancellation that frees pages, and admission
bounds, with nothing compiled."""

import asyncio
import time

import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.python_api.async_llm import AsyncLLM
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.loop import Limits, Refused
from meshserve.serving.python_api.llm import LLM
from tests.serving.fake_runner import VOCAB, FakeModelRunner, reference_outputs
from tests.serving.served import wait_for

CONFIG = dict(num_pages=40, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              prefill_chunk=8, max_model_len=64, max_logprobs=3, compilation_cache=False)


def _engine() -> Engine:
    config = EngineConfig(**CONFIG)
    return Engine(FakeModelRunner(config), None, config)


def _prompt(seed: int, length: int = 6) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _pages_free(engine: Engine) -> bool:
    return (not engine.scheduler.has_unfinished()
            and engine.scheduler.kv_usage().num_used_pages == 0)


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM.from_engine(_engine(), Limits(max_queued_requests=64))
    yield llm
    llm.shutdown()


def test_concurrent_requests_get_their_solo_tokens(async_llm):
    prompts = [_prompt(i, 3 + i) for i in range(10)]

    async def main():
        return await asyncio.gather(*(async_llm.generate(p, _greedy(5 + i))
                                      for i, p in enumerate(prompts)))

    outputs = asyncio.run(main())
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.finished and out.outputs[0].token_ids == reference_outputs(prompt, 5 + i)
    assert _pages_free(async_llm.engine)


def test_a_stream_grows_token_by_token(async_llm):
    prompt = _prompt(20)

    async def main():
        return [list(o.outputs[0].token_ids) async for o in async_llm.stream(prompt, _greedy(6))]

    partials = asyncio.run(main())
    assert len(partials) >= 3 and partials[-1] == reference_outputs(prompt, 6)
    assert all(a == b[:len(a)] for a, b in zip(partials, partials[1:]))


def test_cancelling_the_task_aborts_the_request_and_frees_its_pages():
    engine = _engine()
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]  # 50 tokens take half a second
    async_llm = AsyncLLM.from_engine(engine)

    async def main():
        seen = asyncio.Event()

        async def consume():
            async for _ in async_llm.stream(_prompt(30), _greedy(50)):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        wait_for(lambda: _pages_free(engine) and async_llm.loop.num_inflight() == 0)
        assert engine.stats.num_steps < 40  # aborted, not run to its end
    finally:
        async_llm.shutdown()


def test_bad_input_raises_value_error_naming_the_field(async_llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(async_llm.generate([VOCAB + 1], _greedy(2)))
    with pytest.raises(ValueError, match="logprobs=9 exceeds max_logprobs=3"):
        asyncio.run(async_llm.generate([1, 2], SamplingParams(logprobs=9)))
    with pytest.raises(ValueError, match="no tokenizer"):
        asyncio.run(async_llm.generate("text", _greedy(2)))


def test_a_full_queue_is_refused_at_once():
    llm = AsyncLLM.from_engine(_engine(), Limits(max_queued_requests=1))
    try:
        async def main():
            results = await asyncio.gather(*(llm.generate(_prompt(40 + i), _greedy(30))
                                             for i in range(12)), return_exceptions=True)
            return results

        results = asyncio.run(main())
        refused = [r for r in results if isinstance(r, Refused)]
        assert refused and all(r.kind == "queue_full" and r.retry_after for r in refused)
        assert any(not isinstance(r, Exception) for r in results)
    finally:
        llm.shutdown()
    assert _pages_free(llm.engine)


def test_generate_stream_yields_partials_and_ends_like_generate():
    llm = LLM.__new__(LLM)  # an LLM on the arithmetic engine, no weights
    llm.engine, llm.cluster, llm.tokenizer = _engine(), None, None
    prompt = _prompt(50)
    partials = list(llm.generate_stream(prompt, _greedy(7)))
    assert [len(p.outputs[0].token_ids) for p in partials][-1] == 7 and len(partials) > 2
    assert partials[-1].finished and not partials[0].finished
    assert partials[-1].outputs[0].token_ids == llm.generate(prompt, _greedy(7),
                                                             use_tqdm=False)[0].outputs[0].token_ids
    stream = llm.generate_stream(prompt, _greedy(40))
    next(stream), next(stream)
    stream.close()  # leaving early aborts it
    assert _pages_free(llm.engine)
