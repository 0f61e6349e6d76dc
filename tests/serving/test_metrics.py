"""Server metrics on a real engine (the tiny random Llama), driven as the server loop drives it:
step, observe_step, observe_output for each output; aborts reported with observe_aborted."""

import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.batching.sampling import SamplingParams
from meshserve.model.config import ModelConfig
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.metrics import FINISHED_REASONS, REJECTED_REASONS, ServerMetrics
from tests.conftest import random_params
from tests.serving.fake_runner import FakeModelRunner, reference_outputs

# tests/serving/test_engine.py's shapes: its programs, compiled once a session.
SMALL = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
             prefill_chunk=16, max_model_len=128, max_logprobs=5, warmup=False,
             compilation_cache=False)
# 8 usable pages of 4 tokens: two requests of 8 + 20 tokens cannot both stay.
CRAMPED = dict(num_pages=9, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
               prefill_chunk=16, max_model_len=32, max_logprobs=5, warmup=False,
               compilation_cache=False)

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "step_duration_seconds")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_cached_pages", "kv_cache_fragmentation_ratio",
          "kv_cache_reserved_unused_pages", "prefill_padding_ratio", "decode_padding_ratio",
          "stage_utilisation", "lora_resident_adapters", "lora_max_adapters",
          "lora_cpu_adapters")
COUNTERS = ("num_preemptions_total", "prefix_cache_hits_total", "prompt_tokens_total",
            "generation_tokens_total", "kv_cache_window_freed_pages_total",
            "recompiles_total", "request_success_total", "requests_rejected_total",
            "structured_mask_overlapped_seconds_total", "structured_mask_hidden_seconds_total",
            "lora_adapter_loads_total", "lora_adapter_evictions_total")


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig.preset("tiny-llama")
    return model_from_params(config, random_params(config))


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 512, size=length).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _value(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value("meshserve:" + name,
                                              {"model_name": "tiny", **labels})
    assert value is not None, name
    return value


def _step(engine: Engine, metrics: ServerMetrics) -> list:
    start = time.perf_counter()
    outputs = engine.step()
    metrics.observe_step(engine, time.perf_counter() - start)
    for out in outputs:
        metrics.observe_output(out)
    return outputs


def test_exported_names_and_labels():
    metrics = ServerMetrics("m")
    assert ServerMetrics("m").registry is not metrics.registry  # no clash between instances
    families = list(text_string_to_metric_families(metrics.render().decode()))
    samples = [s for family in families for s in family.samples]
    names = {s.name for s in samples}
    for name in HISTOGRAMS:
        assert {f"meshserve:{name}_{part}" for part in ("bucket", "count", "sum")} <= names
    assert {f"meshserve:{name}" for name in GAUGES + COUNTERS} <= names
    assert all(s.labels["model_name"] == "m" for s in samples)
    assert {s.labels["finished_reason"] for s in samples
            if s.name == "meshserve:request_success_total"} == set(FINISHED_REASONS)
    assert {s.labels["reason"] for s in samples
            if s.name == "meshserve:requests_rejected_total"} == set(REJECTED_REASONS)
    assert "meshserve:request_queue_time_seconds_count" not in names


def test_rejections_are_counted_by_reason():
    metrics = ServerMetrics("tiny")
    metrics.observe_rejected("queue_full")
    metrics.observe_rejected("queue_full")
    metrics.observe_rejected("deadline")
    assert _value(metrics, "requests_rejected_total", reason="queue_full") == 2
    assert _value(metrics, "requests_rejected_total", reason="deadline") == 1
    assert _value(metrics, "requests_rejected_total", reason="invalid") == 0
    with pytest.raises(ValueError, match="unknown rejection reason"):
        metrics.observe_rejected("too_long")


def test_a_served_workload_is_counted_exactly(tiny_model):
    engine = Engine.from_model(tiny_model, None, EngineConfig(**SMALL))
    scheduler, metrics = engine.scheduler, ServerMetrics("tiny")
    doomed = engine.add_request(_prompt(6, seed=9), _greedy(30))  # aborted after 2 tokens
    work = [(5, 6), (20, 4), (3, 1), (9, 7)]  # (prompt length, max_tokens); 20 is chunked
    for i, (length, n) in enumerate(work):
        engine.add_request(_prompt(length, seed=i), _greedy(n))
    last = {}  # request id -> its latest output
    saw_a_queue = is_aborted = False
    while engine.has_unfinished():
        for out in _step(engine, metrics):
            last[out.request_id] = out
        assert _value(metrics, "num_requests_running") == scheduler.num_running
        assert _value(metrics, "num_requests_waiting") == scheduler.num_waiting
        saw_a_queue |= scheduler.num_waiting > 0 and scheduler.num_running > 0
        if not is_aborted and doomed in last and len(last[doomed].outputs[0].token_ids) >= 2:
            is_aborted = engine.abort(doomed)
            assert is_aborted
            metrics.observe_aborted(doomed)
            metrics.observe_step(engine, 123.0)  # no step ran: refreshes the gauges only
            assert _value(metrics, "num_requests_running") == scheduler.num_running
    assert saw_a_queue
    assert not last[doomed].finished and len(last) == 1 + len(work)

    num_tokens = sum(len(out.outputs[0].token_ids) for out in last.values())
    assert _value(metrics, "generation_tokens_total") == num_tokens
    assert _value(metrics, "prompt_tokens_total") == 6 + sum(length for length, _ in work)
    assert _value(metrics, "time_to_first_token_seconds_count") == len(last)
    assert _value(metrics, "inter_token_latency_seconds_count") == num_tokens - len(last)
    assert _value(metrics, "e2e_request_latency_seconds_count") == len(work)
    times = [out.metrics for out in last.values()]
    assert _value(metrics, "time_to_first_token_seconds_sum") == pytest.approx(
        sum(t.time_to_first_token for t in times))
    assert _value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(
        sum(t.last_token_time - t.first_token_time for t in times))
    assert _value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(
        sum(t.finished_time - t.arrival_time for t in times if t.finished_time is not None))
    assert _value(metrics, "request_success_total", finished_reason="length") == len(work)
    assert _value(metrics, "request_success_total", finished_reason="abort") == 1
    assert _value(metrics, "request_success_total", finished_reason="stop") == 0

    assert _value(metrics, "step_duration_seconds_count") == engine.stats.num_steps
    assert _value(metrics, "step_duration_seconds_sum") < 123.0
    assert _value(metrics, "recompiles_total") == engine.stats.compiles_after_warmup > 0
    assert _value(metrics, "num_preemptions_total") == 0
    assert _value(metrics, "kv_cache_usage_perc") == 0
    assert _value(metrics, "num_requests_running") == _value(metrics, "num_requests_waiting") == 0
    assert _value(metrics, "prefill_padding_ratio") == engine.stats.prefill_padding > 0
    assert _value(metrics, "decode_padding_ratio") == engine.stats.decode_padding
    assert _value(metrics, "stage_utilisation") == 1.0
    assert metrics._requests == {}  # nothing kept for finished or aborted requests


def test_preemption_is_counted_and_recomputation_is_not(tiny_model):
    engine = Engine.from_model(tiny_model, None, EngineConfig(**CRAMPED))
    metrics = ServerMetrics("tiny")
    for seed in range(2):
        engine.add_request(_prompt(8, seed=seed), _greedy(20))
    peak_usage = 0.0
    while engine.has_unfinished():
        _step(engine, metrics)
        usage = engine.scheduler.kv_usage()
        assert _value(metrics, "kv_cache_usage_perc") == usage.num_used_pages / 8
        assert _value(metrics, "kv_cache_cached_pages") == usage.num_cached_pages
        assert _value(metrics, "kv_cache_fragmentation_ratio") == usage.fragmentation
        assert _value(metrics, "kv_cache_reserved_unused_pages") == 0
        peak_usage = max(peak_usage, _value(metrics, "kv_cache_usage_perc"))
    assert engine.scheduler.num_preemptions > 0
    assert _value(metrics, "num_preemptions_total") == engine.scheduler.num_preemptions
    assert _value(metrics, "prefix_cache_hits_total") == engine.scheduler.num_cached_tokens
    assert 0.5 < peak_usage <= 1.0
    assert _value(metrics, "kv_cache_usage_perc") == 0
    assert _value(metrics, "generation_tokens_total") == 40
    assert _value(metrics, "prompt_tokens_total") == 16
    assert _value(metrics, "inter_token_latency_seconds_count") == 38
    assert _value(metrics, "request_success_total", finished_reason="length") == 2


def test_http_endpoint_serves_the_registry():
    metrics = ServerMetrics("tiny")
    metrics.observe_rejected("draining")
    port = metrics.start_http_server(0)
    try:
        assert port > 0
        with pytest.raises(RuntimeError, match="already running"):
            metrics.start_http_server(0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'meshserve:num_requests_running{model_name="tiny"} 0.0' in text
        assert ('meshserve:requests_rejected_total{model_name="tiny",reason="draining"} 1.0'
                in text)
    finally:
        metrics.stop_http_server()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    metrics.stop_http_server()  # a second stop is harmless


def test_pages_freed_behind_a_sliding_window_are_counted():
    """An engine over a model whose every layer slides over 6 keys (the arithmetic runner, which
    reads only those): each request keeps 2-3 pages of 4 however long it grows, and the pages it
    gave back are counted."""
    config = EngineConfig(**CRAMPED | dict(num_pages=16, max_model_len=64))
    engine = Engine(FakeModelRunner(config, window=6), None, config)
    metrics = ServerMetrics("tiny")
    prompts = [[(seed + 5 * i) % 97 for i in range(8)] for seed in range(2)]
    ids = [engine.add_request(prompt, _greedy(40)) for prompt in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in _step(engine, metrics):
            outputs[out.request_id] = out.outputs[0].token_ids
        assert engine.scheduler.kv_usage().num_used_pages <= 2 * 3
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id] == reference_outputs(prompt, 40, window=6)
    freed = engine.scheduler.num_window_freed_pages
    assert freed == 2 * ((8 + 39 - 6 + 1) // 4)  # 47 cached tokens each, 5 keys still read
    assert _value(metrics, "kv_cache_window_freed_pages_total") == freed
    assert engine.scheduler.num_preemptions == 0  # 2 x 12 pages would not fit in 15
