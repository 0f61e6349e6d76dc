"""The learned length predictor: it learns a planted signal, calibrates its quantiles, saves and
loads, retrains on its worker thread and compiles nothing new in steady state."""

import threading

import numpy as np
import pytest

from meshserve.batching.length import FeatureConfig, PriorPredictor, extract_features
from meshserve.batching.sampling import SamplingParams
from meshserve.model.executor.runner import CompileCounter
from meshserve.model.length_predictor import LearnedPredictor, PredictorConfig
from meshserve.serving.bench.length_eval import (MarginalPredictor, evaluate,
                                                 planted_length_workload, sample_features, split)

CONFIG = PredictorConfig(capacity=1024, num_steps=200)
SMALL = PredictorConfig(capacity=256, num_steps=40, eval_every=20, max_batch=32)  # quick to train


def _featurize(sample, config=CONFIG):
    return sample_features(sample, config.features)


@pytest.fixture(scope="module")
def planted():
    return split(planted_length_workload(1400, seed=1), 0.7, seed=1)


@pytest.fixture(scope="module")
def trained(planted):
    train, _ = planted
    predictor = LearnedPredictor(CONFIG, background=False)
    for sample in train:
        predictor.observe(_featurize(sample), sample.output_len)
    assert predictor.retrain()
    return predictor


def test_learns_the_planted_signal(planted, trained):
    train, test = planted
    features, actual = [_featurize(s) for s in test], [s.output_len for s in test]
    marginal = MarginalPredictor(CONFIG.quantiles)
    for sample in train:
        marginal.observe(_featurize(sample), sample.output_len)
    learned = evaluate(trained, features, actual)
    assert learned["mae"] < 0.3 * evaluate(PriorPredictor(), features, actual)["mae"]
    assert learned["mae"] < 0.6 * evaluate(marginal, features, actual)["mae"]
    assert learned["coverage"]["q90"] == pytest.approx(0.9, abs=0.06)
    assert learned["coverage"]["q10"] == pytest.approx(0.1, abs=0.12)  # lengths are whole tokens


def test_the_prior_serves_until_min_samples(planted):
    train, test = planted
    predictor = LearnedPredictor(CONFIG, background=False)
    for sample in train[:CONFIG.min_samples - 1]:
        predictor.observe(_featurize(sample), sample.output_len)
    assert not predictor.retrain() and not predictor.is_trained
    features = [_featurize(s) for s in test[:5]]
    assert predictor.predict(features) == PriorPredictor().predict(features)


def test_known_lengths_are_exact_and_not_logged(trained):
    features = extract_features([1, 2, 3], SamplingParams(max_tokens=77, ignore_eos=True))
    (prediction,) = trained.predict([features])
    assert prediction.at(0.1) == prediction.at(0.9) == 77
    fresh = LearnedPredictor(CONFIG, background=False)
    fresh.observe(features, 77)
    assert fresh.num_samples == 0


def test_save_and_load_give_identical_predictions(tmp_path, planted, trained):
    path = tmp_path / "length.npz"
    trained.save(path)
    features = [_featurize(s) for s in planted[1][:50]]
    for loaded in (LearnedPredictor.load(path, background=False),
                   LearnedPredictor.load(path, CONFIG, background=False)):
        assert loaded.is_trained
        assert loaded.predict(features) == trained.predict(features)


def test_a_mismatched_or_foreign_file_fails_clearly(tmp_path, trained):
    path = tmp_path / "length.npz"
    trained.save(path)
    other = PredictorConfig(features=FeatureConfig(num_buckets=128))
    with pytest.raises(ValueError, match="trained with features=.*num_buckets': 256"):
        LearnedPredictor.load(path, other, background=False)
    with pytest.raises(ValueError, match="quantiles"):
        LearnedPredictor.load(path, PredictorConfig(quantiles=(0.5, 0.95)), background=False)
    (tmp_path / "junk.npz").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a length predictor archive"):
        LearnedPredictor.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="is not a meshserve-length-predictor file"):
        LearnedPredictor.load(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="not been trained"):
        LearnedPredictor(CONFIG, background=False).save(tmp_path / "empty.npz")


def test_retraining_runs_on_the_worker_and_swaps_in(planted, monkeypatch):
    train, test = planted
    predictor = LearnedPredictor(SMALL)
    release, threads = threading.Event(), []
    fit = predictor._fit

    def held_fit(*args):
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        return fit(*args)

    monkeypatch.setattr(predictor, "_fit", held_fit)
    features = [_featurize(s) for s in test[:8]]
    for sample in train[:64]:
        predictor.observe(_featurize(sample), sample.output_len)  # the 64th wakes the worker
    # observe returned while training is held: the hot path never waits for it
    assert predictor.predict(features) == PriorPredictor().predict(features)
    release.set()
    assert predictor.wait_idle(timeout=60)
    assert threads == ["length-predictor"] and predictor.is_trained
    assert predictor.predict(features) != PriorPredictor().predict(features)
    predictor.close()


def test_a_failed_training_is_raised_on_the_serving_thread(planted, monkeypatch):
    train, test = planted
    predictor = LearnedPredictor(SMALL)

    def broken_fit(*args):
        raise FloatingPointError("loss is nan")

    monkeypatch.setattr(predictor, "_fit", broken_fit)
    for sample in train[:64]:
        predictor.observe(_featurize(sample), sample.output_len)
    assert predictor.wait_idle(timeout=60)
    assert isinstance(predictor.error, FloatingPointError)
    with pytest.raises(RuntimeError, match="training failed.*loss is nan"):
        predictor.predict([_featurize(test[0])])
    with pytest.raises(RuntimeError, match="training failed"):
        predictor.observe(_featurize(test[0]), 3)


def test_steady_state_compiles_nothing(planted):
    train, test = planted
    config = SMALL
    predictor = LearnedPredictor(config, background=False)
    features = [_featurize(s, config) for s in test[:70]]
    for sample in train[:100]:
        predictor.observe(_featurize(sample, config), sample.output_len)
    predictor.retrain()
    for batch in (8, 16, 32):  # the three buckets
        predictor.predict(features[:batch])
    # the jit caches are per function, shared with earlier tests' predictors
    num_programs = predictor._predict_fn._cache_size(), predictor._train_fn._cache_size()
    with CompileCounter() as counter:
        for batch in (1, 3, 9, 17, 31, 32, 33, 70):
            assert len(predictor.predict(features[:batch])) == batch
        for sample in train[100:150]:
            predictor.observe(_featurize(sample, config), sample.output_len)
        predictor.retrain()  # more samples, same shapes
    assert counter.count == 0
    assert (predictor._predict_fn._cache_size(), predictor._train_fn._cache_size()) == num_programs
