"""Structured output through the real engine: a random-weight tiny Llama with a real byte-level
BPE tokenizer (tests/serving/tiny_tokenizer.py), so random logits are forced into JSON, regexes,
choices and grammars. Every kind matches at temperature 0 and 0.8, nothing compiles after
warm-up, unconstrained rows batched with constrained ones are unchanged, pipeline stages give
one device's tokens, and the gRPC request carries the constraint. The engine's warm-up (about
10 s on 2 cores) makes these slow tests."""

import json
import re

import grpc
import jsonschema
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
              prefill_chunk=8, max_model_len=160, max_logprobs=5, compilation_cache=False)
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
    assert engine.stats.warmup_compiles == len(engine.runner.config.step_keys())
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


def test_pipeline_stages_give_one_devices_tokens(model, tokenizer, engine):
    requests = _requests(tokenizer, 0.8, max_tokens=48)
    staged = Engine.from_model(model, tokenizer, EngineConfig(
        mesh="stage=2", pipeline_rounds=4, **(ENGINE | {"warmup": False})))
    got = _run(staged, requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in _run(engine, requests)]
    assert all(_valid(kind, c.text) for kind, c in zip(CONSTRAINTS, got))


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
