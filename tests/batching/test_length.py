"""Length features, the prior and prediction helpers (host side, no jax)."""

import numpy as np
import pytest

from meshserve.batching.length import (FeatureConfig, LengthPrediction, PriorPredictor,
                                       extract_features, feature_matrix, token_bag)
from meshserve.batching.sampling import SamplingParams


def _features(prompt=(1, 2, 3, 4), **params):
    return extract_features(list(prompt), SamplingParams(**params))


def test_features_hold_the_prompt_and_sampling_params():
    f = _features([5, 5, 7], max_tokens=100, min_tokens=3, temperature=0.5, stop=["\n"])
    assert (f.num_prompt_tokens, f.max_tokens, f.min_tokens) == (3, 100, 3)
    assert f.temperature == 0.5 and f.has_stops and not f.ignore_eos
    assert f.token_bag.shape == (256,) and f.token_bag.dtype == np.float32
    assert f.token_bag.sum() == pytest.approx(1.0)
    assert sorted(f.token_bag[f.token_bag > 0].round(3)) == [0.333, 0.667]


def test_token_bag_is_a_fixed_hash_of_token_ids():
    bag = token_bag([0, 1, 49151, 1], 64)
    assert bag.shape == (64,) and bag.sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(bag, token_bag([1, 49151, 1, 0], 64))  # order-free
    hot = np.flatnonzero(token_bag(range(100_000), 97))
    assert len(hot) == 97  # every bucket is reachable, for any bucket count


def test_feature_matrix_has_the_configured_width():
    config = FeatureConfig(num_buckets=32)
    rows = [extract_features([1, 2], SamplingParams(), config) for _ in range(3)]
    assert feature_matrix(rows).shape == (3, config.num_features) == (3, 38)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="empty prompt"):
        _features([])
    with pytest.raises(ValueError, match="num_buckets"):
        FeatureConfig(num_buckets=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        PriorPredictor(quantiles=(0.5, 0.1))
    with pytest.raises(ValueError, match="output_len"):
        PriorPredictor().observe(_features(max_tokens=8), 9)


def test_prior_is_uniform_between_the_bounds():
    (p,) = PriorPredictor().predict([_features(max_tokens=101)])
    assert p.lengths == (11.0, 51.0, 91.0)
    assert (p.at(0.0), p.median, p.at(1.0)) == (1, 51, 101)
    (p,) = PriorPredictor().predict([_features(max_tokens=101, min_tokens=21)])
    assert p.at(0.0) == 21 and p.median == 61


def test_a_request_that_ignores_eos_without_stops_has_a_known_length():
    f = _features(max_tokens=40, ignore_eos=True)
    assert f.is_length_known and f.bounds == (40, 40)
    (p,) = PriorPredictor().predict([f])
    assert {p.at(q) for q in (0.0, 0.1, 0.5, 1.0)} == {40}
    assert not _features(max_tokens=40, ignore_eos=True, stop_token_ids=[2]).is_length_known


def test_prediction_interpolates_and_rounds_up():
    p = LengthPrediction(quantiles=(0.1, 0.5, 0.9), lengths=(10.0, 20.0, 40.0), low=1, high=100)
    assert p.at(0.5) == 20 and p.at(0.7) == 30 and p.at(0.3) == 15
    assert p.at(0.95) == 70  # halfway from q90 to max_tokens
    assert p.at(0.05) == 6  # ceil(5.5), halfway from the lower bound to q10
    with pytest.raises(ValueError, match="quantile"):
        p.at(1.5)


def test_clipped_prediction_stays_in_bounds_and_never_crosses():
    f = _features(max_tokens=50, min_tokens=5)
    p = LengthPrediction.clipped((0.1, 0.5, 0.9), [0.5, 80.0, 60.0], f)
    assert p.lengths == (5.0, 50.0, 50.0)
