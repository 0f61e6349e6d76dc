"""The llama-server peer (`meshserve bench --compare llama-server`): llama.cpp's own HTTP server,
with parallel slots and continuous batching, the engine a CPU user who wants throughput runs.

`run_peer` does, in order:
1. gets the binary from `llama_server_build.ensure_built` (built once per machine, smoke-tested
   on `model`, falling back to a build without a feature that crashes, and cached);
2. starts it on 127.0.0.1 at a free port, shaped like meshserve's engine (`ServerShape.matching`):
   one slot per `max_num_seqs` row, each with `max_model_len` tokens of context (`-c` is slots
   times that; the KV cache is not unified, so each slot has exactly its share),
   `max_num_batched_tokens` as its batch (`-b`, `-ub`), the bench's CPU threads (`-t`, `-tb`),
   prompt reuse only when meshserve's prefix caching is on, and, when meshserve drafts by
   prompt lookup (`ngram`), llama.cpp's own lookup (`--spec-type ngram-simple`,
   `ServerShape.lookup`); then waits for `/health`;
3. sends one short warm-up request, untimed, which also proves the protocol works;
4. sends the workload's token ids to `/completion`, streamed, through
   `loadgen.run_online(frontend="llama-server")`, on the arrival schedule meshserve's own run
   gets (`rate`, `burstiness`, `seed`, `concurrency`; by default all at t=0, the offline mode);
5. reports `latency.summarize` of the client's timings: output tok/s, TTFT, TPOT, ITL and E2EL
   by the definitions of meshserve's online run (docs/benchmarks.md).

Invariants:
* Every request is greedy (`temperature` 0) with `n_predict` its output length and `ignore_eos`,
  as meshserve runs it. A completed request whose stream carried another number of tokens is
  counted as failed (`SHORT_OUTPUT`), so the peer is never credited with work it did not do.
* The server is stopped whatever happens (SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`), also on
  an exception or Ctrl-C; a server that exits or never turns healthy, or that exits while it
  serves, raises `PeerUnavailable` naming its exit status or signal, with the tail of its log.
* The result's `build` is `llama_server_build.build_info`: the flags the binary was built with
  and its smoke test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from meshserve.serving.bench import latency, llama_server_build, loadgen, memory
from meshserve.serving.bench.peers import PeerUnavailable, model_files
from meshserve.serving.bench.workloads import BenchRequest

NAME = "llama-server"
START_TIMEOUT_S = 180.0   # loading the model and the server's own warm-up
STOP_TIMEOUT_S = 10.0
EXIT_GRACE_S = 0.5
WARMUP_TOKENS = 4
LOG_TAIL_LINES = 20
SHORT_OUTPUT = "SHORT_OUTPUT"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerShape:
    """The server's parallelism: `slots` sequences at once, each up to `context_per_slot`
    tokens; `batch_tokens` tokens per decode call; `threads` CPU threads (None: llama.cpp's
    default); `cache_prompt` lets a slot reuse the prefix its previous request left; `lookup`
    (n, m) turns on llama.cpp's prompt-lookup speculation, `ngram-simple`: the last n tokens
    are looked up in the slot's own context and the (up to) m tokens that followed them are
    drafted, then verified in one batch."""

    slots: int
    context_per_slot: int
    batch_tokens: int = 512
    threads: int | None = None
    cache_prompt: bool = False
    lookup: tuple[int, int] | None = None

    def __post_init__(self):
        for field in ("slots", "context_per_slot", "batch_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None), got {self.threads}")
        if self.lookup is not None and (len(self.lookup) != 2 or min(self.lookup) < 1):
            raise ValueError(f"lookup must be (n, m) with both >= 1, got {self.lookup}")

    @classmethod
    def matching(cls, engine_config: Any, *, threads: int | None = None) -> ServerShape:
        """The shape of a meshserve `EngineConfig` (settled by `for_model`, so `max_model_len`
        is set). An `ngram` speculative config becomes llama.cpp's own lookup: its shortest
        suffix (`prompt_lookup_min`, so llama.cpp finds every match meshserve's proposer can)
        and `num_speculative_tokens` drafts; a draft model has no counterpart here (the peer then
        decodes without speculation)."""
        spec = getattr(engine_config, "speculative_config", None)
        lookup = None
        if spec is not None and spec.method == "ngram":
            lookup = (spec.prompt_lookup_min, spec.num_speculative_tokens)
        return cls(slots=engine_config.max_num_seqs, context_per_slot=engine_config.max_model_len,
                   batch_tokens=engine_config.max_num_batched_tokens, threads=threads,
                   cache_prompt=engine_config.enable_prefix_caching, lookup=lookup)

    def arguments(self) -> list[str]:
        """llama-server's command-line flags for this shape."""
        args = ["-np", str(self.slots), "-c", str(self.slots * self.context_per_slot),
                "--no-kv-unified", "-b", str(self.batch_tokens), "-ub", str(self.batch_tokens)]
        if self.threads is not None:
            args += ["-t", str(self.threads), "-tb", str(self.threads)]
        if not self.cache_prompt:
            args += ["--cache-ram", "0"]  # no host-side prompt cache to fill and search either
        if self.lookup is not None:
            n, m = self.lookup
            args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n),
                     "--spec-ngram-simple-size-m", str(m), "--spec-draft-n-max", str(m)]
        return args


def run_peer(model: str, requests: Sequence[BenchRequest], *, shape: ServerShape,
             rate: float | None = None, burstiness: float = 1.0, concurrency: int | None = None,
             seed: int = 0, slos: latency.Slos | None = None, cache_dir: str | None = None,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """`requests` through llama-server on `model` (a GGUF file or known name); returns the
    client-side summary with the offline mode's names (output_tokens_per_s, requests_per_s)."""
    if not requests:
        raise ValueError("run_peer needs at least one request")
    if any(len(r.prompt_token_ids) + r.num_output_tokens > shape.context_per_slot
           for r in requests):
        raise ValueError(f"a request is longer than the {shape.context_per_slot} tokens of "
                         "context per slot; raise context_per_slot (--max-model-len)")
    path = model_files(NAME, model).path
    binary = llama_server_build.ensure_built(cache_dir, model=path, log=log)
    build = llama_server_build.build_info(cache_dir)
    peaks: dict[str, int | None] = {}
    with serve(binary, path, shape, peaks) as target:
        warmup = dataclasses.replace(requests[0], num_output_tokens=min(
            WARMUP_TOKENS, requests[0].num_output_tokens))
        _check_warmup(*loadgen.run_online(target, [warmup], frontend=NAME))
        load_before = os.getloadavg()
        timings, wall = loadgen.run_online(target, requests, rate=rate, burstiness=burstiness,
                                           concurrency=concurrency, seed=seed, frontend=NAME)
        load_after = os.getloadavg()
    timings = mark_short_outputs(timings, requests)
    summary = latency.summarize(timings, wall_seconds=wall, slos=slos)
    done = [t for t in timings if t.completed]
    return summary | {
        "peer": NAME,
        "output_tokens_per_s": summary["output_throughput"],
        "requests_per_s": summary["request_throughput"],
        "version": version(binary),
        "build": build,
        "threads": shape.threads,
        "peak_rss_bytes": peaks.get("peak_rss_bytes"),
        "server": dataclasses.asdict(shape) | {"arguments": shape.arguments()},
        "arrivals": {"rate": rate, "burstiness": burstiness, "concurrency": concurrency,
                     "seed": seed},
        # llama.cpp's threads spin at every barrier, so it slows far more than meshserve when
        # other processes share the cores: the load says how far to trust the ratio.
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "samples": {"ttft_s": [t.ttft for t in done if t.ttft is not None],
                    "tpot_s": [t.tpot for t in done if t.tpot is not None],
                    "e2el_s": [t.e2el for t in done if t.e2el is not None]},
    }


def mark_short_outputs(timings: Sequence[latency.RequestTiming],
                       requests: Sequence[BenchRequest]) -> list[latency.RequestTiming]:
    """Each completed timing whose output length is not its request's (at most, where the
    request may stop at EOS) marked failed with `SHORT_OUTPUT`."""
    def wrong_length(t: latency.RequestTiming, r: BenchRequest) -> bool:
        if r.stop_at_eos:
            return t.output_tokens > r.num_output_tokens
        return t.output_tokens != r.num_output_tokens

    return [dataclasses.replace(t, error=SHORT_OUTPUT) if t.completed and wrong_length(t, r)
            else t for t, r in zip(timings, requests, strict=True)]


def _check_warmup(timings: list[latency.RequestTiming], _wall: float) -> None:
    if timings[0].error is not None or not timings[0].chunk_times:
        raise PeerUnavailable(f"llama-server failed the warm-up request "
                              f"({timings[0].error or 'no tokens streamed'})")


@contextlib.contextmanager
def serve(binary: Path, model_path: Path, shape: ServerShape,
          peaks: dict[str, int | None] | None = None) -> Iterator[str]:
    """A running llama-server on 127.0.0.1, answering `/health`; yields "127.0.0.1:port" and
    stops the server when the block ends, however it ends. A server that exited while the
    block ran raises `PeerUnavailable` (from the block's own exception, if any). With `peaks`,
    the server's peak resident memory is put in it as `peak_rss_bytes` before it stops."""
    with tempfile.TemporaryDirectory(prefix="meshserve-llama-server-") as scratch:
        log_path = Path(scratch) / "server.log"
        port = free_port()
        command = [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port",
                   str(port), "--no-webui", *shape.arguments()]
        with log_path.open("w") as log_file:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                       stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(process, f"127.0.0.1:{port}", log_path)
            try:
                yield f"127.0.0.1:{port}"
            except Exception as err:
                _raise_if_exited(process, log_path, err)
                raise
            _raise_if_exited(process, log_path, None)
        finally:
            if peaks is not None:
                peaks["peak_rss_bytes"] = memory.process_peak_rss_bytes(process.pid)
            stop(process)


def _raise_if_exited(process: subprocess.Popen, log_path: Path,
                     cause: BaseException | None) -> None:
    """`PeerUnavailable` if the server has exited; after a failure (`cause`) it is given a
    moment, since a client sees the connection drop just before the process can be reaped."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(EXIT_GRACE_S if cause is not None else 0)
    if process.poll() is not None:
        raise PeerUnavailable(
            f"llama-server {llama_server_build.describe_exit(process.returncode)} while it "
            f"served the workload:\n{_tail(log_path)}") from cause


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of asking."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, target: str, log_path: Path, *,
                       timeout: float = START_TIMEOUT_S) -> None:
    """Returns once `GET /health` answers 200; raises `PeerUnavailable` with the log's tail if
    the server exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PeerUnavailable(f"llama-server "
                                  f"{llama_server_build.describe_exit(process.returncode)} "
                                  f"before it was ready:\n{_tail(log_path)}")
        if _is_healthy(target):
            return
        time.sleep(0.1)
    raise PeerUnavailable(f"llama-server was not ready after {timeout:.0f} s:\n{_tail(log_path)}")


def _is_healthy(target: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{target}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `STOP_TIMEOUT_S`; always reaped."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def version(binary: Path) -> str:
    """What the binary says of itself, after the sdist it was built from."""
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                            check=False, timeout=30)
    said = (result.stdout + result.stderr).strip().splitlines()
    first = said[0] if said else "version unknown"
    return f"llama.cpp from llama-cpp-python {llama_server_build.LLAMA_CPP_SDIST_VERSION} ({first})"


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(the log is empty)"
