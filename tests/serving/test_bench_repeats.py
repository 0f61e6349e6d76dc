"""`meshserve bench --repeats`: every system runs N times, interleaved; medians, min and max, the
ratio of medians with its range, and each run's load average, with runs that shared the cores
marked."""

import json

import pytest

from meshserve.serving.bench import repeats
from meshserve.serving.cli.main import main
# clean_checkout: every bench here stamps its result from a clean checkout, as in test_bench.
from tests.serving.test_bench import SMALL, clean_checkout  # noqa: F401


def _run(tok_s: float, load: float = 0.5) -> dict:
    return {"output_tokens_per_s": tok_s,
            "load_average": {"before": load, "after": load, "shared": load > 3}}


def test_medians_ranges_and_ratios_of_medians():
    runs = [{"continuous": _run(100), "static": _run(40), "server": _run(50)},
            {"continuous": _run(80), "static": _run(40), "server": _run(60, load=9)},
            {"continuous": _run(120), "static": _run(30), "server": _run(40)}]
    summary = repeats.summarize(runs)
    cont = summary["systems"]["continuous"]["output_tokens_per_s"]
    assert (cont["median"], cont["min"], cont["max"]) == (100, 80, 120)
    server = summary["ratios"]["continuous/server"]
    assert server["ratio_of_medians"] == 2.0  # 100 / 50, not a mean of the pairs' ratios
    assert server["pairs"] == [2.0, 80 / 60, 3.0]
    assert (server["min"], server["max"]) == (80 / 60, 3.0)
    assert summary["ratios"]["continuous/static"]["ratio_of_medians"] == 2.5
    assert summary["systems"]["server"]["shared_runs"] == 1 and summary["shared_runs"] == 1
    assert repeats.median_run(runs, "continuous")["output_tokens_per_s"] == 100
    assert repeats.median_run(runs[:2], "server")["output_tokens_per_s"] == 50  # lower middle
    printed = "\n".join(repeats.summary_lines(summary))
    assert "2.00x (1.33-3.00)" in printed and "distrust this summary" in printed


def test_time_to_first_token_is_summarized_like_throughput_where_every_run_has_it():
    def timed(tok_s, p50, p99):
        return _run(tok_s) | {"ttft_s": {"median": p50, "p99": p99}}

    runs = [{"continuous": timed(100, 2.0, 9.0), "static": _run(40), "server": timed(50, 8.0, 30)},
            {"continuous": timed(90, 4.0, 12.0), "static": _run(40), "server": timed(60, 5.0, 40)},
            {"continuous": timed(95, 3.0, 20.0), "static": _run(40), "server": timed(55, 10.0, 35)}]
    summary = repeats.summarize(runs)
    p50 = summary["systems"]["continuous"]["ttft_p50_s"]
    assert (p50["median"], p50["min"], p50["max"]) == (3.0, 2.0, 4.0)
    assert "ttft_p50_s" not in summary["systems"]["static"]  # no run of it timed its requests
    ratio = summary["ratios"]["continuous/server"]["ttft_p50_s"]
    assert ratio["ratio_of_medians"] == 3.0 / 8.0 and ratio["pairs"] == [0.25, 0.8, 0.3]
    assert summary["ratios"]["continuous/server"]["ttft_p99_s"]["ratio_of_medians"] == 12 / 35
    assert "ttft_p50_s" not in summary["ratios"]["continuous/static"]
    printed = "\n".join(repeats.summary_lines(summary))
    assert "TTFT p50, ms:" in printed and "0.38x (0.25-0.80)" in printed


def test_a_peer_skipped_in_any_repeat_is_left_out_with_its_reason():
    runs = [{"continuous": _run(100), "static": _run(40), "peer": {"skipped": "not installed"}},
            {"continuous": _run(90), "static": _run(45), "peer": {"skipped": "not installed"}}]
    summary = repeats.summarize(runs)
    assert summary["skipped"] == {"peer": "not installed"}
    assert "continuous/peer" not in summary["ratios"] and summary["shared_runs"] == 0


def test_a_load_above_the_cores_marks_a_run_shared(monkeypatch):
    loads = iter([0.4, repeats.cores() + 1.5])
    monkeypatch.setattr(repeats, "load_average", lambda: next(loads))
    run = repeats.measured(lambda: {"output_tokens_per_s": 1.0})
    assert run["load_average"]["shared"] and run["output_tokens_per_s"] == 1.0


def test_bench_repeats_runs_every_system_each_time_and_writes_every_run(tmp_path, capsys):
    out = tmp_path / "repeats.json"
    assert main(["bench", "--workload", "fixed-12x6", "--num-requests", "6", "--repeats", "3",
                 "--no-roofline", "--no-progress", "--output", str(out), *SMALL]) == 0
    results = json.loads(out.read_text())["results"]
    runs = results["repeats"]["runs"]
    assert len(runs) == 3 and all(set(run) == {"continuous", "static"} for run in runs)
    assert all(isinstance(run["continuous"]["load_average"]["before"], float) for run in runs)
    summary = results["repeats"]["summary"]
    values = sorted(run["continuous"]["output_tokens_per_s"] for run in runs)
    assert summary["systems"]["continuous"]["output_tokens_per_s"]["median"] == values[1]
    assert results["continuous"]["output_tokens_per_s"] == values[1]  # the median run shown
    assert results["ratio_output_tokens_per_s"] == (
        summary["ratios"]["continuous/static"]["ratio_of_medians"])
    printed = capsys.readouterr().out
    assert "repeat 3 of 3" in printed and "3 interleaved repeats" in printed


@pytest.mark.parametrize("flags", [["--repeats", "0"],
                                   ["--repeats", "2", "--mode", "online", "--rates", "1,2"]])
def test_bench_refuses_repeats_it_cannot_run(flags, capsys):
    assert main(["bench", *flags, *SMALL]) == 2
    assert "--repeats" in capsys.readouterr().err
