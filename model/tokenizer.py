"""Text <-> token ids, chat templating and streaming detokenization.

`Tokenizer` wraps a HF `tokenizers.Tokenizer` built either from a `tokenizer.json` (plus the
`tokenizer_config.json` beside it) or from the tokenizer metadata inside a GGUF file.

Invariants:

* `encode` adds BOS only when the model asks for it (GGUF `tokenizer.ggml.add_bos_token`, or the
  post-processor of a `tokenizer.json`); special tokens written in the text, such as
  `<|im_start|>`, always encode to their single id.
* A GGUF vocabulary (byte-level BPE, or SentencePiece) encodes and decodes as llama.cpp does
  for the same file (`meshserve.model.gguf_vocab`); kinds it does not read are refused by name.
  With SentencePiece's `add_space_prefix`, `decode` drops the space the prefix put in front of
  the first token, unless that token is a control token, as `llama_detokenize` does.
* `eos_token_ids` always contains the EOS id first, followed by any end-of-turn token the chat
  template emits (e.g. `<|im_end|>`, and Llama 3's `<|eom_id|>`, which ends a turn that called a
  tool), so generation stops at the end of an assistant turn.
* `apply_chat_template` renders the Jinja template the way HF transformers does: sandboxed,
  `trim_blocks` and `lstrip_blocks`, with `raise_exception`, `strftime_now` and `tojson`, and
  the `tools` variable (OpenAI-style function definitions, or None); `renders_tools` says
  whether the template shows the model those tools. Message content is data, never template
  code. Roles are limited to `CHAT_ROLES`. As in HF transformers, special-token text inside
  content (`<|im_start|>`) encodes to the special token.
* Text with a lone surrogate (no UTF-8 form) is refused with a ValueError naming where it is.
* `IncrementalDecoder` never returns a partial UTF-8 character, and the concatenation of its
  deltas (including `flush()`) equals `Tokenizer.decode` of all ids it was fed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer

from meshserve.model.gguf_vocab import read_vocab

REPLACEMENT_CHAR = "\ufffd"
TOOL_PROBE_NAME = "meshserve_tool_probe"
# Llama 3.1+'s <|eom_id|> ends a turn that called a tool and waits for its result.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|endoftext|>")

@dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """The ids a caller needs to frame and stop generation."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def end_token_ids(
    backend: BackendTokenizer, eos_ids: Iterable[int | None], chat_template: str | None
) -> tuple[int, ...]:
    """The given EOS ids, then the ids of end-of-turn markers the chat template emits, deduplicated."""
    found = [token_id for token_id in eos_ids if token_id is not None]
    for marker in END_OF_TURN_MARKERS:
        marker_id = backend.token_to_id(marker)
        if chat_template and marker in chat_template and marker_id is not None:
            found.append(marker_id)
    return tuple(dict.fromkeys(found))


def token_content(value: Any) -> str | None:
    """A token as `tokenizer_config.json` writes it: a string or an AddedToken-style dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def config_token_id(backend: BackendTokenizer, config: Mapping[str, Any], key: str) -> int | None:
    """The id of the token `config[key]` names, or None when the config does not name one."""
    token = token_content(config.get(key))
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(
            f"tokenizer_config {key} is {token!r}, which is not in the tokenizer's vocabulary; "
            "fix the config."
        )
    return token_id


def config_chat_template(config: Mapping[str, Any]) -> str | None:
    """The default chat template from `tokenizer_config.json` (a string, or a list of named ones)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def sibling_tokenizer_config(tokenizer_json: Path) -> dict[str, Any]:
    """`tokenizer_config.json` next to a `tokenizer.json`, or {} if there is none."""
    config_path = tokenizer_json.with_name("tokenizer_config.json")
    if not config_path.is_file():
        return {}
    return json.loads(config_path.read_text(encoding="utf-8"))


def sibling_chat_template(tokenizer_json: Path) -> str | None:
    """A `chat_template.jinja` next to a `tokenizer.json`, as newer HF checkpoints ship it."""
    template_path = tokenizer_json.with_name("chat_template.jinja")
    return template_path.read_text(encoding="utf-8") if template_path.is_file() else None


def raise_template_exception(message: str) -> None:
    """The `raise_exception` helper chat templates call to reject a conversation."""
    raise jinja2.exceptions.TemplateError(message)


def template_tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """`tojson` as HF defines it for chat templates: plain JSON, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:
    """The current local time, for templates that print today's date."""
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment HF transformers uses."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = template_tojson
    environment.globals["raise_exception"] = raise_template_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_text(text: str, name: str) -> None:
    """Fail, naming `name`, if `text` holds a lone surrogate: such a str has no UTF-8 form, so no
    tokenizer, wire format or decoded output can carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name} holds a lone surrogate ({text[error.start]!r} at index {error.start}); send valid Unicode."
        ) from None


def validate_messages(messages: Any) -> None:
    """Fail unless `messages` is a non-empty list of dicts with a `role` from CHAT_ROLES and string
    `content`, both valid Unicode. A template renders any role it is given, so an unknown or
    empty one would reach the model as a made-up turn marker."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}."
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"messages[{index}][{key!r}] must be a string, got {type(message.get(key)).__name__}."
                )
            check_text(message[key], f"messages[{index}][{key!r}]")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}]['role'] is {message['role'][:40]!r}; it must be one of {', '.join(CHAT_ROLES)}."
            )


class Tokenizer:
    """A model's tokenizer: encode, decode, special ids and chat template."""

    def __init__(
        self, backend: BackendTokenizer, *, special: SpecialTokens, chat_template: str | None,
        space_prefix: bool = False,
    ) -> None:
        self._backend = backend
        self._special = special
        self._chat_template = chat_template
        self._space_prefix = space_prefix
        self._control_ids = frozenset(  # only decode's space rule reads them
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        ) if space_prefix else frozenset()
        self._max_token_chars: int | None = None
        self._renders_tools: bool | None = None

    @classmethod
    def from_file(cls, path: str | Path, tokenizer_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load a HF `tokenizer.json`; special tokens and chat template come from `tokenizer_config`,
        or from the `tokenizer_config.json` (and `chat_template.jinja`) beside it when not given."""
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path))
        config = dict(tokenizer_config) if tokenizer_config is not None else sibling_tokenizer_config(path)
        chat_template = config_chat_template(config) or sibling_chat_template(path)
        special = SpecialTokens(
            bos_token_id=config_token_id(backend, config, "bos_token"),
            eos_token_ids=end_token_ids(
                backend, [config_token_id(backend, config, "eos_token")], chat_template
            ),
            pad_token_id=config_token_id(backend, config, "pad_token"),
        )
        return cls(backend, special=special, chat_template=chat_template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata."""
        vocab = read_vocab(path)
        special = SpecialTokens(
            bos_token_id=vocab.bos_token_id,
            eos_token_ids=end_token_ids(vocab.backend, vocab.eos_token_ids, vocab.chat_template),
            pad_token_id=vocab.pad_token_id,
        )
        return cls(vocab.backend, special=special, chat_template=vocab.chat_template,
                   space_prefix=vocab.space_prefix)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS first, then end-of-turn markers."""
        return self._special.eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._special.pad_token_id

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text longer than `n * max_token_chars` cannot
        fit in `n` tokens, which a server can tell before paying for the tokenization."""
        if self._max_token_chars is None:
            num_ids = self._backend.get_vocab_size(with_added_tokens=True)
            self._max_token_chars = max(
                len(self._backend.decode([i], skip_special_tokens=False)) for i in range(num_ids)
            )
        return self._max_token_chars

    def to_json(self) -> str:
        """The backend as HF `tokenizer.json` text (what grammar libraries read a vocabulary
        from)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` controls only the BOS the model may want."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}.")
        check_text(text, "the text")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a conversation the chat template rendered: with the BOS the model wants,
        once. Templates that write `bos_token` themselves (Gemma's, Llama 2's, Mistral's) would
        otherwise start with two: HF transformers encodes their text without special tokens,
        which for a template that writes none would leave the BOS out."""
        ids = self.encode(text, add_special_tokens=True)
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            return ids[1:]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; special tokens are dropped unless `skip_special_tokens` is False."""
        ids = list(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if (self._space_prefix and ids and ids[0] not in self._control_ids
                and text.startswith(" ")):
            return text[1:]  # the space the prefix put there (see the module docstring)
        return text

    @property
    def space_prefix(self) -> bool:
        """Whether encoding puts a space in front of the text (SentencePiece's
        `add_space_prefix`), which `decode` then drops."""
        return self._space_prefix

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render `messages` with the model's chat template, as HF transformers would; `tools` are
        function definitions (`{"type": "function", "function": {...}}`) for a template that
        declares them (see `renders_tools`)."""
        if not self._chat_template:
            raise ValueError(
                "This tokenizer has no chat template; use a model that ships one "
                "(tokenizer.chat_template in the GGUF, or chat_template in tokenizer_config.json), "
                "or encode a plain prompt instead."
            )
        validate_messages(messages)
        template = compile_chat_template(self._chat_template)
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._template_tokens(),
            )
        except jinja2.exceptions.TemplateError as error:
            raise ValueError(f"The chat template rejected these messages: {error}") from error

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template declares tools: given a probe function in `tools`, the prompt
        it renders names it. A template that mentions no tools, or ignores them, does not."""
        if self._renders_tools is None:
            self._renders_tools = self._probe_tools()
        return self._renders_tools

    def _probe_tools(self) -> bool:
        if not self._chat_template or "tools" not in self._chat_template:
            return False
        function = {"name": TOOL_PROBE_NAME, "description": "A probe.",
                    "parameters": {"type": "object", "properties": {}}}
        probe = {"type": "function", "function": function}
        try:
            rendered = self.apply_chat_template([{"role": "user", "content": "Hi."}], tools=[probe])
        except ValueError:  # a template that refuses a plain conversation with tools declares none
            return False
        return TOOL_PROBE_NAME in rendered

    def _template_tokens(self) -> dict[str, str | None]:
        """The special-token variables a chat template may reference."""
        eos_id = self.eos_token_ids[0] if self.eos_token_ids else None
        return {
            "bos_token": self._token_or_none(self.bos_token_id),
            "eos_token": self._token_or_none(eos_id),
            "pad_token": self._token_or_none(self.pad_token_id),
        }

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    It keeps two offsets into the ids seen so far: text up to `read_offset` has been emitted, and
    decoding restarts from `prefix_offset` so that context-dependent decoders (leading spaces)
    render the new tokens as they would in the full sequence. A delta is emitted only once the
    decoded window grows and does not end in U+FFFD, i.e. once its bytes form whole characters.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes (often "", while a character is unfinished)."""
        self._ids.append(token_id)
        prefix_text, window_text = self._window_texts()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(window_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return whatever is held back, unfinished bytes included (as U+FFFD), at end of stream."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, window_text = self._window_texts()
        return self._advance(window_text[len(prefix_text) :])

    def _window_texts(self) -> tuple[str, str]:
        """Decoded text of [prefix_offset, read_offset) and of [prefix_offset, end)."""
        prefix = self._ids[self._prefix_offset : self._read_offset]
        window = self._ids[self._prefix_offset :]
        decode = partial(self._tokenizer.decode, skip_special_tokens=self._skip_special_tokens)
        return decode(prefix), decode(window)

    def _advance(self, delta: str) -> str:
        """Mark everything fed so far as emitted and return `delta`."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta
