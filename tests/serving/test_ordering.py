"""The "predicted" ordering through the real engine on the tiny random Llama: the same greedy
tokens as FCFS, a learned predictor that learns from what the engine finishes, and a saved
predictor that the engine loads."""

import numpy as np
import pytest

from meshserve.batching.length import extract_features
from meshserve.batching.sampling import SamplingParams
from meshserve.model.config import ModelConfig
from meshserve.model.length_predictor import LearnedPredictor, PredictorConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from tests.conftest import random_params

# tests/serving/test_engine.py's shapes: its programs, compiled once a session.
TINY = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
            prefill_chunk=16, max_model_len=128, max_logprobs=5, compilation_cache=False,
            warmup=False)


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig.preset("tiny-llama")
    return model_from_params(config, random_params(config))


def _requests(num: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(3)
    return [(rng.integers(2, 512, size=int(rng.integers(4, 40))).tolist(),
             SamplingParams(temperature=0, max_tokens=int(rng.integers(2, 60)), ignore_eos=True))
            for _ in range(num)]


def _serve(engine: Engine, requests) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    return [finished[i] for i in ids]


def test_predicted_ordering_gives_the_fcfs_tokens_with_fewer_preemptions(tiny_model):
    """8 pages for 10 requests of up to 100 tokens (7 pages), 4 at a time: FCFS admits into
    shortages and preempts; keeping pages for each request's known length does not. (The pool
    of tests/serving/test_engine.py's tight engine: its programs.)"""
    requests = _requests(10)
    tight = TINY | dict(num_pages=9)
    fcfs = Engine.from_model(tiny_model, None, EngineConfig(**tight))
    predicted = Engine.from_model(tiny_model, None, EngineConfig(**tight, ordering="predicted"),
                                  runner=fcfs.runner)
    assert _serve(predicted, requests) == _serve(fcfs, requests)
    assert predicted.scheduler.num_preemptions < fcfs.scheduler.num_preemptions


def test_the_engine_teaches_its_predictor_and_loads_a_saved_one(tiny_model, tmp_path):
    """Outputs that end at EOS are logged as training samples (forced lengths teach nothing);
    a predictor saved after training is what a new engine predicts with."""
    engine = Engine.from_model(tiny_model, None, EngineConfig(**TINY, ordering="predicted"))
    predictor = engine.scheduler.predictor
    assert isinstance(predictor, LearnedPredictor)
    prompts = [prompt for prompt, _ in _requests(8)]
    _serve(engine, [(p, SamplingParams(temperature=0, max_tokens=30)) for p in prompts])
    assert predictor.num_samples == 8

    config = PredictorConfig(min_samples=8, num_steps=50, eval_every=25)
    trained = LearnedPredictor(config, background=False)
    rng = np.random.default_rng(0)
    for _ in range(64):
        n = int(rng.integers(4, 60))
        params = SamplingParams(max_tokens=80)
        trained.observe(extract_features(rng.integers(2, 512, n).tolist(), params), n)
    assert trained.retrain()
    path = tmp_path / "lengths.npz"
    trained.save(path)
    loaded = Engine.from_model(tiny_model, None, EngineConfig(**TINY, ordering="predicted",
                                                   length_predictor=str(path)),
                               runner=engine.runner)
    request_id = loaded.add_request(prompts[0], SamplingParams(max_tokens=80))
    got = loaded.scheduler.get(request_id).predicted_length
    features = extract_features(prompts[0], SamplingParams(max_tokens=80))
    assert got == trained.predict([features])[0]
    loaded.abort(request_id)


def test_a_length_predictor_needs_the_predicted_ordering():
    with pytest.raises(ValueError, match="ordering='predicted'"):
        EngineConfig(**TINY, length_predictor="lengths.npz")
