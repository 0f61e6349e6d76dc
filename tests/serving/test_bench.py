"""`meshserve bench` on the tiny model: both modes write what docs/benchmarks.md ("Output")
promises, stamped with the commit of the source tree they ran from (small git checkouts made by the
tests, so the stamp does not depend on the state of this one), and refused from a dirty tree
unless `--allow-dirty`."""

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.batching.scheduler import KVUsage
from meshserve.serving.bench import bench, latency, plots, result_files, workloads
from meshserve.serving.cli.main import main

SMALL = ["--model", "tiny-llama", "--num-pages", "64", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--prefill-chunk", "16", "--max-model-len", "64",
         "--no-compilation-cache"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _checkout(path):
    """A committed, clean git checkout of a small tree: a module, prose, a result and a
    workload input."""
    for name, text in (("serving/engine.py", "STEP = 1\n"), ("README.md", "# readme\n"),
                       ("benchmarks/results/run.json", "{}\n"),
                       ("benchmarks/results/prompts.jsonl", '{"prompt": "hi"}\n')):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "init", "-q")
    _git(path, "add", ".")
    _git(path, "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "base")
    return path


@pytest.fixture(scope="module", autouse=True)
def clean_checkout(tmp_path_factory):
    """Every bench in this module runs "from" a clean checkout, not from this tree."""
    repo = _checkout(tmp_path_factory.mktemp("clean"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(result_files, "SOURCE_DIR", repo / "serving")
        yield repo


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout of the test's own, to make dirty."""
    repo = _checkout(tmp_path / "checkout")
    monkeypatch.setattr(result_files, "SOURCE_DIR", repo / "serving")
    return repo


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_bench_compares_both_policies_and_writes_the_results(mode, tmp_path, capsys, checkout):
    """Offline runs from a dirty tree with --allow-dirty, online from a clean one. The offline
    run names its output with `{date}` and `{commit}`: they are filled in (the plots take the
    filled-in name, the command keeps what was typed), and the same command at the same commit
    and day is then refused, since a result file is never overwritten."""
    head = _git(checkout, "rev-parse", "HEAD").strip()
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    asked, out = tmp_path / "results.json", tmp_path / "results.json"
    extra = ["--rate", "50", "--slo-scale", "1"] if mode == "online" else ["--allow-dirty"]
    if mode == "offline":
        (checkout / "serving/engine.py").write_text("STEP = 2\n")
        asked, out = tmp_path / "r-{date}-{commit}.json", tmp_path / f"r-{today}-{head[:7]}.json"
    command = ["bench", "--mode", mode, "--workload", "fixed-12x6", "--num-requests", "10",
               "--output", str(asked), "--no-roofline", *SMALL, *extra]
    assert main(command) == 0
    results = json.loads(out.read_text())
    assert results["mode"] == mode and results["environment"]["jax"]
    assert results["command"] == "meshserve " + " ".join(command)
    assert sorted(results["plots"]["files"]) == sorted(f"{out.stem}-{name}.png"
                                                       for name in plots.NAMES)
    stamp = {k: v for k, v in results["environment"].items() if k.startswith("git_")}
    if mode == "offline":
        assert stamp == {"git_commit": head, "git_dirty": True,
                         "git_dirty_paths": ["serving/engine.py"],
                         "git_diff_sha256": result_files.source_tree(checkout).diff_sha256}
    else:
        assert stamp == {"git_commit": head, "git_dirty": False}
    for policy in ("continuous", "static"):
        r = results["results"][policy]
        assert r["compiles_after_warmup"] == 0 and r["preemptions"] == 0
        assert r["output_tokens_per_s"] > 0
        if mode == "online":
            assert r["completed"] == 10 and r["output_tokens"] == 60
            assert r["ttft_s"]["count"] == 10 and r["tpot_s"]["count"] == 10
            assert r["itl_s"]["count"] == 50  # 5 gaps in each of 10 six-token streams
            assert r["goodput"]["slos"]["name"] == "mlperf-llama2-70b-server x1"
    assert results["results"]["ratio_output_tokens_per_s"] > 0
    assert results["peak_rss_bytes"] > results["weight_bytes"]  # this process's, weights and all
    printed = capsys.readouterr().out
    assert "peak RSS: meshserve" in printed
    assert "continuous / static output tokens/s" in printed and f"wrote {out}" in printed
    assert ("ttft" in printed) == (mode == "online")
    assert main(command) == 2
    assert f"--output {out} exists" in capsys.readouterr().err


def test_quick_run_writes_the_full_schema_plots_and_roofline(tmp_path, capsys):
    out = tmp_path / "quick.json"
    assert main(["bench", "--quick", "--output", str(out), "--compare", "hf", "--no-progress",
                 *SMALL]) == 0
    results = json.loads(out.read_text())
    assert results["schema_version"] == 1 and results["quick"] is True
    assert results["command"].startswith("meshserve bench --quick")
    for key, kind in (("model", str), ("workload", str), ("num_requests", int),
                      ("engine_config", dict), ("environment", dict), ("results", dict),
                      ("roofline", dict), ("plots", dict)):
        assert isinstance(results[key], kind), key
    assert results["num_requests"] == 16
    assert results["engine_config"]["quantization"] == "auto" and results["weight_bytes"] > 0
    assert {"git_commit", "machine", "jax", "devices"} <= set(results["environment"])
    for policy in ("continuous", "static"):
        r = results["results"][policy]
        assert r["recompiles"] == r["compiles_after_warmup"] == 0
        for key in ("prefill_padding", "decode_padding", "host_overhead", "step_seconds",
                    "host_seconds", "wall_s", "output_tokens_per_s"):
            assert isinstance(r[key], float), key
        assert 0 <= r["host_overhead"] < 1
        assert 0 < r["device_wait_seconds"] <= r["step_seconds"] < r["wall_s"]
        assert r["host_seconds"] == pytest.approx(r["wall_s"] - r["device_wait_seconds"])
        kv = r["kv"]
        assert kv["num_samples"] == r["num_steps"] > 0
        assert 0 < kv["peak_used_pages"] <= kv["total_pages"]
        assert 0 <= kv["mean_fragmentation"] <= kv["peak_fragmentation"] < 1
        assert r["ttft_s"]["count"] == r["e2el_s"]["count"] == 16
    roof = results["roofline"]
    assert roof["bandwidth_bytes_per_s"] > 0 and roof["matmul_flops_per_s"] > 0
    assert roof["update_bandwidth_bytes_per_s"] > 0
    assert [row["batch"] for row in roof["rows"]] == [1, 8]
    for row in roof["rows"]:
        assert row["step_s"] > 0 and row["floor_s"] > 0
        assert row["ratio"] == pytest.approx(row["floor_s"] / row["step_s"])
    assert "skipped" in results["results"]["peers"]["hf"]
    plots = results["plots"]
    assert sorted(plots["files"]) == ["quick-latency_cdf.png", "quick-padding.png",
                                      "quick-step_time.png", "quick-throughput.png"]
    for name in plots["files"]:
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert "floor/step" in printed and "frag mean" in printed and "hf: skipped" in printed


def test_bench_refuses_to_stamp_a_result_from_a_dirty_tree(tmp_path, capsys, checkout):
    (checkout / "serving/engine.py").write_text("STEP = 2\n")
    out = tmp_path / "r.json"
    assert main(["bench", "--output", str(out), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "uncommitted changes (serving/engine.py)" in err and "--allow-dirty" in err
    assert not out.exists()


@pytest.mark.parametrize("command", [
    ["bench", *SMALL], ["bench", "--schema-validity", *SMALL], ["roofline", *SMALL],
    ["mesh-sweep", "--meshes", "1x1x1", *SMALL],
    ["quality", "--model", "tiny-llama", "--quantization", "int8", "--text", "missing.txt"],
])
def test_every_command_refuses_an_existing_result_file_before_it_runs(command, tmp_path,
                                                                     capsys):
    """A result file is never overwritten: the run is refused before anything loads (the
    quality run's text does not even exist), and the file keeps its bytes."""
    out = tmp_path / "run.json"
    out.write_text('{"kept": true}\n')
    assert main([*command, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--output {out} exists, and a result file is never overwritten" in err
    assert str(tmp_path / "run-{date}-{commit}.json") in err  # the name it suggests
    assert out.read_text() == '{"kept": true}\n'


@pytest.mark.parametrize("command, plot", [(["bench"], "padding"),
                                           (["mesh-sweep", "--meshes", "1x1x1"], "memory")])
def test_a_plot_that_exists_beside_a_new_result_is_refused_too(command, plot, tmp_path, capsys):
    (tmp_path / f"run-{plot}.png").write_bytes(PNG_MAGIC)
    assert main([*command, "--output", str(tmp_path / "run.json"), *SMALL]) == 2
    assert f"--output {tmp_path / f'run-{plot}.png'} exists" in capsys.readouterr().err
    assert not (tmp_path / "run.json").exists()
    folder = tmp_path / "plots"
    folder.mkdir()
    (folder / "bench-throughput.png").write_bytes(PNG_MAGIC)
    assert main(["bench", "--plots-dir", str(folder), *SMALL]) == 2
    assert f"--plots-dir {folder / 'bench-throughput.png'} exists" in capsys.readouterr().err


def test_length_eval_stamps_its_result_and_writes_only_new_files(tmp_path, capsys,
                                                                clean_checkout):
    """`--out` names the commit (here the clean checkout's); every file the command writes is
    refused, with its flag, where one exists, before anything is generated or trained."""
    from meshserve.serving.bench import length_eval

    kept = tmp_path / "kept"
    kept.write_text("kept\n")
    for flags in (["--out", str(kept)], ["--save-predictor", str(kept)],
                  ["--save-test", str(kept)], ["--workload", "smollm2", "--dataset", str(kept)]):
        assert length_eval.main(flags) == 2
        assert f"{flags[-2]} {kept} exists" in capsys.readouterr().err
    assert kept.read_text() == "kept\n"
    assert length_eval.main(["--num-requests", "200", "--out",
                             str(tmp_path / "eval-{commit}.json")]) == 0
    head = _git(clean_checkout, "rev-parse", "HEAD").strip()
    result = json.loads((tmp_path / f"eval-{head[:7]}.json").read_text())
    assert result["environment"]["git_commit"] == head
    assert result["environment"]["git_dirty"] is False
    assert result["results"]["planted"]["num_test"] == 60


def test_output_names_fill_in_the_date_and_the_short_commit():
    source = result_files.Provenance("0123456789abcdef" * 2 + "01234567")
    day = datetime.date(2026, 12, 5)
    assert result_files.output_path("r/x-{date}-{commit}.json", source, today=day) == Path(
        "r/x-2026-12-05-0123456.json")
    assert result_files.output_path("r/{x}.json", source, today=day) == Path("r/{x}.json")
    with pytest.raises(ValueError, match=r"--out r/\{commit\}.json: \{commit\} needs a git"):
        result_files.output_path("r/{commit}.json", result_files.Provenance(None), flag="--out")


def test_a_result_file_is_written_once(tmp_path):
    path = tmp_path / "deep" / "r.json"
    result_files.write_json(path, {"a": 1.5})
    assert json.loads(path.read_text()) == {"a": 1.5}
    with pytest.raises(FileExistsError):
        result_files.write_json(path, {"a": 2})
    with pytest.raises(TypeError):  # not JSON: no file is left behind
        result_files.write_json(tmp_path / "bad.json", {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1.5} and not (tmp_path / "bad.json").exists()


def test_a_clean_tree_is_its_commit_and_results_and_prose_do_not_dirty_it(checkout):
    head = _git(checkout, "rev-parse", "HEAD").strip()
    assert result_files.source_tree(checkout / "serving") == result_files.Provenance(head)
    (checkout / "README.md").write_text("# changed\n")
    (checkout / "benchmarks/results/run.json").write_text('{"new": 1}\n')
    (checkout / "benchmarks/results/run-throughput.png").write_bytes(PNG_MAGIC)
    assert result_files.source_tree(checkout) == result_files.Provenance(head)
    assert result_files.provenance(allow_dirty=False) == result_files.Provenance(head)
    outside = checkout.parent / "not-a-checkout"
    outside.mkdir()
    # nothing to stamp or refuse
    assert result_files.source_tree(outside) == result_files.Provenance(None)
    assert result_files.Provenance(None).as_dict() == {"git_commit": None, "git_dirty": None}


def test_a_dirty_tree_is_stamped_with_its_paths_and_the_hash_of_its_diff(checkout, tmp_path):
    (checkout / "serving/engine.py").write_text("STEP = 2\n")
    dirty = result_files.source_tree(checkout)
    assert dirty.dirty_paths == ("serving/engine.py",)
    diff = subprocess.run(["git", "-C", str(checkout), "diff", "--binary", "HEAD"], check=True,
                          capture_output=True).stdout
    assert dirty.diff_sha256 == hashlib.sha256(diff).hexdigest()
    # the same change to a clone of the same commit hashes the same; another change does not
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(checkout), str(clone))
    (clone / "serving/engine.py").write_text("STEP = 2\n")
    assert result_files.source_tree(clone) == dirty
    (clone / "serving/engine.py").write_text("STEP = 3\n")
    assert result_files.source_tree(clone).diff_sha256 != dirty.diff_sha256
    # a new file and a changed workload input count; the hash covers the new file's bytes
    (checkout / "serving/extra.py").write_text("X = 1\n")
    (checkout / "benchmarks/results/prompts.jsonl").write_text('{"prompt": "bye"}\n')
    more = result_files.source_tree(checkout)
    assert more.dirty_paths == ("benchmarks/results/prompts.jsonl", "serving/engine.py",
                                "serving/extra.py")
    (checkout / "serving/extra.py").write_text("X = 2\n")
    assert result_files.source_tree(checkout).diff_sha256 != more.diff_sha256
    with pytest.raises(ValueError, match=r"uncommitted changes \(benchmarks/results/prompts"):
        result_files.provenance(allow_dirty=False)
    assert result_files.provenance(allow_dirty=True) == result_files.source_tree(checkout)


def test_jsonl_workload_reads_token_ids_and_default_lengths(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 5}\n\n'
                    '{"prompt_token_ids": [4], "id": "b"}\n')
    requests = workloads.load_jsonl_workload(path, vocab_size=512, default_max_tokens=7)
    assert requests == [workloads.BenchRequest([1, 2, 3], 5), workloads.BenchRequest([4], 7)]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"prompt_token_ids": []}', "non-empty list"),
    ('{"prompt_token_ids": [1], "max_tokens": 0}', "max_tokens"),
    ('{"prompt_token_ids": [9999]}', "outside the vocabulary"),
    ('{"prompt": "hi", "prompt_token_ids": [1]}', "exactly one"),
    ('{"prompt": "hello"}', "tokenizer"),
    ('{"prompt_token_ids": [1], "temperature": 1}', "unknown fields"),
])
def test_jsonl_workload_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"prompts.jsonl:2: .*{message}"):
        workloads.load_jsonl_workload(path, vocab_size=512)


def test_bench_runs_a_jsonl_file_and_reports_a_bad_line(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": list(range(1, 2 + i)),
                                        "max_tokens": 3 + i}) + "\n" for i in range(5)))
    out = tmp_path / "r.json"
    assert main(["bench", "--prompts", str(path), "--no-roofline", "--output", str(out),
                 *SMALL]) == 0
    results = json.loads(out.read_text())
    assert results["workload"] == f"jsonl:{path}" and results["num_requests"] == 5
    assert results["results"]["continuous"]["output_tokens"] == sum(range(3, 8))
    path.write_text('{"prompt_token_ids": [1]}\n{"prompt": "text"}\n')
    assert main(["bench", "--workload", f"jsonl:{path}", "--no-roofline", *SMALL]) == 2
    assert f"{path}:2: a text prompt needs the model's tokenizer" in capsys.readouterr().err


def _usage(used: int, filled: int, *, cached: int = 0, reserved: int = 0) -> KVUsage:
    return KVUsage(num_total_pages=10, num_free_pages=10 - used - cached, num_used_pages=used,
                   num_cached_pages=cached, num_peak_used_pages=4,
                   num_reserved_unused_pages=reserved, num_filled_slots=filled,
                   num_allocated_slots=16 * used)


def test_kv_section_reports_fragmentation_and_cached_and_reserved_pages_per_step():
    samples = [_usage(0, 0),  # nothing allocated: no fragmentation fraction
               _usage(2, 24, cached=3),  # 8 of 32 empty
               _usage(4, 48, cached=1, reserved=2),  # 16 of 64 empty
               _usage(1, 4)]  # 12 of 16 empty
    kv = bench.kv_fragmentation(samples)
    assert kv == {"num_samples": 4, "peak_used_pages": 4, "total_pages": 10,
                  "peak_fragmentation": 0.75,
                  "mean_fragmentation": pytest.approx((0.25 + 0.25 + 0.75) / 3),
                  "peak_cached_pages": 3, "mean_cached_pages": 1.0,
                  "mean_reserved_unused_pages": 0.5}
    assert bench.kv_fragmentation([])["peak_fragmentation"] == 0.0


def test_shared_prefix_workload_is_seeded_and_shares_its_system_prompts():
    requests = workloads.make_workload("shared-prefix", num_requests=32, vocab_size=1000, seed=3)
    again = workloads.make_workload("shared-prefix", num_requests=32, vocab_size=1000, seed=3)
    assert requests == again
    prefixes = {tuple(r.prompt_token_ids[:workloads.SHARED_PREFIX_LEN]) for r in requests}
    assert 1 < len(prefixes) <= workloads.SHARED_PREFIXES
    assert all(8 <= len(r.prompt_token_ids) - workloads.SHARED_PREFIX_LEN <= 128 for r in requests)
    assert all(4 <= r.num_output_tokens <= 128 for r in requests)


def test_find_max_rate_brackets_then_bisects(monkeypatch):
    slos = latency.mlperf_server_slos(1.0)  # TTFT 2 s, TPOT 200 ms

    def fake_online(engine, requests, *, rate, **_):  # meets the SLOs up to 5 req/s
        p99 = {"p99": 1.0 if rate <= 5 else 3.0}
        return {"ttft_s": p99, "tpot_s": {"p99": 0.1}, "failed": 0,
                "output_tokens_per_s": 10.0 * rate, "goodput": {"requests_per_s": rate}}

    monkeypatch.setattr(bench, "run_online", fake_online)
    found = bench.find_max_rate(None, [], slos=slos, start=1.0, max_probes=6)
    assert [p["rate"] for p in found["probes"]] == [1, 2, 4, 8, 6, 5]
    assert [p["passed"] for p in found["probes"]] == [True, True, True, False, False, True]
    assert found["max_rate"] == 5 and found["lowest_failing_rate"] == 6
    high = bench.find_max_rate(None, [], slos=slos, start=16.0, max_probes=3)
    assert [p["rate"] for p in high["probes"]] == [16, 8, 4]
    assert high["max_rate"] == 4 and high["lowest_failing_rate"] == 8


def test_bench_finds_the_max_rate_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "--mode", "online", "--workload", "fixed-8x4", "--num-requests", "4",
                 "--find-max-rate", "--max-rate-probes", "2", "--rate", "20",
                 "--slo-scale", "1", "--no-roofline", "--output", str(out), *SMALL]) == 0
    results = json.loads(out.read_text())["results"]
    for policy in ("continuous", "static"):
        found = results["max_rate"][policy]
        assert len(found["probes"]) == 2 and found["slos"]["ttft_s"] == 2.0
        for probe in found["probes"]:
            assert {"rate", "p99_ttft_s", "p99_tpot_s", "passed"} <= set(probe)
        passing = [p["rate"] for p in found["probes"] if p["passed"]]
        assert found["max_rate"] == (max(passing) if passing else None)
    assert "max rate under mlperf-llama2-70b-server x1" in capsys.readouterr().out


def test_bench_needs_online_mode_and_slos_for_find_max_rate(capsys):
    assert main(["bench", "--find-max-rate", *SMALL]) == 2
    assert "need --mode online" in capsys.readouterr().err
    assert main(["bench", "--mode", "online", "--find-max-rate", *SMALL]) == 2
    assert "needs --slo-scale" in capsys.readouterr().err


def test_hf_peer_without_torch_is_skipped_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed, as far as import can tell
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    requests = [workloads.BenchRequest([1, 2, 3], 4)]
    peers = bench.run_peers(["hf"], str(gguf), requests, max_batch_size=4,
                            continuous={"output_tokens_per_s": 1.0})
    assert set(peers["hf"]) == {"skipped"} and "torch is not installed" in peers["hf"]["skipped"]
    assert "peer hf skipped" in capsys.readouterr().out


def test_an_installed_hf_peer_runs_beside_continuous_with_the_ratio(golden_dir):
    """Runs wherever the tests run: torch and transformers are in the `[test]` extra."""
    requests = [workloads.BenchRequest([1, 2, 3], 4), workloads.BenchRequest([4, 5], 2)]
    peers = bench.run_peers(["hf"], str(golden_dir / "tiny-llama"), requests, max_batch_size=2,
                            continuous={"output_tokens_per_s": 30.0})
    hf = peers["hf"]
    assert "skipped" not in hf, hf["skipped"]
    assert hf["output_tokens"] == 6
    assert hf["ratio_continuous_output_tokens_per_s"] == pytest.approx(
        30.0 / hf["output_tokens_per_s"])


def test_bench_sweeps_concurrencies_for_the_throughput_plot(tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["bench", "--mode", "online", "--workload", "fixed-8x4", "--num-requests", "4",
                 "--concurrencies", "1,4", "--no-roofline", "--output", str(out), *SMALL]) == 0
    results = json.loads(out.read_text())
    sweep = results["results"]["sweep"]
    assert sweep["axis"] == "concurrency" and sweep["values"] == [1, 4]
    for policy in ("continuous", "static"):
        assert [r["completed"] for r in sweep[policy]] == [4, 4]
        assert results["results"][policy] == sweep[policy][-1]
    assert "sweep-throughput.png" in results["plots"]["files"]
