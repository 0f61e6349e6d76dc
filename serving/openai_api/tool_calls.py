"""The model's own tool-call format: which one a chat template teaches, the grammar that keeps
its calls well formed, and the parser that reads them out of the output, whole or streamed.

A chat template that declares tools (`Tokenizer.renders_tools`) is shown the request's tools and
tells the model how to write a call. `FORMATS` is the table of the ways meshserve reads, each
known by its markers in the template:

    hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, as many as the
                 model writes, with text around them (Qwen2.5, Qwen3, Hermes 2 Pro and 3,
                 SmolLM3, ...)
    llama3-json  the whole answer is one {"name": ..., "parameters": {...}}, perhaps after the
                 special token <|python_tag|>; else it is text (Llama 3.1, 3.2 and 3.3)

`chat_tools(tokenizer)` finds a model's format once, or says why there is none: no chat
template, a template that declares no tools, a format not in the table (named when `UNPARSED`
knows it), or a marker the output text leaves out (a special token).

The grammar (`ChatTools.grammar`) leaves text free and constrains each call from its start on: the
JSON names one of the tools, and its arguments follow that tool's parameter schema, written compact
as every JSON constraint is (`meshserve.serving.engine.grammar`). tool_choice decides whether text
may stand alone, parallel_tool_calls whether more than one call may follow. llguidance counts every
added token as special, where the output text keeps the non-special ones (Qwen's `<tool_call>` and
`<think>`): so the grammar accepts a marker both as its token and as text, and lets text hold the
model's other non-special added tokens by id.

`CallParser` reads an output piece by piece and returns what to send: content up to a call's
start (a marker split across pieces is held back, and so is the whitespace before it), then the
call's id and name once its head `{"name": "...", "arguments": ` is read, then its arguments as
they arrive, holding back what may be the wrapper's closing brace and the end marker. Whitespace
between content and a call is dropped. A block that is not a call stays content, markers and
all; a call cut off (max_tokens) keeps the arguments it got. `read_whole` runs the same parser
over a whole output, so a streamed answer and a whole one always agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Sequence

from meshserve.serving.engine.grammar import JSON_OPTIONS
from meshserve.serving.engine.json_schemas import bounded_numbers


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """A way of writing tool calls, each a JSON object `{"name", <arguments_key>}`. Tagged
    (`start` set): each call is `start`, `pad`, the object, `pad`, `end`, anywhere in the text.
    Bare: the whole output is one call, after an optional `lead` token, or it is text."""

    name: str
    markers: tuple[str, ...]  # all are in a template that teaches this format
    models: str  # that write it, for the docs and refusals
    start: str = ""
    end: str = ""
    pad: str = ""
    arguments_key: str = "arguments"
    lead: str = ""  # a special token that may open a bare call (the text leaves it out)

    def is_taught_by(self, template: str) -> bool:
        return all(marker in template for marker in self.markers)

    def head(self) -> re.Pattern:
        """A call's head, up to its arguments; it matches once the arguments have begun."""
        return re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"'
                          + self.arguments_key + r'"\s*:\s*(?=\S)')


FORMATS = (
    ToolCallFormat(name="hermes", markers=("<tool_call>", "</tool_call>"),
                   models="Qwen2.5, Qwen3, Hermes 2 Pro and 3, SmolLM3", start="<tool_call>",
                   end="</tool_call>", pad="\n"),
    ToolCallFormat(name="llama3-json", markers=("<|python_tag|>", '"parameters": '),
                   models="Llama 3.1, 3.2 and 3.3", arguments_key="parameters",
                   lead="<|python_tag|>"),
)
# Formats known by a marker in the template, but not read: a template with one of these is
# refused tool_choice auto naming it.
UNPARSED = {"[TOOL_CALLS]": "Mistral's [TOOL_CALLS]", "<|tool_call|>": "Granite's <|tool_call|>",
            "<｜tool▁calls▁begin｜>": "DeepSeek's <｜tool▁calls▁begin｜>"}
_AUTO = "tool_choice 'auto' (the default with tools)"
_INSTEAD = ("send tool_choice 'required' or a named function, which constrain the output to a "
            "call")
_TEXT = r"TEXT: /(.|\n)*/"
_BARE_TEXT = r"TEXT: /\s*([^\s{](.|\n)*)?/"  # text that does not open a bare call


@dataclasses.dataclass(frozen=True)
class ChatTools:
    """What a model's chat template does with tools: its tool-call `format` and the ids of its
    markers that are one token each, or (`format` None) the `refusal` of tool_choice auto."""

    format: ToolCallFormat | None = None
    marker_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    text_token_ids: tuple[int, ...] = ()  # added tokens, not special, that text may hold
    refusal: str = ""

    def grammar(self, tools: Sequence[tuple[str, dict]], *, is_required: bool,
                is_parallel: bool) -> str:
        """The Lark grammar of an output with calls of `tools` (name, parameters): with
        `is_required` at least one call, with `is_parallel` any number (a tagged format), else
        at most one."""
        fmt = self.format
        assert fmt is not None
        calls = {"anyOf": [_call_schema(name, parameters, fmt.arguments_key, name_first)
                           for name, parameters in tools for name_first in (True, False)],
                 "x-guidance": JSON_OPTIONS}
        body = f"%json {json.dumps(calls, ensure_ascii=False)}"
        if not fmt.start:
            lead = self._token(fmt.lead)
            return "\n".join(["%llguidance {}", "start: call" if is_required else
                              "start: TEXT | call", f"call: {lead + '? ' if lead else ''}{body}",
                              _BARE_TEXT])
        start = {(False, True): "call* free", (False, False): "call | free",
                 (True, True): "call+ free", (True, False): "call"}[is_required, is_parallel]
        pad = json.dumps(fmt.pad)
        words = f"(TEXT {_ids(self.text_token_ids)})* " if self.text_token_ids else ""
        start_token, end_token = self._token(fmt.start), self._token(fmt.end)
        return "\n".join([
            "%llguidance {}",
            f"start: {start}",
            f"call: open {pad} {body} {pad} close",
            f"open: {words}open_text" + (f" | free {start_token}" if start_token else ""),
            f"open_text[lazy]: TEXT {json.dumps(fmt.start)}",
            f"close: {json.dumps(fmt.end)}" + (f" | {end_token}" if end_token else ""),
            f"free: {words}TEXT",
            _TEXT,
        ])

    def _token(self, marker: str) -> str:
        """The marker's token as the grammar names it; "" when it is not one token."""
        token = self.marker_ids.get(marker)
        return "" if token is None else _ids([token])


def _call_schema(name: str, parameters: dict, arguments_key: str, name_first: bool) -> dict:
    """One call of `name`, its keys in either order (Qwen writes the name first, Hermes 2 Pro
    the arguments)."""
    properties = {"name": {"const": name}, arguments_key: bounded_numbers(parameters)}
    if not name_first:
        properties = dict(reversed(properties.items()))
    return {"type": "object", "properties": properties, "required": ["name", arguments_key],
            "additionalProperties": False}


def _ids(ids: Sequence[int]) -> str:
    """Token ids as an llguidance grammar names them: `<[5,9-12]>`."""
    ranges: list[list[int]] = []
    for token in sorted(ids):
        if ranges and token == ranges[-1][1] + 1:
            ranges[-1][1] = token
        else:
            ranges.append([token, token])
    return "<[" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) + "]>"


def chat_tools(tokenizer) -> ChatTools:
    """The tool-call format of the model whose tokenizer this is (None: no tokenizer)."""
    if tokenizer is None or not tokenizer.chat_template:
        return ChatTools(refusal=f"{_AUTO} needs a chat template that declares tools, and this "
                                 f"model has no chat template: {_INSTEAD}")
    if not tokenizer.renders_tools:
        return ChatTools(refusal=f"{_AUTO} needs a chat template that declares tools, and this "
                                 f"model's does not: {_INSTEAD}")
    template = tokenizer.chat_template
    fmt = next((f for f in FORMATS if f.is_taught_by(template)), None)
    if fmt is None:
        known = next((name for marker, name in UNPARSED.items() if marker in template),
                     "a format")
        read = ", ".join(f.name for f in FORMATS)
        return ChatTools(refusal=f"{_AUTO} needs the model's own tool-call format: this model's "
                                 f"chat template declares tools, but teaches {known}, which "
                                 f"meshserve does not read (it reads {read}): {_INSTEAD}")
    ids = {marker: tokenizer.token_to_id(marker) for marker in (fmt.start, fmt.end, fmt.lead)
           if marker and tokenizer.token_to_id(marker) is not None}
    for marker in (fmt.start, fmt.end):
        if marker in ids and tokenizer.decode([ids[marker]]) != marker:
            return ChatTools(refusal=f"{_AUTO} needs the model's own tool-call format, and this "
                                     f"model's marker {marker} is a special token, which its "
                                     f"output text leaves out: {_INSTEAD}")
    added = json.loads(tokenizer.to_json()).get("added_tokens", [])
    text_ids = tuple(token["id"] for token in added if not token.get("special")
                     and token["content"] not in (fmt.start, fmt.end))
    return ChatTools(format=fmt, marker_ids=ids, text_token_ids=text_ids)


# -- reading calls ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Call:
    id: str
    index: int
    name: str
    arguments: str = ""  # as sent so far
    is_complete: bool = False

    def as_message(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class CallParser:
    """One output's content and tool calls, as its text arrives (see the module docstring).
    `add` and `finish` return `(content, deltas)`: the content to send, and OpenAI's tool-call
    deltas."""

    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self.buffer = ""  # text not yet sent: outside a call, or the open call's body
        self.is_in_call = False
        self.call: Call | None = None  # the open call, once its head is read
        self.num_head_chars = 0  # of the buffer, the open call's head
        self.is_after_call = False  # whitespace here is dropped
        self.gap = ""  # the whitespace dropped before the open call, should it not be one
        self.is_text = False  # a bare format's output that is not a call
        self.head = fmt.head()
        self.calls: list[Call] = []

    @property
    def is_complete(self) -> bool:
        """Calls were made, and none was cut off."""
        return bool(self.calls) and all(call.is_complete for call in self.calls)

    def read_whole(self, text: str) -> str | None:
        """A finished output's content (None when it is only calls), as streaming gives it;
        its calls are then `calls`."""
        content = self.add(text)[0] + self.finish()[0]
        return content if content or not self.calls else None

    def add(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[dict] = []
        while self._in_call(content, deltas) if self.is_in_call else self._in_text(content):
            pass
        return "".join(content), _merged(deltas)

    def finish(self) -> tuple[str, list[dict]]:
        """What is held back, at the end of the output."""
        content: list[str] = []
        deltas: list[dict] = []
        if self.is_in_call:
            self._close(self.buffer, "", content, deltas)
        elif not self.is_after_call:
            content.append(self.buffer)
        self.buffer = ""
        return "".join(content), _merged(deltas)

    def _in_text(self, content: list[str]) -> bool:
        if not self.format.start:
            return self._at_bare_start(content)
        if self.is_after_call:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.is_after_call = False
        start = self.format.start
        at = self.buffer.find(start)
        if at >= 0:
            before = self.buffer[:at].rstrip()
            content.append(before)
            self.gap = self.buffer[len(before):at]
            self.buffer = self.buffer[at + len(start):]
            self.is_in_call = True
            return True
        sent = len(self.buffer) - _num_partial(self.buffer, start)
        sent = len(self.buffer[:sent].rstrip())
        content.append(self.buffer[:sent])
        self.buffer = self.buffer[sent:]
        return False

    def _at_bare_start(self, content: list[str]) -> bool:
        """A bare format's output is a call if it opens with `{`, else text, all of it."""
        if self.is_text:
            content.append(self.buffer)
            self.buffer = ""
            return False
        body = self.buffer.lstrip()
        if not body:
            return False
        if body.startswith("{"):
            self.gap, self.buffer = self.buffer[:-len(body)], body
            self.is_in_call = True
        else:
            self.is_text = True
        return True

    def _in_call(self, content: list[str], deltas: list[dict]) -> bool:
        end = self.format.end
        at = self.buffer.find(end) if end else -1
        if at >= 0:
            body, self.buffer = self.buffer[:at], self.buffer[at + len(end):]
            self.is_after_call = self._close(body, end, content, deltas)
            return True
        if self.call is None:
            self._read_head(deltas)
        if self.call is not None:
            self._send_arguments(self.buffer[self.num_head_chars:self._arguments_end()], deltas)
        return False

    def _read_head(self, deltas: list[dict]) -> None:
        match = self.head.match(self.buffer)
        if match is not None:
            self.num_head_chars = match.end()
            self._open(match.group(1), deltas)

    def _open(self, name: str, deltas: list[dict]) -> None:
        self.call = Call(id=tool_call_id(), index=len(self.calls), name=name)
        self.calls.append(self.call)
        deltas.append({"index": self.call.index, "id": self.call.id, "type": "function",
                       "function": {"name": name, "arguments": ""}})

    def _arguments_end(self) -> int:
        """Where the open call's arguments may end so far: before a partial end marker, the
        whitespace before it and one closing brace (each may be the wrapper's)."""
        text = self.buffer[:len(self.buffer) - _num_partial(self.buffer, self.format.end)]
        text = text.rstrip()
        if text.endswith("}"):
            text = text[:-1].rstrip()
        return len(text)

    def _send_arguments(self, arguments: str, deltas: list[dict]) -> None:
        """Sends what `arguments` (the open call's, as far as known) adds to what was sent."""
        call = self.call
        if len(arguments) <= len(call.arguments) or not arguments.startswith(call.arguments):
            return
        piece = arguments[len(call.arguments):]
        call.arguments = arguments
        deltas.append({"index": call.index, "function": {"arguments": piece}})

    def _close(self, body: str, end: str, content: list[str], deltas: list[dict]) -> bool:
        """The open block's whole `body` is known (`end`: its end marker, or "" at the end of
        the output); False if it was not a call."""
        parsed = _parse_call(body, self.format, self.head)
        is_call = parsed is not None or self.call is not None
        if parsed is not None:
            if self.call is None:
                self._open(parsed[0], deltas)
            if parsed[0] == self.call.name:
                self._send_arguments(parsed[1], deltas)
                self.call.is_complete = self.call.arguments == parsed[1]
        elif self.call is None:
            content.append(self.gap + self.format.start + body + end)
        elif not end:  # cut off: the call keeps what it got
            self._send_arguments(body[self.num_head_chars:], deltas)
        self.is_in_call, self.call, self.gap = False, None, ""
        return is_call


def _merged(deltas: list[dict]) -> list[dict]:
    """One delta per call: a call's arguments joined onto its head or earlier piece."""
    merged: list[dict] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"]:
            function = merged[-1]["function"]
            function["arguments"] += delta["function"]["arguments"]
        else:
            merged.append(delta)
    return merged


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str, fmt: ToolCallFormat, head: re.Pattern) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a call's body; None if it is not a call. The arguments keep
    the model's text where the body starts with the name (as streamed)."""
    text = body.strip()
    match = head.match(text)
    if match is not None and text.endswith("}"):
        arguments = text[match.end():-1].rstrip()
        if _is_json(arguments):
            return match.group(1), arguments
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", fmt.arguments_key} or \
            not isinstance(value["name"], str):
        return None
    return value["name"], json.dumps(value[fmt.arguments_key], ensure_ascii=False)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _num_partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
