"""Structured output that completes within max_tokens (batching/structured.py, "Room to close").

The model is a greedy stand-in that honours the device's mask as the sampler does: among the
tokens a row's mask allows it takes the one it ranks highest, and it ranks `,` then `1` then `a`
above everything (EOS last), so under JSON it writes `1111...` inside an integer, `,,,,...`
inside a string that never closes, and `1, 1, 1, ...` inside an array: the loops a small model
walks into under greedy decoding. At max_tokens from one below the shortest completion to well
above it, the output is schema-valid JSON ending "stop" whenever the shortest completion fits,
and "length" only when it does not, whether a step is one call or two with its masks computed
between them (`SplitGreedyRunner`). The tiny byte-level tokenizer (tests/serving/
tiny_tokenizer.py) is real, so the grammar library reads it as it reads a model's. Also: a named
tool's arguments, through the OpenAI-compatible server and the official client.
"""

import json

import jsonschema
import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import (CLOSING_RESERVE, StructuredOutput, allowed_ids,
                                           mask_words)
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.grammar import GrammarCompiler
from tests.serving.fake_runner import MODEL, FakeModelRunner
from tests.serving.tiny_tokenizer import EOS_ID, tiny_tokenizer

VOCAB = 512
SCHEMAS = {
    "integer": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                "additionalProperties": False},
    "string": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
               "additionalProperties": False},
    "array": {"type": "object", "properties": {"a": {"type": "array",
                                                     "items": {"type": "integer"}}},
              "required": ["a"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string"}},
            "required": ["id", "tag"], "additionalProperties": False}}},
        "required": ["name", "items"], "additionalProperties": False},
}
ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              prefill_chunk=64, max_model_len=256, max_logprobs=3, compilation_cache=False)


class GreedyRunner(FakeModelRunner):
    """Greedy over a fixed ranking, within each row's mask (the sampler's `allowed` column)."""

    def __init__(self, config: EngineConfig, preferred: list[int]):
        super().__init__(config)
        self.model_config = MODEL.replace(name="greedy", vocab_size=VOCAB)
        self.config = config.for_model(self.model_config).runner_config()
        rank = np.arange(VOCAB, 0, -1, dtype=np.int64)  # lower ids first
        rank[EOS_ID] = -1
        for place, token in enumerate(preferred):
            rank[token] = 10 * VOCAB - place
        self.rank = rank

    def execute(self, plan):
        self.num_executed += 1
        return self._sample(plan.sampling)

    def _sample(self, sampling):
        return [self._rows(np.array([self._pick(arrays.allowed[i])
                                     for i in range(len(arrays.steps))], np.int32))
                for arrays in sampling]

    def _pick(self, mask: np.ndarray) -> int:
        if mask.shape[0] == 1 and mask[0] == -1:
            return int(np.argmax(self.rank))
        allowed = allowed_ids(mask)
        allowed = allowed[allowed < VOCAB]
        return int(allowed[np.argmax(self.rank[allowed])])


class SplitGreedyRunner(GreedyRunner):
    """The same model, its steps split as `ModelRunner`'s are (`splits_sampling`): the engine
    computes the due masks between `forward` and `sample`."""

    splits_sampling = True

    def forward(self, sub_batches):
        return len(sub_batches)

    def sample(self, forward, sampling):
        assert forward == len(sampling)
        self.num_executed += 1
        return self._sample(sampling)

    def finished_at(self, forward):
        return None


RUNNERS = {"one call": GreedyRunner, "forward, then sampling": SplitGreedyRunner}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.to_json(), vocab_size=VOCAB, eos_token_ids=(EOS_ID,))


@pytest.fixture(scope="module", params=list(RUNNERS))
def engine(tokenizer, request):
    """Both ways of running a step: what the tests assert holds for each."""
    config = EngineConfig(**ENGINE)
    preferred = [tokenizer.token_to_id(symbol) for symbol in (",", "1", "a")]
    return Engine(RUNNERS[request.param](config, preferred), tokenizer, config)


def _shortest(compiler, structured) -> int:
    return compiler.matcher(structured).num_closing_tokens()


def _generate(engine, structured, max_tokens: int):
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=max_tokens, structured=structured))
    finished = []
    while engine.has_unfinished():
        finished += [out for out in engine.step() if out.finished]
    (out,) = finished
    return out.outputs[0]


def test_the_shortest_completion_is_found_in_tokens(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutput(json_schema=SCHEMAS["nested"]))
    assert matcher.num_closing_tokens() == len(tokenizer.encode(
        '{"name": "", "items": [{"id": 0, "tag": ""}]}', add_special_tokens=False))
    for token in tokenizer.encode('{"name": "abc', add_special_tokens=False):
        assert matcher.advance(token)
    mask = np.zeros(mask_words(VOCAB), np.int32)
    matcher.fill_closing_mask(mask, budget=100)
    assert [tokenizer.decode([int(t)]) for t in allowed_ids(mask)] == ['"']
    matcher.fill_closing_mask(mask, budget=matcher.num_closing_tokens() - 1)
    assert not mask.any()  # nothing completes in fewer tokens than the shortest


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_looping_output_closes_within_every_budget_that_fits_it(engine, compiler, name):
    structured = StructuredOutput(json_schema=SCHEMAS[name])
    shortest = _shortest(compiler, structured)
    for max_tokens in sorted({shortest - 1, shortest, shortest + 1, shortest + 2,
                              shortest + CLOSING_RESERVE, shortest + CLOSING_RESERVE + 3,
                              shortest + 17, 60}):
        out = _generate(engine, structured, max_tokens)
        if max_tokens < shortest:
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
            with pytest.raises(json.JSONDecodeError):
                json.loads(out.text)
            continue
        assert out.finish_reason == "stop", (max_tokens, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
        assert len(out.token_ids) <= max_tokens
        # The model loops: it writes until closing must start, then closes.
        assert len(out.token_ids) >= max_tokens - CLOSING_RESERVE, (max_tokens, out.text)


def test_a_budget_far_above_the_shortest_is_spent_looping(engine, compiler):
    out = _generate(engine, StructuredOutput(json_schema=SCHEMAS["integer"]), 40)
    assert out.text.startswith('{"n": 1111111111') and out.text.endswith("}")
    out = _generate(engine, StructuredOutput(json_schema=SCHEMAS["string"]), 40)
    assert out.text.startswith('{"s": ",,,,,,,,,,') and out.text.endswith('"}')


def test_a_regex_and_a_grammar_end_complete_at_max_tokens(engine, compiler):
    # Complete before max_tokens yet free to go on: the output that reaches max_tokens complete
    # ends "stop"; one that needs a closing has it.
    digits = _generate(engine, StructuredOutput(regex=r"[0-9]+(,[0-9]+)*"), 9)
    assert digits.finish_reason == "stop" and len(digits.token_ids) == 9
    assert all(part.isdigit() for part in digits.text.split(","))
    lark = StructuredOutput(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9a]+/')
    for max_tokens in range(_shortest(compiler, lark), 12):
        out = _generate(engine, lark, max_tokens)
        assert out.finish_reason == "stop" and out.text.startswith("(") and \
            out.text.endswith(")"), (max_tokens, out.text)


# -- a named tool's arguments, through the OpenAI-compatible server ------------------------------

@pytest.fixture(scope="module", params=["own format", "no tools in the template"])
def served_tools(request):
    """(client, the constraint a named get_weather call has): the server builds it the same."""
    openai = pytest.importorskip("openai")
    from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
    from meshserve.serving.openai_api.tool_calls import chat_tools
    from tests.serving.test_tool_calls import NO_TOOLS, WEATHER, hermes_tokenizer

    if request.param == "own format":
        tokenizer = hermes_tokenizer()
        structured = StructuredOutput(grammar=chat_tools(tokenizer).grammar(
            [("get_weather", WEATHER)], is_required=True, is_parallel=True))
    else:
        tokenizer = hermes_tokenizer(NO_TOOLS)
        structured = StructuredOutput(json_schema=WEATHER)
    config = EngineConfig(**(ENGINE | {"max_model_len": 1024, "num_pages": 128,
                                       "max_num_batched_tokens": 512, "prefill_chunk": 512}))
    preferred = [tokenizer.token_to_id(symbol) for symbol in (",", "1", "a")]
    server = GenerationServer(Engine(GreedyRunner(config, preferred), tokenizer, config),
                              ServerConfig(port=0, http_port=0))
    server.start()
    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size=VOCAB,
                               eos_token_ids=tokenizer.eos_token_ids)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                       max_retries=0) as client:
        yield client, _shortest(compiler, structured)
    server.stop()


def test_a_named_tool_call_is_whole_within_a_small_max_tokens(served_tools):
    """LangChain's bind_tools with a named tool at max_tokens=24 got a cut call and dropped
    it: now the call is whole whenever the shortest call fits."""
    from tests.serving.test_tool_calls import ASK, TOOLS, WEATHER

    client, shortest = served_tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    for max_tokens in sorted({shortest - 1, shortest, shortest + 1, shortest + 5, 24,
                              shortest + 20}):
        done = client.chat.completions.create(model="greedy", messages=ASK, tools=TOOLS,
                                              tool_choice=named, max_tokens=max_tokens)
        choice = done.choices[0]
        assert done.usage.completion_tokens <= max_tokens
        if max_tokens < shortest:
            assert choice.finish_reason == "length", (max_tokens, choice)
            continue
        assert choice.finish_reason == "tool_calls", (max_tokens, shortest, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_max_tokens_ends_a_complete_output_stop_and_an_incomplete_one_length(compiler, tokenizer):
    """`constrained_stop`, which both the scheduler and the pipeline's resolve apply."""
    from meshserve.batching.request import Request, RequestStatus, constrained_stop
    from meshserve.batching.structured import Constraint

    length = (RequestStatus.FINISHED_LENGTH, None)
    for regex, is_complete in (("a+", True), ("a+b", False)):
        request = Request(request_id="r", prompt_token_ids=[5])
        request.constraint = Constraint(compiler.matcher(StructuredOutput(regex=regex)),
                                        num_words=mask_words(VOCAB), eos_token_ids=(EOS_ID,))
        assert request.constraint.advance(tokenizer.token_to_id("a")) is None
        expected = (RequestStatus.FINISHED_STOPPED, None) if is_complete else length
        assert constrained_stop(request, length, None) == expected
        assert constrained_stop(request, None, None) is None
        assert constrained_stop(request, length, ("unsatisfiable", "x")) == ("unsatisfiable", "x")


def test_the_metrics_give_the_host_time_of_each_steps_masks(engine):
    """`meshserve:structured_mask_seconds`: one observation for each step in which a
    constrained request took a token (the unconstrained request's steps alone add none)."""
    from meshserve.serving.engine.metrics import ServerMetrics

    metrics = ServerMetrics("greedy")
    metrics.observe_step(engine, 0.0)  # the steps of the tests before: one observation each
    labels = {"model_name": "greedy"}
    before = metrics.registry.get_sample_value("meshserve:structured_mask_seconds_count", labels)
    assert before == engine.scheduler.num_constraint_batches
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    request_id = engine.add_request([5, 6], SamplingParams(
        max_tokens=10, structured=StructuredOutput(json_schema=SCHEMAS["integer"])))
    finished = {}
    while engine.has_unfinished():
        finished |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
        metrics.observe_step(engine, 0.01)
    count = metrics.registry.get_sample_value("meshserve:structured_mask_seconds_count", labels)
    total = metrics.registry.get_sample_value("meshserve:structured_mask_seconds_sum", labels)
    assert count - before == len(finished[request_id].token_ids) < 20 and total > 0


# -- bounds: the longest string and number a JSON constraint admits ------------------------------

@pytest.mark.parametrize("name,bounds,text", [
    ("string", {"max_string_length": 5}, '{"s": ",,,,,"}'),
    ("integer", {"max_integer_digits": 3}, '{"n": 111}'),
])
def test_a_bound_closes_a_looping_string_or_number_within_it(engine, name, bounds, text):
    """Far from max_tokens, the model loops until the bound: the string or number closes
    there, not where closing for max_tokens would start (`{"n": 1111...1}` at 60 tokens)."""
    out = _generate(engine, StructuredOutput(json_schema=SCHEMAS[name], **bounds), 60)
    assert out.finish_reason == "stop" and out.text == text
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_the_engines_bounds_apply_where_a_request_sets_none(tokenizer):
    config = EngineConfig(**ENGINE, structured_max_string_length=4,
                          structured_max_integer_digits=2)
    preferred = [tokenizer.token_to_id(symbol) for symbol in (",", "1", "a")]
    engine = Engine(GreedyRunner(config, preferred), tokenizer, config)
    assert _generate(engine, StructuredOutput(json_schema=SCHEMAS["string"]), 60).text == \
        '{"s": ",,,,"}'
    assert _generate(engine, StructuredOutput(json_schema=SCHEMAS["integer"]), 60).text == \
        '{"n": 11}'
    own = StructuredOutput(json_schema=SCHEMAS["string"], max_string_length=7)  # the request's
    assert _generate(engine, own, 60).text == '{"s": ",,,,,,,"}'
    regex = _generate(engine, StructuredOutput(regex="[0-9]+"), 9)  # not JSON: not bounded
    assert regex.text == "1" * 9
    with pytest.raises(ValueError, match=r"structured_max_integer_digits must be in \[1, 15\]"):
        EngineConfig(**ENGINE, structured_max_integer_digits=16)


def test_bounded_keys_leave_the_named_properties_and_listed_values_as_they_are(compiler,
                                                                                tokenizer):
    """Keys beyond `properties` are bounded, the named ones are not (nor intersected with the
    extra keys' schema); an enum keeps every option; a bound no output can meet is refused."""
    schema = {"type": "object", "properties": {"a_long_name": {"type": "string"},
                                               "kind": {"enum": ["abcdefgh", 123456]}},
              "additionalProperties": {"type": "integer"}}
    bounded = StructuredOutput(json_schema=schema, max_string_length=3, max_integer_digits=2)

    def accepts(structured, text):
        matcher = compiler.matcher(structured)
        return all(matcher.advance(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    for text, is_ok in (('{"a_long_name": "abc"}', True), ('{"a_long_name": "abcd"}', False),
                        ('{"kind": "abcdefgh"}', True), ('{"kind": 123456}', True),
                        ('{"abc": 12}', True), ('{"abcd": 12}', False), ('{"abc": 123}', False),
                        ('{"a_long_name": 1}', False)):
        assert accepts(bounded, text) is is_ok, text
        assert accepts(StructuredOutput(json_schema=schema), text) or not is_ok, text
    for text, is_ok in (('{"abc": [1, "xyz"]}', True), ('{"abcd": 1}', False),
                        ('{"a": {"b": "wxyz"}}', False), ('{"a": -99.5}', True),
                        ('{"a": -100}', False)):
        assert accepts(StructuredOutput(json_object=True, max_string_length=3,
                                        max_integer_digits=2), text) is is_ok, text
    with pytest.raises(ValueError, match=r"minLength \(5\) is above max_string_length \(3\)"):
        compiler.check(StructuredOutput(json_schema={"type": "string", "minLength": 5},
                                        max_string_length=3))
    with pytest.raises(ValueError, match="bounds JSON"):
        StructuredOutput(regex="a+", max_string_length=3)


def test_bounds_are_refused_on_the_grpc_wire_rather_than_dropped():
    from meshserve.serving.grpc_api.structured_messages import structured_message

    assert structured_message(StructuredOutput(json_object=True)).json_object
    with pytest.raises(ValueError, match="do not travel over gRPC"):
        structured_message(StructuredOutput(json_object=True, max_string_length=3))


def test_the_other_keys_pattern_is_every_short_key_but_the_named_ones():
    """Checked against Python's `re` on every key of up to 3 characters over the names' own
    characters (punctuation, a non-ASCII letter) and a few longer ones."""
    import itertools
    import re

    from meshserve.serving.engine.json_schemas import other_keys_pattern

    names = ["s", "ab", "a-b", "x.y", "$ref", "a]b", "é", "abc", "a_very_long_name"]
    pattern = re.compile(other_keys_pattern(names, 4))
    alphabet = "sabx.-$]éyz"
    keys = ["".join(chars) for n in range(4) for chars in itertools.product(alphabet, repeat=n)]
    for key in keys + ["aaaa", "zzzz", "aaaaa", "$ref", "x.yz"]:
        assert bool(pattern.fullmatch(key)) is (len(key) <= 4 and key not in names), key
