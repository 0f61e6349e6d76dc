"""Benchmarks: the same seeded requests through the continuous engine and the static baseline,
side by side in one process, as docs/benchmarks.md ("What is measured and how") defines them.

Modes:
  offline   all requests at t=0, straight into the engine (`run_offline`);
  online    through the gRPC server on 127.0.0.1, with Poisson or gamma arrivals at a rate, or a
            fixed concurrency (`run_online`); latencies are measured at the client
            (`meshserve.serving.bench.latency`: TTFT, TPOT, ITL, E2EL, goodput against named SLOs).

The workloads are `meshserve.serving.bench.workloads`'s.

Reported per policy: output tokens/s, request/s, padding waste (prefill and decode), host
overhead, KV pages and internal fragmentation (sampled after every step), preemptions, compiles
after warm-up, speculative decoding's counts when the continuous engine speculates
(`--speculative-config`: drafted, accepted and emitted tokens, acceptance rate per position; the
static baseline never does), and the ratios continuous/static. Around that: the decode roofline
of this machine (`run_roofline`), sweeps over rates or concurrencies, the highest Poisson rate
that still meets the SLOs (`find_max_rate`), and peers (`run_peers`, through
`meshserve.serving.bench.peers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from meshserve.batching.knobs import POLICY_NAMES
from meshserve.batching.scheduler import KVUsage
from meshserve.model.config import kv_bytes_per_token
from meshserve.model.quantized_weights import weight_bytes
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.serving.bench import (latency, llama_server, loadgen, peers, result_files, roofline)
from meshserve.serving.bench.llama_server import ServerShape
from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig


def run_offline(engine: Engine, requests: list[BenchRequest], *,
                progress: bool = False) -> dict[str, Any]:
    """All requests at t=0; returns throughput, the engine-side counters, and each request's
    TTFT and E2EL from the engine's clock (send time = t=0)."""
    before = dataclasses.replace(engine.stats)
    spec_before = _speculative_stats(engine)
    ttfts, e2els = [], []
    with _kv_sampler(engine) as kv, tqdm(total=len(requests), desc="requests", unit="req",
                                         disable=not progress, leave=False) as bar:
        started, started_mono = time.perf_counter(), time.monotonic()
        serves_adapters = engine.adapters is not None
        for req in requests:  # an engine without LoRA serves the request on the base model
            engine.add_request(req.prompt_token_ids, req.params(),
                               lora_request=req.lora_request if serves_adapters else None)
        num_output = 0
        while engine.has_unfinished():
            for out in engine.step():
                if not out.finished:
                    continue
                num_output += len(out.outputs[0].token_ids)
                ttfts.append(out.metrics.first_token_time - started_mono)
                e2els.append(out.metrics.last_token_time - started_mono)
                bar.update(1)
        wall = time.perf_counter() - started
    return {
        "wall_s": wall, "num_requests": len(requests), "output_tokens": num_output,
        "output_tokens_per_s": num_output / wall, "requests_per_s": len(requests) / wall,
        "total_tokens_per_s": (num_output + sum(len(r.prompt_token_ids) for r in requests)) / wall,
        "ttft_s": latency.distribution(ttfts), "e2el_s": latency.distribution(e2els),
        "samples": {"ttft_s": ttfts, "e2el_s": e2els},
    } | _engine_side(engine, before, wall, kv) | _speculative_side(engine, spec_before)


def run_online(engine: Engine, requests: list[BenchRequest], *, rate: float | None = None,
               burstiness: float = 1.0, concurrency: int | None = None,
               slos: latency.Slos | None = None, seed: int = 0,
               progress: bool = False, frontend: str = "grpc") -> dict[str, Any]:
    """Serves `engine` on 127.0.0.1 and sends `requests` through the gRPC client (or the
    OpenAI-compatible HTTP API, `frontend="http"`) on the given arrival schedule; returns the
    client-side summary and the engine-side counters."""
    server = GenerationServer(engine, ServerConfig(
        port=0, http_port=0 if frontend == "http" else None,
        max_queued_requests=max(256, len(requests)),
        max_queued_prompt_tokens=max(1, sum(len(r.prompt_token_ids) for r in requests))))
    port = server.start()
    if frontend == "http":
        port = server.http_port
    before = dataclasses.replace(engine.stats)
    spec_before = _speculative_stats(engine)
    try:
        with _kv_sampler(engine) as kv:
            timings, wall = loadgen.run_online(f"127.0.0.1:{port}", requests, rate=rate,
                                               burstiness=burstiness, concurrency=concurrency,
                                               seed=seed, progress=progress, frontend=frontend)
    finally:
        server.stop()
    summary = latency.summarize(timings, wall_seconds=wall, slos=slos)
    aliases = {"output_tokens_per_s": summary["output_throughput"],
               "requests_per_s": summary["request_throughput"]}  # the offline mode's names
    done = [t for t in timings if t.completed]
    samples = {"ttft_s": [t.ttft for t in done if t.ttft is not None],
               "tpot_s": [t.tpot for t in done if t.tpot is not None],
               "e2el_s": [t.e2el for t in done if t.e2el is not None]}
    return (summary | aliases | {"samples": samples} | _engine_side(engine, before, wall, kv)
            | _speculative_side(engine, spec_before))


def _speculative_stats(engine: Engine):
    """A copy of the engine's speculation counters, or None when it does not speculate."""
    speculator = getattr(engine, "speculator", None)
    return None if speculator is None else speculator.stats.copy()


def _speculative_side(engine: Engine, before) -> dict[str, Any]:
    """What speculation did during a run (drafted, accepted and emitted tokens, acceptance
    rate, mean acceptance length, per position), under "speculative"; nothing without it."""
    if before is None:
        return {}
    return {"speculative": engine.speculator.stats.since(before).summary()}


@contextlib.contextmanager
def _kv_sampler(engine: Engine) -> Iterator[list[KVUsage]]:
    """Records `engine.scheduler.kv_usage()` after every `engine.step()` inside the block,
    whichever thread steps the engine."""
    samples: list[KVUsage] = []
    step = engine.step

    def sampled_step():
        outputs = step()
        samples.append(engine.scheduler.kv_usage())
        return outputs

    engine.step = sampled_step
    try:
        yield samples
    finally:
        del engine.step  # back to the class's method


def kv_fragmentation(samples: Sequence[KVUsage]) -> dict[str, Any]:
    """Peak used pages, internal fragmentation (allocated token slots holding no token, over
    allocated slots), cached and reserved-but-unused pages across per-step samples; the
    fragmentation mean is over samples with pages allocated."""
    fractions = [u.fragmentation for u in samples if u.num_allocated_slots]
    mean = lambda values: float(np.mean(values)) if values else 0.0  # noqa: E731
    return {
        "num_samples": len(samples),
        "peak_used_pages": max((u.num_used_pages for u in samples), default=0),
        "total_pages": samples[0].num_total_pages if samples else None,
        "peak_fragmentation": max(fractions, default=0.0),
        "mean_fragmentation": mean(fractions),
        "peak_cached_pages": max((u.num_cached_pages for u in samples), default=0),
        "mean_cached_pages": mean([u.num_cached_pages for u in samples]),
        "mean_reserved_unused_pages": mean([u.num_reserved_unused_pages for u in samples]),
    }


def _engine_side(engine: Engine, before, wall: float,
                 kv_samples: Sequence[KVUsage]) -> dict[str, Any]:
    stats = _stats_delta(before, engine.stats)
    return {
        "num_steps": stats.num_steps, "step_seconds": stats.step_seconds,
        "device_wait_seconds": stats.device_wait_seconds,
        "host_seconds": wall - stats.device_wait_seconds,
        "host_overhead": 1 - stats.device_wait_seconds / wall,
        "prefill_padding": stats.prefill_padding, "decode_padding": stats.decode_padding,
        "stage_utilisation": stats.stage_utilisation,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_cached_tokens": engine.scheduler.num_cached_tokens,
        "window_freed_pages": engine.scheduler.num_window_freed_pages,
        "compiles_after_warmup": stats.compiles_after_warmup,
        "recompiles": stats.compiles_after_warmup,
        "peak_kv_pages": engine.scheduler.kv_usage().num_peak_used_pages,
        "kv": kv_fragmentation(kv_samples),
    }


def _stats_delta(before, after):
    fields = {f.name: getattr(after, f.name) - getattr(before, f.name)
              for f in dataclasses.fields(after)}
    return dataclasses.replace(after, **fields)


# The continuous engine without drafts, run beside the speculating one (`make_engines`): what
# speculation gains or costs on the same workload, in the same run.
NO_SPECULATION = "no-speculation"
# The continuous engine without LoRA, run beside one serving adapters (`--lora-adapters`): the
# base model alone, on the same requests.
BASE_MODEL = "base-model"


def engine_configs(config: EngineConfig) -> dict[str, EngineConfig]:
    """The engines a bench runs, by name: one per policy, warmed. The static baseline neither
    speculates nor serves adapters: a `speculative_config` applies to the continuous engine, and
    then a third, `NO_SPECULATION`, is the continuous policy without it; `enable_lora` too, with
    `BASE_MODEL` as the third."""
    if config.speculative_config is not None and config.enable_lora:
        raise ValueError("bench measures speculative decoding or LoRA adapters, one at a time: "
                         "drop --speculative-config or --lora-adapters")
    configs = {policy: dataclasses.replace(
        config, policy=policy, warmup=True,
        speculative_config=config.speculative_config if policy == "continuous" else None,
        enable_lora=config.enable_lora and policy == "continuous")
        for policy in POLICY_NAMES}
    if config.speculative_config is not None:
        configs[NO_SPECULATION] = dataclasses.replace(configs["continuous"],
                                                      speculative_config=None)
    if config.enable_lora:
        configs[BASE_MODEL] = dataclasses.replace(configs["continuous"], enable_lora=False)
    return configs


def make_engines(model, config: EngineConfig) -> dict[str, Engine]:
    """`engine_configs`' engines; those of the same runner config share one runner (one
    compiled set: the LoRA engine's programs take the adapters, the others' do not)."""
    engines, runners = {}, []
    for name, settings in engine_configs(config).items():
        wanted = settings.for_model(model.config).runner_config()
        runner = next((r for r in runners if r.config == wanted
                       and (r.lora is not None) == settings.enable_lora), None)
        engine = Engine.from_model(model, None, settings, runner=runner)
        engines[name] = engine
        if runner is None:
            runners.append(engine.runner)
    return engines


def compare_policies(model, config: EngineConfig, requests: list[BenchRequest], *,
                     mode: str = "offline", engines: dict[str, Engine] | None = None,
                     progress: bool = False, **online: Any) -> dict[str, Any]:
    """Both policies (and `NO_SPECULATION` when the continuous engine speculates) on the same
    requests; `online` holds `run_online`'s arrival options."""
    if mode not in ("offline", "online"):
        raise ValueError(f"mode must be offline or online, got {mode!r}")
    engines = engines or make_engines(model, config)
    results = {}
    for name, engine in engines.items():
        results[name] = (run_offline(engine, requests, progress=progress) if mode == "offline"
                         else run_online(engine, requests, progress=progress, **online))
    c, s = results["continuous"], results["static"]
    results["ratio_output_tokens_per_s"] = c["output_tokens_per_s"] / s["output_tokens_per_s"]
    if NO_SPECULATION in results:
        results["ratio_speculation_output_tokens_per_s"] = (
            c["output_tokens_per_s"] / results[NO_SPECULATION]["output_tokens_per_s"])
    if BASE_MODEL in results:
        results["ratio_lora_output_tokens_per_s"] = (
            c["output_tokens_per_s"] / results[BASE_MODEL]["output_tokens_per_s"])
    return results


def sweep(engines: dict[str, Engine], requests: list[BenchRequest], *, axis: str,
          values: Sequence[float], progress: bool = False, **online: Any) -> dict[str, Any]:
    """Online runs of both policies at each rate (`axis="rate"`) or concurrency."""
    if axis not in ("rate", "concurrency"):
        raise ValueError(f"axis must be rate or concurrency, got {axis!r}")
    points = {policy: [] for policy in POLICY_NAMES}
    for value in values:
        for policy in POLICY_NAMES:
            r = run_online(engines[policy], requests, progress=progress,
                           **(online | {axis: value}))
            points[policy].append(r)
    return {"axis": axis, "values": list(values), **points}


def find_max_rate(engine: Engine, requests: list[BenchRequest], *, slos: latency.Slos,
                  start: float = 1.0, max_probes: int = 6, seed: int = 0,
                  burstiness: float = 1.0, progress: bool = False) -> dict[str, Any]:
    """The highest Poisson rate (requests/s) at which p99 TTFT and p99 TPOT stay within `slos`.

    Doubles (or halves) from `start` until the first pass/fail pair brackets the answer, then
    bisects; `max_probes` online runs in all. Every probe is reported."""
    probes: list[dict[str, Any]] = []

    def probe(rate: float) -> bool:
        r = run_online(engine, requests, rate=rate, burstiness=burstiness, slos=slos, seed=seed,
                       progress=progress)
        ttft, tpot = r["ttft_s"]["p99"], r["tpot_s"]["p99"]
        passed = (r["failed"] == 0 and _within(ttft, slos.ttft) and _within(tpot, slos.tpot))
        probes.append({"rate": rate, "p99_ttft_s": ttft, "p99_tpot_s": tpot,
                       "output_tokens_per_s": r["output_tokens_per_s"],
                       "goodput_requests_per_s": r["goodput"]["requests_per_s"],
                       "passed": passed})
        return passed

    passing, failing = None, None
    rate = start
    while len(probes) < max_probes and (passing is None or failing is None):
        if probe(rate):
            passing, rate = rate, rate * 2
        else:
            failing, rate = rate, rate / 2
    while len(probes) < max_probes and passing is not None and failing is not None:
        middle = (passing + failing) / 2
        if probe(middle):
            passing = middle
        else:
            failing = middle
    return {"slos": slos.as_dict(), "max_rate": passing, "lowest_failing_rate": failing,
            "probes": probes}


def _within(value: float | None, limit: float | None) -> bool:
    return limit is None or (value is not None and value <= limit)


ROOFLINE_BATCHES = (1, 8, 32, 64)
ROOFLINE_CONTEXT = 128


def run_roofline(model, config: EngineConfig, *, batches: Sequence[int] = ROOFLINE_BATCHES,
                 context: int = ROOFLINE_CONTEXT, layout=None, repeats: int = 10,
                 memory_fraction: float = 0.25) -> dict[str, Any]:
    """This machine's bandwidth and matmul rate, then each decode batch's step time against its
    floor (ratio = floor / step). A batch whose KV pages would take more than `memory_fraction`
    of the host's memory is skipped. One runner holds the largest batch, so each batch compiles
    one program."""
    model_config = model.config
    context = min(context, model_config.max_position_embeddings - 1)
    page_size = config.page_size
    pages_each = -(-(context + 1) // page_size)
    page_bytes = page_size * kv_bytes_per_token(model_config)
    budget = memory_fraction * _host_memory_bytes()
    fits = [b for b in batches if (1 + b * pages_each) * page_bytes <= budget]
    skipped = [b for b in batches if b not in fits]
    machine = roofline.measure_machine()
    rows: list[dict[str, Any]] = []
    if fits:
        runner = decode_runner(model, max_batch=max(fits), context=context, page_size=page_size,
                               layout=layout)
        for batch in fits:
            step = roofline.measure_decode_step(runner, batch=batch, context=context,
                                                repeats=repeats)
            floor = roofline.decode_floor(model_config, machine, batch=batch, context=context,
                                          weights_bytes=weight_bytes(model))
            rows.append({"batch": batch, "step_s": step, "floor_s": floor, "ratio": floor / step,
                         "output_tokens_per_s": batch / step})
    return {"bandwidth_bytes_per_s": machine.bandwidth,
            "update_bandwidth_bytes_per_s": machine.update_bandwidth,
            "matmul_flops_per_s": machine.matmul_rate, "context": context, "rows": rows,
            "skipped_batches": skipped}


def decode_runner(model, *, max_batch: int, context: int, page_size: int,
                  layout=None) -> ModelRunner:
    """A runner sharing `model` whose pages and rows hold `max_batch` decodes of `context`."""
    replicas = layout.num_replicas if layout is not None else 1
    pages_each = -(-(context + 1) // page_size)
    rows_per_replica = -(-max_batch // replicas)
    return ModelRunner(model, RunnerConfig(
        max_num_seqs=rows_per_replica, num_pages=1 + rows_per_replica * pages_each,
        page_size=page_size, max_pages_per_seq=pages_each,
        max_num_batched_tokens=rows_per_replica), layout)


STARTUP_COMMAND = ("generate", "--prompt", "hi", "--max-tokens", "4")
_STARTUP_LINES = {
    "load_s": r"loaded .* in ([0-9.]+) s",
    "programs": r"compiled ([0-9]+) programs",
    "compile_s": r"compiled [0-9]+ programs in ([0-9.]+) s",
    "programs_from_cache": r"\(([0-9]+) from the compilation cache\)",
    "first_token_s": r"first token after ([0-9.]+) s",
}


def measure_startup(model_path: str, *, dtype: str | None = None,
                    quantization: str | None = None, timeout: float = 900.0) -> dict[str, Any]:
    """`meshserve generate --prompt hi --max-tokens 4` with the default engine (with
    `quantization` when given), run twice as a fresh process: first with an empty compilation
    cache, then with the one the first run filled. Each run's phases come from the lines it
    prints (`parse_startup`), `wall_s` is the whole command, and `peak_rss_bytes` the largest
    resident memory of the runs so far (the process's children's peak)."""
    extra = (["--dtype", dtype] if dtype else []) + (
        ["--quantization", quantization] if quantization else [])
    command = [sys.executable, "-m", "meshserve.serving.cli", *STARTUP_COMMAND,
               "--model", model_path] + extra
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"MESHSERVE_CACHE_DIR": cache}
        for name in ("empty_cache", "warm_cache"):
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"startup run failed ({done.returncode}): {done.stderr[-2000:]}")
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
            runs[name] = {"wall_s": time.perf_counter() - started, **parse_startup(done.stderr),
                          "answer": done.stdout.strip().split("\n")[0], "peak_rss_bytes": peak}
    return {"command": " ".join(["meshserve", *STARTUP_COMMAND, "--model", model_path, *extra]),
            **runs}


def parse_startup(stderr: str) -> dict[str, float | None]:
    """The load, compile and first-token figures `meshserve generate` prints (seconds; the
    first token counts from the process's start); None for a line that is missing."""
    found = {key: re.search(pattern, stderr) for key, pattern in _STARTUP_LINES.items()}
    return {key: float(match.group(1)) if match else None for key, match in found.items()}


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_peers(names: Sequence[str], model_name_or_path: str, requests: list[BenchRequest], *,
              max_batch_size: int, continuous: dict[str, Any] | None = None,
              engine_config: EngineConfig | None = None, arrivals: dict[str, Any] | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each peer on the same requests through `meshserve.serving.bench.peers.run_peer`, and
    llama-server through `meshserve.serving.bench.llama_server.run_peer`, shaped like
    `engine_config` and on `arrivals` (`run_online`'s rate, burstiness, concurrency, seed, slos;
    none: all at t=0); one that is unavailable is recorded as `{"skipped": message}`, never an
    error. With `continuous` (its results), the ratios continuous / peer are added."""
    results = {}
    for name in names:
        try:
            # Every core this process may use, as meshserve's own steps do (llama.cpp would
            # otherwise take half of them).
            if name == llama_server.NAME:
                result = llama_server.run_peer(model_name_or_path, requests, log=log,
                                               shape=_llama_server_shape(engine_config, requests,
                                                                         max_batch_size),
                                               **(arrivals or {}))
            else:
                result = dict(peers.run_peer(name, model_name_or_path, requests,
                                             max_batch_size=max_batch_size,
                                             threads=_cpu_count()))
        except peers.PeerUnavailable as err:
            log(f"peer {name} skipped: {err}")
            results[name] = {"skipped": str(err)}
            continue
        if continuous is not None and result.get("output_tokens_per_s"):
            result["ratio_continuous_output_tokens_per_s"] = (
                continuous["output_tokens_per_s"] / result["output_tokens_per_s"])
        if continuous is not None and ttft_median(result) and ttft_median(continuous):
            result["ratio_continuous_ttft_median"] = (ttft_median(continuous)
                                                      / ttft_median(result))
        results[name] = result
    return results


def _llama_server_shape(config: EngineConfig | None, requests: list[BenchRequest],
                        max_batch_size: int) -> ServerShape:
    if config is None:
        longest = max(len(r.prompt_token_ids) + r.num_output_tokens for r in requests)
        return ServerShape(slots=max_batch_size, context_per_slot=longest, threads=_cpu_count())
    return ServerShape.matching(config, threads=_cpu_count())


def ttft_median(result: dict[str, Any]) -> float | None:
    return (result.get("ttft_s") or {}).get("median")


def environment(source: result_files.Provenance) -> dict[str, Any]:
    """The machine, the software and the source (`result_files.Provenance`) a result came from."""
    return result_files.machine() | {
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    } | source.as_dict()


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))
