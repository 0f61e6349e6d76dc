"""Structured output and tool calls through the OpenAI-compatible HTTP API, with the official
`openai` client, on SmolLM2: response_format json_schema and json_object, vLLM's guided fields and
structured_outputs, and tool_choice "required" or a named function, plain and streamed; bad
constraints are 400s naming the field."""

import json

import jsonschema
import pytest

from tests.serving.served import smol_openai_client

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

SMOL = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
            prefill_chunk=32, max_model_len=512, max_logprobs=3, warmup=False,
            compilation_cache=False)
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_files):
    with smol_openai_client(smollm2_files.path, SMOL) as client:
        yield client


def _chat(client, stream=False, **fields):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=fields.pop("messages", ASK), stream=stream,
                                          max_tokens=fields.pop("max_tokens", 64), **fields)


def _streamed_text(chunks) -> tuple[str, str]:
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_response_format_json_schema_returns_json_that_validates(client, temperature):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    done = _chat(client, messages=[{"role": "user", "content": "Describe a person."}],
                 response_format=response_format, temperature=temperature, seed=3)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)
    text, finish = _streamed_text(_chat(
        client, stream=True, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=response_format, temperature=temperature, seed=3))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllms_fields(client):
    done = _chat(client, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    done = _chat(client, extra_body={"guided_choice": ["sunny", "rainy"]}, temperature=0)
    assert done.choices[0].message.content in ("sunny", "rainy")
    done = _chat(client, extra_body={"guided_regex": "[A-Z][a-z]+, [0-9]{1,2} C"})
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content[0].isupper()
    done = _chat(client, extra_body={"structured_outputs": {"json": WEATHER}}, temperature=0)
    jsonschema.validate(json.loads(done.choices[0].message.content), WEATHER)


def _check_call(name: str, arguments: str) -> None:
    schema = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}[name]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_comes_back_parseable_and_valid(client, tool_choice):
    done = _chat(client, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_streamed_tool_call_follows_the_delta_format(client, tool_choice):
    name, arguments, ids, finish = None, "", set(), None
    for chunk in _chat(client, stream=True, tools=TOOLS, tool_choice=tool_choice,
                       temperature=0.8, seed=5):
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.id:
                ids.add(call.id)
                name = call.function.name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1 and name is not None
    _check_call(name, arguments)


def test_a_streamed_tool_call_carries_the_whole_answer_s_logprobs_and_token_ids(client):
    """Greedy, "required" (one call constrained as JSON, streamed as deltas): the chunks'
    logprobs and token ids, joined, are the whole answer's, each token once."""
    fields = dict(tools=TOOLS, tool_choice="required", temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"return_token_ids": True})
    whole = _chat(client, **fields).choices[0]
    entries, ids = [], []
    for chunk in _chat(client, stream=True, **fields):
        choice = chunk.choices[0]
        chunk_ids = getattr(choice, "token_ids", None)
        if chunk_ids is not None:
            assert len(choice.logprobs.content) == len(chunk_ids), chunk
            entries += choice.logprobs.content
            ids += chunk_ids
    assert whole.finish_reason == "tool_calls" and ids == whole.token_ids
    assert [(lp.token, [t.token for t in lp.top_logprobs]) for lp in entries] == [
        (lp.token, [t.token for t in lp.top_logprobs]) for lp in whole.logprobs.content]
    assert [lp.logprob for lp in entries] == pytest.approx(
        [lp.logprob for lp in whole.logprobs.content], abs=1e-3)


def test_tool_results_can_go_back_in_the_history(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    done = _chat(client, messages=history, max_tokens=8, temperature=0)
    assert done.choices[0].message.content


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": TOOLS}, "tool_choice", "needs a chat template that declares tools"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "response_format: Invalid type: foo"),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex", "guided_regex: "),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice",
     "each constrain the output"),
])
def test_bad_constraints_are_400_naming_the_field(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, **fields)
    body = error.value.body
    assert body["param"] == param and message in body["message"], body
