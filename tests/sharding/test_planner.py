"""The mesh planner, kept honest: its counts against the compiled step, its formulas by hand, its
verdicts on big presets, and the `plan` command.

The counts are read from the same programs as `test_memory.py` and `test_collectives.py`
(`tests/sharding/compiled.py`): tiny-llama and tiny-gpt2 in float32, the decode bucket of 4 rows
per replica, on fake CPU devices. Every other test is plain arithmetic and imports no jax.
"""

import argparse
import json
import math
import subprocess
import sys

import jax
import pytest
from flax import nnx

from meshserve.model.config import ModelConfig, MoeConfig
from meshserve.model.transformer import abstract_model
from meshserve.serving.bench.plan_command import add_plan_parser, run as run_plan
from meshserve.sharding import head_padding as padding, planner
from meshserve.sharding.hardware import HARDWARE, HardwareSpec, hardware
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.planner import (COLLECTIVE_LATENCY_S, MeshShape, PlanOptions, Slo,
                                        Workload)
from meshserve.sharding.rules import DEFAULT_RULES
from tests.sharding.compiled import RUNNER_CONFIG, tensor_parallel_step

COMPILED_CASES = [
    ("tiny-llama", "model=2", 1),
    ("tiny-llama", "model=4", 1),  # 2 kv heads padded to 4
    ("tiny-llama", "data=2,model=2", 1),
    ("tiny-gpt2", "model=2", 1),
    ("tiny-llama", "model=2", 16),  # a prefill bucket: N = 4 rows * 16 tokens
    ("tiny-mixtral", "model=2", 1),  # 4 experts, 2 a device
    ("tiny-mixtral", "model=4", 1),  # one expert a device
]
DECODE_CASES = [case for case in COMPILED_CASES if case[2] == 1]
# Round numbers, so the hand computations below read easily.
TOY = HardwareSpec(name="toy", flops=1e12, f32_flops=1e11, hbm_bw=1e11, hbm=1e6, link_bw=1e10,
                   per_node=8)


def shape_of(mesh: str) -> MeshShape:
    return MeshShape(*MeshConfig.parse(mesh).shape)


# --- The mirror of the rules table, the padding and the weight declarations -------------------


def test_split_axes_are_the_rules_tables():
    split = {axis for axis, mesh_axis in DEFAULT_RULES.table.items() if mesh_axis == "model"}
    assert split == set(planner.MODEL_SPLIT_AXES)
    # Pipelining splits the layer stack and nothing else.
    assert {a for a, m in DEFAULT_RULES.table.items() if m == "stage"} <= {"layers"}


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-llama", {}), ("smollm2-135m", {}), ("llama-2-70b", {}), ("llama-2-7b", {}),
    ("tiny-llama", {"num_heads": 6, "num_kv_heads": 3}),
])
def test_head_counts_pad_as_the_padding_module_does(preset, overrides):
    config = ModelConfig.preset(preset, **overrides)
    for model_size in range(1, 17):
        assert planner.padded_head_counts(config, model_size) == padding.padded_head_counts(
            config, model_size)


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-llama", {}), ("tiny-llama", {"qkv_bias": True}),
    ("tiny-llama", {"tie_embeddings": True}), ("tiny-gpt2", {}), ("tiny-mixtral", {}),
    ("tiny-mixtral", {"qk_norm": True}),
    ("tiny-mixtral", {"moe": MoeConfig(num_experts=4, experts_per_token=2, renormalize=False,
                                       shared_expert_size=32)}),
])
def test_weight_axes_are_the_models_declarations(preset, overrides):
    config = ModelConfig.preset(preset, **overrides)
    _, state = nnx.split(abstract_model(config))
    declared = {"/".join(map(str, path)): tuple(var.axes)
                for path, var in nnx.to_flat_state(state)}
    assert declared == {key: planner.WEIGHT_AXES[key] for key in declared}
    shapes = planner.device_weight_shapes(config, MeshShape(1, 1, 1))
    assert sum(math.prod(shape) for shape in shapes.values()) == config.num_params


# --- Against the compiled step ------------------------------------------------------------------


@pytest.mark.parametrize("preset,mesh,tokens", DECODE_CASES)
def test_weight_bytes_per_device_equal_the_placed_shards(preset, mesh, tokens):
    step = tensor_parallel_step(preset, mesh, tokens)
    config = ModelConfig.preset(preset)
    want = planner.device_weight_bytes(config, shape_of(mesh))
    for device in step.runner.layout.mesh.devices.flat:
        held = sum(_bytes_on(var[...], device)
                   for _, var in nnx.to_flat_state(step.runner.params))
        assert held == want


@pytest.mark.parametrize("preset,mesh,tokens", DECODE_CASES)
def test_weight_and_kv_bytes_are_xlas_argument_bytes(preset, mesh, tokens):
    # XLA's accounting of one device's arguments: the weights, the donated (aliased) KV pages,
    # and the per-row step arrays.
    step = tensor_parallel_step(preset, mesh, tokens)
    config, shape = ModelConfig.preset(preset), shape_of(mesh)
    stats = step.compiled.memory_analysis()
    device = step.runner.layout.mesh.devices.flat[0]
    step_arrays = sum(_bytes_on(x, device) for x in jax.tree.leaves(step.args[2:]))
    slots = RUNNER_CONFIG.num_pages * RUNNER_CONFIG.page_size  # per replica
    assert stats.alias_size_in_bytes == planner.device_kv_bytes_per_token(config, shape) * slots
    assert (stats.argument_size_in_bytes - stats.alias_size_in_bytes - step_arrays
            == planner.device_weight_bytes(config, shape))


@pytest.mark.parametrize("preset,mesh,tokens", COMPILED_CASES)
def test_all_reduces_per_layer_equal_the_hlos(preset, mesh, tokens):
    step = tensor_parallel_step(preset, mesh, tokens)
    config, shape = ModelConfig.preset(preset), shape_of(mesh)
    slots = step.args[2].tokens.shape[0] // shape.data  # per replica
    residual = (("f32", (slots, config.hidden_size)),)
    hlo = step.hlo
    # The layers run in one scan: a while loop over the layers, whose body is one layer.
    loop = hlo.loop_carrying(step.runner.cache.k.addressable_shards[0].data.shape)
    assert hlo.trip_count(loop) == config.num_layers
    body = hlo.body(loop)
    in_layer = [op for op in hlo.ops("all-reduce", body) if op.shapes == residual]
    outside = [op for op in hlo.ops("all-reduce", set(hlo.computations) - body)
               if op.shapes == residual]
    assert len(in_layer) == planner.residual_all_reduces_per_layer(config, shape)
    assert (len(in_layer) * config.num_layers + len(outside)
            == planner.step_all_reduces_of_residual(config, shape))


@pytest.mark.parametrize("preset,mesh,tokens", DECODE_CASES)
def test_sampler_collectives_equal_the_hlos_greedy_path(preset, mesh, tokens):
    step = tensor_parallel_step(preset, mesh, tokens)
    config, hlo = ModelConfig.preset(preset), step.hlo
    always = _reachable_outside_conditionals(hlo)
    residual = {op.name for op in hlo.ops("all-reduce")
                if op.shapes == (("f32", (4 * tokens, config.hidden_size)),)}
    sampler = [op for op in hlo.collectives(always) if op.name not in residual]
    assert len(sampler) == planner.SAMPLER_COLLECTIVES
    gathered = [dims for op in hlo.collectives(set(hlo.computations) - always)
                if op.opcode == "all-gather" for _, dims in op.shapes]
    # The logits row the planner charges bytes for: gathered only on steps returning logprobs.
    assert (4, config.vocab_size) in gathered
    assert all(config.vocab_size not in dims for op in sampler for _, dims in op.shapes)


def _reachable_outside_conditionals(hlo) -> set[str]:
    """Computations every step runs: the sampler's sort sits in a branch the greedy path skips."""
    seen, todo = set(), [hlo.entry]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(c for op in hlo.computations[name] if op.opcode != "conditional"
                        for c in op.called)
    return seen


def _bytes_on(array, device) -> int:
    return sum(s.data.nbytes for s in array.addressable_shards if s.device == device)


# --- The formulas, by hand ----------------------------------------------------------------------

# tiny-llama in bfloat16: D 64, F 128, V 512, L 2, H 4, K 2, h 16, untied embeddings.
# Per layer, matmul weights: q 64*4*16 = 4096, k and v 64*2*16 = 2048 each, o 4096, gate, up and
# down 64*128 = 8192 each: 36,864; norms 2 * 64. lm_head 64*512 = 32,768; embedding 32,768.
TINY = ModelConfig.preset("tiny-llama", dtype="bfloat16")
TINY_PARAMS = 32_768 + 2 * (36_864 + 128) + 64 + 32_768  # 139,584
TINY_KV_PER_TOKEN = 2 * 2 * 16 * 2 * 2  # K and V, 2 kv heads, head_dim 16, 2 bytes, 2 layers


def test_tiny_counts_by_hand():
    one = MeshShape(1, 1, 1)
    assert TINY.num_params == TINY_PARAMS
    assert planner.device_weight_bytes(TINY, one) == 2 * TINY_PARAMS
    assert planner.streamed_weight_bytes(TINY, one) == 2 * (TINY_PARAMS - 32_768)
    assert planner.device_kv_bytes_per_token(TINY, one) == TINY_KV_PER_TOKEN == 256
    # model=4 pads the kv heads to 4: one per device; stage=2 leaves one layer per device.
    assert planner.device_kv_bytes_per_token(TINY, MeshShape(1, 2, 4)) == 2 * 16 * 2


def test_step_time_by_hand():
    cost = planner.step_cost(TINY, TOY, MeshShape(1, 1, 1), rows=2, tokens=1, context=10)
    flops = (2 * 2 * 2 * 36_864  # rows * 2 * layers * per-layer matmul params
             + 2 * 2 * 32_768  # lm_head at each row's last token
             + 4 * 2 * 10 * 4 * 16 * 2)  # attention: 4 * rows * context * H * h * L
    moved = 2 * (TINY_PARAMS - 32_768) + 2 * (10 + 1) * 256  # streamed weights, KV read + write
    assert cost.compute_s == pytest.approx(flops / 1e12)
    assert cost.memory_s == pytest.approx(moved / 1e11)
    assert cost.comm_s == 0
    assert cost.seconds == pytest.approx(max(flops / 1e12, moved / 1e11))


def test_all_reduce_time_by_hand():
    assert planner.all_reduce_seconds(1e6, 4, 1e10) == pytest.approx(
        2 * 3 / 4 * 1e6 / 1e10 + COLLECTIVE_LATENCY_S)
    assert planner.all_reduce_seconds(1e6, 1, 1e10) == 0
    # model=2, 4 decode rows: 2 layers * 2 + the embedding's all-reduces of [4, 64] bf16 (512 B),
    # the [4, 512] float32 logits gathered (8 KiB), and 6 more sampler collectives.
    comm = planner.tensor_parallel_seconds(TINY, TOY, MeshShape(1, 1, 2), rows=4, tokens=1)
    all_reduce = 2 * (1 / 2) * 512 / 1e10 + COLLECTIVE_LATENCY_S
    gather = (1 / 2) * 4 * 512 * 4 / 1e10 + COLLECTIVE_LATENCY_S
    assert comm == pytest.approx(5 * all_reduce + gather + 6 * COLLECTIVE_LATENCY_S)


def test_links_across_nodes_use_the_inter_node_bandwidth():
    two_nodes = HardwareSpec(flops=1e12, hbm_bw=1e11, hbm=1e9, link_bw=1e10, per_node=4,
                             inter_node_bw=1e9)
    assert planner.model_link_bandwidth(two_nodes, MeshShape(2, 1, 4)) == 1e10
    assert planner.model_link_bandwidth(two_nodes, MeshShape(1, 1, 8)) == 1e9
    assert planner.stage_link_bandwidth(two_nodes, MeshShape(1, 2, 2)) == 1e10
    assert planner.stage_link_bandwidth(two_nodes, MeshShape(1, 2, 4)) == 1e9


def test_bubble_fraction_by_hand():
    assert planner.fill_drain_utilisation(4, 2) == pytest.approx(4 / 5)
    assert planner.fill_drain_utilisation(1, 4) == pytest.approx(1 / 4)
    assert planner.fill_drain_utilisation(3, 1) == 1


@pytest.mark.parametrize("fill", [False, True])
def test_pipeline_cycle_by_hand(fill):
    # 8 rows on 2 stages in 2 microbatches of 4: a decode round is (M + S - 1) = 3 ticks, 2 busy.
    workload = Workload(prompt_len=10, output_len=6)
    cycle = planner.replica_cycle(TINY, TOY, MeshShape(1, 2, 1), workload,
                                  PlanOptions(fill_bubbles=fill), rows=8)
    t_dec, t_pre = cycle.decode_tick_s, cycle.prefill_tick_s
    assert cycle.microbatches == 2
    assert t_dec == pytest.approx(
        planner.step_cost(TINY, TOY, MeshShape(1, 2, 1), rows=4, tokens=1, context=13.5).seconds
        + 4 * 64 * 2 / 1e10 + COLLECTIVE_LATENCY_S)  # the [4, 64] activations to stage 2
    decode = 6 * 3 * t_dec
    if fill:  # 6 idle decode ticks per stage take in what prefill they can
        left = 8 * t_pre - 6 * t_dec
        want = decode + (left + t_pre if left > 0 else 0)
    else:
        want = decode + (8 + 1) * t_pre
    assert cycle.seconds == pytest.approx(want)
    assert cycle.busy_s == pytest.approx(6 * 2 * t_dec + 8 * t_pre)
    assert cycle.tpot_s == pytest.approx(want / 6)
    assert cycle.ttft_s == pytest.approx(3 * t_dec + 2 * t_pre)


def test_max_batch_by_hand():
    # 1 MB of HBM, 10% headroom: 900,000 bytes, less 279,168 of weights. A sequence of 10 + 6
    # tokens holds one 16-token page: 16 * 256 bytes of KV.
    workload = Workload(prompt_len=10, output_len=6)
    got = planner.max_batch_per_replica(TINY, TOY, MeshShape(1, 1, 1), workload, 0.1)
    assert got == (900_000 - 279_168) // (16 * 256) == 151
    result = planner.plan(TINY, TOY, 2, workload)
    by_mesh = {str(m.mesh): m for m in result.meshes}
    assert by_mesh["data=2,stage=1,model=1"].max_batch == 2 * 151


def test_concurrency_is_capped_by_the_max_batch():
    result = planner.plan(TINY, TOY, 1, Workload(prompt_len=10, output_len=6, concurrency=1000))
    (only,) = result.meshes
    assert only.batch == only.max_batch == 151
    assert "concurrency capped at 151" in only.notes


# tiny-mixtral in bfloat16: tiny-llama with 4 experts of width 128 in place of the MLP, 2 a
# token. Per layer: attention 12,288, router 64*4 = 256, experts 4 * 3 * 64*128 = 98,304.
MIXTURE = ModelConfig.preset("tiny-mixtral", dtype="bfloat16")
MIXTURE_LAYER = 12_288 + 256 + 98_304 + 128  # with the two norms


def test_mixture_counts_by_hand():
    one = MeshShape(1, 1, 1)
    assert MIXTURE.num_params == 32_768 + 2 * MIXTURE_LAYER + 64 + 32_768
    assert MIXTURE.num_active_params == MIXTURE.num_params - 2 * 2 * 3 * 64 * 128
    assert planner.experts_read(MIXTURE, 1) == 0.5  # one token runs 2 of the 4
    assert planner.experts_read(MIXTURE, 3) == 1 - 0.5 ** 3
    assert planner.experts_read(TINY, 1) == 1
    every = planner.streamed_weight_bytes(MIXTURE, one)
    assert every == 2 * (MIXTURE.num_params - 32_768)
    assert planner.streamed_weight_bytes(MIXTURE, one, tokens=1) == every - 2 * 2 * 98_304 // 2
    # Expert parallelism: model=2 holds 2 whole experts a device.
    shapes = planner.device_weight_shapes(MIXTURE, MeshShape(1, 1, 2))
    assert shapes["layers/mlp/experts/gate"] == (2, 2, 64, 128)
    cost = planner.step_cost(MIXTURE, TOY, one, rows=2, tokens=1, context=10)
    flops = (2 * 2 * 2 * (12_288 + 256 + 98_304 / 2)  # a token runs half of the expert weights
             + 2 * 2 * 32_768 + 4 * 2 * 10 * 4 * 16 * 2)
    assert cost.compute_s == pytest.approx(flops / 1e12)


def test_mixture_all_reduces_follow_the_rules_table():
    shared = MIXTURE.replace(moe=MoeConfig(num_experts=4, experts_per_token=2, renormalize=True,
                                           shared_expert_size=32))
    assert planner.residual_all_reduces_per_layer(MIXTURE, MeshShape(1, 1, 1)) == 0
    assert planner.residual_all_reduces_per_layer(MIXTURE, MeshShape(1, 1, 2)) == 2
    assert planner.residual_all_reduces_per_layer(shared, MeshShape(1, 1, 2)) == 3
    # 4 experts do not divide over 3 devices: replicated, so only attention's all-reduce.
    assert planner.residual_all_reduces_per_layer(MIXTURE, MeshShape(1, 1, 3)) == 1
    three = next(m for m in planner.plan(MIXTURE, HARDWARE["h100-sxm"], 3, LONG).meshes
                 if m.mesh == MeshShape(1, 1, 3))
    assert "4 experts replicated over model=3" in three.notes


# --- Big presets ------------------------------------------------------------------------------

LONG = Workload(prompt_len=1024, output_len=1024)


def test_llama_2_70b_does_not_fit_on_one_h100():
    result = planner.plan("llama-2-70b", HARDWARE["h100-sxm"], 1, LONG, dtype="bfloat16")
    (only,) = result.meshes
    assert not only.feasible and "weights need 138.0 GB per device" in only.reason
    assert result.recommended is None and result.closest is None


def test_llama_2_70b_fits_on_eight_h100s():
    result = planner.plan("llama-2-70b", HARDWARE["h100-sxm"], 8, LONG, dtype="bfloat16")
    assert len(result.meshes) == 10  # every (data, stage, model) of 8
    best = result.recommended
    assert best is not None and best.meets_slo and best.mesh.model > 1
    assert best.throughput == max(m.throughput for m in result.meshes if m.meets_slo)
    replicated = next(m for m in result.meshes if m.mesh == MeshShape(8, 1, 1))
    assert not replicated.feasible and "weights need" in replicated.reason
    assert result.meshes[-1] == replicated  # infeasible meshes come last, with their reason


def test_structural_reasons_are_listed():
    gpt2 = planner.plan("gpt2", HARDWARE["h100-sxm"], 8, LONG)
    by_mesh = {m.mesh: m for m in gpt2.meshes}
    assert "12 heads do not divide over model=8" in by_mesh[MeshShape(1, 1, 8)].reason
    assert "vocab 50257 replicated over model=2" in by_mesh[MeshShape(4, 1, 2)].notes
    assert by_mesh[MeshShape(1, 1, 8)].weight_bytes is None
    tiny = planner.plan("tiny-llama", HARDWARE["h100-sxm"], 4, LONG)
    deep = next(m for m in tiny.meshes if m.mesh == MeshShape(1, 4, 1))
    assert deep.reason == "stage=4 exceeds the 2 layers"


def test_when_no_mesh_meets_the_slos_the_closest_is_shown():
    result = planner.plan("llama-2-70b", HARDWARE["h100-sxm"], 8, LONG, Slo(ttft=2.0, tpot=1e-3),
                          dtype="bfloat16")
    assert result.recommended is None
    closest = result.closest
    assert closest.feasible and not closest.meets_slo
    assert closest.slo_excess(result.slo) == min(m.slo_excess(result.slo) for m in result.meshes
                                                 if m.feasible)


def test_mixtures_of_experts_plan_with_their_published_sizes():
    # Qwen's model cards: 30.5B parameters with 3.3B activated; 235B with 22B activated.
    small = planner.resolve_model("qwen3-30b-a3b")
    assert small.num_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert small.num_active_params / 1e9 == pytest.approx(3.3, rel=0.02)
    big = planner.resolve_model("qwen3-235b-a22b")
    assert big.num_params / 1e9 == pytest.approx(235, abs=0.5)
    assert big.num_active_params / 1e9 == pytest.approx(22, rel=0.02)
    mixtral = planner.plan("mixtral-8x7b", HARDWARE["h100-sxm"], 8, LONG)
    assert mixtral.recommended is not None and mixtral.recommended.mesh.model > 1
    alone = planner.plan("qwen3-30b-a3b", HARDWARE["h100-sxm"], 1,
                         Workload(prompt_len=1024, output_len=1024, concurrency=1))
    (one,) = alone.meshes
    assert one.feasible and "a decode tick reads 6% of the experts" in one.notes
    # At batch 1 a decode step reads the weights a token runs, not all of them.
    dense_bytes = planner.streamed_weight_bytes(small.replace(dtype="bfloat16"), MeshShape(1, 1, 1))
    assert one.decode_memory_s * HARDWARE["h100-sxm"].hbm_bw < 0.2 * dense_bytes


def test_llama_3_8b_is_a_planning_shape():
    config = planner.resolve_model("llama-3-8b", "bfloat16")
    assert (config.num_layers, config.num_kv_heads, config.vocab_size) == (32, 8, 128256)
    assert round(config.num_params / 1e9, 2) == 8.03


# --- The hardware table -----------------------------------------------------------------------


def test_hardware_parse_and_lookup():
    spec = hardware("flops=989e12,hbm_bw=3.35e12,hbm=80e9,link_bw=450e9,per_node=8,name=mine")
    assert spec == HardwareSpec(name="mine", flops=989e12, hbm_bw=3.35e12, hbm=80e9,
                                link_bw=450e9, per_node=8)
    assert hardware("h200-sxm").hbm == 141e9
    with pytest.raises(ValueError, match="unknown hardware 'b200'; use one of"):
        hardware("b200")


@pytest.mark.parametrize("text,message", [
    ("flops=1e12,hbm_bw=1e11", "give hbm, link_bw, per_node as well"),
    ("flops=fast,hbm_bw=1,hbm=1,link_bw=1,per_node=1", "flops must be a number like 80e9"),
    ("flops=1,speed=2", "expected comma-separated KEY=VALUE"),
    ("flops=1,hbm_bw=1,hbm=1,link_bw=1,per_node=2.5", "per_node must be a whole number"),
    ("flops=-1,hbm_bw=1,hbm=1,link_bw=1,per_node=1", "flops must be a number > 0"),
])
def test_hardware_parse_errors_say_what_to_change(text, message):
    with pytest.raises(ValueError, match=message):
        HardwareSpec.parse(text)


def test_float32_needs_a_published_rate():
    with pytest.raises(ValueError, match="tpu-v5e has no float32 rate"):
        planner.plan("tiny-llama", HARDWARE["tpu-v5e"], 1, LONG, dtype="float32")


# --- The command ----------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_run_plan_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plans" / "70b.json"
    args = _parse(["plan", "--model", "llama-2-70b", "--hardware", "h100-sxm", "--devices", "8",
                   "--concurrency", "64", "--output", str(out)])
    assert run_plan(args) == 0
    printed = capsys.readouterr().out
    assert "llama-2-70b (bfloat16, 68.98B params, 138.0 GB of weights) on 8 x h100-sxm" in printed
    assert "weights need 138.0 GB per device" in printed
    assert "recommended: data=" in printed
    saved = json.loads(out.read_text())
    assert saved["devices"] == 8 and saved["workload"]["concurrency"] == 64
    assert len(saved["meshes"]) == 10
    assert saved["recommended"] in {_mesh_str(m["mesh"]) for m in saved["meshes"]}
    assert saved["meshes"][0]["meets_slo"] and saved["meshes"][0]["batch"] == 64


def _mesh_str(mesh: dict) -> str:
    return str(MeshShape(mesh["data"], mesh["stage"], mesh["model"]))


def test_run_plan_refuses_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="unknown model 'llama-9'"):
        run_plan(_parse(["plan", "--model", "llama-9"]))
    with pytest.raises(SystemExit):
        _parse(["plan", "--concurrency", "lots"])
    assert _parse(["plan", "--concurrency", "max"]).concurrency is None


def test_planning_imports_no_jax():
    code = ("import sys, meshserve.serving.bench.plan_command, meshserve.sharding.planner\n"
            "assert 'jax' not in sys.modules, 'jax was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
