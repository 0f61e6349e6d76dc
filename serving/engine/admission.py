"""The one admission check: every request-level check, run once, at the front door.

Every front door calls `Admission.admit` on its own thread, before anything is queued: the gRPC
server's handlers and the HTTP app (through the engine loop's `EngineLoop.admission`, which
bounds the prompt as the server's limits say), `AsyncLLM` (the same) and `LLM` (through
`Engine.add_request`). It returns an `Admitted` request, which the engine queues
(`Engine.enqueue`) without checking it again.

A refusal is an `AdmissionError` (a ValueError): `param` names the field at fault in the engine's
terms (`prompt`, `request_id`, a `SamplingParams` field such as `max_tokens` or `stop`, or
`structured`), `reason` says what is wrong and `str(err)` is the whole message. Each front end
maps `param` to its own request's field (OpenAI's `max_completion_tokens`, `response_format`),
with no reading of the message.

The checks, in order:
  prompt       the tokenizer a text or chat prompt needs; a text too long to fit, by its length in
               characters, before the tokenizer spends time on it; the chat template's own
               refusals; an empty prompt; token ids outside the vocabulary; the max prompt length
               (`max_prompt_tokens`, when the door has one). Never truncated.
  request_id   a non-empty string of printable characters, at most MAX_REQUEST_ID_BYTES bytes in
               UTF-8 (it is echoed in every streamed message).
  sampling     the values `SamplingParams` itself refuses, when the door hands over the fields
               rather than a built `SamplingParams`.
  context      the prompt and max_tokens within max_model_len, and within the KV cache's pages;
               with `fill_context`, a request that sets no max_tokens gets the rest of the
               context (OpenAI's chat default).
  limits       stop strings (which need a tokenizer; at most MAX_STOP_STRINGS, each at most
               MAX_STOP_STRING_CHARS), stop_token_ids (in the vocabulary, and few enough for the
               sampler's table beside the EOS ids), logprobs and prompt_logprobs up to the
               engine's max_logprobs, and a structured-output constraint, compiled (once per
               distinct constraint) and started: one that ends before its first token (nothing can
               satisfy it, or only an empty output does) is refused. A JSON constraint that
               leaves a bound unset takes the engine's (`json_bounds`).

The scheduler keeps its own fit check (`Scheduler.add`) as an invariant of the pages it hands
out: it never fires for an admitted request. An `Admission` reads only the engine's settings,
and compiles grammars under the compiler's lock, so any thread may call it.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Mapping, Sequence

from meshserve.batching.adapters import LoRARequest
from meshserve.batching.pages import num_pages_for
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import Constraint, mask_words
from meshserve.model.tokenizer import Tokenizer, check_text
from meshserve.serving.engine.grammar import ConstraintError, GrammarCompiler

MAX_REQUEST_ID_BYTES = 256  # a request id is echoed in every streamed message
MAX_STOP_STRINGS = 64  # each step searches new text for each stop string of each request
MAX_STOP_STRING_CHARS = 1024  # and holds back len(longest) - 1 characters while streaming
# chat: messages the chat template renders here; chat_text: a conversation the template has
# rendered already (`LLM.chat`), encoded as a chat is.
PROMPT_KINDS = ("text", "token_ids", "chat", "chat_text")


class AdmissionError(ValueError):
    """A request refused at the front door: `param` is the field at fault (engine terms), `reason`
    what is wrong with it; the message is `where: reason`, or the reason alone when it already
    names the field."""

    def __init__(self, param: str | None, reason: str, *, where: str | None = None):
        super().__init__(f"{where}: {reason}" if where else reason)
        self.param, self.reason = param, reason

    @property
    def message(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt as a front end received it. `kind` is text, token_ids or chat (messages, through
    the chat template, with `tools` for a template that declares them); `field` names it in
    refusals (`prompt.text` on gRPC, `messages` on HTTP's chat)."""

    kind: str
    value: str | Sequence[int] | list[dict]
    field: str = "prompt"
    tools: list[dict] | None = None

    def __post_init__(self):
        assert self.kind in PROMPT_KINDS, self.kind

    @classmethod
    def of(cls, value: str | Sequence[int] | list[dict] | Prompt, field: str = "prompt"
           ) -> Prompt:
        """A text, chat messages (a list of dicts) or token ids, told apart by their type (a
        `Prompt` is itself)."""
        if isinstance(value, Prompt):
            return value
        if isinstance(value, str):
            return cls("text", value, field)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
            return cls("chat", value, field)
        return cls("token_ids", value, field)


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request that passed every check, ready to queue: its structured-output matcher (if any)
    already started. `lora_request`, its LoRA adapter, is checked when it is queued
    (`Engine.enqueue`), where the engine's adapter registry lives."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    constraint: Constraint | None = None
    lora_request: LoRARequest | None = None


class Admission:
    """The admission check of one engine (see the module docstring); `Engine.admission` is the
    engine's own, and `limited` makes one that also bounds the prompt."""

    def __init__(self, *, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 max_logprobs: int, max_stop_ids: int, eos_token_ids: Sequence[int],
                 page_size: int, cache_pages: int, max_prompt_tokens: int | None = None,
                 json_bounds: Mapping[str, int | None] | None = None):
        """`json_bounds`: the engine's default bounds of JSON constraints, by
        `StructuredOutput` field (`max_string_length`, `max_integer_digits`)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.json_bounds = dict(json_bounds or {})
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.max_stop_ids, self.eos_token_ids = max_stop_ids, tuple(eos_token_ids)
        self.page_size, self.cache_pages = page_size, cache_pages
        self.max_prompt_tokens = max_prompt_tokens
        self._grammars = _Grammars(tokenizer, vocab_size, self.eos_token_ids)

    def limited(self, max_prompt_tokens: int) -> Admission:
        """The same check that also refuses prompts longer than `max_prompt_tokens`, sharing this
        one's compiled constraints."""
        limited = copy.copy(self)
        limited.max_prompt_tokens = max_prompt_tokens
        return limited

    def grammars(self) -> GrammarCompiler:
        """The compiled constraints of the engine's tokenizer, made on first use."""
        return self._grammars.get()

    def admit(self, prompt: Prompt, sampling: SamplingParams | Mapping[str, Any], *,
              request_id: str, fill_context: bool = False) -> Admitted:
        """Every check of one request (see the module docstring), in order; raises
        AdmissionError at the first that fails. `sampling` is a `SamplingParams`, or its fields
        (then `SamplingParams`'s own refusals name their field too)."""
        prompt_ids, text = self._prompt_ids(prompt)
        check_request_id(request_id)
        if isinstance(sampling, SamplingParams):
            params = sampling
        else:
            values = dict(sampling)
            if fill_context and values.get("max_tokens") is None:
                values["max_tokens"] = max(self.max_model_len - len(prompt_ids), 1)
            params = _sampling_params(values)
        self._check_fits(len(prompt_ids), params.max_tokens)
        self._check_limits(params)
        constraint = self._constraint(params) if params.structured is not None else None
        return Admitted(request_id=request_id, prompt_ids=prompt_ids, prompt_text=text,
                        params=params, constraint=constraint)

    # -- the checks ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        field, limit = prompt.field, self.max_prompt_tokens
        try:
            ids, text = self._encode(prompt, limit)
        except AdmissionError:
            raise
        except ValueError as err:  # the tokenizer's or the chat template's refusal
            raise AdmissionError("prompt", str(err), where=field) from None
        if not ids:
            raise AdmissionError("prompt", "the prompt is empty: it needs at least one token",
                                 where=field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError("prompt", f"token id {bad[0]} is outside the vocabulary "
                                           f"[0, {self.vocab_size})", where=field)
        if limit is not None and len(ids) > limit:
            raise AdmissionError("prompt", f"{len(ids)} tokens exceed the max prompt length of "
                                           f"{limit}; shorten it (it is never truncated)",
                                 where=field)
        return ids, text

    def _encode(self, prompt: Prompt, limit: int | None) -> tuple[list[int], str | None]:
        if prompt.kind == "token_ids":
            return [int(t) for t in prompt.value], None
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise AdmissionError("prompt", "this model has no tokenizer; send token_ids",
                                 where=prompt.field)
        if prompt.kind == "text":
            _check_text_fits(len(prompt.value), limit, tokenizer)
            return tokenizer.encode(prompt.value, add_special_tokens=True), prompt.value
        if not prompt.value:
            raise ValueError("no messages")
        _check_text_fits(len(prompt.value) if prompt.kind == "chat_text" else
                         sum(len(m["content"]) for m in prompt.value), limit, tokenizer)
        text = prompt.value if prompt.kind == "chat_text" else tokenizer.apply_chat_template(
            prompt.value, add_generation_prompt=True, tools=prompt.tools)
        return tokenizer.encode_chat(text), text

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """The prompt and its output within the context and the KV cache (the scheduler's
        invariant, told to the caller here)."""
        total = num_prompt + max_tokens
        if total > self.max_model_len:
            raise AdmissionError("max_tokens", f"the prompt ({num_prompt} tokens) + max_tokens "
                                 f"({max_tokens}) = {total} exceeds max_model_len "
                                 f"({self.max_model_len}); shorten the prompt or lower "
                                 f"max_tokens (nothing is truncated)", where="max_tokens")
        num_pages = num_pages_for(total - 1, self.page_size)  # the last output is never fed
        if num_pages > self.cache_pages:
            raise AdmissionError("max_tokens", f"the prompt ({num_prompt} tokens) + max_tokens "
                                 f"({max_tokens}) needs {num_pages} KV pages of "
                                 f"{self.page_size} tokens, but the cache has "
                                 f"{self.cache_pages}; shorten it or give the cache more pages",
                                 where="max_tokens")

    def _check_limits(self, params: SamplingParams) -> None:
        """What this engine can serve of `params`: stops, logprobs."""
        if params.stop and self.tokenizer is None:
            raise AdmissionError("stop", "stop strings need a tokenizer, and this model has "
                                         "none: use stop_token_ids instead")
        check_stop_strings(params.stop)
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise AdmissionError("stop_token_ids", f"{bad[0]} is outside the vocabulary "
                                                   f"[0, {self.vocab_size})",
                                 where="stop_token_ids")
        room = self.max_stop_ids - len(self.eos_token_ids)
        if len(params.stop_token_ids) > room:
            raise AdmissionError("stop_token_ids", f"{len(params.stop_token_ids)} stop_token_ids "
                                                   f"is too many: at most {room}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise AdmissionError(name, f"{name}={value} exceeds max_logprobs="
                                           f"{self.max_logprobs}")

    def _constraint(self, params: SamplingParams) -> Constraint:
        """A new request's matcher, its first mask ready. A constraint that ends before its
        first token (nothing can satisfy it, or only an empty output does) is refused."""
        structured = params.structured.with_default_bounds(**self.json_bounds)
        where = f"structured.{structured.kind}"
        try:
            matcher = self.grammars().matcher(structured)
        except ConstraintError as err:
            raise AdmissionError("structured", err.reason, where=err.field) from None
        except ValueError as err:  # no tokenizer
            raise AdmissionError("structured", str(err)) from None
        constraint = Constraint(matcher, num_words=mask_words(self.vocab_size),
                                eos_token_ids=self.eos_token_ids, ignore_eos=params.ignore_eos,
                                max_tokens=params.max_tokens)
        end = constraint.end()
        if end is not None:
            reason, detail = end
            what = ("only an empty output meets it" if reason == "stop"
                    else f"no output can meet it with this model's tokenizer ({detail})")
            raise AdmissionError("structured", what, where=where)
        return constraint


class _Grammars:
    """The engine's `GrammarCompiler`, made on first use (building the grammar library's
    tokenizer is slow) and shared by every `Admission` of one engine; safe from any thread."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self._args = tokenizer, vocab_size, eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                tokenizer, vocab_size, eos_token_ids = self._args
                if tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this "
                                     "model has none")
                self._compiler = GrammarCompiler(tokenizer.to_json(), vocab_size=vocab_size,
                                                 eos_token_ids=eos_token_ids)
            return self._compiler


def _sampling_params(values: dict[str, Any]) -> SamplingParams:
    """`SamplingParams(**values)`; its refusal names the field at fault (`_refused_field`)."""
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as err:
        raise AdmissionError(_refused_field(values), str(err)) from None


def _refused_field(values: dict[str, Any]) -> str | None:
    """The field `SamplingParams` refused among `values`. It checks its fields one at a time, in
    the order they are declared (min_tokens against max_tokens), so the refused one is the first,
    in that order, that it refuses on its own."""
    for field in dataclasses.fields(SamplingParams):
        if field.name not in values:
            continue
        alone = {field.name: values[field.name]}
        if field.name == "min_tokens" and "max_tokens" in values:
            alone["max_tokens"] = values["max_tokens"]
        try:
            SamplingParams(**alone)
        except (ValueError, TypeError):
            return field.name
    return None


def check_request_id(request_id: str) -> None:
    """A caller's request id is echoed in every streamed message, so it is bounded: a non-empty
    string of at most MAX_REQUEST_ID_BYTES UTF-8 bytes, printable characters only."""
    if not isinstance(request_id, str) or not request_id:
        raise AdmissionError("request_id", "request_id must be a non-empty string")
    if not request_id.isprintable():
        raise AdmissionError("request_id", "request_id must be printable characters: no control "
                                           "characters, line breaks or lone surrogates")
    size = len(request_id.encode("utf-8"))
    if size > MAX_REQUEST_ID_BYTES:
        raise AdmissionError("request_id", f"request_id is {size} bytes long: at most "
                                           f"{MAX_REQUEST_ID_BYTES}")


def check_stop_strings(stop: Sequence[str]) -> None:
    """Each step searches a request's new text for each of its stop strings, and streaming holds
    back the last `len(longest) - 1` characters: both costs stay bounded."""
    if len(stop) > MAX_STOP_STRINGS:
        raise AdmissionError("stop", f"{len(stop)} stop strings is too many: at most "
                                     f"{MAX_STOP_STRINGS}", where="stop")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise AdmissionError("stop", f"a stop string of {len(s)} characters is too long: at "
                                         f"most {MAX_STOP_STRING_CHARS}", where="stop")
        try:
            check_text(s, "stop: a stop string")
        except ValueError as err:
            raise AdmissionError("stop", str(err)) from None


def _check_text_fits(num_chars: int, limit: int | None, tokenizer: Tokenizer) -> None:
    """A text longer than `limit` tokens of the longest kind cannot fit: refused by its length."""
    if limit is not None and num_chars > limit * tokenizer.max_token_chars:
        raise ValueError(f"{num_chars} characters cannot fit in the max prompt length of {limit} "
                         f"tokens (one token is at most {tokenizer.max_token_chars} characters); "
                         f"shorten it (it is never truncated)")
