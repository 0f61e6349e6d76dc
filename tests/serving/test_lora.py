"""LoRA adapters served end to end against HF transformers + peft in float32.

A tiny random Llama (6 query heads, 3 kv heads) is written with transformers, and three
adapters of it with peft itself
(random, non-zero B): one on the attention (rank 8), one rsLoRA on q and the MLP (rank 4), one on
v, o and down (rank 2). Every prompt runs with each adapter and with the base model, all mixed in
one `LLM.generate` call, and must give HF + peft's greedy tokens with teacher-forced logprobs
within 2e-3 (compared steps have a top-2 margin of at least 1e-3 in HF), on one device, on a
`model=2` mesh, and (a 3-layer model) on `stage=2` and `stage=2,model=2` pipelines, where a slot
let go of in the middle of a pipeline call keeps its adapter until the call ends. Then three
adapters share two slots (a request waits for its adapter's slot), a third adapter evicts a slot
with nothing compiled, the prefix cache keeps each adapter's pages apart, bad adapters are
refused by name while the engine goes on, and `AsyncLLM` takes a `lora_request` per request.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from meshserve import LLM, AsyncLLM, LoRARequest, SamplingParams  # noqa: E402
from meshserve.serving.bench import bench, lora_adapters  # noqa: E402
from meshserve.serving.engine.engine_config import EngineConfig  # noqa: E402

NUM_NEW = 6
# Pages of 4 tokens (the prompts fill whole pages: prefix caching has something to find) and a
# 16-token step: five token buckets serve every step.
ENGINE = dict(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              prefill_chunk=16, max_model_len=64, max_logprobs=1, warmup=False,
              compilation_cache=False, enable_lora=True, max_loras=2, max_lora_rank=8,
              warmup_prompt_logprobs=True)
ADAPTERS = {  # name -> LoraConfig fields
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=6, use_rslora=True,
                target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
    "out": dict(r=2, lora_alpha=3, target_modules=["v_proj", "o_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 33, 8, 91, 40, 3, 77], [12, 64, 9], [100, 2, 45, 45, 60, 31, 7, 19, 88, 23, 54]]


@dataclasses.dataclass(frozen=True)
class Reference:
    tokens: list[int]
    logprobs: list[float]  # teacher-forced, of each token
    margins: list[float]  # top-2 logit-probability margin at each step


def _hf_model(directory):
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _reference(model, prompt: list[int]) -> Reference:
    ids = list(prompt)
    for _ in range(NUM_NEW):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    steps = logprobs[len(prompt) - 1:-1]  # [NUM_NEW, V]: the distribution of each new token
    new = ids[len(prompt):]
    top2 = torch.topk(steps, 2, dim=-1).values
    return Reference(tokens=new, logprobs=[float(steps[i, t]) for i, t in enumerate(new)],
                     margins=[float(m) for m in top2[:, 0] - top2[:, 1]])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The base directory, each adapter's `LoRARequest`, and HF's reference per (prompt,
    adapter name or None)."""
    return _write_served(tmp_path_factory.mktemp("lora"), num_layers=2)


@pytest.fixture(scope="module")
def served_3_layers(tmp_path_factory):
    """The same with 3 layers: 2 stages hold 2 and 1, the second padded by an identity layer."""
    return _write_served(tmp_path_factory.mktemp("lora3"), num_layers=3)


def _write_served(root, *, num_layers: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2)
    base_dir = root / "base"
    transformers.LlamaForCausalLM(config).float().save_pretrained(base_dir)
    models = {None: _hf_model(base_dir)}
    requests = {}
    for i, (name, fields) in enumerate(ADAPTERS.items(), start=1):
        model = peft.get_peft_model(_hf_model(base_dir), peft.LoraConfig(**fields))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "lora_B" in key:  # peft starts B at zero: the adapter would do nothing
                    param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        model.save_pretrained(root / name)
        models[name] = model.eval()
        requests[name] = LoRARequest(name, i, str(root / name))
    want = {(p, name): _reference(model, prompt) for p, prompt in enumerate(PROMPTS)
            for name, model in models.items()}
    return base_dir, requests, want


def _greedy():
    return SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)


def _generate(llm, requests, cases):
    """Runs `(prompt index, adapter name or None)` cases in one generate call."""
    return llm.generate([PROMPTS[p] for p, _ in cases], _greedy(), use_tqdm=False,
                        lora_request=[None if a is None else requests[a] for _, a in cases])


def _assert_matches_hf(outputs, cases, want, *, num_new: int = NUM_NEW) -> None:
    """Each output's tokens are HF's first `num_new` (or all `NUM_NEW`), logprobs close."""
    for out, case in zip(outputs, cases):
        ref, completion = want[case], out.outputs[0]
        for step, (got, token) in enumerate(zip(completion.token_ids, ref.tokens)):
            assert ref.margins[step] >= 1e-3, f"{case}: HF's step {step} is a near tie"
            assert got == token, f"{case}: token {step} is {got}, HF chose {token}"
            logprob = completion.logprobs[step][got].logprob
            assert abs(logprob - ref.logprobs[step]) < 2e-3, (case, step, logprob)
        assert len(completion.token_ids) == num_new


MIXED = [(p, a) for p in range(len(PROMPTS)) for a in (None, "attn", "mlp")]


@pytest.fixture(scope="module")
def llm(served):
    """One device, warmed up: every step program and the slot write compiled at start."""
    base_dir, _, _ = served
    llm = LLM(str(base_dir), **(ENGINE | dict(warmup=True)))
    assert llm.engine.stats.warmup_compiles == llm.engine.runner.num_programs()
    return llm


def test_two_adapters_and_the_base_model_in_one_call_give_hfs_tokens(llm, served):
    """Nine requests (three prompts, each with "attn", "mlp" and none) in one call: steps mix
    all three, and each request gets HF + peft's tokens for its own adapter."""
    _, requests, want = served
    assert len({tuple(want[p, a].tokens) for p, a in MIXED}) == len(MIXED)  # adapters matter
    _assert_matches_hf(_generate(llm, requests, MIXED), MIXED, want)


def test_three_adapters_share_two_slots_by_waiting(llm, served):
    """Three adapters and two slots in one call: a request whose adapter finds every slot
    pinned waits while the others run, and gets its slot once an adapter's requests end."""
    _, requests, want = served
    cases = [(p, a) for p in range(len(PROMPTS)) for a in (None, "attn", "mlp", "out")]
    loads = llm.engine.stats.num_adapter_loads
    _assert_matches_hf(_generate(llm, requests, cases), cases, want)
    assert llm.engine.stats.num_adapter_loads >= loads + 2
    llm.engine.scheduler.adapter_slots.check()


def test_another_adapter_takes_a_slot_with_nothing_compiled(llm, served):
    """With both slots holding adapters, "out" evicts the least recently used one (its slot is
    rewritten whole: "out" leaves q, k, gate and up alone, which must read zeros), then "attn"
    comes back; nothing compiles after the warm-up, whichever adapters run and load."""
    _, requests, want = served
    _generate(llm, requests, MIXED)  # slots: "attn" and "mlp"
    stats = llm.engine.stats
    loads = stats.num_adapter_loads
    for cases in ([(p, a) for p in range(len(PROMPTS)) for a in (None, "out", "mlp")], MIXED):
        _assert_matches_hf(_generate(llm, requests, cases), cases, want)
    assert stats.num_adapter_loads >= loads + 2
    assert stats.compiles_after_warmup == 0


def test_prefix_cache_pages_are_kept_per_adapter(llm, served):
    """The same prompt under one adapter finds its pages again; under another, or none, it
    finds nothing (and still gives that adapter's tokens)."""
    _, requests, want = served
    llm.engine.scheduler.forget_prefixes()  # what the earlier calls cached
    for adapter, cached in (("attn", False), ("attn", True), ("mlp", False), (None, False)):
        (out,) = _generate(llm, requests, [(2, adapter)])
        _assert_matches_hf([out], [(2, adapter)], want)
        assert (out.num_cached_tokens > 0) == cached, adapter


def test_the_benchs_adapters_load_in_peft_and_give_its_tokens(llm, served, tmp_path):
    """`meshserve bench --lora-adapters` writes its adapters in PEFT's format (every projection):
    PEFT loads one, and the engine gives HF + peft's tokens and logprobs with it."""
    base_dir, _, want = served
    (adapter,) = lora_adapters.random_adapters(tmp_path, llm.engine.model_config, 1, rank=4,
                                               seed=3, b_scale=0.3)
    adapter = dataclasses.replace(adapter, lora_int_id=100)  # ids 1-3 are this module's own
    model = peft.PeftModel.from_pretrained(_hf_model(base_dir), adapter.lora_path).eval()
    assert len(model.peft_config["default"].target_modules) == 7
    reference = {(0, "bench"): _reference(model, PROMPTS[0])}
    (out,) = llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=adapter)
    _assert_matches_hf([out], [(0, "bench")], reference)
    base = want[0, None]
    assert max(abs(a - b) for a, b in zip(reference[0, "bench"].logprobs, base.logprobs)) > 0.05


def test_the_bench_runs_the_base_model_beside_the_adapters():
    config = EngineConfig(**ENGINE)
    configs = bench.engine_configs(config)
    assert list(configs) == ["continuous", "static", bench.BASE_MODEL]
    assert [c.enable_lora for c in configs.values()] == [True, False, False]
    assert configs[bench.BASE_MODEL].policy == "continuous"
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="one at a time"):
        bench.engine_configs(EngineConfig(**ENGINE, speculative_config=spec))


def test_bad_adapters_are_refused_by_name_and_the_engine_goes_on(llm, served, tmp_path):
    base_dir, requests, want = served
    dora = tmp_path / "dora"
    model = peft.get_peft_model(_hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    model.save_pretrained(dora)
    wide = tmp_path / "wide"
    peft.get_peft_model(_hf_model(base_dir), peft.LoraConfig(
        r=16, target_modules=["q_proj"])).save_pretrained(wide)
    bad = [(LoRARequest("dora", 7, str(dora)), "use_dora"),
           (LoRARequest("wide", 8, str(wide)), "max_lora_rank"),
           (LoRARequest("gone", 9, str(tmp_path / "gone")), "not a directory"),
           (LoRARequest("other", 1, str(dora)), "lora_int_id 1 is already")]
    for lora_request, named in bad:
        with pytest.raises(ValueError, match=named):
            llm.generate([PROMPTS[0], PROMPTS[1]], _greedy(), use_tqdm=False,
                         lora_request=[requests["attn"], lora_request])
        assert not llm.engine.has_unfinished()  # all or nothing: the good one left too
    _assert_matches_hf(_generate(llm, requests, MIXED[:3]), MIXED[:3], want)


def test_async_llm_takes_a_lora_request_per_request(llm, served):
    """The engine behind an `AsyncLLM` (the module's last use of it): concurrent requests with
    their own adapters, and a bad adapter a ValueError."""
    _, requests, want = served
    async_llm = AsyncLLM.from_engine(llm.engine)

    async def main():
        return await asyncio.gather(*(
            async_llm.generate(PROMPTS[p], _greedy(), lora_request=requests.get(a))
            for p, a in MIXED))

    try:
        _assert_matches_hf(asyncio.run(main()), MIXED, want)
        with pytest.raises(ValueError, match="not a directory"):
            asyncio.run(async_llm.generate(PROMPTS[0], _greedy(), lora_request=LoRARequest(
                "gone", 9, "/nonexistent/adapter")))
    finally:
        async_llm.shutdown()


def test_adapters_on_a_model_mesh_give_hfs_tokens(served):
    """model=2 pads the 3 kv heads to 4 (and 6 query heads to 8): the adapters' heads are padded
    with zeros as the kernels' are, and A and B split as their projections split."""
    base_dir, requests, want = served
    llm = LLM(str(base_dir), mesh="model=2", **ENGINE)
    _assert_matches_hf(_generate(llm, requests, MIXED), MIXED, want)


@pytest.fixture(scope="module")
def pipelined(served_3_layers):
    """Two pipeline stages over 3 layers (2 and 1 + an identity layer), warmed up: the
    pipeline call and the slot write compiled at start."""
    base_dir, _, _ = served_3_layers
    return LLM(str(base_dir), mesh="stage=2", **(ENGINE | dict(warmup=True)))


def test_adapters_on_pipeline_stages_give_hfs_tokens(pipelined, served_3_layers):
    """stage=2: each stage holds its layers' rows of the slabs (the identity layer's are zeros),
    and every unit of the pipeline call carries its tokens' slots; two adapters and the base
    model mixed in one call give HF + peft's tokens."""
    _, requests, want = served_3_layers
    assert len({tuple(want[p, a].tokens) for p, a in MIXED}) == len(MIXED)  # adapters matter
    _assert_matches_hf(_generate(pipelined, requests, MIXED), MIXED, want)
    assert pipelined.engine.stats.compiles_after_warmup == 0


def test_a_slot_let_go_in_a_pipeline_call_keeps_its_adapter_until_the_call_ends(
        pipelined, served_3_layers):
    """Both slots busy ("attn", "mlp"), "out" waiting: "attn" ends after 2 tokens in the
    second of the call's rounds, while later rounds are planned. Its slot must not take "out"
    in those rounds: the load would be written before the call, under "attn"'s rows of the
    first two. "out" gets it in the next call, and every request gets HF + peft's tokens."""
    _, requests, want = served_3_layers
    pipelined.engine.scheduler.forget_prefixes()
    cases = [(0, "attn"), (1, "mlp"), (2, "out"), (2, None)]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)] + \
        [_greedy()] * 3
    loads = pipelined.engine.stats.num_adapter_loads
    outputs = pipelined.generate([PROMPTS[p] for p, _ in cases], params, use_tqdm=False,
                                 lora_request=[requests.get(a) for _, a in cases])
    _assert_matches_hf(outputs[:1], cases[:1], want, num_new=2)
    _assert_matches_hf(outputs[1:], cases[1:], want)
    assert pipelined.engine.stats.num_adapter_loads > loads  # "out" was loaded
    pipelined.engine.scheduler.adapter_slots.check()
    assert pipelined.engine.stats.compiles_after_warmup == 0


def test_adapters_on_stages_and_a_model_mesh_give_hfs_tokens(served_3_layers):
    """stage=2,model=2: the slabs split on `stage` by layers and on `model` as their
    projections do (heads padded 3 -> 4 kv, 6 -> 8 query)."""
    base_dir, requests, want = served_3_layers
    llm = LLM(str(base_dir), mesh="stage=2,model=2", **ENGINE)
    _assert_matches_hf(_generate(llm, requests, MIXED), MIXED, want)


def test_lora_needs_enable_lora(served):
    base_dir, requests, _ = served
    plain = LLM(str(base_dir), **(ENGINE | dict(enable_lora=False)))
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(PROMPTS[0], _greedy(), use_tqdm=False, lora_request=requests["attn"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(**(ENGINE | dict(max_cpu_loras=1, max_loras=2)))
