"""`serving.bench.latency` on hand-made timestamps: every metric checked against numbers worked out
by hand (the arithmetic is in the comments), plus the edge cases."""

import json
import math
import subprocess
import sys

import pytest

from meshserve.serving.bench.latency import (RequestTiming, Slos, distribution,
                                             mlperf_server_slos, summarize)

# A: sent 10.0; chunks at 10.5 (1 token), 10.7 (2 tokens), 11.0 (1 token); 8 prompt tokens.
#    TTFT 0.5, E2EL 1.0, 4 output tokens, TPOT (1.0 - 0.5) / 3 = 1/6, ITLs 0.2 and 0.3.
A = RequestTiming(10.0, (10.5, 10.7, 11.0), (1, 2, 1), prompt_tokens=8, error=None)
# B: sent 10.2; chunks at 11.2 and 11.6 (1 token each); 5 prompt tokens.
#    TTFT 1.0, E2EL 1.4, TPOT (1.4 - 1.0) / 1 = 0.4, ITL 0.4.
B = RequestTiming(10.2, (11.2, 11.6), (1, 1), prompt_tokens=5, error=None)
# C: sent 10.4; one chunk at 10.6 with 1 token; 3 prompt tokens.
#    TTFT 0.2, E2EL 0.2, no TPOT (a single token), no ITL.
C = RequestTiming(10.4, (10.6,), (1,), prompt_tokens=3, error=None)
# D: streamed one token, then failed; E: failed before any token. Both excluded from latencies.
D = RequestTiming(10.1, (10.3,), (1,), prompt_tokens=100, error="DEADLINE_EXCEEDED")
E = RequestTiming(10.3, (), (), prompt_tokens=50, error="UNAVAILABLE")
RUN = [A, B, C, D, E]
WALL = 2.0


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_per_request_quantities():
    assert (A.output_tokens, A.ttft, A.e2el) == (4, 0.5, 1.0)
    assert A.tpot == pytest.approx(1 / 6)
    assert A.itls == pytest.approx((0.2, 0.3))
    assert (C.output_tokens, C.tpot, C.itls) == (1, None, ())
    assert (E.output_tokens, E.ttft, E.e2el, E.tpot) == (0, None, None, None)
    assert A.completed and not D.completed


def test_latencies_mean_median_p90_p99():
    summary = summarize(RUN, wall_seconds=WALL)
    # TTFT of A, B, C sorted: [0.2, 0.5, 1.0]; mean 1.7 / 3; median 0.5;
    # p90 at rank 0.9 * 2 = 1.8: 0.5 + 0.8 * (1.0 - 0.5) = 0.9; p99 at rank 1.98: 0.99.
    _close(summary["ttft_s"], {"count": 3, "mean": 1.7 / 3, "median": 0.5, "p90": 0.9,
                               "p99": 0.99})
    # E2EL sorted: [0.2, 1.0, 1.4]; mean 2.6 / 3; median 1.0;
    # p90: 1.0 + 0.8 * 0.4 = 1.32; p99: 1.0 + 0.98 * 0.4 = 1.392.
    _close(summary["e2el_s"], {"count": 3, "mean": 2.6 / 3, "median": 1.0, "p90": 1.32,
                               "p99": 1.392})
    # TPOT of A and B only (C has one token): [1/6, 0.4]; mean = median = (1/6 + 0.4) / 2
    # = 0.28333...; p90 at rank 0.9: 1/6 + 0.9 * (0.4 - 1/6) = 0.37666...;
    # p99 at rank 0.99: 1/6 + 0.99 * (0.4 - 1/6) = 0.39766...
    _close(summary["tpot_s"], {"count": 2, "mean": 0.85 / 3, "median": 0.85 / 3,
                               "p90": 1.13 / 3, "p99": 1.193 / 3})
    # ITL pooled over A (0.2, 0.3) and B (0.4): [0.2, 0.3, 0.4]; mean = median = 0.3;
    # p90: 0.3 + 0.8 * 0.1 = 0.38; p99: 0.3 + 0.98 * 0.1 = 0.398. D's chunk is not counted.
    _close(summary["itl_s"], {"count": 3, "mean": 0.3, "median": 0.3, "p90": 0.38,
                              "p99": 0.398})
    assert "linear" in summary["percentiles"]


def test_throughput_and_counts():
    summary = summarize(RUN, wall_seconds=WALL)
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (5, 3, 2)
    assert summary["failed_by_code"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    # Completed: 3 requests, 4 + 2 + 1 = 7 output tokens, 8 + 5 + 3 = 16 prompt tokens, in 2 s.
    assert (summary["output_tokens"], summary["prompt_tokens"]) == (7, 16)
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(3.5)
    assert summary["total_throughput"] == pytest.approx(11.5)
    assert summary["wall_s"] == 2.0


def test_goodput_without_slos_is_request_throughput():
    goodput = summarize(RUN, wall_seconds=WALL)["goodput"]
    assert goodput == {"slos": None, "good_requests": 3, "requests_per_s": 1.5}


@pytest.mark.parametrize("slos,good", [
    # TTFT <= 0.6, TPOT <= 0.2: A (0.5, 1/6) good; B (TTFT 1.0) not; C (0.2, no TPOT) good.
    (Slos(ttft=0.6, tpot=0.2, name="both"), 2),
    # TTFT <= 0.5 is inclusive: A (exactly 0.5) and C good, B not.
    (Slos(ttft=0.5, tpot=None, name="ttft-only"), 2),
    # TPOT <= 0.1: A (1/6) and B (0.4) miss; C has a single token and meets any TPOT limit.
    (Slos(ttft=None, tpot=0.1, name="tpot-only"), 1),
    # MLPerf x1 (TTFT 2 s, TPOT 0.2 s): A and C good, B's TPOT 0.4 misses.
    (mlperf_server_slos(1.0), 2),
    # MLPerf x0.25 (TTFT 0.5 s, TPOT 0.05 s): only C (TTFT 0.2, no TPOT).
    (mlperf_server_slos(0.25), 1),
])
def test_goodput_with_slos(slos, good):
    goodput = summarize(RUN, wall_seconds=WALL, slos=slos)["goodput"]
    assert goodput["good_requests"] == good
    assert goodput["requests_per_s"] == pytest.approx(good / WALL)
    assert goodput["slos"] == {"name": slos.name, "ttft_s": slos.ttft, "tpot_s": slos.tpot}


def test_failed_requests_never_meet_an_slo():
    loose = Slos(ttft=100.0, tpot=100.0, name="loose")
    assert not loose.met_by(D) and not loose.met_by(E) and loose.met_by(A)


def test_mlperf_slos_are_scaled_and_named():
    slos = mlperf_server_slos(0.5)
    assert (slos.ttft, slos.tpot, slos.name) == (1.0, 0.1, "mlperf-llama2-70b-server x0.5")
    assert mlperf_server_slos(1).name == "mlperf-llama2-70b-server x1"
    with pytest.raises(ValueError):
        mlperf_server_slos(0)
    with pytest.raises(ValueError):
        Slos(ttft=-1.0, tpot=None, name="bad")
    with pytest.raises(ValueError):
        Slos(ttft=1.0, tpot=None, name="")


def _values(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _values(tree=value)
    else:
        yield tree


@pytest.mark.parametrize("timings", [[], [D, E]], ids=["no-requests", "all-failed"])
def test_empty_sets_give_none_never_nan(timings):
    summary = summarize(timings, wall_seconds=1.0, slos=mlperf_server_slos(1.0))
    for name in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert summary[name] == {"count": 0, "mean": None, "median": None, "p90": None,
                                 "p99": None}
    assert summary["completed"] == 0 and summary["failed"] == len(timings)
    assert summary["request_throughput"] == summary["output_throughput"] == 0.0
    assert summary["goodput"]["requests_per_s"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in _values(summary))
    json.dumps(summary, allow_nan=False)


def test_only_single_token_requests_have_no_tpot_or_itl():
    summary = summarize([C], wall_seconds=1.0)
    assert summary["tpot_s"]["count"] == summary["itl_s"]["count"] == 0
    assert summary["tpot_s"]["mean"] is None
    assert summary["ttft_s"]["count"] == summary["e2el_s"]["count"] == 1
    # One value: every statistic is that value.
    assert summary["ttft_s"]["p99"] == summary["ttft_s"]["mean"] == pytest.approx(0.2)


def test_zero_wall_time_gives_no_rates():
    summary = summarize([], wall_seconds=0.0)
    assert summary["request_throughput"] is None and summary["goodput"]["requests_per_s"] is None
    with pytest.raises(ValueError):
        summarize([], wall_seconds=-1.0)


def test_distribution_is_numpys_linear_percentile():
    # [1, 2, 3, 4, 10]: median 3; p90 at rank 3.6: 4 + 0.6 * 6 = 7.6; p99 at rank 3.96: 9.76.
    assert distribution([10, 1, 3, 2, 4]) == pytest.approx(
        {"count": 5, "mean": 4.0, "median": 3.0, "p90": 7.6, "p99": 9.76})


def test_request_timing_is_checked_and_frozen():
    timing = RequestTiming(0.0, [0.1, 0.2], [1, 1], prompt_tokens=2, error=None)
    assert timing.chunk_times == (0.1, 0.2) and timing.chunk_tokens == (1, 1)
    with pytest.raises(AttributeError):
        timing.error = "X"
    for times, tokens in (((0.1,), (1, 1)), ((0.2, 0.1), (1, 1)), ((-0.1,), (1,)),
                          ((0.1,), (0,))):
        with pytest.raises(ValueError):
            RequestTiming(0.0, times, tokens, prompt_tokens=1, error=None)


def test_the_latency_module_imports_no_jax_or_grpc():
    code = ("import sys, meshserve.serving.bench.latency\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'grpc')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
