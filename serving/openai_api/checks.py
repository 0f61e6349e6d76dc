"""The checks of single request field values, and `RequestError`, which every check of an OpenAI
request raises: the field at fault (`param`), the message, and OpenAI's error code.

Each check takes (field name, value, endpoint) and returns the value to use, or raises
RequestError naming the field; `meshserve.serving.openai_api.fields` gives each field its check.
"""

from __future__ import annotations

import json
from typing import Any, Callable

ENDPOINTS = ("completions", "chat")  # the endpoints of the field table (`fields.FIELDS`)
RESPONSES = ("responses",)  # the Responses API, with a table of its own (`responses.FIELDS`)
BACKENDS = ("auto", "llguidance", "guidance")


class RequestError(Exception):
    """A request that cannot be served: `param` names the field, `code` is OpenAI's error code
    (invalid_value, unsupported_parameter, unknown_parameter)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


Check = Callable[[str, Any, str], Any]  # (field name, value, endpoint) -> the checked value

TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              dict: "an object", list: "a list"}


def shown(value: Any) -> str:
    return json.dumps(value)[:60]


def typed(kind: type) -> Check:
    def check(name: str, value: Any, endpoint: str) -> Any:
        if not is_kind(value, kind):
            raise RequestError(name, f"{name} must be {TYPE_NAMES[kind]}, got {shown(value)}")
        return float(value) if kind is float else value

    return check


def is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def token_ids(name: str, value: Any, endpoint: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_kind(t, int) for t in value):
        raise RequestError(name, f"{name} must be a list of token ids (integers), got "
                                 f"{shown(value)}")
    return tuple(value)


def stop_strings(name: str, value: Any, endpoint: str) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise RequestError(name, f"stop must be a string or a list of strings, got "
                                 f"{shown(value)}")
    return tuple(strings)


def logprobs(name: str, value: Any, endpoint: str) -> int | bool:
    """Completions: how many top alternatives per token; chat: whether to return logprobs."""
    return typed(bool if endpoint == "chat" else int)(name, value, endpoint)


def prompt(name: str, value: Any, endpoint: str) -> tuple[str, str | list[int]]:
    """(kind, prompt): one text or one list of token ids; a batch of one is taken as its prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return "text", value
    if isinstance(value, list) and all(is_kind(t, int) for t in value):
        return "token_ids", value
    if isinstance(value, list):
        raise RequestError(name, "prompt must be one string or one list of token ids; a batch of "
                                 "prompts is not served: send one request per prompt")
    raise RequestError(name, f"prompt must be a string or a list of token ids, got "
                             f"{shown(value)}")


STREAM_OPTIONS = {"include_usage": "OpenAI", "continuous_usage_stats": "vLLM",
                  "include_obfuscation": "OpenAI"}


def stream_options(name: str, value: Any, endpoint: str) -> dict[str, bool]:
    typed(dict)(name, value, endpoint)
    for key, option in value.items():
        where = f"{name}.{key}"
        if key not in STREAM_OPTIONS:
            raise RequestError(where, f"{where} is not a stream option; the options are "
                                      f"{', '.join(STREAM_OPTIONS)}", code="unknown_parameter")
        if option is not None:
            typed(bool)(where, option, endpoint)
    if value.get("include_obfuscation"):
        raise RequestError(f"{name}.include_obfuscation", "stream_options.include_obfuscation: "
                           "no obfuscation field is sent; set it false or leave it out",
                           code="unsupported_value")
    return {key: bool(option) for key, option in value.items()}


def json_value(kinds: tuple[type, ...]) -> Check:
    """A JSON value of one of `kinds`; its content is read by `structured`."""
    def check(name: str, value: Any, endpoint: str) -> Any:
        if not any(is_kind(value, kind) for kind in kinds):
            wanted = " or ".join(TYPE_NAMES[kind] for kind in kinds)
            raise RequestError(name, f"{name} must be {wanted}, got {shown(value)}")
        return value

    return check


def backend(name: str, value: Any, endpoint: str) -> str:
    if value not in BACKENDS:
        raise RequestError(name, f"{name}: this server constrains with llguidance; send one of "
                                 f"{', '.join(BACKENDS)} or leave it out")
    return value
