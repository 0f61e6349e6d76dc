"""`serving.bench.loadgen`: the seeded arrival schedule, and `run_online` against a real
GenerationServer on 127.0.0.1 serving the tiny random Llama (token-id prompts)."""

import contextlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.bench.latency import summarize
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.bench.loadgen import arrival_times, run_online
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig

# tests/serving/served.py's ENGINE (the server tests' shapes): its programs, compiled once.
ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=256, max_logprobs=5, compilation_cache=False,
              warmup=False)
REQUESTS = [BenchRequest(prompt_token_ids=np.random.default_rng(i).integers(2, 512, 4 + i % 9)
                         .tolist(), num_output_tokens=6 + i % 7) for i in range(16)]


# -- the schedule --------------------------------------------------------------------------------

def test_arrivals_start_at_zero_and_have_mean_gap_one_over_rate():
    times = arrival_times(20000, rate=8.0, burstiness=1.0, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0) and len(times) == 20000
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    # Poisson: exponential gaps, whose coefficient of variation is 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_lower_burstiness_is_burstier_at_the_same_mean():
    cv = {}
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_times(20000, rate=5.0, burstiness=burstiness, seed=0))
        assert gaps.mean() == pytest.approx(1 / 5, rel=0.05)
        cv[burstiness] = gaps.std() / gaps.mean()
    assert cv[0.25] > cv[1.0] > cv[4.0]
    assert cv[0.25] == pytest.approx(2.0, rel=0.1)  # 1 / sqrt(0.25)


def test_arrivals_are_seeded():
    first = arrival_times(100, rate=50.0, burstiness=0.5, seed=7)
    np.testing.assert_array_equal(first, arrival_times(100, rate=50.0, burstiness=0.5, seed=7))
    assert not np.array_equal(first, arrival_times(100, rate=50.0, burstiness=0.5, seed=8))


def test_no_rate_is_all_at_once_and_bad_values_are_refused():
    np.testing.assert_array_equal(arrival_times(5, rate=None), np.zeros(5))
    assert arrival_times(0, rate=3.0).shape == (0,) and arrival_times(1, rate=3.0).tolist() == [0]
    for kwargs in ({"rate": 0.0}, {"rate": -1.0}, {"rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrival_times(3, **kwargs)
    with pytest.raises(ValueError):
        run_online("127.0.0.1:1", REQUESTS, concurrency=0)


# -- against a server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    server = GenerationServer(LLM("tiny-llama", **ENGINE).engine, ServerConfig(port=0))
    target = f"127.0.0.1:{server.start()}"
    try:
        run_online(target, REQUESTS, rate=50.0, timeout=120)  # compile before anything is timed
        yield server, target
    finally:
        server.stop()


@contextlib.contextmanager
def _peak_running(server: GenerationServer):
    """Samples the engine scheduler's running count from a background thread."""
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], server.engine.scheduler.num_running)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def _check_complete(timings, requests):
    assert len(timings) == len(requests)
    for timing, request in zip(timings, requests):
        assert timing.error is None
        assert timing.output_tokens == request.num_output_tokens
        assert timing.prompt_tokens == len(request.prompt_token_ids)
        times = (timing.send_time, *timing.chunk_times)
        assert all(b > a for a, b in zip(times, times[1:]))


def _max_overlap(timings) -> int:
    """The most requests in flight (send to last chunk) at any request's send."""
    return max(sum(t.send_time <= u.send_time <= t.chunk_times[-1] for t in timings)
               for u in timings)


def test_a_rate_sends_on_schedule_and_every_request_completes(served):
    server, target = served
    before = time.perf_counter()
    with _peak_running(server) as peak:
        timings, wall = run_online(target, REQUESTS, rate=50.0, seed=1, timeout=120)
    after = time.perf_counter()
    _check_complete(timings, REQUESTS)
    schedule = arrival_times(len(REQUESTS), rate=50.0, seed=1)
    for timing, arrival in zip(timings, schedule):
        assert timing.send_time >= before + arrival  # never early
    assert 0 < wall <= after - before and wall >= schedule[-1]
    assert max(t.chunk_times[-1] for t in timings) <= after
    assert peak[0] >= 2  # requests overlapped: it is an online run, not one at a time
    summary = summarize(timings, wall_seconds=wall)
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(r.num_output_tokens for r in REQUESTS)
    assert summary["tpot_s"]["count"] == 16 and summary["itl_s"]["count"] > 0


def test_concurrency_caps_the_requests_in_flight(served):
    server, target = served
    with _peak_running(server) as uncapped:  # all at t=0 and no cap: the engine runs its 8
        timings, _ = run_online(target, REQUESTS, timeout=120)
    _check_complete(timings, REQUESTS)
    assert uncapped[0] > 4 and _max_overlap(timings) > 4
    before = time.perf_counter()
    with _peak_running(server) as peak:
        timings, wall = run_online(target, REQUESTS, rate=200.0, concurrency=4, timeout=120)
    _check_complete(timings, REQUESTS)
    schedule = arrival_times(len(REQUESTS), rate=200.0)
    assert all(t.send_time >= before + a for t, a in zip(timings, schedule))
    assert 1 <= peak[0] <= 4  # the engine never ran more than 4, though it may run 8
    assert _max_overlap(timings) == 4  # the cap was reached, and held, at the client


def test_an_invalid_request_is_an_error_entry_not_an_exception(served):
    _, target = served
    bad = BenchRequest(prompt_token_ids=[5, 100000], num_output_tokens=4)
    timings, wall = run_online(target, [REQUESTS[0], bad, REQUESTS[1]], timeout=120,
                               progress=True)
    assert [t.error for t in timings] == [None, "INVALID_ARGUMENT", None]
    assert timings[1].chunk_times == () and timings[1].output_tokens == 0
    assert [t.output_tokens for t in timings[::2]] == [r.num_output_tokens for r in REQUESTS[:2]]
    summary = summarize(timings, wall_seconds=wall)
    assert (summary["completed"], summary["failed_by_code"]) == (2, {"INVALID_ARGUMENT": 1})


def test_an_unreachable_server_fails_every_request_with_unavailable():
    timings, _ = run_online("127.0.0.1:1", REQUESTS[:3], timeout=5)
    assert [t.error for t in timings] == ["UNAVAILABLE"] * 3


def test_the_loadgen_module_imports_no_jax():
    code = ("import sys, meshserve.serving.bench.loadgen\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
