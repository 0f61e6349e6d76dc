"""Structured output through the real engine: a random-weight tiny Llama with a real byte-level
BPE tokenizer (tests/serving/tiny_tokenizer.py), so random logits are forced into JSON, regexes,
choices and grammars. Every kind matches at temperature 0 and 0.8, nothing compiles after
warm-up, unconstrained rows batched with constrained ones are unchanged, pipeline stages give
one device's tokens, the gRPC request carries the constraint, and masks computed while the
device runs the forward pass change no output, on one device or a mesh. The engine's warm-up
(about 20 s on 2 cores) makes these slow tests."""

import json
import re

import grpc
import jsonschema
import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import StructuredOutput
from meshserve.model.config import ModelConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.bench.structured_cost import compare_structured, load_schemas, schema_validity
from meshserve.serving.grpc_api.client import Client, ClientError
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from tests.conftest import random_params
from tests.serving.test_meshes import _run
from tests.serving.tiny_tokenizer import tiny_tokenizer

# Four token buckets (1, 2, 4, 8): few programs to compile.
ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
              prefill_chunk=8, max_model_len=160, max_logprobs=5, compilation_cache=False,
              overlap_masks=True,  # the masks beside the forward pass, off by default on a CPU
              warmup_prompt_logprobs=True)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){2}\."
CHOICES = ["alpha", "beta", "gamma"]
LARK = 'start: "(" num ["+" num ["+" num]] ")"\nnum: /[1-9][0-9]?/'
GBNF = 'root ::= "x=" [0-9] [0-9]? ";"'


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "choice":
        return text in CHOICES
    pattern = {"regex": REGEX, "lark": r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)",
               "gbnf": r"x=[0-9][0-9]?;"}[kind]
    return re.fullmatch(pattern, text) is not None


# Each bounded, so random weights cannot run them to max_tokens (any JSON object can be endless:
# json_object is tested on SmolLM2, tests/serving/test_structured_openai.py).
CONSTRAINTS = {"json_schema": StructuredOutput(json_schema=SCHEMA),
               "regex": StructuredOutput(regex=REGEX), "choice": StructuredOutput(choice=CHOICES),
               "lark": StructuredOutput(grammar=LARK), "gbnf": StructuredOutput(grammar=GBNF)}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    config = ModelConfig.preset("tiny-llama")
    return model_from_params(config, random_params(config))


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Engine.from_model(model, tokenizer, EngineConfig(**ENGINE))


def _requests(tokenizer, temperature: float, max_tokens: int = 96) -> list:
    return [(tokenizer.encode(f"request {i}: {kind}"),
             SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                            structured=structured))
            for i, (kind, structured) in enumerate(CONSTRAINTS.items())]


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_kind_matches_and_nothing_compiles_after_warmup(engine, tokenizer, temperature):
    outputs = _run(engine, _requests(tokenizer, temperature))
    for kind, completion in zip(CONSTRAINTS, outputs):
        assert completion.finish_reason == "stop", (kind, completion.text)
        assert _valid(kind, completion.text), (kind, completion.text)
    assert engine.stats.warmup_compiles == engine.runner.num_programs()
    assert engine.stats.compiles_after_warmup == 0


def test_unconstrained_rows_batched_with_constrained_ones_are_unchanged(engine, tokenizer):
    plain = [(tokenizer.encode(f"plain {i}"), SamplingParams(max_tokens=12, temperature=t,
                                                             seed=i, ignore_eos=True))
             for i, t in enumerate((0.0, 0.9))]
    alone = _run(engine, plain)
    mixed = _run(engine, plain + _requests(tokenizer, 0.0, max_tokens=12)[:2])
    assert [c.token_ids for c in mixed[:2]] == [c.token_ids for c in alone]


def test_ignore_eos_goes_on_to_max_tokens_while_the_grammar_allows(engine, tokenizer):
    structured = StructuredOutput(regex=r"[ab]+")
    (out,) = _run(engine, [(tokenizer.encode("go"),
                            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                           structured=structured))])
    # Complete at max_tokens: "stop" (batching/request.py, constrained_stop).
    assert out.finish_reason == "stop" and re.fullmatch("[ab]{20}", out.text), out.text


def test_refusals_name_the_field(engine, tokenizer):
    for structured, message in [
            (StructuredOutput(regex="(ab"), "structured.regex: "),
            (StructuredOutput(regex="[a&&b]"), "structured.regex: no output can meet it"),
            (StructuredOutput(json_schema={"type": "foo"}), "structured.json_schema: Invalid")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request("x", SamplingParams(structured=structured))
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def staged(model, tokenizer):
    """Two pipeline stages, four rounds a call."""
    return Engine.from_model(model, tokenizer, EngineConfig(
        mesh="stage=2", pipeline_rounds=4, **(ENGINE | {"warmup": False})))


def test_pipeline_stages_give_one_devices_tokens(staged, tokenizer, engine):
    requests = _requests(tokenizer, 0.8, max_tokens=48)
    got = _run(staged, requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in _run(engine, requests)]
    assert all(_valid(kind, c.text) for kind, c in zip(CONSTRAINTS, got))


def test_a_pipeline_call_cuts_rounds_only_for_constrained_rows(staged, tokenizer, engine,
                                                               monkeypatch):
    """A constrained request takes one token a call (its next mask needs the last), while an
    unconstrained one beside it takes one a round; a call that samples no constrained row
    carries no mask (its key is `(0,)`). Tokens stay one device's."""
    requests = [(tokenizer.encode("plain"), SamplingParams(max_tokens=32, temperature=0,
                                                           ignore_eos=True)),
                (tokenizer.encode("word"), SamplingParams(max_tokens=24, temperature=0,
                                                          structured=StructuredOutput(
                                                              regex="[a-z]{6}")))]
    keys, run_calls = [], staged.runner.run_calls
    monkeypatch.setattr(staged.runner, "run_calls",
                        lambda k, arrays: keys.extend(k) or run_calls(k, arrays))
    ids = [staged.add_request(prompt, params) for prompt, params in requests]
    counts, per_call, finished = dict.fromkeys(ids, 0), [], {}
    while staged.has_unfinished():
        grown = {}
        for out in staged.step():
            grown[out.request_id] = len(out.outputs[0].token_ids) - counts[out.request_id]
            counts[out.request_id] += grown[out.request_id]
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        per_call.append(grown)
    both = [grown for grown in per_call if len(grown) == 2]
    assert both and all(grown[ids[1]] == 1 for grown in both), per_call
    assert max(grown[ids[0]] for grown in both) == 4, per_call  # every round, beside it
    assert (1,) in keys and keys[-1] == (0,), (keys, per_call)  # the last: none constrained
    want = _run(engine, requests)
    assert [finished[i].token_ids for i in ids] == [c.token_ids for c in want]
    assert re.fullmatch("[a-z]{6}", finished[ids[1]].text)


def test_the_grpc_request_carries_the_constraint(model, tokenizer, engine):
    served = Engine.from_model(model, tokenizer, EngineConfig(**ENGINE | {"warmup": False}),
                               runner=engine.runner)
    server = GenerationServer(served, ServerConfig(port=0))
    port = server.start()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            done = client.generate("hi", {"max_tokens": 96, "temperature": 0.8, "seed": 1,
                                          "structured": {"json_schema": SCHEMA}})
            assert done.finish_reason == "stop" and _valid("json_schema", done.text)
            done = client.generate("hi", SamplingParams(
                max_tokens=8, structured=StructuredOutput(choice=CHOICES)))
            assert done.text in CHOICES
            with pytest.raises(ClientError) as error:
                client.generate("hi", {"structured": {"regex": "(ab"}})
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert str(error.value.message).startswith("sampling: structured.regex: ")
    finally:
        server.stop()


def test_the_bench_measures_validity_and_cost(engine, tokenizer):
    validity = schema_validity(engine, load_schemas()[:4], temperatures=(0.8,), max_tokens=128)
    row = validity["temperatures"]["0.8"]
    assert row["requests"] == 4 and row["valid"] == 4, row["failures"]
    requests = [BenchRequest(prompt_token_ids=tokenizer.encode(f"bench {i}"),
                             num_output_tokens=24) for i in range(3)]
    cost = compare_structured(engine, requests)
    tokens = [cost[run]["output_tokens"] for run in ("unconstrained", "constrained")]
    assert tokens == [72, 72], cost
    # The matcher takes every token, the last (max_tokens) too: it tells whether the output
    # ended complete ("stop") or not ("length").
    assert cost["matcher_advances"] == 3 * 24 and cost["matcher_seconds"] > 0


# -- constrained rows under preemption and on prefix-cache hits ----------------------------------

def _outputs(engine, requests) -> list:
    """Each request's final `RequestOutput`, in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    return [finished[i] for i in ids]


def _json_lines_valid(text: str) -> bool:
    """At least one whole line, each a JSON object valid against the bench's line schema. The
    last line may be cut: a line started with fewer tokens left than its shortest form is the
    one case room to close does not cover (docs/python-api.md)."""
    from meshserve.serving.bench.structured_cost import LINE_SCHEMA

    lines = text.split("\n")
    assert len(lines) > 1, text
    for line in lines[:-1]:
        jsonschema.validate(json.loads(line), {k: v for k, v in LINE_SCHEMA.items()
                                               if k != "x-guidance"})
    return True


def _json_lines_requests(tokenizer, prompts, max_tokens: int) -> list:
    """JSON lines without end (`JSON_LINES`): each output runs to max_tokens, greedy and
    seeded rows alternating."""
    from meshserve.serving.bench.structured_cost import JSON_LINES

    return [(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8 * (i % 2), seed=i,
                                    ignore_eos=True, structured=JSON_LINES))
            for i, prompt in enumerate(prompts)]


def test_constrained_rows_preempted_and_recomputed_keep_their_tokens(model, tokenizer, engine):
    """A cache of 8 pages holds about one and a half of these requests: they preempt each
    other, recompute their prompt and outputs, and go on; each output is the one it is with
    room to spare (greedy, and seeded), and valid."""
    tight = Engine.from_model(model, tokenizer, EngineConfig(
        **(ENGINE | {"num_pages": 9, "warmup": False})))
    prompts = [tokenizer.encode(f"request {i}: people as JSON lines") for i in range(3)]
    requests = _json_lines_requests(tokenizer, prompts, max_tokens=72)
    got = _outputs(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    assert sum(out.metrics.num_preemptions > 0 for out in got) >= 1
    want = _outputs(engine, requests)
    assert all(out.metrics.num_preemptions == 0 for out in want)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason
                                                         for o in want]
    for out in got:
        assert len(out.outputs[0].token_ids) == 72 and _json_lines_valid(out.outputs[0].text)


def test_constrained_rows_on_a_prefix_cache_hit_keep_their_tokens(model, tokenizer, engine):
    """Requests sharing a long prompt prefix: the later ones start from the first one's cached
    pages, and their constrained outputs are the ones computed without the cache."""
    prefix = tokenizer.encode("a shared system prompt, long enough for two full pages. " * 2)
    prompts = [prefix + tokenizer.encode(f"question {i}") for i in range(3)]
    requests = _json_lines_requests(tokenizer, prompts, max_tokens=48)
    uncached = Engine.from_model(model, tokenizer, EngineConfig(
        **(ENGINE | {"enable_prefix_caching": False, "warmup": False})), runner=engine.runner)
    want = _outputs(uncached, requests)
    assert all(out.num_cached_tokens == 0 for out in want)
    first = _outputs(engine, requests[:1])  # fills the cache; the others then hit it
    rest = _outputs(engine, requests[1:])
    got = first + rest
    assert all(out.num_cached_tokens >= 2 * 16 for out in rest), [o.num_cached_tokens
                                                                  for o in rest]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(_json_lines_valid(out.outputs[0].text) for out in got)


# -- masks computed while the device runs the forward pass (Engine._run_overlapped) --------------

@pytest.fixture(scope="module")
def one_call(model, tokenizer):
    """The same engine with every step one call, each mask computed before its plan."""
    return Engine.from_model(model, tokenizer, EngineConfig(
        **(ENGINE | {"overlap_masks": False, "warmup": False})))


def _mixed_requests(tokenizer) -> list:
    """Every kind of constraint, greedy and seeded, with logprobs, beside unconstrained rows:
    seeded with penalties, greedy under min_tokens, and long prompts cut into chunks, one
    asking for prompt logprobs."""
    temperatures = (0.0, 0.8, 0.0, 0.8, 0.8)
    constrained = [(tokenizer.encode(f"mixed {i}: {kind}"),
                    SamplingParams(max_tokens=48, temperature=t, seed=i, logprobs=3,
                                   structured=structured))
                   for i, ((kind, structured), t) in enumerate(zip(CONSTRAINTS.items(),
                                                                   temperatures))]
    long = tokenizer.encode("a prompt long enough for several chunks of eight tokens each")
    plain = [(long, SamplingParams(max_tokens=16, temperature=0.7, seed=11, logprobs=3,
                                   repetition_penalty=1.3, frequency_penalty=0.4,
                                   presence_penalty=0.2, ignore_eos=True)),
             (tokenizer.encode("plain greedy"), SamplingParams(max_tokens=20, min_tokens=5,
                                                               temperature=0, logprobs=3)),
             (long[3:], SamplingParams(max_tokens=12, seed=12, prompt_logprobs=2,
                                       ignore_eos=True))]
    return [constrained[0], plain[0], *constrained[1:3], plain[1], *constrained[3:], plain[2]]


def _assert_same_outputs(got, want, *, atol: float = 0.0) -> None:
    for g, w in zip(got, want):
        g_out, w_out = g.outputs[0], w.outputs[0]
        assert (g_out.token_ids, g_out.finish_reason) == (w_out.token_ids, w_out.finish_reason)
        for logprobs in ("logprobs", "prompt_logprobs"):
            g_steps = getattr(g_out if logprobs == "logprobs" else g, logprobs) or []
            w_steps = getattr(w_out if logprobs == "logprobs" else w, logprobs) or []
            assert len(g_steps) == len(w_steps)
            for g_step, w_step in zip(g_steps, w_steps):
                assert (g_step is None) == (w_step is None)
                if g_step is not None:
                    assert g_step.keys() == w_step.keys()
                    np.testing.assert_allclose([g_step[t].logprob for t in g_step],
                                               [w_step[t].logprob for t in g_step],
                                               rtol=0, atol=atol)


def test_masks_computed_beside_the_forward_pass_change_no_output(engine, one_call, tokenizer):
    """Token for token, logprob for logprob what one call a step gives; the warm-up compiled
    the split step's programs (`num_programs`) and serving compiles nothing."""
    requests = _mixed_requests(tokenizer)
    steps = engine.stats.overlap_steps
    got = _outputs(engine, requests)
    _assert_same_outputs(got, _outputs(one_call, requests))
    assert engine.stats.overlap_steps > steps and one_call.stats.overlap_steps == 0
    assert 0 <= engine.stats.overlap_hidden_seconds <= engine.stats.overlap_mask_seconds
    assert engine.stats.warmup_compiles == engine.runner.num_programs()
    assert engine.stats.compiles_after_warmup == 0
    assert one_call.runner.num_programs() == len(one_call.runner.config.step_keys())


def test_masks_computed_beside_the_forward_pass_on_a_mesh(model, tokenizer, one_call):
    """Two replicas, each splitting its vocabulary over two devices: the forward pass gathers
    the logits whole for the sampling call, and the outputs are one device's (logprobs to
    1e-4, as every mesh's)."""
    meshed = Engine.from_model(model, tokenizer, EngineConfig(
        mesh="data=2,model=2", **(ENGINE | {"warmup": False})))
    requests = _mixed_requests(tokenizer)
    _assert_same_outputs(_outputs(meshed, requests), _outputs(one_call, requests), atol=1e-4)
    assert meshed.stats.overlap_steps > 0
