"""The OpenAI request model: `parse_request` reads a whole request body into an `OpenAIRequest`,
checking every field against the field table (`meshserve.serving.openai_api.fields`).

`parse_request(body, endpoint)` checks every field of the body and returns an `OpenAIRequest`, or
raises `RequestError` naming the first field that cannot be served. The checks that need the
engine (the prompt's tokens, the context length, the engine's own limits) follow in the engine's
admission check (`meshserve.serving.engine.admission`), which the HTTP app calls before anything
is submitted: only a request that passed both ever runs.

This module knows nothing of HTTP, the engine or the engine loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

from meshserve.batching.structured import StructuredOutput
from meshserve.serving.openai_api.checks import ENDPOINTS, RequestError
from meshserve.serving.openai_api.fields import (CHAT, FIELDS_BY_NAME, SAMPLING, STRUCTURED_FIELDS,
                                                 Field)

MAX_JSON_DEPTH = 64  # deeper request bodies are refused; OpenAI's own requests nest about 10 deep
SAMPLING_FIELDS = {f.sampling: f.name for f in SAMPLING}  # SamplingParams field -> request field


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenAIRequest:
    """A request body that passed every field's check. `sampling` holds the `SamplingParams`
    fields it sets, except max_tokens (the engine settles chat's default) and `logprobs`. A
    Responses API request is read as the chat request of its conversation
    (`meshserve.serving.openai_api.responses`): `paths` names its fields where chat's differ,
    and `echoed` holds the settings its response repeats."""

    endpoint: str  # completions, chat or responses
    model: str | None = None
    prompt_kind: str  # text, token_ids or chat
    prompt: Any
    prompt_field: str
    sampling: dict[str, Any]
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    logprobs: int | None = None  # top alternatives per output token; None: no logprobs
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    priority: int = 0  # vLLM's: lower first
    request_id: str | None = None
    structured_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    paths: tuple[tuple[str, str], ...] = ()  # (a pattern of chat's field paths, this request's)
    echoed: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        """Messages through the chat template (chat, and the Responses API)."""
        return self.prompt_kind == "chat"

    @property
    def logprobs_field(self) -> str:
        return "logprobs" if self.endpoint == "completions" else "top_logprobs"

    def own_names(self, text: str) -> str:
        """`text`, a field's path or a message naming one, with chat's field paths as this
        request names them (`paths`)."""
        for chat, own in self.paths:
            text = re.sub(chat, own, text)
        return text

    def sampling_values(self, structured: StructuredOutput | None = None) -> dict[str, Any]:
        """The `SamplingParams` fields this request sets, for the engine's admission check.
        max_tokens left out is OpenAI's 16 for completions, and absent for chat, where the
        admission check gives it the rest of the context."""
        values = dict(self.sampling, logprobs=self.logprobs, structured=structured)
        if self.max_tokens is not None or self.endpoint == "completions":
            values["max_tokens"] = 16 if self.max_tokens is None else self.max_tokens
        return values

    def field_of(self, param: str | None) -> str | None:
        """The request field that sets the engine's `param` (a `SamplingParams` field, or
        `prompt`); None for one no field of this request sets."""
        if param == "prompt":
            return self.prompt_field
        if param == "max_tokens":
            return self.max_tokens_field
        if param == "logprobs":
            return self.logprobs_field
        return SAMPLING_FIELDS.get(param)


def decode_body(raw: bytes) -> dict:
    """The JSON object of a request body; RequestError if it is not one, or nests deeper than
    MAX_JSON_DEPTH (however deep: the parser's own recursion limit is caught too)."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestError(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(None, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    if _depth(body) > MAX_JSON_DEPTH:
        raise RequestError(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1)
                        for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_request(body: dict, endpoint: str) -> OpenAIRequest:
    """Checks every field of `body` for `endpoint` ("completions" or "chat"); raises
    RequestError at the first one that cannot be served."""
    assert endpoint in ENDPOINTS, endpoint
    return _build(checked_values(body, lambda name: _known(name, endpoint), endpoint), endpoint)


def checked_values(body: dict, row_of: Callable[[str], Field], endpoint: str) -> dict[str, Any]:
    """The values of `body`'s fields, each checked by its row (`row_of(name)`, which refuses a
    field the endpoint does not take): null is left out, and so is a refused field's neutral
    value; any other value of a refused field is a RequestError naming it."""
    values = {}
    for name, value in body.items():
        field = row_of(name)
        if value is None:
            continue
        if field.verdict == "refused":
            _refuse_unless_neutral(field, value)
        else:
            values[name] = field.check(name, value, endpoint)
    return values


def _known(name: str, endpoint: str) -> Field:
    """The row of a field `endpoint` takes; RequestError for any other."""
    field = FIELDS_BY_NAME.get(name)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if field is None:
        raise RequestError(name, f"{name} is not a field of OpenAI's or vLLM's {path} request; "
                                 "the fields served are listed in docs/server.md",
                           code="unknown_parameter")
    if endpoint not in field.endpoints:
        other = "/v1/chat/completions" if field.endpoints == CHAT else "/v1/completions"
        raise RequestError(name, f"{name} is a field of {other}, not of {path}",
                           code="unknown_parameter")
    return field


def _refuse_unless_neutral(field: Field, value: Any) -> None:
    if any(_is_same(value, neutral) for neutral in field.neutral):
        return
    if field.neutral:
        allowed = " or ".join(json.dumps(v) for v in field.neutral)
        message = f"{field.name} must be {allowed} or left out: {field.note}"
    else:
        message = f"{field.name} is not supported: {field.note}; leave it out"
    raise RequestError(field.name, message, code="unsupported_parameter")


def _is_same(value: Any, neutral: Any) -> bool:
    """JSON equality, where 1 and 1.0 are the same number and true is not 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return math.isclose(value, neutral)
    return type(value) is type(neutral) and value == neutral


def _build(values: dict[str, Any], endpoint: str) -> OpenAIRequest:
    stream = values.get("stream", False)
    options = values.get("stream_options")
    if options is not None and not stream:
        raise RequestError("stream_options", "stream_options needs stream: true")
    if (options or {}).get("continuous_usage_stats") and not options.get("include_usage"):
        raise RequestError("stream_options.continuous_usage_stats", "stream_options."
                           "continuous_usage_stats needs stream_options.include_usage: true")
    if values.get("prompt_logprobs") is not None and stream:
        raise RequestError("prompt_logprobs", "prompt_logprobs are not streamed: drop stream or "
                                              "prompt_logprobs")
    sampling = {f.sampling: values[f.name] for f in SAMPLING if f.name in values}
    max_field, max_tokens = _max_tokens(values)
    options = options or {}
    return OpenAIRequest(
        endpoint=endpoint, model=values.get("model"), **_prompt_of(values, endpoint),
        sampling=sampling, max_tokens=max_tokens, max_tokens_field=max_field,
        logprobs=_top_logprobs(values, endpoint), stream=stream,
        include_usage=options.get("include_usage", False),
        continuous_usage=options.get("continuous_usage_stats", False),
        return_token_ids=values.get("return_token_ids", False),
        tokens_as_ids=values.get("return_tokens_as_token_ids", False),
        priority=values.get("priority", 0), request_id=values.get("request_id"),
        structured_fields={name: values[name] for name in STRUCTURED_FIELDS if name in values})


def _prompt_of(values: dict[str, Any], endpoint: str) -> dict[str, Any]:
    if endpoint == "chat":
        if "messages" not in values:
            raise RequestError("messages", "messages is required: a list of {role, content}")
        return dict(prompt_kind="chat", prompt=values["messages"], prompt_field="messages")
    if "prompt" not in values:
        raise RequestError("prompt", "prompt is required: a string or a list of token ids")
    kind, prompt = values["prompt"]
    return dict(prompt_kind=kind, prompt=prompt, prompt_field="prompt")


def _max_tokens(values: dict[str, Any]) -> tuple[str, int | None]:
    given = [(name, values[name]) for name in ("max_completion_tokens", "max_tokens")
             if name in values]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise RequestError("max_tokens", "max_tokens and max_completion_tokens differ; give one")
    return given[0] if given else ("max_tokens", None)


def _top_logprobs(values: dict[str, Any], endpoint: str) -> int | None:
    if endpoint == "completions":
        return values.get("logprobs")
    top = values.get("top_logprobs")
    if not values.get("logprobs", False):
        if top is not None:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0
