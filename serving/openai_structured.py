"""Structured output on the OpenAI-compatible HTTP API: the request fields that ask for it, and
tool calls built on it.

`read_structured(body, ...)` turns a request body into at most one `StructuredOutput` and, for
tool calls, a `ToolCalls` plan. The fields, each mapped to the same engine constraint:

    response_format {"type": "json_object"}                  any JSON object
    response_format {"type": "json_schema", "json_schema":   JSON valid against the schema
        {"name", "schema", "strict"}}                        (always enforced, strict or not)
    guided_json, guided_regex, guided_choice, guided_grammar vLLM's extra fields
                                                             (its guided_decoding_backend is
                                                             checked by the field table)
    structured_outputs {"json" | "regex" | "choice" |        vLLM's newer form
        "grammar" | "json_object"}
    tools + tool_choice "required" or a named function       tool calls (below)

Only one of them per request; two are refused naming both.

Tool calls, for any model: with `tool_choice: "required"` the output is constrained to one call
of one of the tools, `{"name": <a tool's name>, "arguments": <its parameters' schema>}`; with a
named function, to that function's parameters. The tools are described to the model in a system
message (unless the chat template renders tools itself), and the output comes back as a
`tool_calls` message, streamed in OpenAI's delta format (`ToolCallStream`). `tool_choice: "auto"`
(the default when tools are given) lets the model choose between text and a call in its own
format: it needs a chat template that declares tools, and is refused by name otherwise;
`"none"` ignores the tools.

Errors are `FieldError`s: a ValueError whose `param` names the request field at fault.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from meshserve.batching.structured import StructuredOutput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_VLLM_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
                "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                       "grammar": "grammar", "json_object": "json_object"}
_UNSERVED_STRUCTURED_OUTPUTS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                                "disable_additional_properties", "disable_fallback")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FieldError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """How a request's output becomes a tool call: of `forced` (a named tool_choice: the output
    is its arguments), or of any of `tools` ("required": the output names the tool)."""

    tools: tuple[Tool, ...]
    forced: Tool | None

    def structured(self) -> StructuredOutput:
        if self.forced is not None:
            return StructuredOutput(json_schema=self.forced.parameters)
        calls = [{"type": "object",
                  "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for tool in self.tools]
        return StructuredOutput(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})

    def system_message(self) -> dict:
        """The tools, described to a model whose chat template does not render them."""
        described = [{"name": t.name, "description": t.description, "parameters": t.parameters}
                     for t in self.tools]
        if self.forced is not None:
            ask = f"Call the function {self.forced.name}: reply with its arguments as JSON."
        else:
            ask = 'Call one of them: reply with JSON {"name": ..., "arguments": {...}}.'
        return {"role": "system", "content": "You can call these functions:\n"
                + json.dumps(described, ensure_ascii=False) + "\n" + ask}

    def parse(self, text: str) -> tuple[str, str] | None:
        """`(name, arguments JSON)` of the call in a finished output; None if it is not one."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.forced is not None:
            return self.forced.name, json.dumps(value, ensure_ascii=False)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return value["name"], json.dumps(value.get("arguments"), ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a request body asks for: its constraint, the field that asked (for errors), and the
    tool-call plan when the constraint comes from tools."""

    output: StructuredOutput | None = None
    field: str | None = None
    tools: ToolCalls | None = None


def read_request(body: dict, *, chat: bool, template_declares_tools: bool = False) -> Structured:
    structured, tools = read_structured(body, chat=chat,
                                        template_declares_tools=template_declares_tools)
    if structured is None:
        return Structured()
    field = "tool_choice" if tools is not None else next(
        name for name in ("response_format", *_VLLM_GUIDED, "structured_outputs")
        if body.get(name) is not None and (name != "response_format"
                                           or body[name].get("type") != "text"))
    return Structured(output=structured, field=field, tools=tools)


def read_structured(body: dict, *, chat: bool, template_declares_tools: bool = False
                    ) -> tuple[StructuredOutput | None, ToolCalls | None]:
    """The request's constraint and tool-call plan (see the module docstring)."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    for field, kind in _VLLM_GUIDED.items():
        if body.get(field) is not None:
            found.append((field, _constraint(field, kind, body[field])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    tools = _tool_calls(body, chat=chat, template_declares_tools=template_declares_tools)
    if tools is not None:
        found.append(("tool_choice", tools.structured()))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise FieldError(found[1][0], f"{names} each constrain the output: send one")
    return (found[0][1] if found else None), tools


def _response_format(value) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError("response_format", "response_format must be an object with a type: "
                                            "text, json_object or json_schema")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise FieldError("response_format.type", f"response_format.type must be text, "
                         f"json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise FieldError("response_format.json_schema", "response_format.json_schema must be "
                         "an object with a name and a schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise FieldError("response_format.json_schema.strict",
                         "response_format.json_schema.strict must be true or false")
    schema = spec.get("schema", {"type": "object"})
    return _constraint("response_format.json_schema.schema", "json_schema", schema)


def _structured_outputs(value) -> StructuredOutput:
    if not isinstance(value, dict):
        raise FieldError("structured_outputs", "structured_outputs must be an object with one "
                         f"of {', '.join(_STRUCTURED_OUTPUTS)}")
    for name in _UNSERVED_STRUCTURED_OUTPUTS:
        if value.get(name):
            raise FieldError(f"structured_outputs.{name}", f"structured_outputs.{name} is not "
                                                           "supported")
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS) - set(_UNSERVED_STRUCTURED_OUTPUTS))
    if unknown:
        raise FieldError(f"structured_outputs.{unknown[0]}",
                         f"structured_outputs: unknown fields {unknown}")
    given = {name: v for name, v in value.items()
             if name in _STRUCTURED_OUTPUTS and v is not None and v is not False}
    if len(given) != 1:
        raise FieldError("structured_outputs", "structured_outputs: set exactly one of "
                         f"{', '.join(_STRUCTURED_OUTPUTS)}")
    (name, content), = given.items()
    return _constraint(f"structured_outputs.{name}", _STRUCTURED_OUTPUTS[name], content)


def _constraint(field: str, kind: str, value) -> StructuredOutput:
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as err:
        raise FieldError(field, f"{field}: {_without_prefix(str(err))}") from None


def _without_prefix(message: str) -> str:
    """A `StructuredOutput` message without the `structured.<kind>` it starts with: the HTTP
    field name replaces it."""
    return re.sub(r"^structured(\.\w+)?:? ", "", message)


def _tool_calls(body: dict, *, chat: bool, template_declares_tools: bool) -> ToolCalls | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None and choice != "none":
            raise FieldError("tool_choice", "tool_choice needs tools")
        return None
    if not chat:
        raise FieldError("tools", "tools are served on /v1/chat/completions only")
    parsed = _tools(tools)
    if choice is None or choice == "auto":
        if template_declares_tools:
            raise FieldError("tool_choice", "tool_choice 'auto' (the default with tools) is not "
                             "served yet: send tool_choice 'required' or a named function")
        raise FieldError("tool_choice", "tool_choice 'auto' (the default with tools) needs a "
                         "chat template that declares tools, and this model's does not: send "
                         "tool_choice 'required' or a named function, which constrain the "
                         "output to a call")
    if choice == "none":
        return None
    if choice == "required":
        return ToolCalls(tools=parsed, forced=None)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise FieldError("tool_choice", "tool_choice must be none, auto, required or "
                         '{"type": "function", "function": {"name": ...}}')
    forced = next((tool for tool in parsed if tool.name == name), None)
    if forced is None:
        raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not among the "
                         "tools")
    return ToolCalls(tools=parsed, forced=forced)


def _tools(tools) -> tuple[Tool, ...]:
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools", "tools must be a non-empty list of functions")
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(function, dict):
            raise FieldError(f"tools[{i}]", f'tools[{i}] must be {{"type": "function", '
                                            f'"function": {{"name", "parameters"}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"tools[{i}].function.name", f"tools[{i}].function.name must be "
                             "1 to 64 letters, digits, underscores or dashes")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise FieldError(f"tools[{i}].function.parameters",
                             f"tools[{i}].function.parameters must be a JSON schema object")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise FieldError(f"tools[{i}].function.description",
                             f"tools[{i}].function.description must be a string")
        parsed.append(Tool(name=name, description=description, parameters=parameters))
    if len({tool.name for tool in parsed}) != len(parsed):
        raise FieldError("tools", "tools: two functions have the same name")
    return tuple(parsed)


def calls_as_text(calls: list) -> str:
    """An assistant turn's tool calls as the chat template reads them: one JSON object
    `{"name", "arguments"}` a line, the form a "required" call is written in."""
    return "\n".join(json.dumps({"name": (c.get("function") or {}).get("name"),
                                 "arguments": _arguments(c)}, ensure_ascii=False) for c in calls)


def _arguments(call: dict):
    text = (call.get("function") or {}).get("arguments", "{}")
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """A streamed output as OpenAI's tool-call deltas: first the call's id and name, then the
    arguments' text as it arrives.

    With a named function the whole output is the arguments. With "required" the output is
    `{"name": "<tool>", "arguments": <arguments>}` in the constraint's compact form, so the name
    is known once the text reaches the arguments, and the wrapper's last `}` is held back."""

    def __init__(self, calls: ToolCalls):
        self.calls = calls
        self.id = tool_call_id()
        self.text = ""
        self.num_sent = 0  # characters of `text` sent (or skipped, the wrapper's head)
        self.is_started = False  # the id and name went out

    def add(self, text: str) -> list[dict]:
        """The `tool_calls` deltas that `text` (the output's next piece) completes."""
        self.text += text
        deltas = []
        if not self.is_started:
            name = self._name()
            if name is None:
                return []
            deltas.append({"index": 0, "id": self.id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
            self.is_started = True
        end = len(self.text) - (0 if self.calls.forced is not None else 1)
        if end > self.num_sent:
            deltas.append({"index": 0, "function": {"arguments": self.text[self.num_sent:end]}})
            self.num_sent = end
        return deltas

    def _name(self) -> str | None:
        """The called tool's name once the text shows it; the wrapper's head is skipped."""
        if self.calls.forced is not None:
            return self.calls.forced.name
        match = re.match(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ', self.text)
        if match is None:
            return None
        self.num_sent = match.end()
        return match.group(1)
