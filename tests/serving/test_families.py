"""The dense families served end to end: HF's greedy tokens from the engine on a mesh, batched
and from the prefix cache.

Each golden folder (scripts/make_golden_families.py) holds a tiny random Qwen3, Gemma 2, Gemma 3
or Phi-3 and HF's greedy continuation of three prompts (12 tokens; logprob and top-2 margin per
step). The engine must give the same tokens, and logprobs within 2e-3; a token may differ only
where HF's top-2 margin is under 1e-3 (none of these does). Pages of 2 tokens under a window of
8: the prompts (5 to 26 tokens) cross it, and attention skips whole context blocks behind it.
"""

from __future__ import annotations

import json

import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading import load_hf
from meshserve.model.executor.pipeline_runner import PipelineRunner
from meshserve.model.executor.runner import ModelRunner
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding.layout import prepare

# A 4-token budget: three compiled programs (1, 2 and 4 token slots) serve every step.
ENGINE = dict(num_pages=128, page_size=2, max_num_seqs=4, max_num_batched_tokens=4,
              prefill_chunk=4, max_model_len=64, max_logprobs=1, warmup=False,
              compilation_cache=False)
# One engine per family, on a mesh with a model axis; between them: tensor parallelism, padded
# heads (kv 2 -> 4 under model=4) and data parallelism. One device runs the same step (the
# tiny Llama's engine tests), and each family's logits alone match HF's on one device too
# (tests/model/test_golden.py).
MESHES = {"tiny-qwen3": "model=2", "tiny-gemma2": "model=4", "tiny-gemma3": "data=2,model=2",
          "tiny-phi3": "model=2"}


@pytest.fixture(scope="module", params=sorted(MESHES))
def family(request, golden_dir):
    config, params = load_hf(golden_dir / request.param)
    golden = json.loads((golden_dir / request.param / "greedy.json").read_text())
    return request.param, model_from_params(config, params), golden


def _run(engine: Engine, cases: list[dict], num_new: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True, logprobs=1)
    ids = [engine.add_request(case["prompt_ids"], params) for case in cases]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for allocator in engine.scheduler.allocators:
            allocator.check()
    return [finished[i] for i in ids]


def _assert_matches_hf(case: dict, output) -> None:
    completion = output.outputs[0]
    for step, (got, want) in enumerate(zip(completion.token_ids, case["greedy_ids"])):
        if got != want:
            assert case["top2_margin"][step] < 1e-3, (
                f"token {step} is {got}, HF chose {want} with a top-2 margin of "
                f"{case['top2_margin'][step]:.2e}")
            return  # a near-tie broken the other way: the rest is not comparable
        logprob = completion.logprobs[step][got].logprob
        assert abs(logprob - case["greedy_logprobs"][step]) < 2e-3, (step, logprob)
    assert len(completion.token_ids) == len(case["greedy_ids"])


@pytest.mark.slow
def test_greedy_tokens_match_hf_on_a_mesh_batched_then_alone_from_the_prefix_cache(family):
    """All three prompts in one continuous batch (42 prompt tokens in chunks of 4, so prefill
    crosses the window chunk by chunk), then each alone, its prompt's full pages now found in
    the prefix cache; on the family's mesh."""
    name, model, golden = family
    engine = Engine.from_model(model, None, EngineConfig(mesh=MESHES[name], **ENGINE))
    assert engine.config.enable_prefix_caching
    cases, num_new = golden["cases"], golden["num_new_tokens"]
    for case, output in zip(cases, _run(engine, cases, num_new)):
        _assert_matches_hf(case, output)
    for case in cases:
        (output,) = _run(engine, [case], num_new)
        assert output.num_cached_tokens >= len(case["prompt_ids"]) - 2, name
        _assert_matches_hf(case, output)
    # Phi-3's every layer slides, so its pages behind the window went back to the pool.
    freed = engine.scheduler.num_window_freed_pages
    assert (freed > 0) == (model.config.attention_window > 0), freed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3"])
def test_pipeline_stages_keep_each_layers_window_and_give_hfs_tokens(name, golden_dir):
    """Three layers over stage=2: stage 0 holds layers 0 and 1, stage 1 layer 2 and an identity
    layer. Each stage's layers keep their own window (Gemma 2: sliding, full | sliding; Gemma 3:
    sliding, sliding | full), soft-cap and scale, so the stages give HF's greedy tokens and
    logprobs."""
    config, params = load_hf(golden_dir / name)
    golden = json.loads((golden_dir / name / "greedy.json").read_text())
    engine = Engine.from_model(model_from_params(config, params), None,
                               EngineConfig(mesh="stage=2", **ENGINE))
    for case, output in zip(golden["cases"], _run(engine, golden["cases"],
                                                  golden["num_new_tokens"])):
        _assert_matches_hf(case, output)


def _runner(model, mesh: str | None, attention: str, platform: str):
    """The runner `Engine.from_model` builds on `mesh`, its backend settled for `platform`."""
    settled = EngineConfig(mesh=mesh, attention=attention, **ENGINE).for_model(model.config)
    prepared = prepare(model, settled.mesh_config)
    if settled.mesh_config.stage > 1:
        return PipelineRunner(prepared.model, settled.runner_config(), prepared.layout,
                              settled.unit_shape(), platform=platform)
    return ModelRunner(prepared.model, settled.runner_config(), prepared.layout,
                       platform=platform)


@pytest.mark.parametrize("mesh", [None, "stage=2"])
def test_auto_attention_on_a_gpu_keeps_a_windowed_model_on_the_portable_backend(mesh, golden_dir):
    """One device's runner and the pipeline's settle "auto" alike: on a GPU, the Pallas kernel
    for a model without a window (Qwen3), `jnp` for Gemma 2's window, which the kernel cannot
    keep to. Only the choice is made here: a CPU cannot run the GPU kernel."""
    models = {name: model_from_params(*load_hf(golden_dir / name))
              for name in ("tiny-qwen3", "tiny-gemma2")}
    assert models["tiny-gemma2"].config.sliding_window == 8
    assert _runner(models["tiny-qwen3"], mesh, "auto", "gpu").attention == "pallas-gpu"
    assert _runner(models["tiny-gemma2"], mesh, "auto", "gpu").attention == "jnp"
    assert _runner(models["tiny-gemma2"], mesh, "auto", "cpu").attention == "jnp"
    with pytest.raises(ValueError, match="attention='pallas-gpu'.*sliding_window=8"):
        _runner(models["tiny-gemma2"], mesh, "pallas-gpu", "gpu")


@pytest.mark.parametrize("mesh", [None, "stage=2"])
def test_an_explicit_gpu_kernel_is_refused_for_a_windowed_model_when_the_engine_is_built(
        mesh, golden_dir):
    model = model_from_params(*load_hf(golden_dir / "tiny-gemma2"))
    config = EngineConfig(mesh=mesh, attention="pallas-gpu", **ENGINE)  # a valid option alone
    with pytest.raises(ValueError, match=r"attention='pallas-gpu' cannot run this model: .*"
                                         r"sliding window of 8 tokens \(sliding_window=8\).*"
                                         r"use attention='jnp'"):
        Engine.from_model(model, None, config)
