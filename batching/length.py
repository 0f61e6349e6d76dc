"""Output-length prediction, host side: request features, predicted quantiles, the predictor
protocol and the prior that serves before any training.

The scheduler calls `extract_features` once per request at admission, `predict` on a batch of
features, and `observe` when a request finishes with its actual output length. A learned predictor
(`meshserve.model.length_predictor`) implements the same `LengthPredictor` protocol.

Bounds every prediction respects (`LengthFeatures.bounds`): an output has at least
max(1, min_tokens) and at most max_tokens tokens. A request with `ignore_eos` and no stop strings
or stop token ids always runs to max_tokens, so its length is known and every quantile equals it.

This module is plain Python and numpy; it must not import jax or anything outside `batching`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence

import numpy as np

from meshserve.batching.sampling import SamplingParams

DEFAULT_QUANTILES = (0.1, 0.5, 0.9)
FEATURE_VERSION = 1  # bump when the layout of `LengthFeatures.vector` changes
NUM_SCALAR_FEATURES = 6  # the entries of `LengthFeatures.vector` before the token bag
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash: a fixed, process-independent hash


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """How features are extracted. A learned predictor is only valid for the config it was
    trained with, so it is saved with the model and checked on load.

    `num_buckets` is the width of the hashed bag of prompt tokens: token id t counts towards
    bucket `((t * 2654435761) mod 2**32) * num_buckets >> 32`.
    """

    num_buckets: int = 256
    version: int = FEATURE_VERSION

    def __post_init__(self):
        if not (isinstance(self.num_buckets, int) and 1 <= self.num_buckets <= 65536):
            raise ValueError(f"num_buckets must be an int in [1, 65536], got {self.num_buckets!r}")
        if self.version != FEATURE_VERSION:
            raise ValueError(f"feature version {self.version} is not this code's "
                             f"({FEATURE_VERSION}); retrain the predictor")

    @property
    def num_features(self) -> int:
        return NUM_SCALAR_FEATURES + self.num_buckets

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LengthFeatures:
    """What a predictor knows about one request at admission. `token_bag` [num_buckets] holds
    the fraction of prompt tokens hashed to each bucket (it sums to 1)."""

    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    temperature: float
    ignore_eos: bool
    has_stops: bool  # any stop string or stop token id
    token_bag: np.ndarray  # [num_buckets] float32

    @property
    def is_length_known(self) -> bool:
        """True when the output always has exactly max_tokens tokens (ignore_eos, no stops)."""
        return self.ignore_eos and not self.has_stops

    @property
    def bounds(self) -> tuple[int, int]:
        """The shortest and longest possible output, in tokens."""
        if self.is_length_known:
            return self.max_tokens, self.max_tokens
        return max(1, self.min_tokens), self.max_tokens

    def vector(self) -> np.ndarray:
        """[NUM_SCALAR_FEATURES + num_buckets] float32: log lengths, sampling flags, token bag.
        Lengths enter as log1p so a linear model sees ratios; temperature is capped at 2."""
        scalars = np.array([math.log1p(self.num_prompt_tokens), math.log1p(self.max_tokens),
                            math.log1p(self.min_tokens), min(self.temperature, 2.0),
                            float(self.ignore_eos), float(self.has_stops)], np.float32)
        return np.concatenate([scalars, self.token_bag])


def extract_features(prompt_token_ids: Sequence[int], params: SamplingParams,
                     config: FeatureConfig = FeatureConfig()) -> LengthFeatures:
    """The features of one request: numpy only, O(prompt length)."""
    if len(prompt_token_ids) == 0:
        raise ValueError("cannot extract length features from an empty prompt")
    return LengthFeatures(num_prompt_tokens=len(prompt_token_ids), max_tokens=params.max_tokens,
                          min_tokens=params.min_tokens, temperature=params.temperature,
                          ignore_eos=params.ignore_eos,
                          has_stops=bool(params.stop or params.stop_token_ids),
                          token_bag=token_bag(prompt_token_ids, config.num_buckets))


def token_bag(token_ids: Sequence[int], num_buckets: int) -> np.ndarray:
    """[num_buckets] float32: the fraction of `token_ids` hashed into each bucket."""
    ids = np.asarray(token_ids, dtype=np.uint64)
    hashed = (ids * np.uint64(_HASH_MULTIPLIER)) & np.uint64(0xFFFFFFFF)
    buckets = (hashed * np.uint64(num_buckets)) >> np.uint64(32)  # fastrange: any num_buckets
    counts = np.bincount(buckets.astype(np.int64), minlength=num_buckets)
    return (counts / len(ids)).astype(np.float32)


def feature_matrix(features: Sequence[LengthFeatures]) -> np.ndarray:
    """[B, num_features] float32, one row per request."""
    return np.stack([f.vector() for f in features])


@dataclasses.dataclass(frozen=True)
class LengthPrediction:
    """Predicted quantiles of one request's output length.

    `lengths[i]` is the `quantiles[i]` quantile, in tokens: non-decreasing and within
    [low, high]. Between the stored quantiles, and out to the certain bounds (quantile 0 is
    `low`, quantile 1 is `high` = max_tokens), `at` interpolates linearly.
    """

    quantiles: tuple[float, ...]
    lengths: tuple[float, ...]
    low: int
    high: int

    def __post_init__(self):
        if len(self.quantiles) != len(self.lengths) or not self.quantiles:
            raise ValueError(f"need one length per quantile, got {len(self.quantiles)} "
                             f"quantiles and {len(self.lengths)} lengths")
        assert 1 <= self.low <= self.high, (self.low, self.high)
        assert list(self.lengths) == sorted(self.lengths), self.lengths
        assert self.low <= self.lengths[0] and self.lengths[-1] <= self.high, self

    @classmethod
    def clipped(cls, quantiles: Sequence[float], lengths: Sequence[float],
                features: LengthFeatures) -> LengthPrediction:
        """A prediction from raw `lengths`, clipped to the request's bounds and made
        non-decreasing (so quantiles never cross)."""
        low, high = features.bounds
        values = np.maximum.accumulate(np.clip(np.asarray(lengths, np.float64), low, high))
        return cls(tuple(float(q) for q in quantiles), tuple(float(v) for v in values), low, high)

    def at(self, q: float) -> int:
        """The q quantile in whole tokens (rounded up), for any q in [0, 1]."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        value = np.interp(q, (0.0, *self.quantiles, 1.0), (self.low, *self.lengths, self.high))
        return int(math.ceil(value - 1e-9))

    @property
    def median(self) -> int:
        return self.at(0.5)


class LengthPredictor(Protocol):
    """What the scheduler needs from a predictor. `predict` runs at admission; `observe` runs
    when a request finishes and must be cheap (it only logs the sample)."""

    quantiles: tuple[float, ...]

    def predict(self, features: Sequence[LengthFeatures]) -> list[LengthPrediction]: ...

    def observe(self, features: LengthFeatures, output_len: int) -> None: ...


class PriorPredictor:
    """The predictor with no data: it assumes every output length from the lower bound to
    max_tokens is equally likely, whatever the prompt, so the q quantile is
    `low + q * (max_tokens - low)` (the median is about max_tokens / 2). It knows only the
    bounds; `observe` discards the sample.
    """

    def __init__(self, quantiles: Sequence[float] = DEFAULT_QUANTILES):
        self.quantiles = check_quantiles(quantiles)

    def predict(self, features: Sequence[LengthFeatures]) -> list[LengthPrediction]:
        return [self.predict_one(f) for f in features]

    def predict_one(self, features: LengthFeatures) -> LengthPrediction:
        low, high = features.bounds
        lengths = [low + q * (high - low) for q in self.quantiles]
        return LengthPrediction.clipped(self.quantiles, lengths, features)

    def observe(self, features: LengthFeatures, output_len: int) -> None:
        check_output_len(features, output_len)


def check_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
    """`quantiles` as a tuple, or ValueError unless strictly increasing within (0, 1)."""
    values = tuple(float(q) for q in quantiles)
    is_increasing = all(a < b for a, b in zip(values, values[1:]))
    if not values or not is_increasing or values[0] <= 0.0 or values[-1] >= 1.0:
        raise ValueError(f"quantiles must be strictly increasing within (0, 1), got {quantiles}")
    return values


def check_output_len(features: LengthFeatures, output_len: int) -> None:
    """ValueError unless `output_len` is a whole number of tokens within the request's bounds."""
    high = features.max_tokens
    if not isinstance(output_len, (int, np.integer)) or not 1 <= output_len <= high:
        raise ValueError(f"output_len must be an int in [1, max_tokens={high}], "
                         f"got {output_len!r}")
