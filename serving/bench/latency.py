"""Client-side latency and throughput of an online run, as docs/benchmarks.md defines
them (the vLLM `bench serve` definitions).

Every time is a client clock reading (`time.perf_counter()`, seconds) and starts at the request's
send time, so time spent queued in the server counts. A request's `RequestTiming` holds its send
time and, for each streamed chunk that carried at least one token, the chunk's arrival time and
its number of tokens. Chunks that carry only text (held back by a stop string) are not recorded.

A request is *completed* when `error` is None; a failed one (its `error` is a gRPC status-code
name such as "INVALID_ARGUMENT") is counted by its code and excluded from every latency and
throughput figure, whatever it streamed before failing. Over the completed requests:

  TTFT   first chunk time - send time                       (requests with >= 1 output token)
  E2EL   last chunk time - send time                        (requests with >= 1 output token)
  TPOT   (E2EL - TTFT) / (output_tokens - 1), per request    (requests with > 1 output token)
  ITL    every gap between consecutive chunks of a request, pooled over all requests

  request throughput  completed requests / wall seconds
  output throughput   output tokens of the completed requests / wall seconds
  total throughput    (output + prompt tokens of the completed requests) / wall seconds
  goodput             completed requests meeting every given SLO / wall seconds

A request meets the TTFT SLO when its TTFT <= the limit (one with no output token has no TTFT and
does not), and the TPOT SLO when its TPOT <= the limit; a request with one output token has no
TPOT and meets any TPOT limit (vLLM counts its TPOT as 0 for goodput). Without SLOs every
completed request is good, and goodput equals request throughput.

Each latency is reported as count, mean, median, p90 and p99 in seconds. Percentiles are numpy's
default (`numpy.percentile`, method "linear": linear interpolation between the closest ranks, so
pK of sorted x[0..n-1] is read at rank K/100 * (n - 1)); the median is p50 by the same rule.
An empty set gives count 0 and None for every statistic, never NaN; a zero wall time gives None
for every rate. This module imports neither jax nor grpc.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILE_METHOD = "linear"  # numpy.percentile's default
STATISTICS = ("mean", "median", "p90", "p99")

# MLPerf Inference, Llama-2-70B, Server scenario: TTFT <= 2 s and TPOT <= 200 ms (p99 limits).
MLPERF_LLAMA2_70B_SERVER_TTFT = 2.0
MLPERF_LLAMA2_70B_SERVER_TPOT = 0.2


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it. `chunk_times[i]` is when the i-th chunk carrying tokens
    arrived and `chunk_tokens[i]` how many tokens it carried (>= 1). `error` is the gRPC
    status-code name of a failed request, None for a completed one."""

    send_time: float
    chunk_times: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    prompt_tokens: int
    error: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "chunk_times", tuple(float(t) for t in self.chunk_times))
        object.__setattr__(self, "chunk_tokens", tuple(int(n) for n in self.chunk_tokens))
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError(f"chunk_times and chunk_tokens differ in length "
                             f"({len(self.chunk_times)} vs {len(self.chunk_tokens)})")
        if any(n < 1 for n in self.chunk_tokens):
            raise ValueError("every recorded chunk carries at least one token")
        times = (self.send_time, *self.chunk_times)
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("chunk times must not decrease, nor precede the send time")
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.error is not None and not self.error:
            raise ValueError("error is a status-code name or None")

    @property
    def completed(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.send_time if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.chunk_times, self.chunk_times[1:]))


@dataclasses.dataclass(frozen=True)
class Slos:
    """Latency limits in seconds for goodput; None leaves that metric unconstrained."""

    ttft: float | None
    tpot: float | None
    name: str

    def __post_init__(self):
        if not self.name:
            raise ValueError("an SLO set needs a name")
        for field in ("ttft", "tpot"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"the {field} limit must be > 0 seconds, got {value}")

    def met_by(self, timing: RequestTiming) -> bool:
        """Whether a completed request meets every limit (see the module docstring)."""
        if not timing.completed:
            return False
        if self.ttft is not None and (timing.ttft is None or timing.ttft > self.ttft):
            return False
        tpot = timing.tpot
        return self.tpot is None or tpot is None or tpot <= self.tpot

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ttft_s": self.ttft, "tpot_s": self.tpot}


def mlperf_server_slos(scale: float = 1.0) -> Slos:
    """MLPerf's Llama-2-70B Server limits (TTFT 2 s, TPOT 200 ms), both times `scale`: a small
    model on a CPU is held to a scaled version of the same shape of limit."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return Slos(ttft=MLPERF_LLAMA2_70B_SERVER_TTFT * scale,
                tpot=MLPERF_LLAMA2_70B_SERVER_TPOT * scale,
                name=f"mlperf-llama2-70b-server x{scale:g}")


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, median, p90 and p99 (numpy's linear percentiles); None when empty."""
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        return {"count": 0, **{name: None for name in STATISTICS}}
    p50, p90, p99 = np.percentile(data, [50, 90, 99], method=PERCENTILE_METHOD)
    return {"count": int(data.size), "mean": float(data.mean()), "median": float(p50),
            "p90": float(p90), "p99": float(p99)}


def summarize(timings: Sequence[RequestTiming], *, wall_seconds: float,
              slos: Slos | None = None) -> dict[str, Any]:
    """Every client-side metric of one run (see the module docstring for the definitions)."""
    if wall_seconds < 0:
        raise ValueError(f"wall_seconds must be >= 0, got {wall_seconds}")
    done = [t for t in timings if t.completed]
    failed = Counter(t.error for t in timings if not t.completed)
    output_tokens = sum(t.output_tokens for t in done)
    prompt_tokens = sum(t.prompt_tokens for t in done)
    good = sum(slos.met_by(t) for t in done) if slos is not None else len(done)

    def rate(count: int) -> float | None:
        return count / wall_seconds if wall_seconds > 0 else None

    return {
        "num_requests": len(timings),
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_code": dict(sorted(failed.items())),
        "wall_s": float(wall_seconds),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_throughput": rate(output_tokens + prompt_tokens),
        "goodput": {"slos": None if slos is None else slos.as_dict(), "good_requests": good,
                    "requests_per_s": rate(good)},
        "ttft_s": distribution(t.ttft for t in done if t.ttft is not None),
        "tpot_s": distribution(t.tpot for t in done if t.tpot is not None),
        "itl_s": distribution(gap for t in done for gap in t.itls),
        "e2el_s": distribution(t.e2el for t in done if t.e2el is not None),
        "percentiles": f"numpy.percentile, method={PERCENTILE_METHOD!r}",
    }
