"""Pipeline parallelism through the real engine on fake CPU devices: the same tokens as one
device on every (data, stage, model) mesh, the compiled call's collectives, stage utilisation with
and without bubble filling, and the engine's invariants (pages, stops, aborts)."""

import functools
import re

import jax
import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.model.attention import ATTENTION_BACKENDS, ragged_attention_pallas_gpu
from meshserve.model.config import ModelConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.metrics import ServerMetrics
from meshserve.sharding.pipeline_stages import pad_layers, stage_layout, unpadded_config
from tests.conftest import random_params
from tests.model.paged import PagedStepper
from tests.serving.test_meshes import ENGINE, _assert_same, _run
from tests.sharding.compiled import Hlo

def _model(preset: str = "tiny-llama", **overrides):
    """One model per (preset, overrides) for the module, however the call spells them: its
    one-device runner is shared too."""
    return _cached_model(preset, tuple(sorted(overrides.items())))


@functools.cache
def _cached_model(preset: str, overrides: tuple):
    config = ModelConfig.preset(preset, **dict(overrides))
    return model_from_params(config, random_params(config))


def _requests(vocab_size: int, count: int = 8, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        prompt = rng.integers(2, vocab_size, size=int(rng.integers(3, 60))).tolist()
        params = SamplingParams(temperature=0.8 if i % 3 == 0 else 0, seed=i, max_tokens=3 + i,
                                ignore_eos=True, logprobs=5)
        requests.append((prompt, params))
    return requests


_REFERENCE_RUNNERS: dict[int, tuple] = {}


def _one_device(model, **overrides) -> Engine:
    """A one-device engine. Those of one model share a runner (its compiled programs); an engine
    that runs after another drops its prefix cache, so none reads another's pages."""
    shared = _REFERENCE_RUNNERS.get(id(model))
    engine = Engine.from_model(model, None, EngineConfig(**(ENGINE | overrides)),
                               runner=shared[1] if shared else None)
    _REFERENCE_RUNNERS[id(model)] = (model, engine.runner)  # the model kept, so its id is too
    return engine


def _reference(model, requests):
    return _run(_one_device(model), requests)


# Stages alone (stage=2 runs in every other test here; stage=3 and stage=4 pad fewer stages the
# same way stage=8 pads seven), stages with padded kv heads, all three axes, and a second family.
@pytest.mark.parametrize("preset,layers,mesh", [
    ("tiny-llama", 9, "stage=8"),  # 2, 1, ... 1 layers: an identity layer on each of 7 stages
    ("tiny-llama", 2, "stage=2,model=3"),  # kv heads padded 2 -> 3 as well
    ("tiny-llama", 4, "data=2,stage=2,model=2"),
    ("tiny-gpt2", 2, "stage=2,model=2"),
])
def test_tokens_equal_one_device(preset, layers, mesh):
    model = _model(preset, num_layers=layers)
    requests = _requests(model.config.vocab_size)
    engine = Engine.from_model(model, None, EngineConfig(mesh=mesh, **ENGINE))
    _assert_same(_run(engine, requests), _reference(model, requests))
    assert engine.stats.compiles_after_warmup <= 1  # the one pipeline program (no warm-up here)


# Rounds 4 (the default) with filling run in the other tests here. Three layers a stage: the
# 9-layer model of stage=8 above, whose one-device runner serves the reference.
@pytest.mark.parametrize("rounds,filling", [(1, True), (3, False)])
def test_any_number_of_rounds_with_or_without_filling_gives_the_same_tokens(rounds, filling):
    model = _model(num_layers=9)
    requests = _requests(model.config.vocab_size, count=10, seed=1)
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=3", pipeline_rounds=rounds,
                                              bubble_filling=filling, **ENGINE))
    _assert_same(_run(engine, requests), _reference(model, requests))


@pytest.mark.slow
def test_the_pallas_gpu_backend_serves_pipeline_stages(monkeypatch):
    """Stages run the ragged step's attention seam: the GPU kernel, in Pallas's interpret mode
    on fake CPU devices, is what the stages' layers call, and it gives one device's tokens."""
    traced = []

    def kernel(*args, **kwargs):
        traced.append(args[0].shape)  # q [T, H, h] of a DECODE or a PREFILL unit
        return ragged_attention_pallas_gpu(*args, interpret=True, **kwargs)

    monkeypatch.setitem(ATTENTION_BACKENDS, "pallas-gpu", kernel)
    model = _model(num_layers=2)
    requests = _requests(model.config.vocab_size, count=3, seed=8)
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", attention="pallas-gpu",
                                                         **ENGINE))
    assert engine.runner.attention == "pallas-gpu"
    _assert_same(_run(engine, requests), _reference(model, requests))
    shape = engine.runner.shape
    assert {t for t, _, _ in traced} == {shape.decode_rows, shape.prefill_tokens}


def test_penalties_and_stop_ids_end_where_one_device_ends():
    model = _model(num_layers=2)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (7, 30, 12, 3)]
    greedy = _reference(model, [(p, SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True)) for p in prompts])
    requests = [
        (prompts[0], SamplingParams(max_tokens=12, temperature=0, logprobs=5,
                                    stop_token_ids=[greedy[0].token_ids[4]])),
        (prompts[1], SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3,
                                    frequency_penalty=0.4, ignore_eos=True, logprobs=5)),
        (prompts[2], SamplingParams(max_tokens=12, temperature=0, min_tokens=6, logprobs=5,
                                    stop_token_ids=[greedy[2].token_ids[1]])),
        (prompts[3], SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True,
                                    logprobs=5)),
    ]
    want = _reference(model, requests)
    # The default rounds: the pipeline program of the other stage=2 tests here.
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", **ENGINE))
    got = _run(engine, requests)
    _assert_same(got, want)
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 5
    assert all(a.num_used == 0 for a in engine.scheduler.allocators)


def test_preemption_and_aborts_keep_the_page_invariant():
    model = _model(num_layers=4)
    requests = _requests(model.config.vocab_size, count=12, seed=2)
    small = ENGINE | dict(num_pages=14)
    want = _reference(model, requests)
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", **small))
    got = _run(engine, requests)  # checks every allocator after every step
    _assert_same(got, want)
    assert engine.scheduler.num_preemptions > 0
    ids = [engine.add_request(p, s) for p, s in requests[:4]]
    engine.step()
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished()
    assert all(a.num_used == 0 for a in engine.scheduler.allocators)


def test_cached_prefixes_give_the_same_tokens_as_one_device_without_the_cache():
    """Pipeline calls read cached pages, and register pages that their own earlier rounds wrote:
    units run in order on every stage, so a later unit reads KV an earlier one wrote. Pages
    filled by decode are keyed once their placeholders are resolved."""
    model = _model(num_layers=2)
    rng = np.random.default_rng(5)
    system = rng.integers(2, model.config.vocab_size, size=40).tolist()
    requests = [(system + rng.integers(2, model.config.vocab_size, size=n).tolist(),
                 SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5))
                for n in (3, 9, 1, 14, 6)]
    plain = _one_device(model, enable_prefix_caching=False)
    want = _run(plain, requests[:1]) + _run(plain, requests[1:])
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", **ENGINE))
    got = _run(engine, requests[:1]) + _run(engine, requests[1:])
    _assert_same(got, want)
    assert engine.scheduler.num_cached_tokens >= 4 * 32


@pytest.mark.slow
def test_warm_up_compiles_one_program_and_then_nothing_with_prompt_logprobs():
    """The compiled set is one call, prompt logprobs included. After warm-up a varied workload
    (prompt logprobs, penalties, sampling, several call lengths) compiles nothing, and gives one
    device's tokens, logprobs and prompt logprobs."""
    model = _model(num_layers=2)
    rng = np.random.default_rng(6)
    requests = _requests(model.config.vocab_size, count=6, seed=6)
    for n, count in ((45, 3), (9, 5), (2, 1)):  # prompt logprobs over two chunks, one, a pair
        requests.append((rng.integers(2, 512, size=n).tolist(),
                         SamplingParams(max_tokens=4, temperature=0, logprobs=5,
                                        prompt_logprobs=count)))
    requests.append((rng.integers(2, 512, size=20).tolist(),
                     SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.2,
                                    ignore_eos=True, logprobs=5)))
    want = _finished(_one_device(model), requests)
    engine = Engine.from_model(model, None,
                               EngineConfig(mesh="stage=2", **(ENGINE | dict(warmup=True))))
    assert engine.stats.warmup_compiles == 1
    got = _finished(engine, requests)
    assert engine.stats.compiles_after_warmup == 0
    _assert_same([o.outputs[0] for o in got], [o.outputs[0] for o in want])
    for got_out, want_out in zip(got[6:9], want[6:9]):
        assert len(got_out.prompt_logprobs) == len(want_out.prompt_logprobs)
        assert got_out.prompt_logprobs[0] is want_out.prompt_logprobs[0] is None
        for got_entry, want_entry in zip(got_out.prompt_logprobs[1:], want_out.prompt_logprobs[1:]):
            assert got_entry.keys() == want_entry.keys()
            for token, logprob in want_entry.items():
                assert got_entry[token].rank == logprob.rank
                assert got_entry[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


def _finished(engine: Engine, requests) -> list:
    """Every request's final `RequestOutput`, in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    return [finished[i] for i in ids]


def test_bubble_filling_beats_the_plain_fill_drain_schedule():
    """Mixed arrivals: a few long decodes, then prompts arriving while they run. The stage
    utilisation measured from the schedules the engine ran is higher with filling."""
    model = _model(num_layers=4)

    runners = []

    def utilisation(filling: bool) -> float:
        # Filling is host policy: both engines run the same compiled pipeline call.
        engine = Engine.from_model(model, None, EngineConfig(mesh="stage=4", bubble_filling=filling,
                                                  **ENGINE), runner=(runners or [None])[0])
        runners.append(engine.runner)
        rng = np.random.default_rng(9)
        for i in range(2):
            engine.add_request(rng.integers(2, 512, size=6).tolist(),
                               SamplingParams(max_tokens=30, ignore_eos=True))
        arrivals = [rng.integers(2, 512, size=int(rng.integers(10, 40))).tolist()
                    for _ in range(6)]
        while engine.has_unfinished():
            engine.step()
            if arrivals:
                engine.add_request(arrivals.pop(), SamplingParams(max_tokens=6, ignore_eos=True))
        return engine.stats.stage_utilisation

    plain, filled = utilisation(False), utilisation(True)
    assert 0 < plain < filled <= 1
    assert filled > plain + 0.1, (plain, filled)


def test_stage_utilisation_is_exported():
    engine = Engine.from_model(_model(num_layers=2), None, EngineConfig(mesh="stage=2", **ENGINE))
    metrics = ServerMetrics("tiny")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        metrics.observe_step(engine, 0.01)
    # One request in one lane: a unit a round, the rounds fed back S = 2 units apart.
    value = metrics.registry.get_sample_value("meshserve:stage_utilisation",
                                              {"model_name": "tiny"})
    assert value == engine.stats.stage_utilisation
    assert 0.2 < value < 0.75


def test_the_compiled_call_permutes_per_tick_and_gathers_no_weight():
    """On all three axes: the program of test_tokens_equal_one_device's data=2,stage=2,model=2
    engine."""
    model = _model(num_layers=4)
    engine = Engine.from_model(model, None, EngineConfig(mesh="data=2,stage=2,model=2", **ENGINE))
    runner = engine.runner
    hlo = Hlo.parse(runner.program().as_text())
    ticks_loop = [op for op in hlo.ops("while")
                  if "collective-permute" in " ".join(o.opcode for c in hlo.body(op)
                                                      for o in hlo.computations[c])]
    assert len(ticks_loop) == 1  # the tick loop
    body = hlo.body(ticks_loop[0])
    permutes = hlo.ops("collective-permute", body)
    # The activations to the next stage, and the last stage's tokens back to stage 0, each
    # between the same (data, model) position of two stages. Devices are numbered in mesh order.
    index = np.arange(runner.layout.mesh.devices.size).reshape(runner.layout.mesh.devices.shape)
    forward = {(int(a), int(b)) for a, b in zip(index[:, 0].flat, index[:, 1].flat)}
    back = {(int(b), int(a)) for a, b in zip(index[:, 0].flat, index[:, 1].flat)}
    pairs = [re.search(r"source_target_pairs=\{(.*?\})\}", op.text).group(1) for op in permutes]
    found = [{tuple(map(int, pair)) for pair in re.findall(r"\{(\d+),(\d+)\}", text)}
             for text in pairs]
    assert sorted(found, key=sorted) == sorted([forward, back], key=sorted)
    assert hlo.ops("collective-permute", set(hlo.computations) - body) == []
    weights = {tuple(a.shape) for a in jax.tree.leaves(runner.params)}
    weights |= {tuple(s.data.shape) for a in jax.tree.leaves(runner.params)
                for s in a.addressable_shards}
    for op in hlo.ops("all-gather"):
        for _, dims in op.shapes:
            assert dims not in weights, f"a weight is gathered: {op.text[:160]}"


def test_a_lora_adapter_is_written_at_its_layers_places_in_the_padded_stack():
    """4 layers over 3 stages (2, 1, 1 -> 6): an adapter read for the model's own 4 layers
    (the engine reads adapters against the unpadded config) lands in rows 0, 1, 2 and 4 of
    each slab, split over the stages with them; the identity layers 3 and 5 hold zeros."""
    engine = Engine.from_model(_model(num_layers=4), None, EngineConfig(
        mesh="stage=3", enable_lora=True, max_loras=2, max_lora_rank=4, **ENGINE))
    assert engine.adapters.model_config.num_layers == 4
    slabs = engine.runner.lora_slabs.slabs
    a_slab, b_slab = slabs["layers/mlp/down/lora/a"], slabs["layers/mlp/down/lora/b"]
    assert a_slab.shape[0] == 6 and a_slab.get_value().sharding.spec[0] == "stage"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, *a_slab.shape[1:-2], 3)).astype(np.float32)  # rank 3 of 4
    b = rng.standard_normal((4, 3, *b_slab.shape[3:])).astype(np.float32)
    engine.runner.load_adapter(2, {"layers/mlp/down": (a, b)})
    got_a = np.asarray(a_slab.get_value())[..., 1, :]  # slot 2: [6, ffw, r]
    got_b = np.asarray(b_slab.get_value())[:, 1]  # [6, r, embed]
    np.testing.assert_array_equal(got_a[[0, 1, 2, 4], ..., :3], a)
    np.testing.assert_array_equal(got_b[[0, 1, 2, 4], :3], b)
    assert not got_a[[3, 5]].any() and not got_b[[3, 5]].any()
    assert not got_a[..., 3].any()  # the rank padded with zeros


def test_layers_are_split_contiguously_and_padding_layers_are_exact():
    layout = stage_layout(30, 4)
    assert layout.real_layers == (8, 8, 7, 7) and layout.num_padded_layers == 32
    assert [layout.padded_index(i) for i in (0, 7, 8, 15, 16, 22, 23, 29)] == [
        0, 7, 8, 15, 16, 22, 24, 30]
    assert layout.num_layers == 30 and layout.layer_index()[[22, 23, 29]].tolist() == [22, 24, 30]
    with pytest.raises(ValueError, match="3 pipeline stages need at least as many layers"):
        stage_layout(2, 3)
    model = _model(num_layers=4)
    padded = pad_layers(model, 3)  # 2, 1, 1 -> 6 layers
    assert padded.config.num_layers == 6
    index = stage_layout(4, 3).layer_index()
    assert index.tolist() == [0, 1, 2, 4]
    assert unpadded_config(padded.config, index) == model.config  # what adapters are read for
    q = np.asarray(padded.layers.attn.q.kernel[...])
    assert q[:3].any(axis=(1, 2, 3)).all() and q[4].any()
    assert not q[3].any() and not q[5].any()  # stages 1 and 2 each end in the identity
    # The identity layers change no logit, at any position of any row: one dense forward pass
    # of each model (the pipeline tests above run padded stages through the engine).
    tokens = np.random.default_rng(3).integers(2, 512, size=(4, 40))
    np.testing.assert_allclose(PagedStepper(padded, page_size=4, num_pages=4).dense(tokens),
                               PagedStepper(model, page_size=4, num_pages=4).dense(tokens),
                               atol=1e-5, rtol=1e-5)
