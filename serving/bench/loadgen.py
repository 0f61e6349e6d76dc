"""Online load generation: send benchmark requests to a running server on an arrival schedule
and record, for each, what `serving.bench.latency` needs (`RequestTiming`).

Arrival schedule (`arrival_times`): request 0 arrives at t = 0 and request i at the sum of the
first i gaps, where the gaps are independent gamma draws with shape `burstiness` and scale
1 / (rate * burstiness), so their mean is 1 / rate whatever the burstiness; burstiness 1 is a
Poisson process, below 1 is burstier (coefficient of variation 1 / sqrt(burstiness)), above 1
steadier. The draws are seeded, so the same seed gives the same schedule. `rate=None` puts every
arrival at t = 0 (offline-like). `concurrency=N` caps the requests in flight at N: a request
that arrives while N are in flight waits for one to end. Rate and cap can be combined.

Timing, on the client's `time.perf_counter()` clock: a request's send time is the moment its
RPC starts, at or after its arrival and after it got a concurrency slot (time waiting for a
client slot is not counted, as in vLLM's `bench serve`; time queued in the server is). Each
streamed chunk carrying at least one token is stamped as it arrives. The wall time runs from
t = 0 of the schedule until the last request has ended. The channel is connected (one health
check) before the clock starts, so no request's TTFT includes the connection setup.

Every request is sent as token ids with `BenchRequest.params()`: greedy, `max_tokens` its target
length and `ignore_eos` (unless it stops at EOS), so its output has exactly that length. Every request
gets exactly one `RequestTiming`, in request order: a failed RPC is recorded with `error` set to
its gRPC status-code name, and a stream that ends with finish_reason "abort" as "ABORTED".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Sequence

import grpc
import numpy as np
from tqdm.auto import tqdm

from meshserve.serving.client import (AsyncClient, AsyncStream, ClientError, Completion,
                                      StreamChunk)
from meshserve.serving.bench.latency import RequestTiming

if TYPE_CHECKING:  # bench imports jax; the load generator itself needs none
    from meshserve.serving.bench.bench import BenchRequest

_CONNECT_TIMEOUT = 10.0  # seconds the pre-run health check may take


def arrival_times(n: int, rate: float | None, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """The n arrival offsets in seconds from the start (see the module docstring)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if rate is None or rate == float("inf"):
        return np.zeros(n)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (or None for all at t=0), got {rate}")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness),
                                             size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def run_online(target: str, requests: Sequence[BenchRequest], *, rate: float | None = None,
               burstiness: float = 1.0, concurrency: int | None = None, seed: int = 0,
               api_key: str | None = None, timeout: float | None = None,
               progress: bool = False) -> tuple[list[RequestTiming], float]:
    """Runs `requests` against the server at `target` ("host:port"); returns one RequestTiming
    per request, in request order, and the wall seconds. `timeout` is each request's deadline
    in seconds (None: none). Bad arguments raise ValueError before anything is sent; a failed
    request never raises, it is recorded."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (or None for no cap), got {concurrency}")
    arrivals = arrival_times(len(requests), rate, burstiness, seed)
    return asyncio.run(_run(target, requests, arrivals, concurrency=concurrency,
                            api_key=api_key, timeout=timeout, progress=progress))


async def _run(target: str, requests: Sequence[BenchRequest], arrivals: np.ndarray, *,
               concurrency: int | None, api_key: str | None, timeout: float | None,
               progress: bool) -> tuple[list[RequestTiming], float]:
    slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
    async with AsyncClient(target, api_key=api_key, timeout=timeout) as client:
        # Built (and validated: ValueError) before anything is sent; each is sent when iterated.
        streams = [client.stream(list(r.prompt_token_ids), r.params()) for r in requests]
        with contextlib.suppress(ClientError):  # an unreachable server fails every request
            await client.health(timeout=_CONNECT_TIMEOUT)
        with tqdm(total=len(requests), desc="requests", unit="req",
                  disable=not progress) as bar:
            start = time.perf_counter()

            async def one(index: int) -> RequestTiming:
                await _sleep_until(start + float(arrivals[index]))
                async with slots if slots is not None else contextlib.nullcontext():
                    timing = await _send(streams[index], len(requests[index].prompt_token_ids))
                bar.update(1)
                return timing

            timings = await asyncio.gather(*(one(i) for i in range(len(requests))))
            wall = time.perf_counter() - start
    return list(timings), wall


async def _sleep_until(when: float) -> None:
    """Returns no earlier than `when` on the perf_counter clock."""
    while (left := when - time.perf_counter()) > 0:
        await asyncio.sleep(left)


async def _send(stream: AsyncStream, prompt_tokens: int) -> RequestTiming:
    times: list[float] = []
    tokens: list[int] = []
    error = None
    send = time.perf_counter()
    try:
        async with stream:
            async for item in stream:
                if isinstance(item, StreamChunk):
                    if item.token_ids:
                        times.append(time.perf_counter())
                        tokens.append(len(item.token_ids))
                elif isinstance(item, Completion) and item.finish_reason == "abort":
                    error = grpc.StatusCode.ABORTED.name
    except ClientError as err:
        error = err.code.name
    return RequestTiming(send_time=send, chunk_times=tuple(times), chunk_tokens=tuple(tokens),
                         prompt_tokens=prompt_tokens, error=error)
