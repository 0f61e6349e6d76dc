"""The OpenAI request model: every field of OpenAI's chat and completions requests and of vLLM's
extras, its verdict, and the function that reads a whole request body into an `OpenAIRequest`.

`FIELDS` is the one table. A row names a field, where it comes from (OpenAI or vLLM), the
endpoints that take it and its verdict:

    honoured  the field does what OpenAI (or vLLM) documents;
    accepted  the field is checked, and changes nothing a client gets back here (an end-user id,
              a prompt-cache hint: prefix caching is automatic and never changes an output);
    refused   a value other than a neutral one (one that changes nothing, such as the default)
              is a 400 naming the field, with the row's reason.

A field in no row, or one sent to an endpoint its row does not list, is refused too: a client
never gets a 200 for something that was not done. `docs/server.md` prints this table
(`markdown_table()`, or `python -m meshserve.serving.openai_request`); a test keeps the two
equal. Making a refused field honoured is a change of its row (its verdict and check) and of
`_build`, which puts the value into the `OpenAIRequest` (`_BUILT` lists what it reads).

`parse_request(body, endpoint)` checks every field of the body and returns an `OpenAIRequest`, or
raises `RequestError` naming the first field that cannot be served. The checks that need the
engine (the prompt's tokens, the context length, the engine's own limits) follow in
`meshserve.serving.http_api`, still before anything is submitted: only a request that passed
both ever runs.

This module knows nothing of HTTP, the engine or the engine loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import StructuredOutput

ENDPOINTS = ("completions", "chat")
VERDICTS = ("honoured", "accepted", "refused")
MAX_JSON_DEPTH = 64  # deeper request bodies are refused; OpenAI's own requests nest about 10 deep


class RequestError(Exception):
    """A request that cannot be served: `param` names the field, `code` is OpenAI's error code
    (invalid_value, unsupported_parameter, unknown_parameter)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


# -- the table -------------------------------------------------------------------------------------

Check = Callable[[str, Any, str], Any]  # (field name, value, endpoint) -> the checked value


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field. `check` (honoured and accepted rows) raises RequestError for a value of
    the wrong kind and returns the value to use; `sampling` names the `SamplingParams` field it
    sets, if any; `neutral` (refused rows) are the values that change nothing, and pass."""

    name: str
    origin: str
    endpoints: tuple[str, ...]
    verdict: str
    note: str
    check: Check | None = None
    sampling: str | None = None
    neutral: tuple = ()

    def __post_init__(self):
        assert self.verdict in VERDICTS, self.verdict
        assert (self.check is None) == (self.verdict == "refused"), self.name
        assert set(self.endpoints) <= set(ENDPOINTS), self.endpoints


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "an object", list: "a list"}


def _shown(value: Any) -> str:
    return json.dumps(value)[:60]


def _typed(kind: type) -> Check:
    def check(name: str, value: Any, endpoint: str) -> Any:
        if not _is_kind(value, kind):
            raise RequestError(name, f"{name} must be {_TYPE_NAMES[kind]}, got {_shown(value)}")
        return float(value) if kind is float else value

    return check


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _token_ids(name: str, value: Any, endpoint: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_kind(t, int) for t in value):
        raise RequestError(name, f"{name} must be a list of token ids (integers), got "
                                 f"{_shown(value)}")
    return tuple(value)


def _stop(name: str, value: Any, endpoint: str) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise RequestError(name, f"stop must be a string or a list of strings, got "
                                 f"{_shown(value)}")
    return tuple(strings)


def _logprobs(name: str, value: Any, endpoint: str) -> int | bool:
    """Completions: how many top alternatives per token; chat: whether to return logprobs."""
    return _typed(bool if endpoint == "chat" else int)(name, value, endpoint)


def _prompt(name: str, value: Any, endpoint: str) -> tuple[str, str | list[int]]:
    """(kind, prompt): one text or one list of token ids; a batch of one is taken as its prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return "text", value
    if isinstance(value, list) and all(_is_kind(t, int) for t in value):
        return "token_ids", value
    if isinstance(value, list):
        raise RequestError(name, "prompt must be one string or one list of token ids; a batch of "
                                 "prompts is not served: send one request per prompt")
    raise RequestError(name, f"prompt must be a string or a list of token ids, got "
                             f"{_shown(value)}")


def read_messages(messages: Any) -> list[dict]:
    """Chat messages read as the chat endpoint reads them; ValueError naming the message and key
    at fault (the Python API's `LLM.chat`)."""
    try:
        return _messages("messages", messages, "chat")
    except RequestError as err:
        raise ValueError(err.message) from None


def _messages(name: str, value: Any, endpoint: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError(name, "messages must be a non-empty list of {role, content}")
    return [_message(f"{name}[{i}]", message) for i, message in enumerate(value)]


# Message keys other than role, content and name: OpenAI clients send them back as null with an
# assistant message; any other value would change the conversation, and is refused.
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "function_call", "refusal", "audio",
                   "annotations", "reasoning_content")
MAX_NAME_CHARS = 64  # a participant's name, as OpenAI bounds function names


def _message(where: str, message: Any) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(where, f"{where} must be an object with a role (a string)")
    for key, value in message.items():
        if key in ("role", "content", "name") or value in (None, [], "") or \
                _is_tool_key(message, key):
            continue
        why = ("only role, content and name are served" if key in _MESSAGE_EXTRAS
               else "not a chat message field")
        raise RequestError(f"{where}.{key}", f"{where}.{key}: {why}; leave it out",
                           code="unsupported_parameter")
    if message["role"] == "assistant" and message.get("tool_calls"):
        read = _tool_calls_message(f"{where}.tool_calls", message)
    else:
        read = {"role": message["role"], "content": _content(f"{where}.content",
                                                             message.get("content"))}
    if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
        read["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        read["name"] = _name(f"{where}.name", message["name"])
    return read


def _name(where: str, name: Any) -> str:
    """A participant's name: the chat template gets it as the message's `name`."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise RequestError(where, f"{where} must be a string of 1 to {MAX_NAME_CHARS} "
                                  f"characters, got {_shown(name)}")
    return name


def _is_tool_key(message: dict, key: str) -> bool:
    """A tool call's traces in the history: an assistant's `tool_calls`, a tool's
    `tool_call_id` (the result is the tool message's content)."""
    return ((key == "tool_calls" and message["role"] == "assistant")
            or (key == "tool_call_id" and message["role"] == "tool"))


def _tool_calls_message(where: str, message: dict) -> dict:
    """An assistant turn that called tools: its content (possibly empty) and its calls, which
    `openai_structured.prompt_messages` hands to the chat template as the model reads them."""
    calls = message["tool_calls"]
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        raise RequestError(where, f"{where} must be a list of "
                                  '{"type": "function", "function": {"name", "arguments"}}')
    content = message.get("content")
    text = "" if content is None else _content(where.replace("tool_calls", "content"), content)
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": c.get("id"), "type": "function",
         "function": {"name": c["function"]["name"],
                      "arguments": c["function"].get("arguments", "{}")}} for c in calls]}


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where} must be a string or a list of text parts, got "
                                  f"{_shown(content)}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(f"{where}[{j}]", f"{where}[{j}]: only text parts "
                               f'({{"type": "text", "text": ...}}) are served, got type '
                               f"{_shown(kind)}", code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


_STREAM_OPTIONS = {"include_usage": "OpenAI", "continuous_usage_stats": "vLLM",
                   "include_obfuscation": "OpenAI"}


def _stream_options(name: str, value: Any, endpoint: str) -> dict[str, bool]:
    _typed(dict)(name, value, endpoint)
    for key, option in value.items():
        where = f"{name}.{key}"
        if key not in _STREAM_OPTIONS:
            raise RequestError(where, f"{where} is not a stream option; the options are "
                                      f"{', '.join(_STREAM_OPTIONS)}", code="unknown_parameter")
        if option is not None:
            _typed(bool)(where, option, endpoint)
    if value.get("include_obfuscation"):
        raise RequestError(f"{name}.include_obfuscation", "stream_options.include_obfuscation: "
                           "no obfuscation field is sent; set it false or leave it out",
                           code="unsupported_value")
    return {key: bool(option) for key, option in value.items()}


def honoured(name: str, note: str, check: Check, *, origin: str = "OpenAI",
             endpoints: tuple[str, ...] = ENDPOINTS, sampling: str | None = None) -> Field:
    return Field(name, origin, endpoints, "honoured", note, check, sampling)


def accepted(name: str, note: str, kind: type, *, origin: str = "OpenAI",
             endpoints: tuple[str, ...] = ENDPOINTS) -> Field:
    return Field(name, origin, endpoints, "accepted", note, _typed(kind))


def refused(name: str, note: str, *, neutral: tuple = (), origin: str = "OpenAI",
            endpoints: tuple[str, ...] = ENDPOINTS) -> Field:
    return Field(name, origin, endpoints, "refused", note, neutral=neutral)


CHAT, COMPLETIONS = ("chat",), ("completions",)
_STRUCTURED = "the output is constrained to it (structured output; one such field per request)"
_OLD_FUNCTIONS = "the old function calling: send tools and tool_choice"
_BACKENDS = ("auto", "llguidance", "guidance")


def _json_value(kinds: tuple[type, ...]) -> Check:
    """A JSON value of one of `kinds`; its content is read by `openai_structured`."""
    def check(name: str, value: Any, endpoint: str) -> Any:
        if not any(_is_kind(value, kind) for kind in kinds):
            wanted = " or ".join(_TYPE_NAMES[kind] for kind in kinds)
            raise RequestError(name, f"{name} must be {wanted}, got {_shown(value)}")
        return value

    return check


def _backend(name: str, value: Any, endpoint: str) -> str:
    if value not in _BACKENDS:
        raise RequestError(name, f"{name}: this server constrains with llguidance; send one of "
                                 f"{', '.join(_BACKENDS)} or leave it out")
    return value
_CACHE = "prefix caching is automatic and never changes an output"

FIELDS: tuple[Field, ...] = (
    # -- OpenAI ---------------------------------------------------------------------------------
    honoured("model", "one of the served names (`GET /v1/models`); may be left out",
             _typed(str)),
    honoured("prompt", "one text, or one list of token ids (a list of one of either too)",
             _prompt, endpoints=COMPLETIONS),
    honoured("messages", "role and content (a string, or text parts), through the model's chat "
             "template; a message's name goes to the template too, which renders it where it "
             "reads names (most templates, SmolLM2's among them, leave it out)", _messages,
             endpoints=CHAT),
    honoured("max_tokens", "default: 16 for completions, the rest of the context for chat; "
             "prompt + max_tokens must fit the context (nothing is truncated)", _typed(int)),
    honoured("max_completion_tokens", "the same as max_tokens", _typed(int), endpoints=CHAT),
    honoured("temperature", ">= 0; 0 is greedy", _typed(float), sampling="temperature"),
    honoured("top_p", "(0, 1]", _typed(float), sampling="top_p"),
    honoured("presence_penalty", "[-2, 2], on output tokens", _typed(float),
             sampling="presence_penalty"),
    honoured("frequency_penalty", "[-2, 2], on output tokens", _typed(float),
             sampling="frequency_penalty"),
    honoured("seed", "0 to 2^32 - 1; the same seed gives the same tokens, whatever the batch",
             _typed(int), sampling="seed"),
    honoured("stop", "a string or a list; the text never ends inside a stop string", _stop,
             sampling="stop"),
    honoured("logprobs", "completions: the number of top alternatives per token; chat: true "
             "or false", _logprobs),
    honoured("top_logprobs", "needs logprobs: true", _typed(int), endpoints=CHAT),
    honoured("stream", "server-sent events, ending with `data: [DONE]`", _typed(bool)),
    honoured("stream_options", "needs stream: true; include_usage, and vLLM's "
             "continuous_usage_stats (usage in every chunk); include_obfuscation: true is "
             "refused", _stream_options),
    refused("n", "one choice per request: send n requests (with different seeds)",
            neutral=(1,)),
    refused("best_of", "one choice per request, and no ranking of candidates", neutral=(1,),
            origin="OpenAI (completions), vLLM (chat)"),
    refused("echo", "the prompt is not repeated in the output", neutral=(False,),
            origin="OpenAI (completions), vLLM (chat)"),
    refused("suffix", "no fill-in-the-middle", neutral=("",), endpoints=COMPLETIONS),
    refused("logit_bias", "no per-token bias", neutral=({},)),
    accepted("user", "an end-user id: checked, changes nothing", str),
    accepted("safety_identifier", "an end-user id: checked, changes nothing", str,
             endpoints=CHAT),
    accepted("prompt_cache_key", _CACHE, str, endpoints=CHAT),
    accepted("prompt_cache_options", _CACHE, dict, endpoints=CHAT),
    accepted("prompt_cache_retention", _CACHE, str, endpoints=CHAT),
    refused("store", "completions are not stored", neutral=(False,), endpoints=CHAT),
    refused("metadata", "it labels stored completions, and none are stored", neutral=({},),
            endpoints=CHAT),
    refused("service_tier", "one tier only", neutral=("auto", "default"), endpoints=CHAT),
    refused("modalities", "text output only", neutral=(["text"],), endpoints=CHAT),
    refused("audio", "no audio output", endpoints=CHAT),
    refused("prediction", "no predicted outputs", endpoints=CHAT),
    refused("reasoning_effort", "no reasoning-effort control", endpoints=CHAT),
    refused("verbosity", "no verbosity control", endpoints=CHAT),
    refused("web_search_options", "no web search", endpoints=CHAT),
    refused("moderation", "no moderation", endpoints=CHAT),
    honoured("response_format", "json_object or json_schema (name, description, schema, strict: "
             "enforced either way; no schema: any JSON object) constrain the output; text does "
             "not; any other key is refused by its path", _json_value((dict,))),
    honoured("tools", "functions, answered as tool_calls: in the model's own format where its "
             "chat template declares tools (Hermes/Qwen `<tool_call>` blocks, each call held to "
             "its tool's schema), else through a system message; a function takes name, "
             "description, parameters and strict (held to its schema either way), any other key "
             "is refused by its path", _json_value((list,)),
             endpoints=CHAT),
    honoured("tool_choice", "auto (the default with tools: text, calls or both; needs the "
             "model's own format, refused naming why without it), required, none, or a named "
             "function, `{\"type\": \"function\", \"function\": {\"name\"}}` and no other key",
             _json_value((str, dict)), endpoints=CHAT),
    honoured("parallel_tool_calls", "false: one call at most; true (the default): as many as "
             "the model writes in its own format", _typed(bool), endpoints=CHAT),
    refused("functions", _OLD_FUNCTIONS, neutral=([],), endpoints=CHAT),
    refused("function_call", _OLD_FUNCTIONS, neutral=("none",), endpoints=CHAT),
    # -- vLLM -----------------------------------------------------------------------------------
    honoured("top_k", ">= 1; 0 or -1 is off", _typed(int), origin="vLLM", sampling="top_k"),
    honoured("min_p", "[0, 1]", _typed(float), origin="vLLM", sampling="min_p"),
    honoured("repetition_penalty", "> 0, on prompt and output tokens", _typed(float), origin="vLLM",
             sampling="repetition_penalty"),
    honoured("stop_token_ids", "token ids that end the request", _token_ids, origin="vLLM",
             sampling="stop_token_ids"),
    honoured("ignore_eos", "EOS ends nothing", _typed(bool), origin="vLLM", sampling="ignore_eos"),
    honoured("min_tokens", "EOS and stop_token_ids are held back until then, with or without "
             "ignore_eos", _typed(int), origin="vLLM", sampling="min_tokens"),
    honoured("prompt_logprobs", "not with stream; in the response as vLLM gives them",
             _typed(int), origin="vLLM", sampling="prompt_logprobs"),
    honoured("return_token_ids", "adds token_ids (and prompt_token_ids) to the response; "
             "streamed, each chunk has its own tokens' ids (and logprobs), tool calls too",
             _typed(bool), origin="vLLM"),
    honoured("return_tokens_as_token_ids", "logprob tokens as `token_id:<id>`", _typed(bool),
             origin="vLLM"),
    honoured("priority", "lower is scheduled first, as in vLLM", _typed(int), origin="vLLM"),
    honoured("request_id", "the response's id is `cmpl-<request_id>` (`chatcmpl-` for chat); "
             "the x-request-id header wins over it", _typed(str), origin="vLLM"),
    refused("use_beam_search", "no beam search", neutral=(False,), origin="vLLM"),
    refused("length_penalty", "beam search only", neutral=(1,), origin="vLLM"),
    refused("include_stop_str_in_output", "the stop string is never part of the text",
            neutral=(False,), origin="vLLM"),
    refused("skip_special_tokens", "special tokens are always left out of the text",
            neutral=(True,), origin="vLLM"),
    refused("spaces_between_special_tokens", "special tokens are left out of the text",
            neutral=(True,), origin="vLLM"),
    refused("truncate_prompt_tokens", "prompts are never truncated: a long one is refused",
            origin="vLLM"),
    refused("allowed_token_ids", "no token allow-list", origin="vLLM"),
    refused("bad_words", "no banned words", neutral=([],), origin="vLLM"),
    refused("logits_processors", "no custom logits processors", neutral=([],), origin="vLLM"),
    refused("add_special_tokens", "BOS is added when the model asks for it; send token ids to "
            "choose the tokens exactly", neutral=(True,), origin="vLLM"),
    refused("add_generation_prompt", "the assistant's turn is always opened", neutral=(True,),
            origin="vLLM", endpoints=CHAT),
    refused("continue_final_message", "the last message is not continued", neutral=(False,),
            origin="vLLM", endpoints=CHAT),
    refused("documents", "no documents for the chat template", neutral=([],), origin="vLLM",
            endpoints=CHAT),
    refused("chat_template", "the model's own chat template only", origin="vLLM",
            endpoints=CHAT),
    refused("chat_template_kwargs", "the model's own chat template only", neutral=({},),
            origin="vLLM", endpoints=CHAT),
    refused("include_reasoning", "no reasoning parser", neutral=(True,), origin="vLLM",
            endpoints=CHAT),
    refused("mm_processor_kwargs", "text only", neutral=({},), origin="vLLM"),
    refused("prompt_embeds", "token ids or text only", origin="vLLM", endpoints=COMPLETIONS),
    refused("cache_salt", "the prefix cache is not salted per request", origin="vLLM"),
    refused("kv_transfer_params", "no disaggregated serving", neutral=({},), origin="vLLM"),
    refused("vllm_xargs", "no extension arguments", neutral=({},), origin="vLLM"),
    honoured("structured_outputs", "one of json, regex, choice, grammar, json_object: "
             + _STRUCTURED, _json_value((dict,)), origin="vLLM"),
    honoured("guided_json", "a JSON schema (or its text): " + _STRUCTURED,
             _json_value((dict, str)), origin="vLLM"),
    honoured("guided_regex", "a regular expression: " + _STRUCTURED, _json_value((str,)),
             origin="vLLM"),
    honoured("guided_choice", "a list of strings: " + _STRUCTURED, _json_value((list,)),
             origin="vLLM"),
    honoured("guided_grammar", "a Lark or GBNF grammar: " + _STRUCTURED, _json_value((str,)),
             origin="vLLM"),
    refused("structural_tag", "no structural tags", origin="vLLM"),
    Field("guided_decoding_backend", "vLLM", ENDPOINTS, "accepted",
          f"{', '.join(_BACKENDS)}: llguidance constrains the output", _backend),
    refused("guided_whitespace_pattern", "JSON is written compact, no other whitespace",
            origin="vLLM"),
)
FIELDS_BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
assert len(FIELDS_BY_NAME) == len(FIELDS), "a field has two rows"

_SAMPLING = tuple(f for f in FIELDS if f.sampling)

# The honoured fields `_build` reads, besides those that set a `SamplingParams` field: a row made
# honoured needs its use in `_build` and its name here, or it would be taken and do nothing.
# The fields that constrain the output, read whole by `openai_structured.read_request` once the
# engine's chat template is known (tool_choice auto depends on it).
STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_BUILT = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs",
          "top_logprobs", "stream", "stream_options", "return_token_ids",
          "return_tokens_as_token_ids", "priority", "request_id", *STRUCTURED_FIELDS)
assert {f.name for f in FIELDS if f.verdict == "honoured" and not f.sampling} == set(_BUILT), (
    "an honoured field that _build does not use, or a used one not honoured")


def markdown_table() -> str:
    """The table as docs/server.md prints it."""
    lines = ["| field | endpoints | from | verdict | notes |", "|---|---|---|---|---|"]
    for f in FIELDS:
        endpoints = "both" if f.endpoints == ENDPOINTS else f.endpoints[0]
        verdict = f.verdict
        if f.neutral:
            verdict += " unless " + " or ".join(f"`{json.dumps(v)}`" for v in f.neutral)
        lines.append(f"| `{f.name}` | {endpoints} | {f.origin} | {verdict} | {f.note} |")
    return "\n".join(lines)


# -- the request -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenAIRequest:
    """A request body that passed every field's check. `sampling` holds the `SamplingParams`
    fields it sets, except max_tokens (the engine settles chat's default) and `logprobs`."""

    endpoint: str
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

    @property
    def logprobs_field(self) -> str:
        return "top_logprobs" if self.endpoint == "chat" else "logprobs"

    def sampling_params(self, max_tokens: int,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's sampling parameters; a value out of range is a RequestError naming the
        request's field."""
        try:
            return SamplingParams(**self.sampling, max_tokens=max_tokens, logprobs=self.logprobs,
                                  structured=structured)
        except (ValueError, TypeError) as err:
            raise RequestError(self.param_of(str(err)), str(err)) from None

    def param_of(self, message: str) -> str | None:
        """The request field a sampling message is about: the first field name in it."""
        names = {f.sampling: f.name for f in FIELDS if f.sampling} | {
            "max_tokens": self.max_tokens_field, "logprobs": self.logprobs_field}
        for word in re.findall(r"[a-z_]+", message):
            if word in names:
                return names[word]
        return None


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
    values = {}
    for name, value in body.items():
        field = _known(name, endpoint)
        if value is None:
            continue
        if field.verdict == "refused":
            _refuse_unless_neutral(field, value)
        else:
            values[name] = field.check(name, value, endpoint)
    return _build(values, endpoint)


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
    sampling = {f.sampling: values[f.name] for f in _SAMPLING if f.name in values}
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


if __name__ == "__main__":
    print(markdown_table())
