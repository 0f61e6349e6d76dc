"""Structured output on the OpenAI-compatible HTTP API: the request fields that ask for it, and
tool calls built on it.

`read_structured(body, ...)` turns a request body into at most one `StructuredOutput` and, for
tool calls, a `ToolCalls` plan. The fields, each mapped to the same engine constraint:

    response_format {"type": "json_object"}                  any JSON object
    response_format {"type": "json_schema", "json_schema":   JSON valid against the schema
        {"name", "description", "schema", "strict"}}         (always enforced, strict or not;
                                                             without a schema, any JSON object)
    guided_json, guided_regex, guided_choice, guided_grammar vLLM's extra fields
                                                             (its guided_decoding_backend is
                                                             checked by the field table)
    structured_outputs {"json" | "regex" | "choice" |        vLLM's newer form
        "grammar" | "json_object"}
    tools, tool_choice, parallel_tool_calls                   tool calls (below)
    structured_bounds {"max_string_length",                   meshserve's: bounds of the JSON
        "max_integer_digits"}                                constraint any of the above asks
                                                             for (`StructuredOutput`'s)

Only one of them per request; two are refused naming both. The objects these fields hold take
the keys OpenAI's API defines for them and no other (`check_keys`): an unknown key is refused by
its path, such as `response_format.json_schema.schema_` or `tools[0].function.colour`.

Tool calls take one of two ways, chosen by the model's chat template (`tool_calls.chat_tools`):
  - the model's own format, where the template declares tools and writes calls in a format
    meshserve reads (`tool_calls.FORMATS`, e.g. Qwen's `<tool_call>` blocks): the tools go to
    the template as its `tools`, assistant tool calls in the history go to it as `tool_calls`,
    and a grammar keeps every call the model opens well formed (`ChatTools.grammar`).
    tool_choice "auto" (the default with tools) lets the model answer with text, calls or
    both; "required" asks for at least one call, a named function for calls of it only;
    parallel_tool_calls false allows one call at most. The output is read by
    `tool_calls.CallParser`.
  - any other model: tool_choice "required" constrains the whole output to one call
    `{"name": <a tool's name>, "arguments": <its parameters' schema>}`, a named function to
    its arguments; the tools are described in a system message, and history tool calls are
    written as that JSON. "auto" is refused, naming why (`ChatTools.refusal`).
Either way the output comes back as a `tool_calls` message, streamed in OpenAI's delta format.
`"none"` ignores the tools.

Errors are `FieldError`s: a ValueError whose `param` names the request field at fault.
"""

from __future__ import annotations

import dataclasses
import json
import re

from meshserve.batching.structured import BOUNDS, JSON_KINDS, StructuredOutput, check_bound
from meshserve.serving.openai_api.tool_calls import CallParser, ChatTools, chat_tools, tool_call_id

NO_TEMPLATE = chat_tools(None)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_VLLM_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
                "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                       "grammar": "grammar", "json_object": "json_object"}
_UNSERVED_STRUCTURED_OUTPUTS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                                "disable_additional_properties", "disable_fallback")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FieldError(ValueError):
    """`param` names the field at fault, as a path (`tools[0].function.name`); `code` is
    OpenAI's error code: invalid_value, or unknown_parameter for a key no such object has."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


# The keys of each object these fields hold, as OpenAI's API defines them; any other key is a
# FieldError naming its path, so nothing a client sends is silently left out.
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                        "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
TOOL_CHOICE_KEYS = ("type", "function")
TOOL_CHOICE_FUNCTION_KEYS = ("name",)


def check_keys(where: str, value: dict, keys: tuple[str, ...], *, what: str = "") -> None:
    """Refuses the first key of `value` (the object at path `where`, described as `what`) that
    is not one of `keys`."""
    unknown = next((key for key in value if key not in keys), None)
    if unknown is not None:
        raise FieldError(f"{where}.{unknown}", f"{where}.{unknown} is not a field of "
                         f"{what or where}; its fields are {', '.join(keys)}",
                         code="unknown_parameter")


def _optional(where: str, value: dict, key: str, kind: type, wanted: str):
    """`value[key]`, None when absent or null; a FieldError unless it is a `kind`."""
    item = value.get(key)
    if item is not None and not isinstance(item, kind):
        raise FieldError(f"{where}.{key}", f"{where}.{key} must be {wanted}")
    return item


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """How a request's output becomes tool calls: in the model's own format (`own`, see the
    module docstring), or as one call of `forced` (a named tool_choice: the output is its
    arguments) or of any of `tools` ("required": the output names the tool)."""

    tools: tuple[Tool, ...]
    forced: Tool | None
    own: ChatTools | None = None
    is_auto: bool = False  # own format only: text may stand alone
    is_parallel: bool = True  # own format only: more than one call may follow

    def structured(self) -> StructuredOutput:
        callable_tools = self.tools if self.forced is None else (self.forced,)
        if self.own is not None:
            return StructuredOutput(grammar=self.own.grammar(
                [(tool.name, tool.parameters) for tool in callable_tools],
                is_required=not self.is_auto, is_parallel=self.is_parallel))
        if self.forced is not None:
            return StructuredOutput(json_schema=self.forced.parameters)
        calls = [{"type": "object",
                  "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for tool in self.tools]
        return StructuredOutput(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})

    def template_tools(self) -> list[dict]:
        """The tools as a chat template's `tools` variable reads them (OpenAI's form)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}}
                for t in self.tools]

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

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished output as OpenAI's assistant message, and its finish reason: "tool_calls"
        when it made calls and stopped by itself after them. In the model's own format the
        message holds the content beside the calls; otherwise the output is one call, or (cut
        off, or not a call) text."""
        if self.own is not None:
            parser = CallParser(self.own.format)
            message = {"role": "assistant", "content": parser.read_whole(text)}
            if parser.calls:
                message["tool_calls"] = [call.as_message() for call in parser.calls]
            is_called = parser.is_complete and finish_reason == "stop"
            return message, "tool_calls" if is_called else finish_reason
        parsed = self.parse(text) if finish_reason == "stop" else None
        if parsed is None:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": None,
                 "tool_calls": [tool_call(tool_call_id(), *parsed)]}, "tool_calls")

    def parse(self, text: str) -> tuple[str, str] | None:
        """`(name, arguments JSON)` of the call in a finished output (not in the model's own
        format); None if it is not one."""
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


def read_request(body: dict, *, chat: bool, chat_tools: ChatTools = NO_TEMPLATE) -> Structured:
    """`body`'s constraint; `chat_tools` is what the model's chat template does with tools."""
    structured, tools = read_structured(body, chat=chat, chat_tools=chat_tools)
    if structured is None:
        return Structured()
    field = "tools" if tools is not None else next(
        name for name in ("response_format", *_VLLM_GUIDED, "structured_outputs")
        if body.get(name) is not None and (name != "response_format"
                                           or body[name].get("type") != "text"))
    return Structured(output=structured, field=field, tools=tools)


def read_structured(body: dict, *, chat: bool, chat_tools: ChatTools = NO_TEMPLATE
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
    tools = _tool_calls(body, chat=chat, chat_tools=chat_tools)
    if tools is not None:
        found.append(("tool_choice" if body.get("tool_choice") is not None else "tools",
                      tools.structured()))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise FieldError(found[1][0], f"{names} each constrain the output: send one")
    structured = found[0][1] if found else None
    if body.get("structured_bounds") is not None:
        structured = _bounded(structured, body["structured_bounds"], tools)
    return structured, tools


def _bounded(structured: StructuredOutput | None, bounds: dict,
             tools: ToolCalls | None) -> StructuredOutput:
    """The request's JSON constraint with `structured_bounds` (`batching/structured.py`)."""
    where = "structured_bounds"
    check_keys(where, bounds, BOUNDS)
    for name, value in bounds.items():
        try:
            check_bound(f"{where}.{name}", name, value)
        except ValueError as err:
            raise FieldError(f"{where}.{name}", str(err)) from None
    if structured is None:
        raise FieldError(where, "structured_bounds bounds a JSON constraint, and this request "
                                "asks for none: send it with response_format, guided_json, "
                                "structured_outputs or tools")
    if structured.kind not in JSON_KINDS:
        what = ("tool calls in the model's own format, a grammar" if tools is not None
                else f"a {structured.kind}")
        raise FieldError(where, f"structured_bounds bounds JSON, and this request's constraint "
                                f"is {what}: write the limits into it")
    return dataclasses.replace(structured, **{name: value for name, value in bounds.items()
                                              if value is not None})


def _response_format(value) -> StructuredOutput | None:
    """OpenAI's response_format: `{"type": "text"}`, `{"type": "json_object"}`, or
    `{"type": "json_schema", "json_schema": {...}}` (`_json_schema`); no other key."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError("response_format", "response_format must be an object with a type: "
                                            "text, json_object or json_schema")
    kind = value["type"]
    if kind not in RESPONSE_FORMAT_KEYS:
        raise FieldError("response_format.type", f"response_format.type must be text, "
                         f"json_object or json_schema, got {kind!r}")
    check_keys("response_format", value, RESPONSE_FORMAT_KEYS[kind],
               what=f"a {kind} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    return _json_schema(value.get("json_schema"))


def _json_schema(spec) -> StructuredOutput:
    """response_format.json_schema: `name` (required, spelled as a function name), `description`
    (checked; the model is never shown it: the constraint holds the output to the schema),
    `schema` (optional in OpenAI's API: without it the output is any JSON object, as with
    json_object) and `strict` (true, false or null: the schema is enforced either way)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise FieldError(where, f"{where} must be an object with a name (and a schema)")
    check_keys(where, spec, JSON_SCHEMA_KEYS)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(f"{where}.name", f"{where}.name is required, and must be 1 to 64 "
                                          "letters, digits, underscores or dashes")
    _optional(where, spec, "description", str, "a string")
    _optional(where, spec, "strict", bool, "true or false")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutput(json_object=True)
    return _constraint(f"{where}.schema", "json_schema", schema)


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
                         f"structured_outputs: unknown fields {unknown}", code="unknown_parameter")
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


def _tool_calls(body: dict, *, chat: bool, chat_tools: ChatTools) -> ToolCalls | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None and choice != "none":
            raise FieldError("tool_choice", "tool_choice needs tools")
        return None
    if not chat:
        raise FieldError("tools", "tools are served on /v1/chat/completions only")
    parsed = _tools(tools)
    own = chat_tools if chat_tools.format is not None else None
    is_parallel = body.get("parallel_tool_calls") is not False
    if choice is None or choice == "auto":
        if own is None:
            raise FieldError("tool_choice", chat_tools.refusal)
        return ToolCalls(tools=parsed, forced=None, own=own, is_auto=True,
                         is_parallel=is_parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolCalls(tools=parsed, forced=None, own=own, is_parallel=is_parallel)
    forced = _named_choice(choice, parsed)
    return ToolCalls(tools=parsed, forced=forced, own=own, is_parallel=is_parallel)


def _named_choice(choice, tools: tuple[Tool, ...]) -> Tool:
    """The tool a tool_choice object names: `{"type": "function", "function": {"name"}}`, no
    other key (OpenAI's allowed_tools and custom choices are not served)."""
    if not isinstance(choice, dict):
        raise FieldError("tool_choice", "tool_choice must be none, auto, required or "
                         '{"type": "function", "function": {"name": ...}}')
    if choice.get("type") != "function":
        raise FieldError("tool_choice.type", 'tool_choice.type must be "function" (allowed_tools '
                         f"and custom tools are not served), got {choice.get('type')!r}")
    check_keys("tool_choice", choice, TOOL_CHOICE_KEYS)
    function = choice.get("function")
    if not isinstance(function, dict):
        raise FieldError("tool_choice.function", 'tool_choice.function must be {"name": ...}')
    check_keys("tool_choice.function", function, TOOL_CHOICE_FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str):
        raise FieldError("tool_choice.function.name",
                         "tool_choice.function.name must be a tool's name")
    forced = next((tool for tool in tools if tool.name == name), None)
    if forced is None:
        raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not among the "
                         "tools")
    return forced


def _tools(tools) -> tuple[Tool, ...]:
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools", "tools must be a non-empty list of functions")
    parsed = tuple(_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools))
    if len({tool.name for tool in parsed}) != len(parsed):
        raise FieldError("tools", "tools: two functions have the same name")
    return parsed


def _tool(where: str, tool) -> Tool:
    """One of tools: `{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}`, no other key. `strict` may be true, false or null: a call is held to its
    parameters' schema either way."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or \
            not isinstance(function, dict):
        raise FieldError(where, f'{where} must be {{"type": "function", '
                                f'"function": {{"name", "parameters"}}}}')
    check_keys(where, tool, TOOL_KEYS)
    at = f"{where}.function"
    check_keys(at, function, FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(f"{at}.name", f"{at}.name must be 1 to 64 letters, digits, "
                                       "underscores or dashes")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise FieldError(f"{at}.parameters", f"{at}.parameters must be a JSON schema object")
    description = _optional(at, function, "description", str, "a string")
    _optional(at, function, "strict", bool, "true or false")
    return Tool(name=name, description=description or "",
                parameters=EMPTY_PARAMETERS if parameters is None else parameters)


def prompt_messages(messages: list[dict], calls: ToolCalls | None, chat_tools: ChatTools
                    ) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools` a chat request's template renders. With the model's own
    format, history tool calls go to the template as `tool_calls` (their arguments as JSON
    values, as templates expect) and the tools as its `tools`; otherwise tool calls are written
    as JSON text (`calls_as_text`) and the tools described in a system message."""
    if chat_tools.format is not None:
        tools = calls.template_tools() if calls is not None else None
        return [_with_argument_values(message) for message in messages], tools
    flat = [_as_text(message) for message in messages]
    if calls is not None:
        flat = [calls.system_message()] + flat
    return flat, None


def _with_argument_values(message: dict) -> dict:
    if "tool_calls" not in message:
        return message
    calls = [call | {"function": call["function"] | {"arguments": _arguments(call)}}
             for call in message["tool_calls"]]
    return message | {"tool_calls": calls}


def _as_text(message: dict) -> dict:
    """A message with only role, content (its tool calls written after it) and name."""
    content = message["content"]
    if "tool_calls" in message:
        content = (content + "\n" if content else "") + calls_as_text(message["tool_calls"])
    named = {"name": message["name"]} if "name" in message else {}
    return {"role": message["role"], "content": content} | named


def calls_as_text(calls: list) -> str:
    """An assistant turn's tool calls as a template without tools reads them: one JSON object
    `{"name", "arguments"}` a line, the form a "required" call is written in."""
    return "\n".join(json.dumps({"name": (c.get("function") or {}).get("name"),
                                 "arguments": _arguments(c)}, ensure_ascii=False) for c in calls)


def _arguments(call: dict):
    text = (call.get("function") or {}).get("arguments", "{}")
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


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
