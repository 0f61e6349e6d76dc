"""The grammar library behind structured output: llguidance, behind one small interface.

`GrammarCompiler` compiles a `StructuredOutput` (`batching/structured.py`) for one tokenizer and
hands out `Matcher`s: each distinct constraint is compiled once and kept (least recently used
first out, at most `max_cached`), and every request gets its own copy of the compiled matcher. An
invalid schema, regex or grammar raises ValueError with the library's reason, naming the field.

Why llguidance: on SmolLM2's vocabulary its mask and its compiles cost little beside a step
(docs/benchmarks.md, "Structured output", has the figures), it fills a numpy bitmask with no
torch, it has no dependencies, and one abi3 wheel serves Python 3.11 and 3.12.

JSON is compact (`", "` and `": "` between items, no other whitespace): a small model given
free whitespace can spend its whole budget on newlines. For the same reason a JSON number has at
most `MAX_FRACTION_DIGITS` digits after the point (a `multipleOf` added to every number the
schema leaves open, which only narrows what is valid): SmolLM2 writes digits one token at a time
and, unbounded, can repeat them until max_tokens.

Thread-safe: the admission check makes matchers on the front ends' threads. This is the only module
that imports llguidance.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Sequence

import llguidance
import numpy as np

from meshserve.batching.structured import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_FRACTION_DIGITS = 8
_ANY_VALUE = {"anyOf": [{"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
                        {"type": "array", "items": {"$ref": "#/$defs/value"}},
                        {"type": "string"}, {"type": "number"}, {"type": "boolean"},
                        {"type": "null"}]}
ANY_OBJECT_SCHEMA = {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"},
                     "$defs": {"value": _ANY_VALUE}}
MAX_REASON_CHARS = 2000  # of the library's message, which can hold a parser state dump


class ConstraintError(ValueError):
    """A constraint that does not compile: `field` is `structured.<kind>`, `reason` the
    library's."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class LLGuidanceMatcher:
    """One request's matcher (the `Matcher` protocol of `batching/structured.py`)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_mask(self, out: np.ndarray) -> None:
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, token: int) -> bool:
        return self._matcher.consume_token(token)

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str:
        return _reason(self._matcher.get_error())


class GrammarCompiler:
    """Compiled constraints for one tokenizer, keyed by `StructuredOutput.key`."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = 256):
        """`vocab_size` is the model's (it may pad the tokenizer's); building the library's
        tokenizer is slow (it reads every token), so an engine makes this on first use."""
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
        self._cache: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = \
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
        return LLGuidanceMatcher(self._compiled(structured).deep_copy())

    def _compiled(self, structured: StructuredOutput) -> llguidance.LLMatcher:
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

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        field = f"structured.{structured.kind}"
        try:
            grammar = _grammar(structured)
        except ValueError as err:
            raise ConstraintError(field, _reason(str(err))) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(field, _reason(matcher.get_error()))
        return matcher


def _grammar(structured: StructuredOutput) -> str:
    """The constraint as an llguidance grammar (not yet checked: compiling does that)."""
    kind = structured.kind
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            bounded_numbers(json.loads(structured.json_schema)), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(ANY_OBJECT_SCHEMA),
                                                             defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(option, ensure_ascii=False)
                                for option in structured.choice))
    assert kind == "grammar", kind
    return llguidance.grammar_from("grammar", structured.grammar)  # Lark, or GBNF converted


_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not schemas


def bounded_numbers(schema):
    """`schema` with `multipleOf: 10**-MAX_FRACTION_DIGITS` on every number type that has no
    `multipleOf` (see the module docstring); everything else as it is."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else bounded_numbers(value)
           for key, value in schema.items()}
    types = schema.get("type")
    is_number = types == "number" or (isinstance(types, list) and "number" in types)
    if is_number and "multipleOf" not in schema:
        out["multipleOf"] = 10.0 ** -MAX_FRACTION_DIGITS
    return out


def _reason(message: str) -> str:
    """The library's message without its parser state dump, bounded."""
    message = message.split("\n<state>", 1)[0].strip()
    return message if len(message) <= MAX_REASON_CHARS else message[:MAX_REASON_CHARS] + "..."
