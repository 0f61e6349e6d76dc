"""The HTTP API's structured-output fields and tool calls (serving/openai_api/structured_fields.py): each
form maps to its engine constraint, conflicts and bad values are refused naming the field, and
tool calls are parsed and streamed in OpenAI's delta format. No server: the served path is in
tests/serving/test_structured_openai.py."""

import json

import pytest

from meshserve.batching.structured import StructuredOutput
from meshserve.serving.openai_api.structured_fields import (NO_TEMPLATE, FieldError, ToolCallStream,
                                                     prompt_messages, read_structured)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json_schema=SCHEMA)),
    ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(json_schema=SCHEMA)),
    ({"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=["a", "b"])),
    ({"guided_grammar": 'start: "x"'}, StructuredOutput(grammar='start: "x"')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput(regex="a+")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput(choice=["x"])),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutput(grammar='start: "x"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ({"tools": [WEATHER], "tool_choice": "none"}, None),
    ({"response_format": {"type": "json_object"}, "structured_bounds": {"max_string_length": 9}},
     StructuredOutput(json_object=True, max_string_length=9)),
    ({"guided_json": SCHEMA, "structured_bounds": {"max_integer_digits": 4,
                                                   "max_string_length": None}},
     StructuredOutput(json_schema=SCHEMA, max_integer_digits=4)),
])
def test_each_form_maps_to_its_constraint(body, expected):
    structured, tools = read_structured(body, chat=True)
    assert structured == expected and tools is None


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object"),
    ({"response_format": "json"}, "response_format", "must be an object with a type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "must be a JSON object"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex: is empty"),
    ({"guided_choice": "a"}, "guided_choice", "must be a list of strings"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json",
     "response_format and guided_json each constrain the output: send one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "set exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema",
     "unknown fields"),
    ({"tools": [WEATHER]}, "tool_choice", "tool_choice 'auto' (the default with tools) needs a "
                                          "chat template that declares tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a chat template"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools[0].function.name", "letters, digits"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "the same name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]",
     '"type": "function"'),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "guided_regex and tool_choice each constrain"),
    ({"structured_bounds": {"max_string_length": 8}}, "structured_bounds",
     "this request asks for none"),
    ({"guided_regex": "a+", "structured_bounds": {"max_string_length": 8}}, "structured_bounds",
     "this request's constraint is a regex"),
    ({"guided_json": SCHEMA, "structured_bounds": {"max_length": 8}},
     "structured_bounds.max_length", "its fields are max_string_length, max_integer_digits"),
    ({"guided_json": SCHEMA, "structured_bounds": {"max_integer_digits": 0}},
     "structured_bounds.max_integer_digits", "must be in [1, 15], got 0"),
    ({"guided_json": SCHEMA, "structured_bounds": {"max_string_length": "8"}},
     "structured_bounds.max_string_length", "must be an int"),
])
def test_bad_fields_are_refused_by_name(body, param, message):
    with pytest.raises(FieldError) as error:
        read_structured(body, chat=True)
    assert error.value.param == param and message in str(error.value), str(error.value)


def test_tools_are_chat_only():
    with pytest.raises(FieldError, match="chat/completions only"):
        read_structured({"tools": [WEATHER], "tool_choice": "required"}, chat=False)


def test_a_named_function_constrains_to_its_parameters():
    structured, tools = read_structured(
        {"tools": [WEATHER, TIME],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, chat=True)
    assert structured == StructuredOutput(json_schema=SCHEMA)
    assert tools.parse('{"city": "Oslo"}') == ("get_weather", '{"city": "Oslo"}')
    assert "get_weather" in tools.system_message()["content"]


def test_required_constrains_to_one_call_of_any_tool():
    structured, tools = read_structured({"tools": [WEATHER, TIME], "tool_choice": "required"},
                                        chat=True)
    schema = json.loads(structured.json_schema)
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["get_weather",
                                                                           "get_time"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert tools.parse('{"name": "get_time", "arguments": {}}') == ("get_time", "{}")
    assert tools.parse('{"name": "get_ti') is None


@pytest.mark.parametrize("choice,text", [
    ("required", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}'),
])
def test_a_streamed_call_is_its_id_and_name_then_argument_pieces(choice, text):
    _, tools = read_structured({"tools": [WEATHER], "tool_choice": choice}, chat=True)
    stream = ToolCallStream(tools)
    deltas = [d for i in range(0, len(text), 5) for d in stream.add(text[i:i + 5])]
    head, pieces = deltas[0], deltas[1:]
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in pieces)
    assert "".join(d["function"]["arguments"] for d in pieces) == '{"city": "Paris"}'


def test_the_request_model_reads_tool_history_and_the_backend():
    from meshserve.serving.openai_api.checks import RequestError
    from meshserve.serving.openai_api.request_model import parse_request

    request = parse_request({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}],
        "tools": [WEATHER], "tool_choice": "required", "guided_decoding_backend": "auto"}, "chat")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert request.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert request.prompt[2] == {"role": "tool", "content": "4 C", "tool_call_id": "call_1"}
    assert set(request.structured_fields) == {"tools", "tool_choice"}
    # a template without tools reads the calls as JSON text, after the tools' system message
    _, tools = read_structured(request.structured_fields, chat=True)
    messages, template_tools = prompt_messages(request.prompt, tools, NO_TEMPLATE)
    assert template_tools is None and messages[0]["role"] == "system"
    assert messages[2:] == [{"role": "assistant", "content":
                             '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
                            {"role": "tool", "content": "4 C"}]
    for body, param in [({"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
                         "guided_decoding_backend"),
                        ({"tool_choice": 3}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
                         "messages[0].tool_calls")]:
        with pytest.raises(RequestError) as error:
            parse_request({"messages": [{"role": "user", "content": "x"}]} | body, "chat")
        assert error.value.param == param, error.value.message


def test_structured_bounds_is_a_field_of_both_endpoints_and_bounds_a_json_tool_call():
    from meshserve.serving.openai_api.request_model import parse_request

    for endpoint, prompt in (("chat", {"messages": [{"role": "user", "content": "hi"}]}),
                             ("completions", {"prompt": "hi"})):
        request = parse_request(prompt | {"guided_json": SCHEMA,
                                          "structured_bounds": {"max_string_length": 3}},
                                endpoint)
        structured, _ = read_structured(request.structured_fields, chat=endpoint == "chat")
        assert structured == StructuredOutput(json_schema=SCHEMA, max_string_length=3)
    structured, tools = read_structured({"tools": [WEATHER], "tool_choice": "required",
                                         "structured_bounds": {"max_integer_digits": 2}},
                                        chat=True)
    assert structured.kind == "json_schema" and structured.max_integer_digits == 2
