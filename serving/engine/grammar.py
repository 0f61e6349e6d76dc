"""The grammar library behind structured output: llguidance, behind one small interface.

`GrammarCompiler` compiles a `StructuredOutput` (`batching/structured.py`) for one tokenizer and
hands out `Matcher`s: each distinct constraint is compiled once and kept (least recently used
first out, at most `max_cached`), and every request gets its own copy of the compiled matcher. An
invalid schema, regex or grammar raises ValueError with the library's reason, naming the field.

Why llguidance: on SmolLM2's vocabulary its mask and its compiles cost little beside a step
(docs/benchmarks.md, "Structured output", has the figures), it fills a numpy bitmask with no
torch, it has no dependencies, and one abi3 wheel serves Python 3.11 and 3.12.

JSON is compact (`", "` and `": "` between items, no other whitespace): a small model given
free whitespace can spend its whole budget on newlines. The schema a JSON constraint compiles is
first rewritten by `meshserve.serving.engine.json_schemas`: every number it types has at most 8
digits after its point, and a constraint's bounds (longest string, most integer digits) are
written in as schema keywords.

Closing (`LLGuidanceMatcher.num_closing_tokens`): a shortest completion of the output from where
it stands, in tokens, which the request's `Constraint` keeps room for within max_tokens
(`batching/structured.py`). The library says neither how far an accepting state is nor how to
reach it, so it is found here, on the matcher itself (consumed, then rolled back), by a walk:
the bytes the grammar forces are taken as they come; in free text (where `a` may follow), a
special token the grammar names that leads on (a tool call's `<tool_call>`); else the first byte
the grammar allows in `CLOSING_BYTE_ORDER` (closing quotes and brackets, then `0`, then the
rest), except that where several of `CLOSERS` may follow outside free text each is tried with a
walk of its own and the shortest taken (`]` closes an empty array; `""` would fill it). The
walk ends where the matcher accepts; its text is spelled in the fewest tokens of the vocabulary
(any spelling gives the same bytes, so the grammar takes each). A walk longer than
`MAX_CLOSING_BYTES`, or one that meets a dead end, gives no closing (the request is not
steered). On JSON from a schema the walk closes the string, the number and each open bracket
and gives a missing required property its shortest value; on a regex or grammar whose shortest
completion takes a byte later in the order it may be longer than the shortest, never invalid.
Each step checks that the last closing found still completes the output (one validation, no
walk), and walks again only when it does not.

Masks of many matchers at once (`fill_masks`, the scheduler's `MaskFiller`): one call of the
library's parallel fill (`llguidance.numpy.fill_next_token_bitmask_par`, on its thread pool,
`LLExecutor`, made on first use), so a step's constrained rows cost one call from Python, their
masks computed side by side; a single matcher, or one of another kind, fills its own.

Thread-safe: the admission check makes matchers on the front ends' threads. This is the only module
that imports llguidance.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from typing import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from meshserve.batching.structured import StructuredOutput
from meshserve.serving.engine.json_schemas import ANY_OBJECT_SCHEMA, bounded_schema

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_REASON_CHARS = 2000  # of the library's message, which can hold a parser state dump
MAX_CLOSING_BYTES = 512
CLOSERS = b'"}])'
FREE_TEXT_BYTE = ord("a")  # allowed beside `"`: inside a string, where `"` closes
CLOSING_BYTE_ORDER = bytes([*b'"}])\'>,;. \n0123456789', *range(ord("a"), ord("z") + 1),
                            *range(ord("A"), ord("Z") + 1)])
CLOSING_BYTE_ORDER += bytes(b for b in range(256) if b not in CLOSING_BYTE_ORDER)


class ConstraintError(ValueError):
    """A constraint that does not compile: `field` is `structured.<kind>`, `reason` the
    library's."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class Vocabulary:
    """The tokenizer's tokens as bytes: what a closing text is spelled in. Special tokens spell
    nothing, except where a grammar names them (`markers`, text to token)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.ids_of: dict[bytes, list[int]] = {}  # of the tokens that are not special
        self.texts: dict[int, bytes] = {}  # of every token
        for token in range(tokenizer.vocab_size):
            text = tokenizer.decode_bytes([token])
            if not text:
                continue
            self.texts[token] = text
            if not tokenizer.is_special_token(token):
                self.ids_of.setdefault(text, []).append(token)
        self.eos = tokenizer.eos_token
        self.byte_ids = [self.ids_of.get(bytes([b]), [None])[0] for b in range(256)]
        self.prefixes = {text[:end] for text in self.ids_of for end in range(1, len(text) + 1)}

    def ids(self, text: bytes, markers: dict[bytes, int]) -> list[int]:
        """The tokens that spell exactly `text`."""
        marker = markers.get(text)
        return self.ids_of.get(text, []) + ([] if marker is None else [marker])

    def spell(self, text: bytes, markers: dict[bytes, int]) -> Closing | None:
        """`text` as a `Closing`: the fewest tokens that spell each of its suffixes, by dynamic
        programming over the vocabulary; None if some byte has no token."""
        n = len(text)
        fewest, steps = [0] * (n + 1), [(n, -1)] * n
        for i in range(n - 1, -1, -1):
            ends = [i + len(marker) for marker in markers if text.startswith(marker, i)]
            j = i + 1
            while j <= n and text[i:j] in self.prefixes:
                if text[i:j] in self.ids_of:
                    ends.append(j)
                j += 1
            if not ends:
                return None
            end = min(ends, key=lambda j: fewest[j])
            fewest[i] = 1 + fewest[end]
            steps[i] = (end, self.ids(text[i:end], markers)[-1])
        return Closing(text, fewest, steps)


@dataclasses.dataclass(frozen=True)
class Closing:
    """A shortest way found to complete the output: its text; for each of its suffixes the
    fewest tokens that spell it (`fewest[0]` is the closing's length in tokens), and the first
    step of such a spelling (`steps[i]`: the end of its first token, and the token)."""

    text: bytes
    fewest: list[int]
    steps: list[tuple[int, int]]

    @property
    def num_tokens(self) -> int:
        return self.fewest[0]

    @property
    def tokens(self) -> list[int]:
        """A spelling of the whole text in `num_tokens` tokens."""
        tokens, at = [], 0
        while at < len(self.text):
            at, token = self.steps[at]
            tokens.append(token)
        return tokens

    def rest(self, start: int) -> Closing:
        """The closing after its first `start` bytes."""
        return Closing(self.text[start:], self.fewest[start:],
                       [(end - start, token) for end, token in self.steps[start:]])


class LLGuidanceMatcher:
    """One request's matcher (the `Matcher` protocol of `batching/structured.py`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: Vocabulary,
                 markers: dict[bytes, int] | None = None):
        self._matcher = matcher
        self._vocabulary = vocabulary
        self._markers = markers or {}  # the special tokens the grammar names, by text
        self._closing: Closing | None = None
        self._is_closing_known = False  # `_closing` is this state's (else the last state's)

    def fill_mask(self, out: np.ndarray) -> None:
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, token: int) -> bool:
        after = self._closing_after(token)
        self._is_closing_known = after is not None
        self._closing = after or self._closing  # else the last one, which may still complete
        return self._matcher.consume_token(token)

    def num_closing_tokens(self) -> int | None:
        closing = self._closing_here()
        return None if closing is None else closing.num_tokens

    def num_closing_tokens_at_most(self) -> int | None:
        """An upper bound on `num_closing_tokens`, cheap: the last closing found, if it still
        completes the output from here (one validation, no walk)."""
        if self._is_closing_known or self._closing is None:
            return self.num_closing_tokens()
        tokens = self._closing.tokens + [self._vocabulary.eos]  # EOS: taken only when accepting
        completes = self._matcher.validate_tokens(tokens) == len(tokens)
        return self._closing.num_tokens if completes else None

    def _closing_after(self, token: int) -> Closing | None:
        """The closing after `token`, when the token spells the start of this state's: the rest
        of it (the walk from there makes the same choices)."""
        if not self._is_closing_known or self._closing is None:
            return None
        text = self._vocabulary.texts.get(token)
        if not text or not self._closing.text.startswith(text):
            return None
        return self._closing.rest(len(text))

    def fill_closing_mask(self, out: np.ndarray, budget: int) -> None:
        out[:] = 0
        closing = self._closing_here()
        if closing is None:
            return
        bits = out.view(np.uint32)
        tokens = [token for end in range(1, len(closing.text) + 1)
                  if 1 + closing.fewest[end] <= budget
                  for token in self._vocabulary.ids(closing.text[:end], self._markers)]
        for token in tokens + self._other_digits(closing, budget):
            bits[token // 32] |= np.uint32(1 << (token % 32))

    def _other_digits(self, closing: Closing, budget: int) -> list[int]:
        """Where the closing writes a digit next, the other digits that the same rest
        completes: the model keeps its choice of digit (`7}`, not only `0}`)."""
        if not closing.text[:1].isdigit() or 1 + closing.fewest[1] > budget:
            return []
        rest = closing.rest(1).tokens + [self._vocabulary.eos]
        digits = [self._vocabulary.byte_ids[digit] for digit in b"0123456789"]
        return [token for token in digits if token is not None
                and self._matcher.validate_tokens([token] + rest) == 1 + len(rest)]

    def _closing_here(self) -> Closing | None:
        if not self._is_closing_known:
            self._closing, self._is_closing_known = self._find_closing(), True
        return self._closing

    def _find_closing(self) -> Closing | None:
        """The closing walk of the module docstring, on the matcher, rolled back after."""
        if self._matcher.is_error():
            return None
        text = _walk(self._matcher, self._vocabulary.byte_ids, self._markers,
                     compare_closers=True)
        return None if text is None else self._vocabulary.spell(text, self._markers)

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str:
        return _reason(self._matcher.get_error())


_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def fill_masks(matchers: Sequence, out: np.ndarray) -> None:
    """The next-token masks of `matchers` into the rows of `out` (int32 [n, words]), the
    library's matchers in one parallel fill (see the module docstring)."""
    assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and out.shape[0] == len(matchers)
    ours = [(m._matcher, row) for row, m in enumerate(matchers)
            if isinstance(m, LLGuidanceMatcher)]
    for row, matcher in enumerate(matchers):
        if len(ours) < 2 or not isinstance(matcher, LLGuidanceMatcher):
            matcher.fill_mask(out[row])
    if len(ours) >= 2:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), ours, out)


def _executor() -> llguidance.LLExecutor:
    """The library's thread pool for parallel fills, one per process, made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def _walk(matcher: llguidance.LLMatcher, byte_ids: list[int | None],
          markers: dict[bytes, int] | None = None, *, compare_closers: bool) -> bytes | None:
    """The bytes from the matcher's state to an accepting one (module docstring); the matcher is
    rolled back after. `compare_closers`: where more than one of `CLOSERS` may come next, each is
    tried with a walk of its own after it and the shortest is taken (so an empty array is
    closed with `]`, not filled with `""`). `markers`: special tokens the grammar names (a tool
    call's `<tool_call>`); inside free text the first one the grammar takes comes next, where
    free text alone would never end."""
    text, num_consumed = bytearray(), 0
    try:
        while not matcher.is_accepting():
            if matcher.is_stopped() or len(text) > MAX_CLOSING_BYTES:
                return None
            step = matcher.compute_ff_bytes()
            tokens = [byte_ids[byte] for byte in step]
            if not step:
                step, tokens = _marker(matcher, byte_ids, markers or {})
            if not step:
                step = _choose(matcher, byte_ids, compare_closers)
                tokens = [byte_ids[byte] for byte in step]
            if not step or None in tokens:
                return None
            num_taken = matcher.try_consume_tokens(tokens)
            num_consumed += num_taken
            if num_taken != len(tokens):
                return None
            text += step
    finally:
        matcher.rollback(num_consumed)
    return bytes(text)


def _choose(matcher: llguidance.LLMatcher, byte_ids: list[int | None],
            compare_closers: bool) -> bytes:
    """The byte a walk takes where the grammar forces none (see `_walk`); b"" if none may
    follow."""
    allowed = (byte for byte in CLOSING_BYTE_ORDER if _allows(matcher, byte_ids, byte))
    first = next(allowed, None)
    if first is None:
        return b""
    if not compare_closers or first not in CLOSERS or _allows(matcher, byte_ids, FREE_TEXT_BYTE):
        return bytes([first])  # not at a closer, or inside free text (a string): the first
    closers = [first] + [byte for byte in CLOSERS[CLOSERS.index(first) + 1:]
                         if _allows(matcher, byte_ids, byte)]
    if len(closers) == 1:
        return bytes([first])
    lengths = {}
    for byte in closers:
        matcher.consume_token(byte_ids[byte])
        rest = _walk(matcher, byte_ids, compare_closers=False)
        matcher.rollback(1)
        if rest is not None:
            lengths[byte] = len(rest)
    return bytes([min(lengths, key=lengths.get)]) if lengths else bytes([first])


def _marker(matcher: llguidance.LLMatcher, byte_ids: list[int | None],
            markers: dict[bytes, int]) -> tuple[bytes, list[int]]:
    """Inside free text, the first marker the grammar takes next and that leads somewhere (the
    grammar forces bytes after it, or accepts): its text and token."""
    if markers and _allows(matcher, byte_ids, FREE_TEXT_BYTE):
        for text, token in markers.items():
            if matcher.try_consume_tokens([token]) == 1:
                leads = matcher.is_accepting() or bool(matcher.compute_ff_bytes())
                matcher.rollback(1)
                if leads:
                    return text, [token]
    return b"", []


def _allows(matcher: llguidance.LLMatcher, byte_ids: list[int | None], byte: int) -> bool:
    token = byte_ids[byte]
    return token is not None and matcher.validate_tokens([token]) == 1


class GrammarCompiler:
    """Compiled constraints for one tokenizer, keyed by `StructuredOutput.key`."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = 256):
        """`vocab_size` is the model's (it may pad the tokenizer's); building the library's
        tokenizer is slow (it reads every token), so an engine makes this on first use."""
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
        self._vocabulary = Vocabulary(self._tokenizer)
        self._cache: collections.OrderedDict[
            tuple[str, str], tuple[llguidance.LLMatcher, dict[bytes, int]]] = \
            collections.OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.num_compiles = 0

    def check(self, structured: StructuredOutput) -> None:
        """Raises ConstraintError (a ValueError), naming the field, if the constraint does not
        compile."""
        self._compiled(structured)

    def matcher(self, structured: StructuredOutput) -> LLGuidanceMatcher:
        """A fresh matcher of the constraint, at the start of the output."""
        compiled, markers = self._compiled(structured)
        return LLGuidanceMatcher(compiled.deep_copy(), self._vocabulary, markers)

    def _compiled(self, structured: StructuredOutput
                  ) -> tuple[llguidance.LLMatcher, dict[bytes, int]]:
        key = structured.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(structured)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiles += 1
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, structured: StructuredOutput
                 ) -> tuple[llguidance.LLMatcher, dict[bytes, int]]:
        field = f"structured.{structured.kind}"
        try:
            grammar = _grammar(structured)
        except ValueError as err:
            raise ConstraintError(field, _reason(str(err))) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(field, _reason(matcher.get_error()))
        return matcher, self._markers(grammar)

    def _markers(self, grammar: str) -> dict[bytes, int]:
        """The special tokens `grammar` names (`<[5,9-12]>`), by text."""
        markers = {}
        for names in _TOKEN_NAMES.findall(grammar):
            for part in names.split(","):
                low, _, high = part.partition("-")
                for token in range(int(low), int(high or low) + 1):
                    text = self._vocabulary.texts.get(token, b"")
                    if text and text not in self._vocabulary.ids_of:
                        markers.setdefault(text, token)
        return markers


def _grammar(structured: StructuredOutput) -> str:
    """The constraint as an llguidance grammar (not yet checked: compiling does that)."""
    kind = structured.kind
    if kind in ("json_schema", "json_object"):
        schema = (json.loads(structured.json_schema) if kind == "json_schema"
                  else ANY_OBJECT_SCHEMA)
        return llguidance.LLMatcher.grammar_from_json_schema(
            bounded_schema(schema, max_string_length=structured.max_string_length,
                           max_integer_digits=structured.max_integer_digits),
            defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(option, ensure_ascii=False)
                                for option in structured.choice))
    assert kind == "grammar", kind
    return llguidance.grammar_from("grammar", structured.grammar)  # Lark, or GBNF converted


_TOKEN_NAMES = re.compile(r"<\[([0-9,\-]+)\]>")
def _reason(message: str) -> str:
    """The library's message without its parser state dump, bounded."""
    message = message.split("\n<state>", 1)[0].strip()
    return message if len(message) <= MAX_REASON_CHARS else message[:MAX_REASON_CHARS] + "..."
