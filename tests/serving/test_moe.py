"""Mixtures of experts served by the engine give HF's greedy tokens, on one device and on meshes.

The families' golden prompts (tests/golden, scripts/make_moe_golden.py) run through the real
engine: one prompt alone, then the other three together in a continuous batch, one of which
shares its first 16 tokens with the first prompt and is served from the prefix cache. Every
greedy token must equal HF's and its logprob be within 2e-3 (the fixtures' top-2 margins are all
over 1e-3, so no token is a near tie). The meshes are fake CPU devices:

    expert parallel   the default rules: experts split over `model`, attention Megatron-style
    tensor parallel   the experts' width split over `model` instead (`expert` -> None,
                      `expert_ffw` -> model), with the shared expert and attention as usual
    data x expert     two replicas of a 2-way expert-parallel model
    stage x expert    two pipeline stages, each with its experts split over `model`

and the compiled step of each mesh (but the pipeline's) holds each device's share of the experts only, gathers no
weight, and combines the experts' outputs with one all-reduce of the residual per layer, beside
attention's (and the shared expert's, which XLA may fold into the same all-reduce).
"""

import json

import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading import load_hf
from meshserve.model.executor.runner import ModelRunner
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding.hlo import Hlo
from meshserve.sharding.layout import prepare
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules

# A 4-token budget: three compiled programs (1, 2 and 4 token slots) serve every step.
ENGINE = dict(num_pages=32, page_size=16, max_num_seqs=4, max_num_batched_tokens=4,
              prefill_chunk=4, max_model_len=64, max_logprobs=1, warmup=False,
              compilation_cache=False)
EXPERT_WIDTH_RULES = ShardingRules({**DEFAULT_RULES.table, "expert": None,
                                    "expert_ffw": "model"})
ALONE = 1  # the prompt run first, alone; prompt 2 shares its first 16 tokens (one page)


def _golden(golden_dir, family: str):
    directory = golden_dir / family
    config, params = load_hf(directory)
    golden = json.loads((directory / "greedy.json").read_text())
    return model_from_params(config, params), golden


def _serve(engine: Engine, cases) -> list:
    """Prompt ALONE by itself, then the rest together; outputs in the cases' order."""
    params = SamplingParams(temperature=0, max_tokens=len(cases[0]["greedy_ids"]),
                            ignore_eos=True, logprobs=0)
    order = [ALONE] + [i for i in range(len(cases)) if i != ALONE]
    outputs = {}
    for group in (order[:1], order[1:]):
        ids = {engine.add_request(cases[i]["prompt_ids"], params): i for i in group}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[ids[out.request_id]] = out
    return [outputs[i] for i in range(len(cases))]


def _assert_matches_hf(outputs, cases) -> None:
    for out, case in zip(outputs, cases):
        completion = out.outputs[0]
        assert completion.token_ids == case["greedy_ids"]
        got = [entry[token].logprob for entry, token in zip(completion.logprobs,
                                                             completion.token_ids)]
        np.testing.assert_allclose(got, case["greedy_logprobs"], atol=2e-3)


# One device, for one family: Qwen2-MoE and Qwen3-MoE run on their meshes only (below), which
# compare them with HF the same way, alone, batched and from the prefix cache.
@pytest.mark.slow
def test_engine_gives_hf_greedy_tokens_alone_batched_and_from_the_prefix_cache(golden_dir):
    model, golden = _golden(golden_dir, "tiny-mixtral")
    outputs = _serve(Engine.from_model(model, None, EngineConfig(**ENGINE)), golden["cases"])
    _assert_matches_hf(outputs, golden["cases"])
    assert [out.num_cached_tokens for out in outputs] == [0, 0, 16, 0]


# (family, mesh, rules, tokens prompt 2 finds in the prefix cache): with two data replicas it is
# placed on the other replica than prompt 1, whose cache is its own.
MESHES = [
    ("tiny-mixtral", "model=2", DEFAULT_RULES, 16),  # expert parallel
    ("tiny-qwen2-moe", "model=4", EXPERT_WIDTH_RULES, 16),  # tensor parallel, kv heads padded
    ("tiny-qwen3-moe", "data=2,model=2", DEFAULT_RULES, 0),
    ("tiny-qwen3-moe", "stage=2,model=2", DEFAULT_RULES, 16),  # experts split in each stage
]


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: f"{m[0]}-{m[1]}")
def mesh_engine(request, golden_dir):
    family, mesh, rules, cached = request.param
    model, golden = _golden(golden_dir, family)
    config = EngineConfig(mesh=mesh, **ENGINE)
    if rules is DEFAULT_RULES:
        return Engine.from_model(model, None, config), golden, rules, cached
    prepared = prepare(model, config.mesh_config, rules=rules)
    runner = ModelRunner(prepared.model, config.for_model(model.config).runner_config(),
                         prepared.layout)
    return Engine.from_model(prepared.model, None, config, runner=runner), golden, rules, cached


@pytest.mark.slow
def test_meshes_give_hf_greedy_tokens(mesh_engine):
    engine, golden, _, cached = mesh_engine
    outputs = _serve(engine, golden["cases"])
    _assert_matches_hf(outputs, golden["cases"])
    assert [out.num_cached_tokens for out in outputs] == [0, 0, cached, 0]


@pytest.mark.slow
def test_compiled_step_keeps_experts_apart_and_exchanges_tokens_once_per_layer(mesh_engine):
    engine, _, rules, _ = mesh_engine
    runner = engine.runner
    if not isinstance(runner, ModelRunner):
        pytest.skip("a pipeline's one call is read in tests/serving/test_pipeline.py")
    c, mesh = runner.model_config, runner.layout.mesh
    key = runner.config.step_keys()[2]  # 4 token slots per replica: a decode step
    hlo = Hlo.parse(runner.program(key).as_text())
    split = {"expert": c.moe.num_experts // mesh.shape["model"], "expert_ffw":
             c.intermediate_size // mesh.shape["model"]}
    experts = (c.num_layers, c.moe.num_experts, c.hidden_size, c.intermediate_size)
    local = tuple(split.get(a, dim) if rules.mesh_axis(a) == "model" else dim
                  for a, dim in zip(("layers", "expert", "embed", "expert_ffw"), experts))
    assert local != experts and local in hlo.parameter_shapes()  # each device's share only
    assert experts not in hlo.parameter_shapes()
    # The layers' loop: the one that carries the stacked expert kernels (XLA:CPU may lower a
    # scatter into a loop of its own over another stacked array, the KV cache).
    (loop,) = [op for op in hlo.ops("while") if any(dims == local for _, dims in op.shapes)][:1]
    body = hlo.body(loop)
    assert not hlo.ops("all-gather", body)  # no weight is gathered in the layers
    residual = ("f32", (key[0], c.hidden_size))
    reduces = hlo.ops("all-reduce", body)
    assert all(shape == residual for op in reduces for shape in op.shapes)
    # Attention's o, the experts' combine (a psum under shard_map) and the shared expert's down:
    # XLA may combine the last two into one all-reduce of both arrays.
    shared = 1 if c.moe.shared_expert_size else 0
    assert sum(len(op.shapes) for op in reduces) == 2 + shared
    assert sum("shard_map/psum" in op.text for op in reduces) == 1


def test_loading_onto_an_expert_parallel_mesh_gives_each_device_its_experts(golden_dir):
    from meshserve.sharding.sharded_loading import load_sharded

    directory = golden_dir / "tiny-mixtral"
    _, params = load_hf(directory)
    placed = load_sharded(str(directory), "model=2").model.layers.mlp.experts.gate[...]
    want = params["layers/mlp/experts/gate"]  # [L, E, D, F]
    half = want.shape[1] // 2
    for shard in placed.addressable_shards:
        expert_slice = shard.index[1]
        assert shard.data.shape == (want.shape[0], half, *want.shape[2:])
        np.testing.assert_array_equal(np.asarray(shard.data), want[:, expert_slice])


def test_the_roofline_floor_counts_the_experts_a_batch_reads():
    from meshserve.model.config import ModelConfig, weight_bytes
    from meshserve.serving.bench.roofline import read_weight_bytes

    moe, dense = ModelConfig.preset("small-mixtral"), ModelConfig.preset("small-mixtral-dense")
    # One token runs 2 of the 8 experts: the dense twin's MLP width, plus the router.
    router = 4 * moe.num_layers * moe.hidden_size * moe.moe.num_experts
    assert read_weight_bytes(moe, 1) == pytest.approx(read_weight_bytes(dense, 1) + router)
    assert read_weight_bytes(moe, 64) == pytest.approx(weight_bytes(moe), rel=1e-6)
    assert read_weight_bytes(dense, 64) == weight_bytes(dense)
