"""Per-request sampling parameters, with vLLM's names and defaults.

`SamplingParams` is user input: it is validated once, on construction, and every invalid value
raises `ValueError` naming the field, the allowed range and the value given, so the serving layer
can pass the message straight back to the client. After construction the fields are normalised:
floats are floats, `top_k` is 0 when off (-1 is accepted as off), and `stop` and
`stop_token_ids` are tuples.

This module is plain Python; it must not import jax or anything from meshserve's other packages.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

MAX_LOGPROBS = 20  # most top logprobs a request may ask for, per token
MAX_SEED = 2**32  # seeds are uint32 on the device


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's output, and when to stop it.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 are off. The penalties follow
    vLLM: repetition_penalty > 1 discourages any token seen in the prompt or output, presence and
    frequency penalties apply to output tokens only. `logprobs` asks for that many top logprobs per
    output token (0: the chosen token's only), `prompt_logprobs` the same for prompt tokens.
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

    def _check_extras(self) -> None:
        if self.seed is not None:
            _check_int_range("seed", self.seed, low=0, high=MAX_SEED - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int_range(name, getattr(self, name), low=0, high=MAX_LOGPROBS)


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
    """`value` as a finite float; ints are accepted, bools and strings are not."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(is_number, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    _require(math.isfinite(value), f"{name} must be finite, got {value}")
    return float(value)


def _as_stop_strings(stop) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    _require(isinstance(strings, (list, tuple)),
             f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in strings:
        _require(isinstance(s, str) and s != "",
                 f"stop strings must be non-empty strings, got {s!r}")
    return tuple(strings)


def _as_token_ids(name: str, ids) -> tuple[int, ...]:
    _require(isinstance(ids, (list, tuple)),
             f"{name} must be a list of ints, got {type(ids).__name__}")
    for token in ids:
        _require(_is_int(token) and token >= 0,
                 f"{name} must hold non-negative ints, got {token!r}")
    return tuple(int(token) for token in ids)
