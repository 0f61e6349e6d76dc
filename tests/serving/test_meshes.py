"""The same engine on every mesh shape gives the same tokens as on one device; weights loaded
onto a mesh and checkpoints restored onto another mesh give them too.

Each mesh runs the same requests through the real engine on fake CPU devices. Greedy tokens must be
identical, and the top-K logprobs of every generated token (the model's log-softmax, so logits up
to a per-row constant) must match the single-device run to 1e-4. Sampled (temperature > 0) rows
must match too: a row's draw depends only on its seed, its output index and its logits.
"""

import weakref

import jax
import numpy as np
import pytest
from flax import nnx

from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading.checkpoint import save_checkpoint
from meshserve.model.config import ModelConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding.layout import prepare
from meshserve.sharding.sharded_loading import MeshPlacement as _Placer, load_sharded
from tests.conftest import random_params

ENGINE = dict(num_pages=48, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=160, max_logprobs=5, warmup=False,
              compilation_cache=False)
# One mesh of each kind, the most demanding of its sizes: model=2 pads the heads (3 kv heads to
# 4, 9 query heads to 12; model=3 divides them), data=3 splits 4 requests unevenly, and
# data=2,model=2 and stage=2,model=3 combine axes. The last is a pipeline mesh
# (tests/serving/test_pipeline.py has the rest of PP's tests, padded stages among them); all share
# this module's one-device reference run.
SMOLLM2_MESHES = ["model=2", "data=3", "data=2,model=2", "stage=2,model=3"]
# The step is mapped over `data` whatever its size, so data=2,model=4 runs model=4's step (kv
# heads padded 2 -> 4) in each replica; data=2,model=2 runs under page pressure
# (test_data_parallel_engine_serves_...) and model=3 pads the heads of a plain tensor-parallel
# step (test_a_weight_that_does_not_divide_...).
TINY_MESHES = ["model=2", "data=2,model=4"]
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "List three colours: red,", "Once upon a time, in a land far away, there lived a"]


def _run(engine: Engine, requests) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        for allocator in engine.scheduler.allocators:
            allocator.check()
    return [finished[i] for i in ids]


def _top_logprobs(completion) -> np.ndarray:
    """[tokens, K] logprobs of each step's top-K tokens, by rank."""
    return np.array([sorted(lp.logprob for lp in step.values() if lp.rank is not None)[::-1][:5]
                     for step in completion.logprobs])


def _assert_same(got, want) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(_top_logprobs(g), _top_logprobs(w), atol=1e-4)


# The one-device reference has ENGINE's token budget and chunk (the same steps) in the page pool
# of tests/serving/test_engine.py's SmolLM2 engine, whose programs it then shares.
SMOLLM2_ONE_DEVICE = ENGINE | dict(num_pages=64, max_model_len=256, max_logprobs=20)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_pretrained):
    requests = [(p, SamplingParams(temperature=0, max_tokens=6, logprobs=5)) for p in PROMPTS]
    engine = Engine.from_model(smollm2_pretrained.model, smollm2_pretrained.tokenizer,
                               EngineConfig(**SMOLLM2_ONE_DEVICE))
    return requests, _run(engine, requests)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", SMOLLM2_MESHES)
def test_smollm2_tokens_and_logprobs_match_one_device(smollm2_pretrained, smollm2_reference, mesh):
    requests, want = smollm2_reference
    engine = Engine.from_model(smollm2_pretrained.model, smollm2_pretrained.tokenizer,
                               EngineConfig(mesh=mesh, **ENGINE))
    _assert_same(_run(engine, requests), want)


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig.preset("tiny-llama")
    return model_from_params(config, random_params(config))


def _tiny_requests() -> list:
    rng = np.random.default_rng(0)
    requests = []
    for i, length in enumerate((5, 17, 40, 3, 9, 60, 22, 11)):
        prompt = rng.integers(2, 512, size=length).tolist()
        params = SamplingParams(temperature=0.8 if i % 3 == 0 else 0, seed=i, max_tokens=4 + i,
                                ignore_eos=True, logprobs=5)
        requests.append((prompt, params))
    return requests


@pytest.fixture(scope="module")
def tiny_want(tiny_model) -> list:
    """The one-device outputs of `_tiny_requests()`, run once: every tiny mesh must match them."""
    return _run(Engine.from_model(tiny_model, None, EngineConfig(**ENGINE)), _tiny_requests())


@pytest.mark.parametrize("mesh", TINY_MESHES)
def test_tiny_llama_matches_one_device(tiny_model, tiny_want, mesh):
    engine = Engine.from_model(tiny_model, None, EngineConfig(mesh=mesh, **ENGINE))
    got = _run(engine, _tiny_requests())
    _assert_same(got, tiny_want)


def test_data_parallel_engine_serves_a_mixed_workload_under_pressure(tiny_model, tiny_want):
    """Two replicas, each split over two devices, each with a page pool so small that requests
    preempt: every request still gets exactly its single-device tokens (preemption changes no
    token), both replicas serve, and each replica's page invariant holds after every step."""
    requests = _tiny_requests() * 2
    small = ENGINE | dict(num_pages=9)  # 8 usable pages a replica; the longest request needs 5
    want = tiny_want * 2
    engine = Engine.from_model(tiny_model, None, EngineConfig(mesh="data=2,model=2", **small))
    placed = set()
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        placed |= {r.replica for r in engine.scheduler.running}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        for allocator in engine.scheduler.allocators:
            allocator.check()
    _assert_same([finished[i] for i in ids], want)
    assert placed == {0, 1}
    assert engine.scheduler.num_preemptions > 0
    assert all(a.num_used == 0 for a in engine.scheduler.allocators)


def test_mesh_is_validated_before_anything_runs(tiny_model):
    with pytest.raises(ValueError, match="needs 16 devices"):
        Engine.from_model(tiny_model, None, EngineConfig(mesh="data=4,model=4", **ENGINE))
    with pytest.raises(ValueError, match="unknown|expected comma-separated"):
        EngineConfig(mesh="tensor=2")
    assert EngineConfig(mesh="model=2").mesh == "data=1,stage=1,model=2"


def test_checkpoint_saved_on_one_mesh_serves_identical_tokens_on_another(tiny_model, tiny_want,
                                                                          tmp_path):
    """Save from weights sharded on (data=1, model=2); restore on (data=2, model=4) and on one
    device: the same tokens."""
    prepared = prepare(tiny_model, "model=2")
    sharded = model_from_params(
        tiny_model.config,
        {"/".join(map(str, path)): var[...] for path, var in nnx.to_flat_state(
            jax.device_put(nnx.split(prepared.model)[1], prepared.layout.params))})
    directory = save_checkpoint(sharded, None, tmp_path / "ckpt")
    requests, want = _tiny_requests()[:4], tiny_want[:4]
    for mesh in ("data=2,model=4", None):
        restored = load_sharded(str(directory), mesh)
        engine = Engine.from_model(restored.model, None, EngineConfig(mesh=mesh, **ENGINE))
        _assert_same(_run(engine, requests), want)


@pytest.mark.slow
def test_sharded_loading_holds_one_host_tensor_at_a_time(smollm2_files, monkeypatch):
    """Every weight arrives on the mesh split by the rules, and each host tensor is gone before
    the loader reads the next one."""
    placed_so_far = []
    place = _Placer.__call__

    def checked_place(self, config, key, array):
        alive = [name for name, ref in placed_so_far if ref() is not None]
        assert not alive, f"host tensors {alive} are still alive when {key} is placed"
        result = place(self, config, key, array)
        placed_so_far.append((key, weakref.ref(array)))
        return result

    monkeypatch.setattr(_Placer, "__call__", checked_place)
    loaded = load_sharded(str(smollm2_files.path), "data=2,model=2")
    assert len(placed_so_far) == len(nnx.to_flat_state(nnx.split(loaded.model)[1]))
    layout = prepare(loaded.model, "data=2,model=2").layout
    _, state = nnx.split(loaded.model)
    flat_layout = dict(nnx.to_flat_state(layout.params))
    for path, var in nnx.to_flat_state(state):
        assert var[...].sharding == flat_layout[path], path
    q = loaded.model.layers.attn.q.kernel[...]
    assert loaded.config.num_heads == 12  # 9 heads padded for model=2
    assert {shard.data.shape for shard in q.addressable_shards} == {(30, 576, 6, 64)}


def test_a_weight_that_does_not_divide_is_replicated_with_a_warning(tiny_model, tiny_want):
    """tiny-llama's vocabulary (512) does not divide over model=3: the embedding is replicated,
    the user is told, and the tokens are still right."""
    requests = _tiny_requests()[:3]
    with pytest.warns(UserWarning, match=r"embed/embedding \(vocab\)"):
        engine = Engine.from_model(tiny_model, None, EngineConfig(mesh="model=3", **ENGINE))
    _assert_same(_run(engine, requests), tiny_want[:3])  # alone or in company: the same
