"""`meshserve bench` on the tiny model: both modes write what the README promises."""

import json

import pytest

from meshserve.serving.cli import main

SMALL = ["--model", "tiny-llama", "--num-pages", "64", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--prefill-chunk", "16", "--max-model-len", "64",
         "--no-compilation-cache"]


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_bench_compares_both_policies_and_writes_the_results(mode, tmp_path, capsys):
    out = tmp_path / "results.json"
    extra = ["--rate", "50", "--slo-scale", "1"] if mode == "online" else []
    assert main(["bench", "--mode", mode, "--workload", "fixed-12x6", "--num-requests", "10",
                 "--output", str(out), *SMALL, *extra]) == 0
    results = json.loads(out.read_text())
    assert results["mode"] == mode and results["environment"]["jax"]
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
    printed = capsys.readouterr().out
    assert "continuous / static output tokens/s" in printed
    assert ("ttft" in printed) == (mode == "online")
