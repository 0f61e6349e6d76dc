"""Speculative decoding in the engine.

On the arithmetic runner (`tests/serving/fake_runner.py`, nothing compiled), with a proposer that
knows each request's true continuation and gets one draft wrong on purpose, every acceptance
length happens; the outputs, stops, pages, prefix cache and preemption must be exactly those of
decoding without drafts. A draft model (the tiny random Llama drafting for itself) gives the
tokens of decoding without it. On SmolLM2 (slow): prompt lookup with greedy and seeded sampling
gives the very tokens of decoding without it, in batches with prefill chunks and a
structured-output row, with drafts accepted.
"""

import dataclasses
import itertools

import numpy as np
import pytest

from meshserve.batching.pages import num_pages_for
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.speculative import SpeculativeConfig
from meshserve.model.config import ModelConfig
from meshserve.model.loading.checkpoint import save_checkpoint
from meshserve.model.transformer import model_from_params
from meshserve.serving.bench import bench
from meshserve.serving.bench.workloads import BenchRequest, grounded_workload
from meshserve.serving.cli.main import build_parser
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.metrics import ServerMetrics
from meshserve.serving.options import dataclass_from_args
from tests.conftest import random_params
from tests.serving.fake_runner import VOCAB, FakeModelRunner, reference_outputs, token_logprob

CONFIG = dict(num_pages=40, page_size=4, max_num_seqs=8, max_num_batched_tokens=16,
              prefill_chunk=8, max_model_len=64, max_logprobs=3, compilation_cache=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


class OracleProposer:
    """Drafts the request's true next tokens (`reference_outputs`) with one of them wrong, which
    one turning with every call so that every acceptance length occurs; `miss=False`: all
    right."""

    def __init__(self, *, miss: bool = True):
        self.miss, self.num_calls = miss, 0

    def propose(self, requests, max_drafts):
        self.num_calls += 1
        proposals = []
        for request, k in zip(requests, max_drafts):
            done = len(request.output_token_ids)
            truth = reference_outputs(request.prompt_token_ids, done + k)[done:]
            wrong = (self.num_calls + len(request.prompt_token_ids)) % (k + 2) if self.miss else k
            proposals.append([(t + 1) % VOCAB if i == wrong else t for i, t in enumerate(truth)])
        return proposals


def _engine(spec=NGRAM, proposer=None, **overrides) -> Engine:
    config = EngineConfig(**(CONFIG | {"speculative_config": spec} | overrides))
    engine = Engine(FakeModelRunner(config), None, config)
    if proposer is not None:
        engine.speculator.proposer = proposer
    return engine


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


def _run(engine: Engine, requests, **add) -> list:
    """Runs the requests together; checks the page accounting after every step: the allocator's
    invariants, and no running request holding pages past its tokens (drafts' pages went
    back)."""
    ids = [engine.add_request(prompt, params, **add) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        outputs = engine.step()
        assert len({out.request_id for out in outputs}) == len(outputs)  # one output each
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
        scheduler = engine.scheduler
        scheduler.allocator.check()
        for request in scheduler.running:
            assert len(request.pages) <= num_pages_for(request.num_tokens,
                                                       scheduler.config.page_size)
    assert engine.scheduler.kv_usage().num_used_pages == 0
    return [finished[i] for i in ids]


def _workload(seed: int, num: int):
    rng = np.random.default_rng(seed)
    return [(_prompt(int(rng.integers(1, 30)), seed * 100 + i),
             _greedy(int(rng.integers(1, 24)))) for i in range(num)]


def test_drafted_steps_give_every_request_its_solo_tokens():
    engine = _engine(NGRAM | {"disable_by_batch_size": None}, OracleProposer())
    requests = _workload(seed=3, num=12)
    outputs = _run(engine, requests)
    for (prompt, params), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == reference_outputs(prompt, params.max_tokens)
        assert out.outputs[0].finish_reason == "length"
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.accepted_tokens_per_position) == 3
    assert all(n > 0 for n in stats.accepted_tokens_per_position)  # every length occurred
    total = sum(params.max_tokens for _, params in requests)
    assert stats.num_emitted_tokens <= total


def test_drafts_cut_the_steps_of_a_lone_request():
    prompt, params = _prompt(9, seed=1), _greedy(20)
    plain = _engine(spec=None)
    fast = _engine(proposer=OracleProposer(miss=False))
    (want,), (got,) = _run(plain, [(prompt, params)]), _run(fast, [(prompt, params)])
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # a chunk of 8, then the prompt's last token with 3 drafts: 20 outputs at 4 a step
    assert fast.stats.num_steps == 1 + 20 // 4 < plain.stats.num_steps == 1 + 20
    stats = fast.speculator.stats
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 4.0


def test_stop_ids_and_max_tokens_cut_an_accepted_run():
    prompt = _prompt(6, seed=7)
    reference = reference_outputs(prompt, 20)
    index = next(i for i in range(3, 20) if reference[i] not in reference[:i])
    engine = _engine(proposer=OracleProposer(miss=False))
    stopped, capped = _run(engine, [(prompt, _greedy(20, stop_token_ids=[reference[index]])),
                                    (prompt, _greedy(6))])
    assert stopped.outputs[0].token_ids == reference[:index + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == (
        "stop", reference[index])
    assert capped.outputs[0].token_ids == reference[:6]
    assert capped.outputs[0].finish_reason == "length"


def test_logprobs_follow_the_emitted_tokens():
    prompt = _prompt(5, seed=2)
    engine = _engine(proposer=OracleProposer())
    (out,) = _run(engine, [(prompt, _greedy(12, logprobs=2))])
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].logprob == pytest.approx(token_logprob(token))
        assert entry[token].rank == 1


def test_the_prefix_cache_sees_only_accepted_tokens():
    """A second request whose prompt is the first's prompt and output reuses the first's
    pages; the fake cache reads KV through them, so a page holding a rejected draft's KV (or
    registered before its tokens were final) would change the second's output."""
    engine = _engine(proposer=OracleProposer())
    prompt = _prompt(7, seed=5)
    (first,) = _run(engine, [(prompt, _greedy(22))])
    follow_up = prompt + first.outputs[0].token_ids
    (second,) = _run(engine, [(follow_up, _greedy(8))])
    assert second.num_cached_tokens >= 24
    assert second.outputs[0].token_ids == reference_outputs(follow_up, 8)


def test_preemption_with_drafts_keeps_outputs_identical():
    cramped = dict(num_pages=13, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   prefill_chunk=8, max_model_len=48)
    engine = _engine(NGRAM | {"disable_by_batch_size": None}, OracleProposer(), **cramped)
    requests = [(_prompt(10 + i, seed=40 + i), _greedy(20)) for i in range(4)]
    outputs = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for (prompt, params), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == reference_outputs(prompt, params.max_tokens)


def test_the_load_rule_and_the_opt_out_keep_requests_from_drafting():
    engine = _engine(NGRAM | {"disable_by_batch_size": 1}, OracleProposer())
    requests = [(_prompt(4, seed=60 + i), _greedy(6 + 6 * i)) for i in range(3)]
    _run(engine, requests)
    stats = engine.speculator.stats
    assert stats.num_steps_off > 0 and stats.num_drafts > 0  # the last one alone drafts
    opted_out = _engine(proposer=OracleProposer())
    outputs = _run(opted_out, [(p, dataclasses.replace(s, speculate=False))
                               for p, s in requests])
    assert opted_out.speculator.stats.num_drafts == 0
    assert [o.outputs[0].token_ids for o in outputs] == [
        reference_outputs(p, s.max_tokens) for p, s in requests]


def test_metrics_count_what_speculation_did():
    engine = _engine(proposer=OracleProposer())
    metrics = ServerMetrics("fake")
    engine.add_request(_prompt(6, seed=9), _greedy(15))
    while engine.has_unfinished():
        for out in engine.step():
            metrics.observe_output(out)
        metrics.observe_step(engine, 0.01)
    stats = engine.speculator.stats
    value = lambda name, **labels: metrics.registry.get_sample_value(  # noqa: E731
        "meshserve:" + name, {"model_name": "fake", **labels})
    assert value("spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert value("spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value("spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    assert value("spec_decode_num_emitted_tokens_total") == stats.num_emitted_tokens
    assert value("spec_decode_num_accepted_tokens_per_pos_total", position="0") == (
        stats.accepted_tokens_per_position[0])
    assert value("spec_decode_draft_acceptance_rate") == pytest.approx(stats.acceptance_rate)
    assert value("generation_tokens_total") == 15


@pytest.mark.parametrize("overrides,message", [
    (dict(speculative_config={"method": "draft_model", "model": "m",
                              "num_speculative_tokens": 2}, mesh="model=2"),
     "runs its draft model on one device"),
    (dict(speculative_config=NGRAM, policy="static"), "needs policy 'continuous'"),
    (dict(speculative_config=NGRAM, mesh="stage=2"), "not supported with pipeline stages"),
    (dict(speculative_config=NGRAM, max_num_seqs=2, max_num_batched_tokens=16),
     r"num_speculative_tokens \(3\) \+ 1 must be <= max_num_seqs \(2\)"),
    (dict(speculative_config='{"method": "ngram"}'), "num_speculative_tokens is required"),
])
def test_unsupported_combinations_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**(CONFIG | overrides))


@pytest.mark.parametrize("command", [["serve"], ["batch", "--input", "in.jsonl", "--output",
                                                   "out.jsonl"],
                                     ["generate", "--prompt", "x"], ["bench"]])
def test_every_command_takes_the_flag(command):
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    args = build_parser().parse_args(command + ["--speculative-config", flag])
    config = dataclass_from_args(EngineConfig, args)
    assert config.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=4)
    assert dataclass_from_args(EngineConfig, build_parser().parse_args(command)
                               ).speculative_config is None


def test_the_config_field_takes_json_and_survives_asdict():
    config = EngineConfig(**(CONFIG | {"speculative_config": '{"method": "ngram", '
                                                             '"num_speculative_tokens": 2}'}))
    assert config.speculative_config == SpeculativeConfig(method="ngram",
                                                          num_speculative_tokens=2)
    again = EngineConfig(**dataclasses.asdict(config))  # as the command line's loader does
    assert again.speculative_config == config.speculative_config


class _Characters:
    """A stand-in tokenizer: one token per character."""

    def apply_chat_template(self, messages):
        return "<user>" + messages[0]["content"] + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]


def test_bench_runs_the_engine_without_drafts_beside_the_speculating_one():
    configs = bench.engine_configs(EngineConfig(**CONFIG, speculative_config=NGRAM))
    assert list(configs) == ["continuous", "static", bench.NO_SPECULATION]
    assert [c.speculative_config is not None for c in configs.values()] == [True, False, False]
    assert configs[bench.NO_SPECULATION].policy == "continuous"
    assert all(c.warmup for c in configs.values())
    assert list(bench.engine_configs(EngineConfig(**CONFIG))) == ["continuous", "static"]
    engines = {name: Engine(FakeModelRunner(c), None, c) for name, c in configs.items()}
    engines["continuous"].speculator.proposer = OracleProposer(miss=False)
    requests = [BenchRequest(prompt_token_ids=_prompt(5, seed=i), num_output_tokens=12)
                for i in range(2)]
    results = bench.compare_policies(None, None, requests, engines=engines)
    assert results["continuous"]["speculative"]["num_draft_tokens"] > 0
    assert "speculative" not in results[bench.NO_SPECULATION]
    assert {results[n]["output_tokens"] for n in configs} == {24}
    assert results["ratio_speculation_output_tokens_per_s"] == pytest.approx(
        results["continuous"]["output_tokens_per_s"]
        / results[bench.NO_SPECULATION]["output_tokens_per_s"])


def test_the_grounded_workload_asks_for_answers_that_copy_their_input():
    requests = grounded_workload(_Characters(), num_requests=30, seed=0)
    assert len(requests) == 30
    assert all(r.stop_at_eos and r.num_output_tokens == 256 for r in requests)
    prompts = {"".join(map(chr, r.prompt_token_ids)) for r in requests}
    assert len(prompts) == 28  # every task of the data (6 passages x 4, 4 pieces of code)
    assert any("Repeat the following text exactly" in p for p in prompts)
    assert any("in the following code and return the whole code" in p for p in prompts)
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        grounded_workload(None, num_requests=1)


# -- a draft model (the tiny random Llama) ---------------------------------------------------------

# The shapes of test_engine.py's tiny engine.
TINY = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
            prefill_chunk=16, max_model_len=128, max_logprobs=5, warmup=False,
            compilation_cache=False)


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    """The tiny random Llama (test_engine.py's weights) without speculation, and with itself as
    its draft model, from a checkpoint: the draft is the target, so it guesses nearly every
    token."""
    config = ModelConfig.preset("tiny-llama")
    target = model_from_params(config, random_params(config))
    draft = save_checkpoint(target, None, tmp_path_factory.mktemp("draft") / "ckpt")
    plain = Engine.from_model(target, None, EngineConfig(**TINY))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
            "disable_by_batch_size": None}
    drafted = Engine.from_model(target, None, EngineConfig(**TINY, speculative_config=spec),
                                runner=plain.runner)
    return plain, drafted


def test_a_draft_model_gives_the_tokens_of_decoding_without_it(tiny_engines):
    plain, drafted = tiny_engines
    requests = [(_prompt(length, seed=i), _greedy(n)) for i, (length, n) in
                enumerate([(3, 12), (40, 10), (1, 16), (17, 6)])]  # 40: chunked, and caught up
    requests.append((_prompt(9, seed=9), SamplingParams(temperature=0.8, seed=5, max_tokens=10,
                                                        ignore_eos=True)))
    want = _run(plain, requests)
    got = _run(drafted, requests)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert drafted.speculator.stats.num_draft_tokens > 0
    # alone, a greedy request drafts every step, and its draft (the target) is always right
    before, steps = drafted.speculator.stats.copy(), drafted.stats.num_steps
    (alone,) = _run(drafted, requests[:1])
    assert alone.outputs[0].token_ids == want[0].outputs[0].token_ids
    grown = drafted.speculator.stats.since(before)
    assert grown.acceptance_rate == 1.0 and grown.num_draft_tokens >= 6
    assert drafted.stats.num_steps - steps == 1 + -(-11 // 3)  # its prompt, then 3 a step


# -- SmolLM2 ---------------------------------------------------------------------------------------

# The shapes of test_engine.py's SmolLM2 engine, so a session compiles them once.
SMOL = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
            prefill_chunk=32, max_model_len=256, warmup=False, compilation_cache=False)
PASSAGE = ("The lighthouse keeper climbed the stairs every evening at six, lit the lamp, wrote "
           "the weather in a small blue book, and watched the ships pass the rocks until dawn.")


@pytest.fixture(scope="module")
def smol_engines(smollm2_pretrained):
    """An engine without speculation and one with prompt lookup, sharing one runner."""
    model, tokenizer = smollm2_pretrained.model, smollm2_pretrained.tokenizer
    plain = Engine.from_model(model, tokenizer, EngineConfig(**SMOL))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    fast = Engine.from_model(model, tokenizer, EngineConfig(**SMOL, speculative_config=spec),
                             runner=plain.runner)
    return plain, fast


def _chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _staggered(engine: Engine, first, later, *, after_steps: int) -> list:
    """Runs `first`, adds `later` after `after_steps` steps, runs all to the end; outputs in
    order."""
    ids = [engine.add_request(prompt, params) for prompt, params in first]
    finished = {}
    for step in itertools.count():
        if step == after_steps:
            ids += [engine.add_request(prompt, params) for prompt, params in later]
        if step > after_steps and not engine.has_unfinished():
            return [finished[i] for i in ids]
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out


def _spy_on_mixed_steps(engine: Engine) -> list:
    """The speculations of `engine`'s steps whose plan also carries a prefill chunk."""
    mixed, expand = [], engine.speculator.expand

    def spy(plan, scheduler):
        speculation = expand(plan, scheduler)
        if speculation is not None and any(np.any(b.num_new > 1) for b in plan.sub_batches):
            mixed.append(speculation)
        return speculation

    engine.speculator.expand = spy
    return mixed


@pytest.mark.slow
def test_smollm2_outputs_with_prompt_lookup_are_those_without(smol_engines):
    """Greedy and seeded rows copying their prompt, then a prompt chunked over steps that also
    verify drafts, and a structured-output row (which never drafts): every token as without
    drafts."""
    plain, fast = smol_engines
    copy = _chat(plain, f"Repeat the following text exactly:\n\n{PASSAGE}")
    long = _chat(plain, "Summarise, quoting it: " + PASSAGE + " " + PASSAGE)
    assert len(plain.tokenizer.encode(long)) > 64  # chunked over several steps
    first = [(copy, SamplingParams(temperature=0, max_tokens=40)),
             (copy, SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=6))]
    later = [(long, SamplingParams(temperature=0, max_tokens=8)),
             (_chat(plain, "Is the sea blue? Answer yes or no."),
              SamplingParams(temperature=0, max_tokens=4,
                             structured={"choice": ["yes", "no"]}))]
    mixed = _spy_on_mixed_steps(fast)
    want = _staggered(plain, first, later, after_steps=8)
    got = _staggered(fast, first, later, after_steps=8)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    stats = fast.speculator.stats
    assert stats.num_accepted_tokens > 0  # drafts were verified and accepted
    assert mixed  # some steps verified drafts beside a prefill chunk
    assert fast.stats.num_steps < plain.stats.num_steps
    assert fast.scheduler.kv_usage().num_used_pages == 0
