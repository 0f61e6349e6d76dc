"""Per-request sampling parameters, with vLLM's names and defaults, and their per-row arrays.

`SamplingParams` is user input: it is validated once, on construction, and every invalid value
raises `ValueError` naming the field, the allowed range and the value given, so the serving layer
can pass the message straight back to the client. After construction the fields are normalised:
floats are floats, `top_k` is 0 when off (-1 is accepted as off), and `stop` and
`stop_token_ids` are tuples.

`SamplingArrays` are those parameters as the device sampler reads them, one row per plan row. Its
fields are the one table of sampling columns (dtype, neutral value, padded width), and every
host-side operation on them (greedy defaults, padding, concatenation, scattering rows into slots)
is derived from that table.

This module is plain Python and numpy; it must not import jax or anything from meshserve's other
packages.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping, Sequence

import numpy as np

from meshserve.batching.structured import StructuredOutput

MAX_LOGPROBS = 20  # most top logprobs a request may ask for, per token
MAX_SEED = 2**32  # seeds are uint32 on the device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on the device; any value past the vocabulary is all of it
MAX_FLOAT32 = float(np.finfo(np.float32).max)  # float fields are float32 on the device


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's output, and when to stop it.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 are off. The penalties follow
    vLLM: repetition_penalty > 1 discourages any token seen in the prompt or output, presence and
    frequency penalties apply to output tokens only. `logprobs` asks for that many top logprobs per
    output token (0: the chosen token's only), `prompt_logprobs` the same for prompt tokens.
    `structured` constrains the output to a JSON schema, a regex, a choice or a grammar
    (`StructuredOutput`, or a dict of its fields). `speculate` False keeps the request from
    drafting when the engine speculates (`speculative_config`); its tokens are the same either way.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    speculate: bool = True

    def __post_init__(self):
        self._check_lengths()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()
        self._check_extras()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _check_lengths(self) -> None:
        _check_int_range("max_tokens", self.max_tokens, low=1)
        _check_int_range("min_tokens", self.min_tokens, low=0, high=self.max_tokens,
                         high_name="max_tokens")

    def _check_sampling(self) -> None:
        self._set("temperature", _as_float("temperature", self.temperature))
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        _require(self.top_k >= -1, f"top_k must be >= 1, or 0 or -1 for off, got {self.top_k}")
        _require(self.top_k <= MAX_TOP_K, f"top_k must be at most {MAX_TOP_K} (a value past the "
                                          f"vocabulary takes all of it), got {self.top_k}")
        self._set("top_k", max(self.top_k, 0))
        self._set("top_p", _as_float("top_p", self.top_p))
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        self._set("min_p", _as_float("min_p", self.min_p))
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        self._set("repetition_penalty", _as_float("repetition_penalty", self.repetition_penalty))
        _require(self.repetition_penalty > 0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, _as_float(name, getattr(self, name)))
            value = getattr(self, name)
            _require(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")

    def _check_stops(self) -> None:
        self._set("stop", _as_stop_strings(self.stop))
        self._set("stop_token_ids", _as_token_ids("stop_token_ids", self.stop_token_ids))
        _require(isinstance(self.ignore_eos, bool),
                 f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _require(isinstance(self.speculate, bool),
                 f"speculate must be True or False, got {self.speculate!r}")

    def _check_extras(self) -> None:
        if self.seed is not None:
            _check_int_range("seed", self.seed, low=0, high=MAX_SEED - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int_range(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        if isinstance(self.structured, Mapping):
            self._set("structured", _as_structured(self.structured))
        _require(self.structured is None or isinstance(self.structured, StructuredOutput),
                 f"structured must be a StructuredOutput, a dict of its fields, or None, got "
                 f"{type(self.structured).__name__}")


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value) -> None:
    _require(_is_int(value), f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _check_int_range(name: str, value, *, low: int, high: int | None = None,
                     high_name: str | None = None) -> None:
    """Raises unless `value` is an int in [low, high]; `high_name` names a bound set by a field."""
    _check_int(name, value)
    if high is None:
        _require(value >= low, f"{name} must be >= {low}, got {value}")
        return
    upper = f"{high_name} ({high})" if high_name else str(high)
    _require(low <= value <= high, f"{name} must be in [{low}, {upper}], got {value}")


def _as_float(name: str, value) -> float:
    """`value` as a finite float that stays finite in float32 (the sampler's dtype: 1e300 would
    reach it as inf); ints are accepted, bools and strings are not."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(is_number, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    _require(math.isfinite(value) and abs(value) <= MAX_FLOAT32,
             f"{name} must be finite and at most {MAX_FLOAT32:.4g} in size (the sampler "
             f"computes in float32), got {value}")
    return float(value)


def _as_stop_strings(stop) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    _require(isinstance(strings, (list, tuple)),
             f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in strings:
        _require(isinstance(s, str) and s != "",
                 f"stop strings must be non-empty strings, got {s!r}")
    return tuple(strings)


def _as_structured(fields: Mapping) -> StructuredOutput:
    """A dict of `StructuredOutput` fields (JSON input: batch files, client dicts)."""
    known = {f.name for f in dataclasses.fields(StructuredOutput)}
    unknown = sorted(set(fields) - known)
    _require(not unknown, f"structured: unknown fields {unknown}; known: {sorted(known)}")
    return StructuredOutput(**fields)


def _as_token_ids(name: str, ids) -> tuple[int, ...]:
    _require(isinstance(ids, (list, tuple)),
             f"{name} must be a list of ints, got {type(ids).__name__}")
    for token in ids:
        _require(_is_int(token) and token >= 0,
                 f"{name} must hold non-negative ints, got {token!r}")
    return tuple(int(token) for token in ids)


# Per-row sampling arrays: the columns a step plan carries to the device sampler.

@dataclasses.dataclass(frozen=True)
class Column:
    """How one sampling array is stored: its dtype, the value that makes a row (or a padding
    column) neutral and greedy, which width its second axis pads to ("history", "banned"; None for
    a [B] array; "vocab_words": the packed token mask), and whether it copies the `SamplingParams` field of the same name."""

    dtype: type
    neutral: float | int | bool
    width: str | None = None
    from_params: bool = False


def _column(dtype: type, neutral, *, width: str | None = None, from_params: bool = False):
    return dataclasses.field(metadata={"column": Column(dtype, neutral, width, from_params)})


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters of one sub-batch, as the device sampler reads them.

    This class is the one table of sampling columns: greedy defaults, padding, concatenation and
    the pipeline's gather all follow from its fields (`COLUMNS`), and
    `meshserve.model.executor.sampler` registers it as a pytree, so the same class holds the
    device arrays. A new sampling knob is a `SamplingParams` field and one column here
    (`from_params=True`), plus the sampler code that reads it.

    temperature 0 means greedy. top_k 0 means off. `seeds` and `steps` make a row's random draw a
    function of (request seed, output index) only, so batch company never changes it. `history`
    holds the ids of each row's prompt and output so far (padded with -1), for the penalties;
    `history_is_output` marks which of them were generated. While `steps < min_tokens` the row's
    `banned_ids` (EOS and stop ids, padded with -1) are masked. `allowed` is each row's packed
    mask of the tokens its structured-output constraint allows next (`batching/structured.py`):
    all bits set (-1) for an unconstrained row, and only one word wide on the host when no row of
    a sub-batch is constrained; the runner pads it to the vocabulary's words. `is_constrained`
    marks the rows whose mask applies: the sampler decides whether to read the masks from it,
    since a vote over `allowed` itself would cost a collective on a mesh that splits the
    vocabulary (the mask's words follow the logits' split). `num_logprobs` is how many top
    logprobs the row returns, -1 when it returns none: a step where no row does skips the top-K
    over the vocabulary.
    """

    temperature: np.ndarray = _column(np.float32, 0.0, from_params=True)  # [B]
    top_k: np.ndarray = _column(np.int32, 0, from_params=True)  # [B]
    top_p: np.ndarray = _column(np.float32, 1.0, from_params=True)  # [B]
    min_p: np.ndarray = _column(np.float32, 0.0, from_params=True)  # [B]
    repetition_penalty: np.ndarray = _column(np.float32, 1.0, from_params=True)  # [B]
    presence_penalty: np.ndarray = _column(np.float32, 0.0, from_params=True)  # [B]
    frequency_penalty: np.ndarray = _column(np.float32, 0.0, from_params=True)  # [B]
    seeds: np.ndarray = _column(np.uint32, 0)  # [B]
    steps: np.ndarray = _column(np.int32, 0)  # [B] index of the output token being sampled
    history: np.ndarray = _column(np.int32, -1, width="history")  # [B, H]
    history_is_output: np.ndarray = _column(np.bool_, False, width="history")  # [B, H]
    min_tokens: np.ndarray = _column(np.int32, 0, from_params=True)  # [B]
    banned_ids: np.ndarray = _column(np.int32, -1, width="banned")  # [B, E]
    allowed: np.ndarray = _column(np.int32, -1, width="vocab_words")  # [B, W] packed token mask
    is_constrained: np.ndarray = _column(np.bool_, False)  # [B] whether `allowed` applies
    num_logprobs: np.ndarray = _column(np.int32, -1)  # [B]

    def __post_init__(self):
        rows = self.temperature.shape[0]
        for name in COLUMNS:
            assert getattr(self, name).shape[0] == rows, name
        assert self.history.shape == self.history_is_output.shape

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


COLUMNS: dict[str, Column] = {field.name: field.metadata["column"]
                              for field in dataclasses.fields(SamplingArrays)}


def params_columns(params: Sequence[SamplingParams]) -> dict[str, np.ndarray]:
    """The columns copied from each row's `SamplingParams`."""
    return {name: np.array([getattr(p, name) for p in params], column.dtype)
            for name, column in COLUMNS.items() if column.from_params}


def greedy_sampling(rows: int, history_width: int = 1) -> SamplingArrays:
    """Greedy, penalty-free sampling for `rows` rows, with no stop masking."""
    widths = {"history": history_width, "banned": 1, "vocab_words": 1}
    return SamplingArrays(**{
        name: np.full((rows,) if c.width is None else (rows, widths[c.width]), c.neutral, c.dtype)
        for name, c in COLUMNS.items()})


def pad_sampling(arrays: SamplingArrays, *, rows: int | None = None,
                 widths: Mapping[str, int | None] | None = None,
                 index: np.ndarray | None = None) -> SamplingArrays:
    """`arrays` with row i at row `index[i]` (default: in order) of `rows` rows, and each 2-D
    column `widths[its width]` wide (default: as it is); the other rows and columns neutral."""
    rows = arrays.num_rows if rows is None else rows
    index = np.arange(arrays.num_rows) if index is None else index
    padded = {}
    for name, c in COLUMNS.items():
        value = np.asarray(getattr(arrays, name))
        if c.width is None:
            padded[name] = np.full(rows, c.neutral, c.dtype)
            padded[name][index] = value
        else:
            width = (widths or {}).get(c.width) or value.shape[1]
            padded[name] = np.full((rows, width), c.neutral, c.dtype)
            padded[name][index, :value.shape[1]] = value
    return SamplingArrays(**padded)


def concat_sampling(arrays: Sequence[SamplingArrays]) -> SamplingArrays:
    """The rows of several sub-batches' arrays, in order, 2-D columns padded to the widest."""
    merged = {}
    for name, c in COLUMNS.items():
        values = [np.asarray(getattr(a, name)) for a in arrays]
        if c.width is not None:
            width = max(v.shape[1] for v in values)
            values = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=c.neutral)
                      for v in values]
        merged[name] = np.concatenate(values).astype(c.dtype)
    return SamplingArrays(**merged)


def scatter_rows(picks: Sequence[tuple[SamplingArrays, int]], slots: Sequence[int],
                 num_slots: int) -> SamplingArrays:
    """Row `row` of `arrays` at slot `slots[i]`, for each pick i `(arrays, row)`, out of
    `num_slots`; empty slots greedy and neutral, 2-D columns as wide as the widest source."""
    rows = [take_rows(arrays, [row]) for arrays, row in picks]
    merged = concat_sampling(rows) if rows else greedy_sampling(0)
    return pad_sampling(merged, rows=num_slots, index=np.asarray(slots, np.int64))


def take_rows(arrays: SamplingArrays, rows: Sequence[int]) -> SamplingArrays:
    """Rows `rows` of `arrays`, in that order."""
    return SamplingArrays(**{name: np.asarray(getattr(arrays, name))[list(rows)]
                             for name in COLUMNS})
