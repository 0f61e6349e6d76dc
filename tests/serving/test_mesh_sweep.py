"""`meshserve mesh-sweep` on the tiny model and fake CPU devices: the JSON it writes, the
collectives it reads off each mesh's decode program, memory per device, charts, bad meshes, and
the planner's orderings set beside the measured ones.

What is checked against the planner is what holds on fake devices. They share this machine's
cores, so measured throughput does not grow with devices as the planner's per-device rates
assume, and on shapes this small host work dominates: the measured ordering is recorded with its
rank correlation, but not asserted. Per-device weight bytes, and their ordering, are asserted.
"""

import json

import pytest

from meshserve.model.config import ModelConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.bench import mesh_measure, mesh_sweep
from meshserve.serving.cli.main import main
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding.hlo import COLLECTIVES
from tests.conftest import random_params

# A 16-token budget, one prefill chunk: six programs a mesh (token buckets 1 to 16, and prompt
# logprobs at 16) for the sweep's warm-up to compile.
SMALL = ["--model", "tiny-llama", "--num-pages", "32", "--max-num-seqs", "2",
         "--max-num-batched-tokens", "16", "--prefill-chunk", "16", "--max-model-len", "32",
         "--no-compilation-cache", "--no-warmup", "--pipeline-rounds", "2"]
WORKLOAD = ["--workload", "fixed-8x4", "--num-requests", "4", "--concurrency", "2",
            "--repeats", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """1x1x1 and 1x1x2 measured; 1x3x1 cannot split tiny-llama's 2 layers. About 1.5 minutes
    on two cores: the tests reading it are marked slow."""
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    # --allow-dirty: the stamp is this tree's, committed or not (test_bench.py tests it)
    assert main(["mesh-sweep", "--meshes", "1x1x1,1x1x2,1x3x1", "--output", str(out),
                 "--allow-dirty", *WORKLOAD, *SMALL]) == 0
    return out, json.loads(out.read_text())


@pytest.mark.slow
def test_the_json_holds_every_measurement(sweep):
    _, results = sweep
    assert results["schema_version"] == 1 and results["command"].startswith("meshserve mesh-sweep")
    assert {"git_commit", "git_dirty", "machine", "jax", "devices"} <= set(results["environment"])
    assert results["machine"]["bandwidth"] > 0 and results["concurrency"] == 2
    assert [m["mesh"] for m in results["meshes"]] == ["1x1x1", "1x1x2", "1x3x1"]
    for record in results["meshes"][:2]:
        steps, serving = record["steps"], record["serving"]
        assert 0 < steps["decode_step_s"] and 0 < steps["prefill_step_s"]
        assert steps["prefill_tokens"] == 16 and steps["decode_rows"] == 2
        assert serving["completed"] == 4 and serving["output_tokens"] == 16
        assert serving["compiles_after_warmup"] == 0  # warm_up reached every bucket
        for metric in ("ttft_s", "tpot_s", "e2el_s"):
            assert 0 < serving[metric]["mean"] <= serving[metric]["p99"]
        assert serving["stage_utilisation"] == 1.0
        assert set(record["collectives"]) == set(COLLECTIVES)
        analysis = record["memory"]["memory_analysis"]
        # XLA's arguments: the weights and KV pages, plus the small per-row step arrays.
        weights_and_kv = record["memory"]["weight_bytes"] + record["memory"]["kv_bytes"]
        assert weights_and_kv < analysis["argument_size_in_bytes"] < 1.05 * weights_and_kv
        assert analysis["alias_size_in_bytes"] == record["memory"]["kv_bytes"]  # donated


@pytest.mark.slow
def test_a_mesh_the_model_cannot_split_is_recorded_with_its_reason(sweep):
    _, results = sweep
    bad = results["meshes"][2]
    assert "steps" not in bad and "2 layers, fewer than its 3 pipeline stages" in bad["error"]


@pytest.mark.slow
def test_collectives_match_the_mesh(sweep):
    _, results = sweep
    one, two = (results["meshes"][i]["collectives"] for i in (0, 1))
    assert all(c["ops"] == c["per_step"] == 0 for c in one.values())
    layers = ModelConfig.preset("tiny-llama").num_layers
    # Two residual all-reduces a layer (attention out, MLP down), the embedding's, the sampler's.
    assert two["all-reduce"]["per_step"] >= 2 * layers + 2
    assert two["all-gather"]["per_step"] >= 1  # the logits row for the top-k logprobs
    assert two["all-reduce"]["bytes_per_step"] > 0


@pytest.mark.slow
def test_weight_bytes_halve_when_model_doubles(sweep):
    _, results = sweep
    one, two = (results["meshes"][i]["memory"] for i in (0, 1))
    # Split weights halve; the replicated norm scales (under 1% of tiny-llama) do not. Its two
    # kv heads divide over model=2, so nothing is padded.
    assert 0.5 < two["weight_bytes"] / one["weight_bytes"] < 0.51
    assert two["kv_bytes"] * 2 == one["kv_bytes"]


@pytest.mark.slow
def test_the_planner_is_compared_where_the_devices_allow(sweep):
    _, results = sweep
    comparison = results["comparison"]
    assert comparison["meshes"] == ["1x1x1", "1x1x2"]
    assert sorted(comparison["measured_order"]) == ["1x1x1", "1x1x2"]
    for name in mesh_sweep.SPECS:
        assert sorted(comparison[name]["predicted_order"]) == ["1x1x1", "1x1x2"]
        assert abs(comparison[name]["spearman"]) == pytest.approx(1.0)
    # What fake devices cannot blur: the planner's per-device weight bytes are the placed ones.
    assert comparison["weight_bytes_match"] is True
    one, two = results["meshes"][:2]
    assert (one["planner"]["whole_machine"]["weight_bytes"]
            > two["planner"]["whole_machine"]["weight_bytes"])
    assert results["meshes"][2]["planner"]["whole_machine"]["reason"].startswith("stage=3")


@pytest.mark.slow
def test_charts(sweep):
    out, results = sweep
    assert sorted(results["plots"]["files"]) == [
        "sweep-communication.png", "sweep-memory.png", "sweep-serving.png"]
    for name in results["plots"]["files"]:
        assert (out.parent / name).read_bytes().startswith(PNG_MAGIC)


def test_a_pipeline_mesh_permutes_between_stages():
    """The stage mesh's decode program, read as the sweep reads it: collective-permutes each
    tick (activations forward, tokens back), and no all-reduce without a model axis."""
    config = ModelConfig.preset("tiny-llama")
    model = model_from_params(config, random_params(config))
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", num_pages=32, max_num_seqs=2,
                                              max_num_batched_tokens=32, prefill_chunk=16,
                                              max_model_len=32, pipeline_rounds=2,
                                              warmup=False, compilation_cache=False))
    steps = mesh_measure.step_times(engine, [[5, 6, 7], [8, 9]], repeats=1)
    call = steps.pop("decode_call")
    assert steps["decode_rounds_per_call"] == call.num_rounds == 2
    collectives = mesh_measure.decode_program(engine, call)["collectives"]
    permutes = collectives["collective-permute"]
    assert permutes["ops"] == 2 and permutes["per_call"] == 2 * call.num_ticks
    assert collectives["all-reduce"]["per_step"] == 0


@pytest.mark.parametrize("meshes,message", [
    ("1x2", "bad mesh '1x2' in --meshes: expected DATAxSTAGExMODEL"),
    ("1x1x1,1x1x1", "names a mesh twice"),
    ("4x4x1", "needs 16 devices, but only 8 are visible; on a CPU, start with XLA_FLAGS="),
])
def test_a_bad_mesh_fails_before_anything_runs(meshes, message, capsys):
    assert main(["mesh-sweep", "--meshes", meshes, *SMALL]) == 2
    assert message in capsys.readouterr().err


def test_all_is_every_factorisation_of_the_devices():
    labels = [mesh_sweep.mesh_label(m) for m in mesh_sweep.parse_meshes("all", 4)]
    assert sorted(labels) == sorted(["1x1x4", "1x2x2", "1x4x1", "2x1x2", "2x2x1", "4x1x1"])


def test_spearman():
    assert mesh_sweep.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert mesh_sweep.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert mesh_sweep.spearman([1, 2, 2, 4], [1, 3, 2, 4]) == pytest.approx(0.9486833)
    assert mesh_sweep.spearman([1], [1]) is None
