"""Structured output: what a request's output must match, and the host state that enforces it.

`StructuredOutput` is user input, one constraint per request: a JSON schema, any JSON object, a
regular expression, a choice of strings, or a grammar (Lark, or GBNF). It checks only its own
shape on construction (exactly one kind, of the right type; a schema given as text must be JSON);
whether the schema, regex or grammar itself is valid is for the grammar library to say when the
engine compiles it (`meshserve.serving.engine.grammar`), before the request is queued.

Bounds (JSON constraints only; `BOUNDS`): `max_string_length` caps every string the output may
write at that many characters, and every object key its schema does not name, and
`max_integer_digits` caps the digits of every number before its point (|x| < 10**digits); a
number the schema types has at most 8 digits after it in any case. Unset, a bound is the
engine's default (`EngineConfig.structured_max_string_length`, `structured_max_integer_digits`),
and unset there the schema's own limits are all there is, as in OpenAI's API, which documents
none. `meshserve.serving.engine.json_schemas` writes them into the schema.

`Matcher` is what the host needs of a compiled constraint, one per request: the bitmask of the
tokens allowed next, and advancing by the token sampled. `Constraint` is that matcher inside a
request: it keeps the mask of the request's next token ready (computed once per output, right
after the previous token), so a step plan copies it into the `allowed` sampling column, and it
decides when the constraint ends the request:
  - complete: the matcher accepts and nothing but EOS may follow: "stop", at once;
  - dead: no token may follow, or the library refused a token: "unsatisfiable", with the
    library's reason as the stop reason, so a constraint the tokenizer cannot meet ends the
    request instead of running to max_tokens or hanging.
With `ignore_eos` the EOS bits are cleared from the mask: the output goes on until the constraint
is complete or `max_tokens`, as unconstrained output goes on until `max_tokens`.

Room to close: a constraint that knows its request's `max_tokens` keeps the output completable
within it. The matcher finds a shortest completion from the current state and its length in
tokens (`num_closing_tokens`, "need"). While the tokens left (max_tokens minus the outputs so
far) exceed need + `CLOSING_RESERVE`, the mask is the grammar's; once they do not, it is narrowed
to the tokens that begin a completion within what is left (`fill_closing_mask`), so the sampler
picks among them and each step brings the output one token nearer complete. Once the matcher
accepts, the mask is the grammar's again (with EOS; where nothing else may follow, the request
ends "stop" at once), and an output that reaches max_tokens complete ends "stop" too
(`request.constrained_stop`): "length" means the output is not complete. Where need exceeds
what is left, or the matcher finds no completion, the mask is the grammar's, as without a
budget. The reserve covers a token that opens more than it closes (a `,` before another array
item) written just before the closing starts; the output can still end incomplete only if one
token written freely raises need by at least the tokens that were left beyond need (more than
`CLOSING_RESERVE`, or it would not have been free).

Masks are packed as the device reads them: int32 words, bit `t % 32` of word `t // 32` set when
token t is allowed (`mask_words`). All bits set (-1) allows everything.

One step, many rows (`advance_all`): every constrained row of a step takes its token first, and
then the masks of all of them are computed in one call of a `MaskFiller`, which the scheduler is
given: the grammar library's parallel fill over every matcher at once
(`meshserve.serving.engine.grammar.fill_masks`), or `fill_each`, one matcher after another. Each
mask is then finished as above (EOS cleared, narrowed to a completion), which is per row.

The two halves can run apart (`Constraint.consume`, then `fill_due`): a constraint that took its
token and goes on has its mask due (`is_mask_due`) until the fill, which the engine runs while the
device computes the next step's forward pass. What ends a request is known at once where the
mask is not needed to tell: a refused token ("unsatisfiable"), or a matcher that is stopped
(nothing but EOS may follow, so the mask is empty: "stop" when accepting, else
"unsatisfiable"). Only a matcher that goes on but whose next bytes no token of the vocabulary
spells ends at the fill.

This module is plain Python and numpy; it must not import jax, the grammar library, or anything
from meshserve's other packages.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Protocol, Sequence

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex, grammar or choice list, as text
MAX_CHOICES = 4096
CLOSING_RESERVE = 4  # tokens beyond the closing's own at which closing starts (see above)
BOUNDS = ("max_string_length", "max_integer_digits")
JSON_KINDS = ("json_schema", "json_object")  # the kinds bounds apply to
MAX_BOUNDS = {"max_string_length": 1 << 16,  # characters; longer is no bound within a context
              "max_integer_digits": 15}  # a float64 holds 15 digits exactly


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutput:
    """Constrains a request's output; set exactly one field.

    json_schema: a JSON Schema (a dict, or its JSON text); the output is JSON valid against it.
    json_object: True: the output is one JSON object, any keys.
    regex: the output matches this regular expression, whole (Rust `regex` syntax).
    choice: the output is exactly one of these strings.
    grammar: the output is a sentence of this grammar (Lark syntax with a `start` rule, or GBNF
    with a `root` rule).

    With `json_schema` or `json_object`, optional bounds (see the module docstring):
    max_string_length: no string (or object key) longer than this many characters.
    max_integer_digits: no number with more digits than this before its point.

    After construction `json_schema` is compact JSON text (keys in their given order, which is
    the order the output writes them in), so equal schemas are one constraint (one compile), and
    `choice` is a tuple.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    max_string_length: int | None = None
    max_integer_digits: int | None = None

    def __post_init__(self):
        given = [kind for kind in KINDS if _is_set(self, kind)]
        if len(given) != 1:
            raise ValueError(f"structured output: set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured.json_object must be True or False, got "
                             f"{self.json_object!r}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _canonical_schema(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(f"structured.{name}", value)
        if self.choice is not None:
            object.__setattr__(self, "choice", _as_choices(self.choice))
        for name in BOUNDS:
            value = getattr(self, name)
            check_bound(f"structured.{name}", name, value)
            if value is not None and given[0] not in JSON_KINDS:
                raise ValueError(f"structured.{name} bounds JSON (json_schema or json_object), "
                                 f"not {given[0]}: write the limit into the {given[0]} itself")

    @property
    def kind(self) -> str:
        """The one field that is set."""
        return next(kind for kind in KINDS if _is_set(self, kind))

    @property
    def bounds(self) -> tuple[int | None, ...]:
        """The bounds, in `BOUNDS` order (None: unset)."""
        return tuple(getattr(self, name) for name in BOUNDS)

    @property
    def key(self) -> tuple[str, str, tuple[int | None, ...]]:
        """`(kind, text, bounds)`: equal for equal constraints; what compiled grammars are
        cached by."""
        kind = self.kind
        if kind == "json_object":
            return kind, "", self.bounds
        if kind == "choice":
            return kind, json.dumps(list(self.choice)), self.bounds
        return kind, getattr(self, kind), self.bounds

    def with_default_bounds(self, **defaults: int | None) -> StructuredOutput:
        """This constraint with each bound it leaves unset taken from `defaults` (the engine's);
        a constraint that is not JSON takes none."""
        unset = {name: value for name, value in defaults.items()
                 if value is not None and getattr(self, name) is None}
        if self.kind not in JSON_KINDS or not unset:
            return self
        return dataclasses.replace(self, **unset)


def _is_set(structured: StructuredOutput, kind: str) -> bool:
    value = getattr(structured, kind)
    return value is not False and value is not None


def check_bound(field: str, name: str, value) -> None:
    """Bound `name` (one of `BOUNDS`) is unset, or an int in [1, MAX_BOUNDS[name]]; `field`
    names it in the error (the engine's default is a knob of its own name)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {value!r}")
    if not 1 <= value <= MAX_BOUNDS[name]:
        raise ValueError(f"{field} must be in [1, {MAX_BOUNDS[name]}], got {value}")


def _canonical_schema(schema) -> str:
    if isinstance(schema, str):
        _check_text("structured.json_schema", schema)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"structured.json_schema is not valid JSON: {err.msg} at line "
                             f"{err.lineno} column {err.colno}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured.json_schema must be a JSON object (a dict), got "
                         f"{type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"structured.json_schema cannot be written as JSON: {err}") from None
    _check_text("structured.json_schema", text)
    return text


def _check_text(name: str, value) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} is empty")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{name} is {len(value)} characters long: at most "
                         f"{MAX_CONSTRAINT_CHARS}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} holds a lone surrogate at index {err.start}; send valid "
                         "Unicode") from None


def _as_choices(choice) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise ValueError(f"structured.choice must be a list of strings, got "
                         f"{type(choice).__name__}")
    if not choice:
        raise ValueError("structured.choice is empty: give at least one string")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured.choice has {len(choice)} strings: at most {MAX_CHOICES}")
    for index, value in enumerate(choice):
        _check_text(f"structured.choice[{index}]", value)
    _check_text("structured.choice", json.dumps(list(choice)))
    return tuple(choice)


def mask_words(vocab_size: int) -> int:
    """Int32 words of a packed mask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    """The token ids a packed mask allows, ascending."""
    bits = np.unpackbits(np.ascontiguousarray(mask, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


class Matcher(Protocol):
    """One request's compiled constraint, advanced by the host one token at a time."""

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the packed mask of the tokens allowed next into `out` (int32 [words])."""

    def advance(self, token: int) -> bool:
        """Consumes a sampled token; False if the constraint refused it (the matcher is dead)."""

    def is_accepting(self) -> bool:
        """Whether the output so far is a whole sentence of the constraint."""

    def is_stopped(self) -> bool:
        """Whether nothing but EOS may follow (complete, or dead)."""

    def error(self) -> str:
        """Why the matcher is dead; "" while it is not."""

    def num_closing_tokens(self) -> int | None:
        """The length in tokens of the shortest completion found from here (0 when accepting);
        None if none is found."""

    def num_closing_tokens_at_most(self) -> int | None:
        """An upper bound on `num_closing_tokens`, cheaper to get; None if unknown."""

    def fill_closing_mask(self, out: np.ndarray, budget: int) -> None:
        """Writes into `out` (int32 [words]) the tokens that start a completion found from here
        of at most `budget` tokens; all zero if none."""


# Writes the mask of each matcher's next token into the row of `out` (int32 [n, words]) of the
# same index: `fill_each`, or a grammar library's fill of all of them at once.
MaskFiller = Callable[[Sequence[Matcher], np.ndarray], None]


def fill_each(matchers: Sequence[Matcher], out: np.ndarray) -> None:
    """The `MaskFiller` of any matchers: one after another."""
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(out[row])


def advance_all(constraints: Sequence[Constraint], tokens: Sequence[int],
                fill_masks: MaskFiller = fill_each) -> list[tuple[str, str | None] | None]:
    """Each constraint takes its token; then the masks of those still going are computed
    together, in one call of `fill_masks` (see the module docstring). Returns each one's
    `Constraint.advance` result."""
    ends = [constraint.consume(token) for constraint, token in zip(constraints, tokens)]
    due = [i for i, end in enumerate(ends) if end is None]
    for i, end in zip(due, fill_due([constraints[i] for i in due], fill_masks)):
        ends[i] = end
    return ends


def fill_due(constraints: Sequence[Constraint], fill_masks: MaskFiller = fill_each
             ) -> list[tuple[str, str | None] | None]:
    """The masks `consume` left due, computed together in one call of `fill_masks`; returns how
    each constraint then ends its request (`Constraint.end`), if it does."""
    assert all(c.is_mask_due for c in constraints), "a mask is filled once per token"
    if not constraints:
        return []
    masks = np.empty((len(constraints), constraints[0].num_words), np.int32)
    assert all(c.num_words == masks.shape[1] for c in constraints), "one vocabulary per batch"
    fill_masks([constraint.matcher for constraint in constraints], masks)
    for constraint, mask in zip(constraints, masks):
        constraint.take_mask(mask)
    return [constraint.end() for constraint in constraints]


@dataclasses.dataclass(eq=False)
class Constraint:
    """A request's matcher and the mask of its next token (see the module docstring)."""

    matcher: Matcher
    num_words: int
    eos_token_ids: tuple[int, ...]
    ignore_eos: bool = False
    max_tokens: int | None = None  # the request's; None: no room kept to close
    mask: np.ndarray = dataclasses.field(init=False)  # int32 [num_words]
    num_consumed: int = 0  # outputs advanced through the matcher
    is_closing: bool = False  # the mask is narrowed to a completion within max_tokens
    is_mask_due: bool = False  # consumed a token whose next mask is not computed yet

    def __post_init__(self):
        self.mask = np.zeros(self.num_words, np.int32)
        self._refresh()

    def advance(self, token: int) -> tuple[str, str | None] | None:
        """Takes the request's next output; returns `(finish_reason, stop_reason)` when the
        constraint ends the request, else None."""
        return advance_all([self], [token])[0]

    def consume(self, token: int) -> tuple[str, str | None] | None:
        """The matcher takes `token`. Returns how the constraint ends the request where that
        needs no mask: "unsatisfiable" if it refused the token; once the matcher is stopped, its
        mask is empty and `end` says. Else None, and the mask is due (`take_mask`)."""
        self.num_consumed += 1
        if not self.matcher.advance(token):
            return "unsatisfiable", self._dead_reason(f"the constraint refused token {token}")
        if self.matcher.is_stopped():
            self.mask[:] = 0  # what `_finish_mask` makes of any mask of a stopped matcher
            self.is_closing = False
            return self.end()
        self.is_mask_due = True
        return None

    def take_mask(self, mask: np.ndarray) -> None:
        """Refreshes the mask from the matcher's own (`Matcher.fill_mask`'s, computed for its
        state after `consume`)."""
        self.mask[:] = mask
        self.is_mask_due = False
        self._finish_mask()

    def end(self) -> tuple[str, str | None] | None:
        """Whether the constraint, as it stands, ends the request (see `advance`)."""
        if self.has_allowed():
            return None
        if self.matcher.is_accepting():
            return "stop", None
        return "unsatisfiable", self._dead_reason("no token of the vocabulary can continue the "
                                                  "constraint")

    def has_allowed(self) -> bool:
        return bool(self.mask.any())

    def is_complete(self) -> bool:
        """Whether the output so far is a whole sentence of the constraint."""
        return self.matcher.is_accepting()

    def _refresh(self) -> None:
        self.matcher.fill_mask(self.mask)
        self._finish_mask()

    def _finish_mask(self) -> None:
        """The matcher's mask, made the request's: nothing once stopped, EOS cleared under
        `ignore_eos`, narrowed to a completion when closing is due."""
        if self.matcher.is_stopped():
            self.mask[:] = 0  # complete or dead: the EOS that would follow is not sampled
        elif self.ignore_eos:
            words = self.mask.view(np.uint32)
            for token in self.eos_token_ids:
                if token < 32 * self.num_words:
                    words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
        self.is_closing = self._is_closing_due()
        if self.is_closing:
            closing = np.empty_like(self.mask)
            self.matcher.fill_closing_mask(closing, self.max_tokens - self.num_consumed)
            np.bitwise_and(closing, self.mask, out=closing)
            self.is_closing = bool(closing.any())  # else the grammar's mask, as it stands
            if self.is_closing:
                self.mask[:] = closing

    def _is_closing_due(self) -> bool:
        """Whether the tokens left are down to what closing needs (see the module docstring);
        the cheap bound first, the closing walk only when the bound says it may be due."""
        if self.max_tokens is None or self.matcher.is_stopped():
            return False
        num_left = self.max_tokens - self.num_consumed
        if num_left <= 0:
            return False
        bound = self.matcher.num_closing_tokens_at_most()
        if bound is not None and num_left > bound + CLOSING_RESERVE:
            return False
        need = self.matcher.num_closing_tokens()
        return need is not None and 0 < need <= num_left <= need + CLOSING_RESERVE

    def _dead_reason(self, what: str) -> str:
        error = self.matcher.error()
        return f"{what}: {error}" if error else what
