"""What the server tests share: the tiny engine's settings, token-id prompts, waiting on a served
engine, and holding an engine between steps (`StepGate`) so that what a test asserts does not
depend on how fast the machine is."""

import contextlib
import threading
import time

import numpy as np

from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.loop import EngineLoop
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=256, max_logprobs=5, compilation_cache=False,
              warmup=False)
# SmolLM2 as the in-process server and LLM tests load it (`LLM`, its GGUF blocks kept): one
# set of shapes, so its programs are compiled once a session (the session's compilation cache).
SMOL = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
            prefill_chunk=32, max_model_len=256, max_logprobs=3, warmup=False,
            compilation_cache=False)


@contextlib.contextmanager
def openai_server(engine: Engine, **config):
    """`engine` behind a real server on 127.0.0.1 (gRPC and HTTP; `config`: more `ServerConfig`
    fields) and the official `openai` client on its HTTP port: yields (server, client); the
    server stops on leaving."""
    import openai

    server = GenerationServer(engine, ServerConfig(port=0, http_port=0, **config))
    server.start()
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                           max_retries=0) as client:
            yield server, client
    finally:
        server.stop()


@contextlib.contextmanager
def smol_openai_client(path, engine: dict = SMOL):
    """SmolLM2 with `engine`'s shapes behind `openai_server`: yields the client."""
    from meshserve.serving.python_api.llm import LLM

    with openai_server(LLM(str(path), **engine).engine) as (_, client):
        yield client


def prompt_ids(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(2, 512, size=length).tolist()


def wait_for(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def pages_free(server: GenerationServer) -> bool:
    scheduler = server.engine.scheduler
    return not scheduler.has_unfinished() and scheduler.kv_usage().num_used_pages == 0


class StepGate:
    """Runs an engine's steps only as far as a test allows. While the gate is shut the
    engine-loop thread still takes its commands (new requests, cancels) and expires deadlines,
    but computes no token: a request in flight cannot finish on its own, however fast the
    machine, and cannot outrun a test's setup, however loaded. A shut gate's step returns no
    output after a short wait, which the engine contract allows (an empty plan)."""

    _POLL = 0.005  # seconds a shut gate waits before the loop looks at its commands again

    def __init__(self, engine: Engine, *, shut: bool = False):
        self._budget: int | None = 0 if shut else None  # steps still allowed; None: open
        self._changed = threading.Condition()
        step = engine.step

        def gated_step():
            with self._changed:
                if self._budget == 0:
                    self._changed.wait(self._POLL)
                    return []
                if self._budget is not None:
                    self._budget -= 1
            return step()

        engine.step = gated_step

    def shut(self) -> None:
        """No step starts after this (one already running finishes)."""
        self._set(0)

    def open(self) -> None:
        self._set(None)

    def allow(self, steps: int) -> None:
        with self._changed:
            self._budget = (self._budget or 0) + steps
            self._changed.notify_all()

    def step_until(self, condition, timeout: float = 10.0) -> None:
        """Allows one step at a time until `condition()` holds."""
        end = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < end, "timed out"
            if self._budget == 0:
                self.allow(1)
            time.sleep(self._POLL)

    def _set(self, budget: int | None) -> None:
        with self._changed:
            self._budget = budget
            self._changed.notify_all()


def record_cancels(loop: EngineLoop, monkeypatch=None) -> list[str]:
    """The ids of the requests a front end cancels on `loop`, each appended once its abort is
    queued for the engine loop (so a test that sees it knows the engine will act on it). With
    pytest's `monkeypatch`, the recording ends with the test (for a loop that outlives it)."""
    cancelled: list[str] = []
    cancel = loop.cancel

    def recorded(request_id: str) -> None:
        cancel(request_id)
        cancelled.append(request_id)

    _patch(monkeypatch, loop, "cancel", recorded)
    return cancelled


def record_aborts(loop: EngineLoop, monkeypatch=None) -> list[str]:
    """The ids of the requests the engine aborted before they finished (cancelled, or past a
    deadline), as the loop counts them (finish reason "abort" in the metrics); `monkeypatch` as
    for `record_cancels`."""
    aborted: list[str] = []
    observe = loop.metrics.observe_aborted

    def recorded(request_id: str) -> None:
        aborted.append(request_id)
        observe(request_id)

    _patch(monkeypatch, loop.metrics, "observe_aborted", recorded)
    return aborted


def _patch(monkeypatch, target, name: str, value) -> None:
    if monkeypatch is None:
        setattr(target, name, value)
    else:
        monkeypatch.setattr(target, name, value)
