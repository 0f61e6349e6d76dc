"""The engine end to end on real models: batching, sampling, preemption, stops, logprobs, compiles.

Most tests share one warmed engine on the tiny random Llama (an engine drains, so it is reusable)
and compare what a request gets in company with what it gets alone. Prompts are token ids: the
tiny model has no tokenizer. Everything that must not count against the warmed engine's compile
record (prompt logprobs compile their own shapes) runs on unwarmed engines with the same weights.
Text, stop strings and streaming run on the real SmolLM2 (slow).
"""

import dataclasses

import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import CompileCounter
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from tests.conftest import random_params
from tests.model.paged import PagedStepper

# Few buckets: rows (1, 2, 4) x tokens (16,) x pages (4, 8), so the warm-up stays short.
TINY = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
            prefill_chunk=16, max_model_len=128, max_logprobs=5, compilation_cache=False)


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 512, size=length).tolist()


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _drain(engine: Engine) -> dict:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _run(engine: Engine, requests) -> list:
    """Queues `(prompt, params)` pairs together, runs them to the end; outputs in that order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = _drain(engine)
    return [finished[i] for i in ids]


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _decode_padding(engine: Engine, requests) -> float:
    """Decode padding of this workload alone, from the engine's counters before and after."""
    stats = engine.stats
    tokens, slots = stats.decode_tokens, stats.decode_slots
    _run(engine, requests)
    return 1 - (stats.decode_tokens - tokens) / (stats.decode_slots - slots)


@pytest.fixture(scope="module")
def tiny_config():
    return ModelConfig.preset("tiny-llama")


@pytest.fixture(scope="module")
def tiny_params(tiny_config):
    return random_params(tiny_config)


@pytest.fixture(scope="module")
def tiny_model(tiny_config, tiny_params):
    return model_from_params(tiny_config, tiny_params)


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The warmed engine, prompt-logprobs variants too: nothing it serves may compile."""
    return Engine.from_model(tiny_model, None,
                             EngineConfig(**(TINY | dict(warmup_prompt_logprobs=True))))


@pytest.fixture(scope="module")
def eos_probe(engine):
    """A prompt, its greedy output, and an index k where the output first emits token t."""
    prompt = _prompt(6, seed=99)
    (out,) = _run(engine, [(prompt, _greedy(10))])
    tokens = out.outputs[0].token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    return prompt, tokens, k, tokens[k]


@pytest.fixture(scope="module")
def cold_engine(tiny_config, tiny_params, eos_probe):
    """Unwarmed, same weights; its model's EOS is the token t of `eos_probe`."""
    config = tiny_config.replace(eos_token_ids=(eos_probe[3],))
    return Engine.from_model(model_from_params(config, tiny_params), None,
                             EngineConfig(**(TINY | dict(warmup=False))))


# -- batching --------------------------------------------------------------------------------------

MIXED = [(3, 5), (40, 12), (1, 20), (17, 3), (9, 8)]  # (prompt length, max_tokens); 40 is chunked


def test_mixed_batch_gives_each_request_its_solo_tokens(engine):
    requests = [(_prompt(length, seed=i), _greedy(n)) for i, (length, n) in enumerate(MIXED)]
    steps = engine.stats.num_steps
    together = _run(engine, requests)
    steps_together = engine.stats.num_steps - steps
    steps = engine.stats.num_steps
    alone = [_run(engine, [request])[0] for request in requests]
    assert steps_together < engine.stats.num_steps - steps  # they did share steps
    assert _tokens(together) == _tokens(alone)
    for out, (_, n) in zip(together, MIXED):
        assert len(out.outputs[0].token_ids) == n and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_ignores_batch_company(engine):
    prompt = _prompt(10, seed=7)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    (first,) = _run(engine, [(prompt, params)])
    (again,) = _run(engine, [(prompt, params)])
    company = [(_prompt(5, seed=8), SamplingParams(temperature=1.0, max_tokens=20, seed=5)),
               (_prompt(30, seed=9), _greedy(4)),
               (_prompt(2, seed=10), SamplingParams(temperature=0.7, top_k=5, max_tokens=9))]
    crowd = _run(engine, [company[0], (prompt, params), *company[1:]])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == crowd[1].outputs[0].token_ids
    (greedy,) = _run(engine, [(prompt, _greedy(12))])
    assert first.outputs[0].token_ids != greedy.outputs[0].token_ids  # it did sample


def test_unseeded_requests_sample_differently(engine):
    prompt = _prompt(10, seed=7)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True)
    a, b = _run(engine, [(prompt, params), (prompt, params)])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


@pytest.fixture(scope="module")
def tight_engine(tiny_model):
    """8 pages of 16 tokens: any one request fits, four of ~50 tokens at once do not."""
    return Engine.from_model(tiny_model, None,
                             EngineConfig(**(TINY | dict(num_pages=9, warmup=False))))


def test_preemption_keeps_outputs_identical(engine, tight_engine):
    seeded = lambda seed: SamplingParams(temperature=0.9, top_p=0.95, seed=seed,  # noqa: E731
                                         max_tokens=30, ignore_eos=True)
    requests = [(_prompt(18 + 2 * i, seed=50 + i), _greedy(30) if i % 2 == 0 else seeded(i))
                for i in range(6)]
    roomy_preemptions = engine.scheduler.num_preemptions
    roomy = _run(engine, requests)
    tight = _run(tight_engine, requests)
    assert engine.scheduler.num_preemptions == roomy_preemptions
    assert tight_engine.scheduler.num_preemptions > 0
    preempted = [out.metrics.num_preemptions > 0 for out in tight]
    assert any(preempted[0::2]) and any(preempted[1::2])  # greedy and seeded ones both recomputed
    assert _tokens(tight) == _tokens(roomy)
    assert tight_engine.scheduler.allocator.num_used == 0


@pytest.fixture(scope="module")
def uncached_engine(tiny_model, engine):
    """The warmed engine's twin without prefix caching; it shares its compiled programs."""
    return Engine.from_model(tiny_model, None,
                             EngineConfig(**(TINY | dict(enable_prefix_caching=False))),
                             runner=engine.runner)


def _shared_prefix_requests(system_len: int, tails, max_tokens: int, seed: int) -> list:
    system = _prompt(system_len, seed=seed)
    return [(system + _prompt(n, seed=seed + 1 + i), _greedy(max_tokens))
            for i, n in enumerate(tails)]


def _first_alone_then_rest(engine: Engine, requests) -> list:
    return _run(engine, requests[:1]) + _run(engine, requests[1:])


def test_prefix_cache_gives_identical_tokens_and_skips_the_shared_pages(engine, uncached_engine):
    requests = _shared_prefix_requests(40, [3, 9, 17, 1], max_tokens=10, seed=60)
    computed = engine.stats.prefill_tokens + engine.stats.decode_tokens
    cached = _first_alone_then_rest(engine, requests)
    saved = [out.num_cached_tokens for out in cached]
    assert saved == [0, 32, 32, 32]  # the system prompt's 2 full pages of 16
    uncached = _first_alone_then_rest(uncached_engine, requests)
    assert _tokens(cached) == _tokens(uncached)
    assert all(out.num_cached_tokens == 0 for out in uncached)
    computed = engine.stats.prefill_tokens + engine.stats.decode_tokens - computed
    assert computed == sum(len(p) for p, _ in requests) - sum(saved) + 4 * (10 - 1)
    assert engine.scheduler.allocator.num_cached > 0 and engine.scheduler.allocator.num_used == 0


@pytest.fixture(scope="module")
def static_engine(tiny_model, engine):
    """Warmed, with the warm engine's shapes: the policy is the scheduler's, so its warm-up
    builds the same programs (loaded from the session's compilation cache, not compiled again)."""
    return Engine.from_model(tiny_model, None, EngineConfig(**(TINY | dict(policy="static"))))


STATIC_WORKLOAD = [(5, 2), (20, 24), (12, 5), (3, 9), (8, 16)]  # (prompt length, max_tokens)


def _static_requests():
    return [(_prompt(n, seed=60 + n), _greedy(m)) for n, m in STATIC_WORKLOAD]


def test_static_policy_matches_continuous_with_more_decode_padding(engine, static_engine):
    continuous_padding = _decode_padding(engine, _static_requests())
    static = _run(static_engine, _static_requests())
    assert _tokens(static) == _tokens(_run(engine, _static_requests()))
    assert static_engine.stats.decode_padding > continuous_padding + 0.2


def test_static_policy_after_warmup_compiles_nothing(static_engine):
    assert static_engine.stats.warmup_compiles > 0
    _run(static_engine, _static_requests())
    _run(static_engine, _static_requests()[:2])
    assert static_engine.stats.compiles_after_warmup == 0


# -- compiles ------------------------------------------------------------------------------------

def _varied_requests(rng, count: int):
    """Prompts of 1..100 tokens with assorted lengths and sampling parameters."""
    kinds = [
        lambda n: _greedy(n),
        lambda n: SamplingParams(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30)),
                                 max_tokens=n, ignore_eos=True),
        lambda n: SamplingParams(temperature=1.0, top_k=8, min_p=0.05, max_tokens=n, logprobs=5),
        lambda n: SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.5, max_tokens=n, logprobs=0),
        lambda n: SamplingParams(temperature=0, max_tokens=n, min_tokens=min(n, 3),
                                 stop_token_ids=[7, 8, 9]),
    ]
    requests = []
    for i in range(count):
        length = int(rng.integers(1, 101))
        max_tokens = int(rng.integers(1, min(24, 128 - length) + 1))
        requests.append((_prompt(length, seed=1000 + i), kinds[i % len(kinds)](max_tokens)))
    return requests


def test_serving_after_warmup_compiles_nothing(engine):
    keys = engine.runner.config.step_keys()  # one program per token bucket, and prompt logprobs
    assert engine.stats.warmup_compiles == engine.runner.num_programs() >= len(keys) > 0
    rng = np.random.default_rng(3)
    with CompileCounter() as compiles:
        _run(engine, [(_prompt(100, seed=1), _greedy(3))])
        _run(engine, [(_prompt(1, seed=2), _greedy(20))])
        _run(engine, [(_prompt(9, seed=4), _greedy(2, prompt_logprobs=3))])
        for wave in range(3):  # requests join while others are mid-prompt or decoding
            for prompt, params in _varied_requests(rng, 6):
                engine.add_request(prompt, params)
            for _ in range(4 + 3 * wave):
                engine.step()
        _drain(engine)
        _run(engine, _varied_requests(rng, 4))
    assert compiles.count == 0
    assert engine.stats.compiles_after_warmup == 0  # nor anything else this engine served


def test_prompt_logprobs_variants_compile_on_first_use_by_default(tiny_model, engine):
    """Without `warmup_prompt_logprobs` the warm-up leaves out the steps that return prompt
    logprobs (memory: a compiled program holds ~18 MB on the CPU); the first request asking for
    them compiles its bucket's variant, once, and gets what a fully warmed engine gives."""
    lazy = Engine.from_model(tiny_model, None, EngineConfig(**TINY))
    runner = lazy.runner
    assert lazy.stats.warmup_compiles == runner.num_programs(prompt_logprobs=False) \
        == len([key for key in runner.config.step_keys() if not key[1]]) \
        < runner.num_programs()
    _run(lazy, [(_prompt(30, seed=8), _greedy(4))])
    assert lazy.stats.compiles_after_warmup == 0
    request = [(_prompt(9, seed=4), _greedy(3, prompt_logprobs=3))]
    (got,) = _run(lazy, request)
    assert lazy.stats.compiles_after_warmup == 1  # bucket (16, has targets), on first use
    (again,) = _run(lazy, request)
    (want,) = _run(engine, request)
    assert lazy.stats.compiles_after_warmup == 1
    for out in (got, again):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert [None if e is None else {t: lp.logprob for t, lp in e.items()}
                for e in out.prompt_logprobs] == \
            [None if e is None else {t: lp.logprob for t, lp in e.items()}
             for e in want.prompt_logprobs]


# -- finishing -------------------------------------------------------------------------------------

def test_max_tokens_finishes_with_length(engine):
    (out,) = _run(engine, [(_prompt(4, seed=11), _greedy(7))])
    completion = out.outputs[0]
    assert out.finished and len(completion.token_ids) == 7
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)


def test_stop_token_id_finishes_with_stop(engine, eos_probe):
    prompt, tokens, k, stop_id = eos_probe
    (out,) = _run(engine, [(prompt, _greedy(10, stop_token_ids=[stop_id, 511]))])
    completion = out.outputs[0]
    assert completion.token_ids == tokens[:k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_min_tokens_defers_a_stop_token(engine, eos_probe):
    prompt, tokens, k, stop_id = eos_probe
    (out,) = _run(engine, [(prompt, _greedy(10, min_tokens=k + 2, stop_token_ids=[stop_id]))])
    got = out.outputs[0].token_ids
    assert got[:k] == tokens[:k]
    assert stop_id not in got[:k + 2] and len(got) >= k + 2


def test_eos_ends_a_request_unless_ignore_eos(cold_engine, eos_probe):
    prompt, tokens, k, eos = eos_probe
    (stopped,) = _run(cold_engine, [(prompt, SamplingParams(temperature=0, max_tokens=10))])
    assert stopped.outputs[0].token_ids == tokens[:k + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    (ignored,) = _run(cold_engine, [(prompt, _greedy(10))])
    assert ignored.outputs[0].token_ids == tokens
    assert ignored.outputs[0].finish_reason == "length"


def test_min_tokens_defers_eos(cold_engine, eos_probe):
    prompt, tokens, k, eos = eos_probe
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=k + 2)
    (out,) = _run(cold_engine, [(prompt, params)])
    got = out.outputs[0].token_ids
    assert got[:k] == tokens[:k]
    assert eos not in got[:k + 2] and len(got) >= k + 2


def test_min_tokens_masks_eos_even_with_ignore_eos(cold_engine, eos_probe):
    """As in vLLM: ignore_eos lets EOS end nothing, and min_tokens still keeps it out before."""
    prompt, tokens, k, eos = eos_probe
    (out,) = _run(cold_engine, [(prompt, _greedy(10, min_tokens=k + 2))])
    got = out.outputs[0].token_ids
    assert got[:k] == tokens[:k] and len(got) == 10
    assert eos not in got[:k + 2]


# -- logprobs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def logprob_run(cold_engine, tiny_model):
    """A 20-token prompt (two chunks) with greedy output, logprobs=3 and prompt_logprobs=2, and
    the log-softmax of a dense forward pass over the prompt and the output."""
    prompt = _prompt(20, seed=13)
    (out,) = _run(cold_engine, [(prompt, _greedy(6, logprobs=3, prompt_logprobs=2))])
    tokens = prompt + out.outputs[0].token_ids
    stepper = PagedStepper(tiny_model, page_size=16, num_pages=2)
    logits = stepper.dense([tokens])[0].astype(np.float64)  # [T, V]
    logits -= logits.max(-1, keepdims=True)
    dense = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return prompt, out, dense


def test_output_logprobs_hold_the_chosen_token_and_its_rank(logprob_run):
    prompt, out, dense = logprob_run
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert token in entry and len(entry) >= 3
        assert entry[token].rank == 1
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token].logprob == pytest.approx(dense[len(prompt) - 1 + i, token], abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(dense[len(prompt) - 1 + i, t] for i, t in enumerate(completion.token_ids)), abs=1e-3)


def test_prompt_logprobs_match_a_dense_forward_pass(logprob_run):
    prompt, out, dense = logprob_run
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry, token = entries[position], prompt[position]
        assert token in entry and len(entry) >= 2
        assert entry[token].logprob == pytest.approx(dense[position - 1, token], abs=1e-4)
        top2 = np.argsort(-dense[position - 1])[:2].tolist()
        assert {t for t, lp in entry.items() if lp.rank in (1, 2)} == set(top2)


def test_logprobs_zero_gives_the_chosen_token_only(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    (out,) = _run(engine, [(_prompt(8, seed=14), params)])
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert list(entry) == [token] and entry[token].logprob <= 0


# -- abort, validation, shutdown -------------------------------------------------------------------

def test_abort_frees_pages_at_once_and_ends_outputs(engine):
    """Aborted, a request holds no page: its full pages stay in the prefix cache (evictable),
    the rest are free, so every page it took is available again."""
    allocator = engine.scheduler.allocator
    available_before = allocator.num_available
    request_id = engine.add_request(_prompt(40, seed=15), _greedy(60))
    while not any(out.request_id == request_id and out.outputs[0].token_ids
                  for out in engine.step()):
        pass
    assert allocator.num_used > 0 and allocator.num_available < available_before
    assert engine.abort(request_id) is True
    assert allocator.num_used == 0 and allocator.num_available == available_before
    allocator.check()
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.abort(request_id) is False
    assert engine.abort("no-such-request") is False


def test_abort_of_a_waiting_request(engine):
    first = engine.add_request(_prompt(5, seed=16), _greedy(3))
    queued = engine.add_request(_prompt(5, seed=17), _greedy(3))
    assert engine.abort(queued) is True
    assert set(_drain(engine)) == {first}


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    ([3, 512], SamplingParams(), "token id 512 is outside the vocabulary"),
    ([-1], SamplingParams(), "outside the vocabulary"),
    ([5] * 100, SamplingParams(max_tokens=29), "exceeds max_model_len"),
    ([5], SamplingParams(logprobs=6), "exceeds max_logprobs"),
    ([5], SamplingParams(prompt_logprobs=6), "exceeds max_logprobs"),
    ([5], SamplingParams(stop_token_ids=list(range(2, 18))), "too many"),
])
def test_requests_that_can_never_run_are_rejected(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_stop_strings_without_a_tokenizer_are_rejected(engine):
    """Without a tokenizer there is no text, so a stop string could never match."""
    try:
        with pytest.raises(ValueError, match="tokenizer"):
            engine.add_request([5, 6], SamplingParams(stop=["\n"]))
    finally:
        engine.shutdown()


def test_text_prompt_without_a_tokenizer_is_rejected(engine):
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello")


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request([5, 6], _greedy(2), request_id="same")
    with pytest.raises(ValueError, match="'same' is already in use"):
        engine.add_request([7], _greedy(2), request_id="same")
    assert set(_drain(engine)) == {"same"}


@pytest.mark.parametrize("overrides, message", [
    (dict(policy="fifo"), "policy must be one of"),
    (dict(prefill_chunk=64, max_num_batched_tokens=32), "must not exceed max_num_batched_tokens"),
    (dict(max_model_len=2048), "exceeds the model's context of 1024"),
    (dict(num_pages=0), "num_pages must be >= 1"),
    (dict(kv_watermark=1.0), r"kv_watermark must be a fraction in \[0, 1\)"),
    (dict(kv_watermark="high"), "kv_watermark must be a fraction"),
])
def test_bad_engine_config_is_rejected(tiny_model, overrides, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_model(tiny_model, None, EngineConfig(**(TINY | dict(warmup=False) | overrides)))


def test_shutdown_empties_the_engine(engine):
    for i in range(6):
        engine.add_request(_prompt(10 + 7 * i, seed=20 + i), _greedy(30))
    engine.step()
    engine.step()
    assert engine.scheduler.num_running > 0 and engine.scheduler.num_waiting > 0
    engine.shutdown()
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_used == 0
    assert engine.step() == []
    (out,) = _run(engine, [(_prompt(3, seed=30), _greedy(2))])  # still serves afterwards
    assert len(out.outputs[0].token_ids) == 2


# -- SmolLM2: text, stop strings, streaming ----------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2+2?",
             "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smol_engine(smollm2_pretrained):
    return Engine.from_model(smollm2_pretrained.model, smollm2_pretrained.tokenizer, EngineConfig(
        num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32,
        max_model_len=256, warmup=False, compilation_cache=False))


def _chat(engine: Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


@pytest.mark.slow
def test_smollm2_mixed_batch_gives_each_request_its_solo_output(smol_engine):
    prompts = [_chat(smol_engine, q) for q in QUESTIONS] + ["Hello"]
    assert max(len(smol_engine.tokenizer.encode(p)) for p in prompts) > 32  # chunked
    requests = [(p, SamplingParams(temperature=0, max_tokens=n))
                for p, n in zip(prompts, [12, 5, 8, 6, 3])]
    together = _run(smol_engine, requests)
    alone = [_run(smol_engine, [request])[0] for request in requests]
    assert _tokens(together) == _tokens(alone)
    assert [o.outputs[0].text for o in together] == [o.outputs[0].text for o in alone]
    assert "Paris" in together[0].outputs[0].text
    assert together[0].outputs[0].finish_reason == "stop"  # the answer ends with EOS
    assert together[0].outputs[0].token_ids[-1] in smol_engine.tokenizer.eos_token_ids
    assert together[0].prompt == prompts[0]


SYSTEM = ("You are a careful assistant for a small library. Answer briefly, in plain words, "
          "and say so when you do not know.")


@pytest.mark.slow
def test_smollm2_shared_system_prompt_gives_the_same_tokens_with_and_without_the_cache(
        smollm2_pretrained, smol_engine):
    uncached = Engine.from_model(
        smollm2_pretrained.model, smollm2_pretrained.tokenizer,
        dataclasses.replace(smol_engine.config, enable_prefix_caching=False),
        runner=smol_engine.runner)
    prompts = [smol_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS]
    requests = [(p, SamplingParams(temperature=0, max_tokens=12)) for p in prompts]
    cached = _first_alone_then_rest(smol_engine, requests)
    plain = _first_alone_then_rest(uncached, requests)
    assert _tokens(cached) == _tokens(plain)
    assert [o.outputs[0].text for o in cached] == [o.outputs[0].text for o in plain]
    assert min(o.num_cached_tokens for o in cached[1:]) >= 32  # the system prompt's full pages
    assert all(o.num_cached_tokens == 0 for o in plain)


def _stream(engine: Engine, prompt: str, params: SamplingParams):
    """The text of every output of the request while it runs, and its final output."""
    request_id = engine.add_request(prompt, params)
    snapshots, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                snapshots.append(out.outputs[0].text)
                final = out
    return snapshots, final


@pytest.fixture(scope="module")
def smol_reference(smol_engine):
    """Greedy text of the haiku question, and a stop string of 12 characters from its middle."""
    prompt = _chat(smol_engine, QUESTIONS[3])
    (out,) = _run(smol_engine, [(prompt, SamplingParams(temperature=0, max_tokens=24))])
    text = out.outputs[0].text
    start = len(text) // 3
    stop = text[start:start + 12]
    assert text.find(stop) == start and len(text) > start + 20
    return prompt, out, stop


@pytest.mark.slow
def test_stop_string_cuts_the_text_and_streams_no_partial_stop(smol_engine, smol_reference):
    prompt, reference, stop = smol_reference
    full = reference.outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=24, stop=["never-in-text", stop])
    snapshots, final = _stream(smol_engine, prompt, params)
    completion = final.outputs[0]
    assert completion.text == full[:full.find(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < len(reference.outputs[0].token_ids)
    assert any(snapshots[:-1])  # text was streamed before the end
    for earlier, later in zip(snapshots, snapshots[1:]):
        assert later.startswith(earlier)
    for snapshot in snapshots:
        assert completion.text.startswith(snapshot)
        assert not any(snapshot.endswith(stop[:i]) and not completion.text.endswith(stop[:i])
                       for i in range(1, len(stop)))


@pytest.mark.slow
def test_stop_string_completed_by_the_last_allowed_token_reports_stop(smol_engine,
                                                                      smol_reference):
    """The stop string shows up in the same step that max_tokens is reached."""
    prompt, reference, stop = smol_reference
    tokenizer, tokens = smol_engine.tokenizer, reference.outputs[0].token_ids
    n = next(i for i in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:i]))
    params = SamplingParams(temperature=0, max_tokens=n, stop=[stop])
    (out,) = _run(smol_engine, [(prompt, params)])
    completion = out.outputs[0]
    assert completion.text == reference.outputs[0].text[:reference.outputs[0].text.find(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


@pytest.mark.parametrize("overrides", [
    {},  # the default config
    dict(max_num_seqs=8, prefill_chunk=128, max_num_batched_tokens=256, max_model_len=512),  # demo
])
def test_the_compiled_set_is_at_most_16_programs(overrides):
    """The step's programs depend on the token budget alone: never on prompt lengths, contexts,
    page counts or batch sizes, so the whole set is small and known before the first request."""
    smollm2 = ModelConfig.preset("smollm2-135m")
    runner_config = EngineConfig(**overrides).for_model(smollm2).runner_config()
    keys = runner_config.step_keys()
    assert len(keys) <= 16
    assert max(tokens for tokens, _ in keys) == runner_config.max_num_batched_tokens
    # Where masks overlap the forward pass: a forward pass per key, a sampler per slot count.
    assert len(runner_config.sampling_rows()) <= 6


def test_engines_sharing_a_runner_take_turns_with_its_cache(tiny_model, engine):
    """Another engine on the same runner writes the same pages, so an engine that runs after it
    drops its prefix cache instead of reading the other's tokens as its own prefix."""
    first = Engine.from_model(tiny_model, None, EngineConfig(**(TINY | dict(warmup=False))),
                              runner=engine.runner)
    other = Engine.from_model(tiny_model, None, EngineConfig(**(TINY | dict(warmup=False))),
                              runner=engine.runner)
    prompt = _prompt(40, seed=21)  # two full pages can be cached
    (want,) = _run(first, [(prompt, _greedy(6))])
    (hit,) = _run(first, [(prompt, _greedy(6))])
    assert hit.num_cached_tokens == 32 and _tokens([hit]) == _tokens([want])
    _run(other, [(_prompt(40, seed=22), _greedy(6))])  # the same page ids, other tokens
    (again,) = _run(first, [(prompt, _greedy(6))])
    assert again.num_cached_tokens == 0
    assert _tokens([again]) == _tokens([want])
    other.add_request(_prompt(5, seed=23), _greedy(4))
    other.step()  # its request is running, with its KV in the shared cache...
    first.add_request(_prompt(5, seed=24), _greedy(4))
    first.step()  # ... which the first engine now writes
    with pytest.raises(RuntimeError, match="overwritten"):
        other.step()
