"""OpenAI's Responses API (`POST /v1/responses`) with the official `openai` client, against servers
on 127.0.0.1.

Where the model does not matter, a scripted runner (tests/serving/test_tool_calls.py: it writes a
given token sequence whatever the prompt) under a byte-level tokenizer whose chat template
declares tools, Hermes-style: the events in order and adding up to the whole response, a text and
a call read as items (and through the client's own stream reader), input items read as the same
conversation as chat messages, max_output_tokens, text.format, refusals that name the field and
run nothing, the metrics, and a disconnect that stops the request. On SmolLM2 (test_http.py's
engine shapes, so its compiled programs are shared): the answer equals chat's, plain and
streamed, text.format json_schema, and a function tool.
"""

import http.client
import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.openai_api.responses import responses_table
from tests.serving.served import (StepGate, pages_free, record_aborts, record_cancels,
                                  openai_server, smol_openai_client, wait_for)
from tests.serving.test_tool_calls import ENGINE, PARIS, WEATHER, ScriptedRunner, hermes_tokenizer

openai = pytest.importorskip("openai")

DOCS = Path(__file__).parents[2] / "docs" / "server.md"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now.",
          "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                "description": "Weather now.",
                                                "parameters": WEATHER, "strict": True}}]
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


@pytest.fixture(scope="module")
def scripted():
    tokenizer = hermes_tokenizer()
    config = EngineConfig(**ENGINE)
    runner = ScriptedRunner(config)
    engine = Engine(runner, tokenizer, config)
    gate = StepGate(engine)  # open, but for the disconnect test
    with openai_server(engine) as (server, client):
        yield SimpleNamespace(client=client, runner=runner, tokenizer=tokenizer, server=server,
                              gate=gate)
        gate.open()


def _say(scripted, text: str) -> None:
    scripted.runner.script = scripted.tokenizer.encode(text)


def _create(scripted, **fields):
    return scripted.client.responses.create(model="scripted",
                                            input=fields.pop("input", "Weather in Paris?"),
                                            **fields)


def _metric(server, pattern: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return float(re.search(pattern + r"\S* (\S+)$", text, re.M).group(1))


def test_the_docs_print_the_responses_field_table():
    docs = DOCS.read_text()
    table = docs.split("<!-- responses-fields:begin -->\n", 1)[1].split(
        "<!-- responses-fields:end -->", 1)[0]
    assert table.strip() == responses_table(), (
        "docs/server.md's Responses field table is stale: paste `python -m "
        "meshserve.serving.openai_api.responses` between its responses-fields markers")


def test_a_stream_s_events_come_in_order_and_add_up_to_the_whole_response(scripted):
    _say(scripted, "Sunny, 18 C.")
    whole = _create(scripted, instructions="Be brief.")
    assert whole.status == "completed" and whole.output_text == "Sunny, 18 C."
    assert whole.id.startswith("resp_") and whole.object == "response"
    (message,) = whole.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == "Be brief." and whole.tool_choice == "auto"

    events = list(_create(scripted, instructions="Be brief.", stream=True))
    types = [event.type for event in events]
    deltas = types[4:-4]
    assert types == (["response.created", "response.in_progress"] + TEXT_EVENTS[:2] + deltas
                     + TEXT_EVENTS[2:] + ["response.completed"])
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert {event.item_id for event in events[3:-2]} == {item_id}
    final = events[-1].response
    assert "".join(event.delta for event in events if event.type.endswith(".delta")) == \
        final.output_text == events[-4].text == whole.output_text
    assert final.output[0].id == item_id and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens

    conn = http.client.HTTPConnection("127.0.0.1", scripted.server.http_port, timeout=30)
    conn.request("POST", "/v1/responses", json.dumps({"input": "Hi", "stream": True}),
                 {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    assert raw.startswith("event: response.created\ndata: {")  # each event named, as OpenAI's
    assert raw.rstrip().split("\n")[-2] == "event: response.completed" and "[DONE]" not in raw


def test_text_and_a_call_come_as_items_plain_and_through_the_client_s_stream(scripted):
    _say(scripted, f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>")
    whole = _create(scripted, tools=TOOLS)
    message, call = whole.output
    assert message.content[0].text == "Let me look." and whole.status == "completed"
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == ARGUMENTS
    with scripted.client.responses.stream(model="scripted", input="Weather in Paris?",
                                          tools=TOOLS) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    message_done = types.index("response.output_item.done")
    assert types.count("response.output_item.added") == 2
    assert types[message_done + 1:message_done + 3] == [
        "response.output_item.added", "response.function_call_arguments.delta"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me look." and final.output[1].parsed_arguments == ARGUMENTS


def test_input_items_are_the_same_conversation_as_chat_messages(scripted, monkeypatch):
    prompts = []
    admit = scripted.server.loop.admission.admit

    def recording(prompt, *args, **kwargs):
        admitted = admit(prompt, *args, **kwargs)
        prompts.append(admitted.prompt_ids)
        return admitted

    monkeypatch.setattr(scripted.server.loop.admission, "admit", recording)
    call = '{"city": "Paris", "unit": "celsius"}'
    items = [
        {"role": "developer", "content": "Answer in Celsius."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": call},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in Celsius."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": call}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    _say(scripted, "Sunny.")
    done = _create(scripted, instructions="Be brief.", input=items, tools=TOOLS)
    scripted.client.chat.completions.create(model="scripted", messages=messages,
                                            tools=CHAT_TOOLS)
    assert done.output_text == "Sunny." and len(prompts) == 2 and prompts[0] == prompts[1]


def test_max_output_tokens_and_text_format(scripted):
    _say(scripted, "Sunny and warm all day long.")
    done = _create(scripted, max_output_tokens=3)
    assert (done.status, done.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert done.output[0].status == "incomplete" and done.usage.output_tokens == 3
    events = list(_create(scripted, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == done.output_text
    schema = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    _say(scripted, json.dumps(ARGUMENTS))
    done = _create(scripted, text={"format": schema})
    assert done.status == "completed" and json.loads(done.output_text) == ARGUMENTS
    assert done.text.format.type == "json_schema"  # the settings come back
    _say(scripted, "Sunny.")  # not JSON: the constraint stops it
    done = _create(scripted, text={"format": {"type": "json_object"}})
    assert (done.status, done.incomplete_details.reason) == ("incomplete", "unsatisfiable")


REFUSED = [  # (fields, param, code)
    (dict(store=True), "store", "unsupported_parameter"),
    (dict(previous_response_id="resp_1"), "previous_response_id", "unsupported_parameter"),
    (dict(extra_body={"colour": "red"}), "colour", "unknown_parameter"),
    (dict(include=["message.output_text.logprobs"]), "include", "unsupported_parameter"),
    (dict(text={"verbosity": "low"}), "text.verbosity", "unsupported_parameter"),
    (dict(tools=[{"type": "web_search"}]), "tools[0]", "unsupported_value"),
    (dict(tools=[TOOLS[0] | {"defer_loading": True}]), "tools[0].defer_loading",
     "unknown_parameter"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}), "tool_choice",
     "invalid_value"),
    (dict(text={"format": {"type": "json_schema", "schema": WEATHER}}), "text.format.name",
     "invalid_value"),
    (dict(text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "foo"}}}),
     "text.format", "invalid_value"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]", "unsupported_value"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input[0]", "unsupported_value"),
    (dict(max_output_tokens=2000), "max_output_tokens", "invalid_value"),
]


def test_refused_fields_are_400s_naming_them_and_run_nothing(scripted):
    runs = scripted.runner.num_executed
    invalid = r'^meshserve:requests_rejected_total\{.*reason="invalid"'
    before = _metric(scripted.server, invalid)
    for fields, param, code in REFUSED:
        with pytest.raises(openai.BadRequestError) as err:
            _create(scripted, **fields)
        assert (err.value.body["param"], err.value.body["code"]) == (param, code), fields
    assert scripted.runner.num_executed == runs
    assert _metric(scripted.server, invalid) == before + len(REFUSED)
    stops = r'^meshserve:request_success_total\{.*finished_reason="stop"'
    served = _metric(scripted.server, stops)
    _say(scripted, "Yes.")
    assert _create(scripted, store=False).output_text == "Yes."  # not stored: false passes
    assert _metric(scripted.server, stops) == served + 1


def test_a_client_that_disconnects_mid_stream_has_its_request_stopped(scripted, monkeypatch):
    server, gate = scripted.server, scripted.gate
    cancelled = record_cancels(server.loop, monkeypatch)
    aborted = record_aborts(server.loop, monkeypatch)
    _say(scripted, "Sunny " * 40)
    gate.shut()
    steps = server.engine.stats.num_steps
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v1/responses", json.dumps({"input": "Hi", "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline() == b"event: response.created\n"
        request_id = json.loads(response.readline()[len("data: "):])["response"]["id"]
        gate.allow(2)  # the prompt's step and one decode: 2 tokens of the script's 200 or so
        while response.readline() != b"event: response.output_text.delta\n":
            pass
        assert server.engine.stats.num_steps > steps
        conn.sock.shutdown(2)
        conn.close()
        wait_for(lambda: cancelled == [request_id])
    finally:
        gate.open()
    wait_for(lambda: pages_free(server))
    assert aborted == cancelled and server.engine.stats.num_steps - steps < 10


# -- SmolLM2 ---------------------------------------------------------------------------------------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(smollm2_files):
    with smol_openai_client(smollm2_files.path) as client:
        yield SimpleNamespace(client=client, model=client.models.list().data[0].id)


@pytest.mark.slow
def test_smollm2_answers_as_chat_does_plain_and_streamed(smol):
    ask = "Name three fruits."
    done = smol.client.responses.create(model=smol.model, input=ask, max_output_tokens=12,
                                        temperature=0)
    chat = smol.client.chat.completions.create(
        model=smol.model, messages=[{"role": "user", "content": ask}], max_tokens=12,
        temperature=0)
    assert done.output_text and done.output_text == chat.choices[0].message.content
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert done.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")
    events = list(smol.client.responses.create(model=smol.model, input=ask,
                                               max_output_tokens=12, temperature=0,
                                               stream=True))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == done.output_text
    assert events[-1].response.usage.output_tokens == done.usage.output_tokens


@pytest.mark.slow
def test_smollm2_text_format_json_schema_parses_and_validates(smol):
    done = smol.client.responses.create(
        model=smol.model, input="Describe a person.", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), PERSON)


@pytest.mark.slow
def test_smollm2_calls_a_function_tool(smol):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": WEATHER, "strict": True}]
    common = dict(model=smol.model, input="What is the weather in Paris?", tools=tools,
                  max_output_tokens=64, temperature=0)
    done = smol.client.responses.create(tool_choice="required", **common)
    (call,) = done.output
    assert (call.type, call.name, done.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(smol.client.responses.create(
        tool_choice={"type": "function", "name": "get_weather"}, stream=True, **common))
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    (done_event,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done_event.arguments and events[-1].type == "response.completed"
    jsonschema.validate(json.loads(arguments), WEATHER)
    with pytest.raises(openai.BadRequestError) as err:  # auto needs a template with tools
        smol.client.responses.create(**common)
    assert err.value.body["param"] == "tool_choice"
