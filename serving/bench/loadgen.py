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

`frontend="http"` sends the same requests to the OpenAI-compatible HTTP API instead
(`POST /v1/completions`, streamed, with `return_token_ids` so each chunk's tokens are counted),
one connection per request, over a small HTTP/1.1 client on asyncio streams (no dependency beyond
the standard library). `frontend="llama-server"` sends them the same way to llama.cpp's
`llama-server` (`POST /completion`, streamed, `n_predict` and `ignore_eos`; a chunk's tokens are
the growth of its running `tokens_predicted`, which also counts a token the server held back
while it completed a UTF-8 character). An HTTP error is recorded under the gRPC name of its
status (`_HTTP_ERRORS`), so every front end's results read alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Callable, Sequence

import grpc
import numpy as np
from tqdm.auto import tqdm

from meshserve.serving.grpc_api.client import (AsyncClient, AsyncStream, ClientError, Completion,
                                               StreamChunk)
from meshserve.serving.bench.latency import RequestTiming
from meshserve.serving.bench.workloads import BenchRequest

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
               progress: bool = False, frontend: str = "grpc"
               ) -> tuple[list[RequestTiming], float]:
    """Runs `requests` against the server at `target` ("host:port"; its gRPC port, its HTTP
    port with `frontend="http"`, or llama-server's with `frontend="llama-server"`); returns one
    RequestTiming per request, in request order, and the wall seconds. `timeout` is each
    request's deadline in seconds (None: none). Bad arguments raise ValueError before anything
    is sent; a failed request never raises, it is recorded."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (or None for no cap), got {concurrency}")
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {', '.join(FRONTENDS)}, got {frontend!r}")
    arrivals = arrival_times(len(requests), rate, burstiness, seed)
    if frontend == "grpc":
        run = _run(target, requests, arrivals, concurrency=concurrency, api_key=api_key,
                   timeout=timeout, progress=progress)
    else:
        run = _run_http(target, requests, arrivals, concurrency=concurrency, api_key=api_key,
                        timeout=timeout, progress=progress, api=_HTTP_APIS[frontend])
    return asyncio.run(run)


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


# -- the HTTP front ends ---------------------------------------------------------------------------

_HTTP_ERRORS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND",
                408: "DEADLINE_EXCEEDED", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
                500: "INTERNAL", 503: "UNAVAILABLE"}


@dataclasses.dataclass(frozen=True)
class _HttpApi:
    """A streaming completion endpoint: where a request goes, its JSON body, and how one SSE
    event reads: `read(event, tokens so far)` is (the tokens it carries, an error name or None)."""

    path: str
    body: Callable[[BenchRequest], dict]
    read: Callable[[dict, int], tuple[int, str | None]]


def _openai_body(request: BenchRequest) -> dict:
    params = request.params()
    return {"prompt": list(request.prompt_token_ids), "max_tokens": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": params.ignore_eos,
            "stream": True, "return_token_ids": True}


def _read_openai_event(event: dict, _seen: int) -> tuple[int, str | None]:
    if "error" in event:
        return 0, _error_name(event["error"])
    tokens = sum(len(choice.get("token_ids") or ()) for choice in event["choices"])
    aborted = any(choice.get("finish_reason") == "abort" for choice in event["choices"])
    return tokens, "ABORTED" if aborted else None


def _llama_server_body(request: BenchRequest) -> dict:
    params = request.params()
    return {"prompt": list(request.prompt_token_ids), "n_predict": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": params.ignore_eos,
            "stream": True}


def _read_llama_server_event(event: dict, seen: int) -> tuple[int, str | None]:
    if "error" in event:
        return 0, _error_name(event["error"])
    return max(0, int(event.get("tokens_predicted", seen)) - seen), None


def _error_name(error: dict) -> str:
    """meshserve names its errors with gRPC's codes; llama-server gives the HTTP status."""
    code = error.get("code")
    if isinstance(code, int):
        return _HTTP_ERRORS.get(code, f"HTTP_{code}")
    return str(code or "INTERNAL").upper()


_HTTP_APIS = {"http": _HttpApi("/v1/completions", _openai_body, _read_openai_event),
              "llama-server": _HttpApi("/completion", _llama_server_body,
                                       _read_llama_server_event)}
FRONTENDS = ("grpc", *_HTTP_APIS)


async def _run_http(target: str, requests: Sequence[BenchRequest], arrivals: np.ndarray, *,
                    concurrency: int | None, api_key: str | None, timeout: float | None,
                    progress: bool, api: _HttpApi) -> tuple[list[RequestTiming], float]:
    host, port = target.rsplit(":", 1)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    bodies = [json.dumps(api.body(r)).encode() for r in requests]
    slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
    with contextlib.suppress(OSError, ValueError, asyncio.TimeoutError):  # unreachable: all fail
        await asyncio.wait_for(_drain(_http_request(host, int(port), "GET", "/health", b"", {})),
                               _CONNECT_TIMEOUT)
    with tqdm(total=len(requests), desc="requests", unit="req", disable=not progress) as bar:
        start = time.perf_counter()

        async def one(index: int) -> RequestTiming:
            await _sleep_until(start + float(arrivals[index]))
            async with slots if slots is not None else contextlib.nullcontext():
                timing = await _send_http(host, int(port), api, bodies[index], headers, timeout,
                                          len(requests[index].prompt_token_ids))
            bar.update(1)
            return timing

        timings = await asyncio.gather(*(one(i) for i in range(len(requests))))
        wall = time.perf_counter() - start
    return list(timings), wall


async def _drain(request) -> None:
    _, events = await request
    async for _ in events:
        pass


async def _send_http(host: str, port: int, api: _HttpApi, body: bytes, headers: dict,
                     timeout: float | None, prompt_tokens: int) -> RequestTiming:
    times: list[float] = []
    tokens: list[int] = []
    error = None
    send = time.perf_counter()

    async def read() -> str | None:
        status, events = await _http_request(host, port, "POST", api.path, body, headers)
        if status != 200:
            async for _ in events:
                pass
            return _HTTP_ERRORS.get(status, f"HTTP_{status}")
        async for event in events:
            new_tokens, failure = api.read(event, sum(tokens))
            if new_tokens:
                times.append(time.perf_counter())
                tokens.append(new_tokens)
            if failure is not None:
                return failure
        return None

    try:
        error = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        error = "DEADLINE_EXCEEDED"
    except OSError:
        error = "UNAVAILABLE"
    return RequestTiming(send_time=send, chunk_times=tuple(times), chunk_tokens=tuple(tokens),
                         prompt_tokens=prompt_tokens, error=error)


async def _http_request(host: str, port: int, method: str, path: str, body: bytes,
                        headers: dict):
    """(status, an async iterator over the SSE events' JSON bodies) of one HTTP/1.1 request on
    its own connection."""
    reader, writer = await asyncio.open_connection(host, port)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    is_chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        is_chunked |= (name.strip().lower() == "transfer-encoding"
                       and "chunked" in value.lower())

    async def pieces():
        if not is_chunked:
            yield await reader.read()
            return
        while size := int((await reader.readline()).split(b";")[0], 16):
            yield await reader.readexactly(size)
            await reader.readline()

    async def events():
        buffer = b""
        try:
            async for piece in pieces():
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = _sse_data(event.decode())
                    if data and data != "[DONE]":
                        yield json.loads(data)
        finally:
            writer.close()

    return status, events()


def _sse_data(event: str) -> str:
    """The data of one server-sent event: its `data:` lines joined. Comment lines (":", which
    llama-server sends as a keep-alive while a request waits) and other fields carry none."""
    lines = [line.removeprefix("data:").removeprefix(" ") for line in event.splitlines()
             if line.startswith("data:")]
    return "\n".join(lines).strip()
