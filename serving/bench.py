"""Benchmarks: the same seeded requests through the continuous engine and the static baseline,
side by side in one process, as `../shared/BENCHMARKS.md` defines them.

Modes:
  offline   all requests at t=0, straight into the engine (`run_offline`);
  online    through the gRPC server on 127.0.0.1, with Poisson or gamma arrivals at a rate, or a
            fixed concurrency (`run_online`); latencies are measured at the client
            (`meshserve.serving.latency`: TTFT, TPOT, ITL, E2EL, goodput against named SLOs).

Workloads (prompt tokens are seeded random ids; every output is forced to its target length with
`ignore_eos` and `max_tokens`, so both policies do the same work):
  chat-mix    prompts lognormal, median 64, sigma 1.0, clipped to [8, 512];
              outputs lognormal, median 48, sigma 1.0, clipped to [4, 256]
  long        prompts uniform in [256, 1024], outputs uniform in [16, 128]
  fixed-IxO   every request has I prompt and O output tokens, e.g. fixed-128x64

Reported per policy: output tokens/s, request/s, padding waste (prefill and decode), preemptions,
compiles after warm-up, and the ratios continuous/static.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshserve.batching.sampling import SamplingParams
from meshserve.serving import latency, loadgen
from meshserve.serving.engine import Engine, EngineConfig
from meshserve.serving.server import GenerationServer, ServerConfig


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    num_output_tokens: int


def make_workload(name: str, *, num_requests: int, vocab_size: int,
                  seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prompt_lens, output_lens = _lengths(name, num_requests, rng)
    return [BenchRequest(prompt_token_ids=rng.integers(0, vocab_size, int(p)).tolist(),
                         num_output_tokens=int(o)) for p, o in zip(prompt_lens, output_lens)]


def _lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if name == "chat-mix":
        prompts = np.clip(np.round(64 * rng.lognormal(0.0, 1.0, n)), 8, 512)
        outputs = np.clip(np.round(48 * rng.lognormal(0.0, 1.0, n)), 4, 256)
        return prompts, outputs
    if name == "long":
        return rng.integers(256, 1025, n), rng.integers(16, 129, n)
    if name.startswith("fixed-"):
        prompt_len, output_len = (int(x) for x in name.removeprefix("fixed-").split("x"))
        return np.full(n, prompt_len), np.full(n, output_len)
    raise ValueError(f"unknown workload {name!r}; use chat-mix, long or fixed-IxO (fixed-128x64)")


def run_offline(engine: Engine, requests: list[BenchRequest]) -> dict[str, Any]:
    """All requests at t=0; returns throughput and the engine-side counters."""
    before = dataclasses.replace(engine.stats)
    started = time.perf_counter()
    for req in requests:
        engine.add_request(req.prompt_token_ids, SamplingParams(
            max_tokens=req.num_output_tokens, ignore_eos=True, temperature=0.0))
    num_output = 0
    while engine.has_unfinished():
        num_output += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall, "num_requests": len(requests), "output_tokens": num_output,
        "output_tokens_per_s": num_output / wall, "requests_per_s": len(requests) / wall,
        "total_tokens_per_s": (num_output + sum(len(r.prompt_token_ids) for r in requests)) / wall,
    } | _engine_side(engine, before, wall)


def run_online(engine: Engine, requests: list[BenchRequest], *, rate: float | None = None,
               burstiness: float = 1.0, concurrency: int | None = None,
               slos: latency.Slos | None = None, seed: int = 0) -> dict[str, Any]:
    """Serves `engine` on 127.0.0.1 and sends `requests` through the gRPC client on the given
    arrival schedule; returns the client-side summary and the engine-side counters."""
    server = GenerationServer(engine, ServerConfig(
        port=0, max_queued_requests=max(256, len(requests)),
        max_queued_prompt_tokens=max(1, sum(len(r.prompt_token_ids) for r in requests))))
    port = server.start()
    before = dataclasses.replace(engine.stats)
    try:
        timings, wall = loadgen.run_online(f"127.0.0.1:{port}", requests, rate=rate,
                                           burstiness=burstiness, concurrency=concurrency,
                                           seed=seed)
    finally:
        server.stop()
    summary = latency.summarize(timings, wall_seconds=wall, slos=slos)
    aliases = {"output_tokens_per_s": summary["output_throughput"],
               "requests_per_s": summary["request_throughput"]}  # the offline mode's names
    return summary | aliases | _engine_side(engine, before, wall)


def _engine_side(engine: Engine, before, wall: float) -> dict[str, Any]:
    stats = _stats_delta(before, engine.stats)
    return {
        "num_steps": stats.num_steps, "step_seconds": stats.step_seconds,
        "host_overhead": 1 - stats.step_seconds / wall,
        "prefill_padding": stats.prefill_padding, "decode_padding": stats.decode_padding,
        "preemptions": engine.scheduler.num_preemptions,
        "compiles_after_warmup": stats.compiles_after_warmup,
        "peak_kv_pages": engine.scheduler.kv_usage().num_peak_used_pages,
    }


def _stats_delta(before, after):
    fields = {f.name: getattr(after, f.name) - getattr(before, f.name)
              for f in dataclasses.fields(after)}
    return dataclasses.replace(after, **fields)


def compare_policies(model, config: EngineConfig, requests: list[BenchRequest], *,
                     mode: str = "offline", **online: Any) -> dict[str, Any]:
    """Both policies on the same requests; `online` holds `run_online`'s arrival options."""
    if mode not in ("offline", "online"):
        raise ValueError(f"mode must be offline or online, got {mode!r}")
    results, runner = {}, None
    for policy in ("continuous", "static"):  # warm before the clock starts; one compiled set
        engine = Engine(model, None, dataclasses.replace(config, policy=policy, warmup=True),
                        runner=runner)
        runner = engine.runner
        results[policy] = (run_offline(engine, requests) if mode == "offline"
                           else run_online(engine, requests, **online))
    c, s = results["continuous"], results["static"]
    results["ratio_output_tokens_per_s"] = c["output_tokens_per_s"] / s["output_tokens_per_s"]
    return results


def environment() -> dict[str, Any]:
    return {
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "cpu_count": _cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "git_commit": _git_commit(),
    }


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False)
    return result.stdout.strip() or None


def write_results(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
