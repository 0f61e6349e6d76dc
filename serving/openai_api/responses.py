"""OpenAI's Responses API (`POST /v1/responses`), read as a chat request: the field table of its
request (`FIELDS`), and `parse_responses_request`, which checks a body against it and returns the
`OpenAIRequest` the chat route would build for the same conversation. Everything after that is the
chat route's: the chat template, the admission check, structured output and tool calls
(`meshserve.serving.openai_api.structured_fields`).

What each field becomes:

    input               a string is one user message; a list holds messages (roles user, system,
                        developer, assistant; content a string or input_text / output_text
                        parts), function_call items (an assistant's call: it joins the assistant
                        message before it, as chat's `tool_calls`) and function_call_output
                        items (a `tool` message)
    instructions        a system message before the input
    max_output_tokens   max_tokens
    text.format         response_format: text, json_object, or json_schema, whose name,
                        description, schema and strict move under `json_schema`
    tools, tool_choice  chat's, each function's keys moved under `function`

A refusal from chat's readers names chat's path; `PATHS` turns it into this request's
(`response_format.json_schema.schema` is `text.format.schema`, `tools[0].function.name` is
`tools[0].name`), through `OpenAIRequest.own_names`.

Stateless: nothing is stored. `store` must be false or left out: OpenAI's default is true, but the
official client leaves it out, and a response here says `store: false`. `previous_response_id`
and `conversation` are refused: the client sends the whole conversation as `input`, as with chat.

This module knows nothing of HTTP, the engine or the engine loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshserve.serving.openai_api.chat_messages import read_message
from meshserve.serving.openai_api.checks import RESPONSES, RequestError, json_value, shown, typed
from meshserve.serving.openai_api.fields import (FIELDS_BY_NAME, Field, accepted, honoured,
                                                 markdown_table, refused)
from meshserve.serving.openai_api.request_model import OpenAIRequest, checked_values
from meshserve.serving.openai_api.structured_fields import FieldError, check_keys

PATH = "/v1/responses"
ROLES = ("user", "system", "developer", "assistant")
# Chat's paths, as this request names them; applied in order to a refusal's path and message.
PATHS = ((r"\bresponse_format\.json_schema\b", "text.format"),
         (r"\bresponse_format\b", "text.format"),
         (r"\btools\[(\d+)\]\.function\b", r"tools[\1]"),
         (r"\btool_choice\.function\b", "tool_choice"))
# The settings a response repeats, and what each is when the request leaves it out.
ECHOED = {"instructions": None, "max_output_tokens": None, "temperature": 1.0, "top_p": 1.0,
          "text": {"format": {"type": "text"}}, "tools": [], "tool_choice": "auto",
          "parallel_tool_calls": True, "user": None}
_STATELESS = "responses are not stored here: send the whole conversation as input"


# -- the checks of this endpoint's own fields ------------------------------------------------------

def _keys(where: str, value: dict, keys: tuple[str, ...], what: str) -> None:
    try:
        check_keys(where, value, keys, what=what)
    except FieldError as err:
        raise RequestError(err.param, str(err), code=err.code) from None


def input_messages(name: str, value: Any, endpoint: str) -> list[dict]:
    """`input` as chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [read_message(name, {"role": "user", "content": value})]
    if not isinstance(value, list) or not value:
        raise RequestError(name, f"{name} must be a string or a non-empty list of messages")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        kind = (item.get("type") or "message") if isinstance(item, dict) else None
        if kind == "function_call" and messages and messages[-1]["role"] == "assistant":
            last = messages[-1]
            last["tool_calls"] = last.get("tool_calls", []) + _function_call(where, item)
        elif kind == "function_call":
            messages.append(read_message(where, {"role": "assistant", "content": None,
                                                 "tool_calls": _function_call(where, item)}))
        elif kind == "function_call_output":
            messages.append(_call_output(where, item))
        elif kind == "message":
            messages.append(_message(where, item))
        else:
            raise RequestError(where, f"{where} must be a message, a function_call or a "
                               f"function_call_output, got type {shown(kind)}",
                               code="unsupported_value")
    return messages


def _message(where: str, item: dict) -> dict:
    # id, status and phase come back with an earlier response's output: they change nothing
    _keys(where, item, ("type", "role", "content", "id", "status", "phase"), "a message")
    role = item.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, "
                                            f"got {shown(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_parts(f"{where}.content", content)
    return read_message(where, {"role": role, "content": text})


def _text_parts(where: str, parts: Any) -> str:
    """The text of input_text and output_text parts (an output's annotations and logprobs are
    left out: they describe it, they are not the conversation)."""
    if not isinstance(parts, list):
        raise RequestError(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]", f"{where}[{j}]: only text parts (input_text, "
                               f"output_text) are served, got type {shown(kind)}",
                               code="unsupported_value")
        _keys(f"{where}[{j}]", part, ("type", "text", "annotations", "logprobs"), "a text part")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(where: str, item: dict) -> list[dict]:
    """A function_call item as chat's `tool_calls` (of one call)."""
    _keys(where, item, ("type", "call_id", "name", "arguments", "id", "status"),
          "a function_call")
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise RequestError(f"{where}.{key}", f"{where}.{key} must be a string")
    return [{"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}]


def _call_output(where: str, item: dict) -> dict:
    _keys(where, item, ("type", "call_id", "output", "id", "status"), "a function_call_output")
    if not isinstance(item.get("call_id"), str):
        raise RequestError(f"{where}.call_id", f"{where}.call_id must be a string")
    output = item.get("output")
    text = output if isinstance(output, str) else _text_parts(f"{where}.output", output)
    return read_message(where, {"role": "tool", "tool_call_id": item["call_id"],
                                "content": text})


def text_format(name: str, value: Any, endpoint: str) -> dict | None:
    """`text` as chat's response_format (None: plain text)."""
    json_value((dict,))(name, value, endpoint)
    _keys(name, value, ("format", "verbosity"), name)
    if value.get("verbosity") is not None:
        raise RequestError(f"{name}.verbosity", f"{name}.verbosity is not supported: no "
                           "verbosity control; leave it out", code="unsupported_parameter")
    fmt = value.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {key: v for key, v in fmt.items() if key != "type"}}
    return fmt


def function_tools(name: str, value: Any, endpoint: str) -> list[dict] | None:
    """`tools` as chat's (None for an empty list, which asks for nothing)."""
    json_value((list,))(name, value, endpoint)
    return [_function(f"{name}[{i}]", tool) for i, tool in enumerate(value)] or None


def _function(where: str, tool: Any) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise RequestError(where, f'{where} must be a function tool, {{"type": "function", '
                           f'"name", "parameters"}}; built-in tools are not served, got type '
                           f"{shown(kind)}", code="unsupported_value")
    return {"type": "function", "function": {key: v for key, v in tool.items() if key != "type"}}


def tool_choice(name: str, value: Any, endpoint: str) -> str | dict:
    """`tool_choice` as chat's: a named function's name moves under `function`."""
    json_value((str, dict))(name, value, endpoint)
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {key: v for key, v in value.items()
                                                 if key != "type"}}
    return value


# -- the table -------------------------------------------------------------------------------------

def _chat_row(name: str, **changes) -> Field:
    """The chat table's row of `name`: the same check, sampling field and neutral values."""
    return dataclasses.replace(FIELDS_BY_NAME[name], endpoints=RESPONSES, **changes)


_ONLY = dict(endpoints=RESPONSES)
FIELDS: tuple[Field, ...] = (
    # -- OpenAI ---------------------------------------------------------------------------------
    _chat_row("model"),
    honoured("input", "a string, or a list of messages (roles user, system, developer, "
             "assistant; content a string or input_text/output_text parts), function_call and "
             "function_call_output items, through the model's chat template", input_messages,
             **_ONLY),
    honoured("instructions", "a system message before the input", typed(str), **_ONLY),
    honoured("max_output_tokens", "default: the rest of the context; input + max_output_tokens "
             "must fit the context (nothing is truncated); an answer cut by it is `incomplete`, "
             "`incomplete_details.reason` `max_output_tokens`", typed(int), **_ONLY),
    _chat_row("temperature"),
    _chat_row("top_p"),
    honoured("stream", "server-sent events, `event: <type>` and `data: <event>` with its "
             "`sequence_number`: response.created, response.in_progress, each output item's "
             "events, then response.completed (response.incomplete when cut short)",
             typed(bool), **_ONLY),
    refused("stream_options", "no obfuscation field is sent",
            neutral=({}, {"include_obfuscation": False}), **_ONLY),
    honoured("text", "format: text, json_object, or json_schema (name, description, schema, "
             "strict) constrains the output, as chat's response_format; verbosity is refused",
             text_format, **_ONLY),
    honoured("tools", "functions, `{\"type\": \"function\", \"name\", \"description\", "
             "\"parameters\", \"strict\"}`, as chat's tools, answered as function_call items; "
             "built-in tools are refused", function_tools, **_ONLY),
    honoured("tool_choice", "auto, required, none, or `{\"type\": \"function\", \"name\"}`, as "
             "chat's tool_choice", tool_choice, **_ONLY),
    _chat_row("parallel_tool_calls"),
    refused("store", "nothing is stored: false, or left out as the official client leaves it "
            "(OpenAI's default is true); the response says `store: false`", neutral=(False,),
            **_ONLY),
    refused("previous_response_id", _STATELESS, **_ONLY),
    refused("conversation", _STATELESS, **_ONLY),
    refused("background", "responses are answered while the request waits", neutral=(False,),
            **_ONLY),
    refused("background_options", "responses are answered while the request waits",
            neutral=({},), **_ONLY),
    refused("include", "no extra output data (logprobs, encrypted reasoning)", neutral=([],),
            **_ONLY),
    refused("top_logprobs", "no logprobs in responses", neutral=(0,), **_ONLY),
    refused("truncation", "prompts are never truncated: a long one is refused",
            neutral=("disabled",), **_ONLY),
    refused("reasoning", "no reasoning-effort control", neutral=({},), **_ONLY),
    refused("prompt", "no stored prompt templates", **_ONLY),
    accepted("max_tool_calls", "it bounds calls of built-in tools, and none are served: "
             "checked, changes nothing", int, **_ONLY),
    refused("context_management", "no context compaction", neutral=([],), **_ONLY),
    refused("access_programs", "no access programs", neutral=({},), **_ONLY),
    refused("image", "text only", neutral=({},), **_ONLY),
    _chat_row("moderation"),
    _chat_row("metadata", note="it labels stored responses, and none are stored"),
    _chat_row("service_tier"),
    _chat_row("user"),
    _chat_row("safety_identifier"),
    _chat_row("prompt_cache_key"),
    _chat_row("prompt_cache_options"),
    _chat_row("prompt_cache_retention"),
    # -- vLLM -----------------------------------------------------------------------------------
    _chat_row("top_k"),
    _chat_row("priority"),
    _chat_row("speculate"),
    honoured("request_id", "the response's id is `resp_<request_id>`; the x-request-id header "
             "wins over it", typed(str), origin="vLLM", **_ONLY),
    _chat_row("logit_bias", origin="vLLM"),
    _chat_row("skip_special_tokens"),
    _chat_row("mm_processor_kwargs"),
    _chat_row("cache_salt"),
    refused("enable_response_messages", "no raw messages in the response", neutral=(False,),
            origin="vLLM", **_ONLY),
    refused("previous_input_messages", _STATELESS, neutral=([],), origin="vLLM", **_ONLY),
)
ROWS: dict[str, Field] = {f.name: f for f in FIELDS}
assert len(ROWS) == len(FIELDS), "a field has two rows"
# The honoured fields `_build` reads, besides those that set a `SamplingParams` field.
BUILT = ("model", "input", "instructions", "max_output_tokens", "stream", "text", "tools",
         "tool_choice", "parallel_tool_calls", "priority", "request_id")
assert {f.name for f in FIELDS if f.verdict == "honoured" and not f.sampling} == set(BUILT), (
    "an honoured field that responses._build does not use, or a used one not honoured")


# -- the request -----------------------------------------------------------------------------------

def parse_responses_request(body: dict) -> OpenAIRequest:
    """Checks every field of `body` against `FIELDS`; raises RequestError at the first one that
    cannot be served."""
    return _build(checked_values(body, _row, "responses"), body)


def _row(name: str) -> Field:
    row = ROWS.get(name)
    if row is None:
        raise RequestError(name, f"{name} is not a field of OpenAI's or vLLM's {PATH} request; "
                                 "the fields served are listed in docs/server.md",
                           code="unknown_parameter")
    return row


def _build(values: dict[str, Any], body: dict) -> OpenAIRequest:
    if "input" not in values:
        raise RequestError("input", "input is required: a string or a list of messages")
    messages = values["input"]
    if "instructions" in values:
        messages = [{"role": "system", "content": values["instructions"]}] + messages
    structured = {"response_format": values.get("text"), "tools": values.get("tools"),
                  "tool_choice": values.get("tool_choice"),
                  "parallel_tool_calls": values.get("parallel_tool_calls")}
    return OpenAIRequest(
        endpoint="responses", model=values.get("model"), prompt_kind="chat", prompt=messages,
        prompt_field="input", sampling={f.sampling: values[f.name] for f in FIELDS
                                        if f.sampling and f.name in values},
        max_tokens=values.get("max_output_tokens"), max_tokens_field="max_output_tokens",
        stream=values.get("stream", False), priority=values.get("priority", 0),
        request_id=values.get("request_id"),
        structured_fields={name: value for name, value in structured.items()
                           if value is not None},
        paths=PATHS, echoed={name: default if body.get(name) is None else body[name]
                             for name, default in ECHOED.items()})


def responses_table() -> str:
    """The table as docs/server.md prints it."""
    return markdown_table(FIELDS, by_endpoint=False)


if __name__ == "__main__":
    print(responses_table())
