"""The engine loop: one thread that owns an `Engine`, and the submission side that every front end
shares (the gRPC server, the OpenAI-compatible HTTP app and `AsyncLLM`).

Threads and queues:

    front-end threads (gRPC handlers, the HTTP    engine-loop thread (one; owns the Engine)
    event loop, an asyncio application)           -----------------------------------------
    -------------------------------------------   loop:
    `admission.admit`: every request check          take every command from `commands`
    submit: queue counters -> maybe                   (queue an admitted request, abort one)
      Refused("queue_full") at once                 engine.step()
    put ("add", Submission) on `commands` ----->    put each request's Delta on its queue,
    read the Submission's own queue       <-----      then Finished (or Failed)
      (`get`, or `async for` over `items()`)        fail requests past their deadline or the
    on cancel / disconnect: cancel(id)    ----->      max queue time
    a LoRA adapter read and checked:                publish a load snapshot
      add_adapter / remove_adapter        ----->    (the registry takes or drops it)

Only the engine-loop thread touches the Engine, so the engine needs no locks. Front ends share
with it only the `commands` queue, each submission's own output queue, and the queue counters
(guarded by one lock). A cancelled request is aborted at the start of the next engine step, and
its pages are free after that step.

Every request is checked once, on its front end's thread, by the loop's `admission` (the
engine's admission check, with the prompt bounded by `Limits.max_prompt_tokens`); the engine
queues the `Admitted` request without checking it again.

Queueing is bounded by queued requests and by queued prompt tokens (`Limits`). A request counts
as queued from submission until the engine first schedules it, or until it ends. Past either
bound `submit` raises `Refused("queue_full")` at once, never a hang. A request still waiting after
`max_queue_time` fails with `Failed("deadline")`.

States: starting -> serving -> draining -> stopped, or failed from serving or draining. An
exception in the loop fails every open request with `Failed("internal")`, and `wait()` returns
False. Refusals and failures carry a `kind` that each front end maps to its own status code
(`KINDS`). This module knows nothing of gRPC or HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from meshserve.batching.adapters import LoRARequest
from meshserve.batching.request import RequestStatus
from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading.lora_files import LoraAdapter
from meshserve.serving.engine.admission import Admitted
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.metrics import ServerMetrics
from meshserve.serving.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

log = logging.getLogger(__name__)

_IDLE_WAIT = 0.05  # seconds the loop blocks for a command when the engine has nothing to do
_SERVED_ENGINES: set[int] = set()  # ids of engines a running loop owns
_SERVED_LOCK = threading.Lock()
RETRY_AFTER_SECONDS = 1  # the hint a full queue gives

# Why a request was refused or failed; each front end maps these to its own status codes.
KINDS = ("invalid", "duplicate", "queue_full", "draining", "unavailable", "deadline", "internal")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Admission bounds (the gRPC server's `ServerConfig` carries the same fields as flags)."""

    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 262144
    max_queue_time: float | None = None
    max_prompt_tokens: int | None = None


class Refused(Exception):
    """A request refused at submission. `kind` is one of `KINDS`; `param` names the offending
    field when there is one; `retry_after` (seconds) comes with a full queue."""

    def __init__(self, kind: str, message: str, *, param: str | None = None,
                 retry_after: int | None = None):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind, self.message, self.param, self.retry_after = kind, message, param, retry_after


# -- What a submission receives, in order: Deltas, then one Finished or Failed ---------------------

@dataclasses.dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    output: RequestOutput  # the request as of this step (its text holds back partial stops)


@dataclasses.dataclass(frozen=True)
class Finished:
    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class Failed:
    kind: str
    message: str


@dataclasses.dataclass
class Submission:
    admitted: Admitted
    priority: int
    deadline: float | None  # time.monotonic() after which the request fails
    outputs: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    is_queued: bool = True  # still in the queue counters (not yet scheduled)
    sent_tokens: int = 0
    text: str = ""  # the output text streamed so far
    _wake: Callable[[], None] | None = None  # set by an asyncio reader

    @property
    def request_id(self) -> str:
        return self.admitted.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.admitted.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.admitted.params

    def put(self, item: Delta | Finished | Failed) -> None:
        self.outputs.put(item)
        wake = self._wake
        if wake is not None:
            wake()

    def get(self, timeout: float | None = None) -> Delta | Finished | Failed:
        """The next item (blocking; for threads)."""
        return self.outputs.get(timeout=timeout)

    async def items(self) -> AsyncIterator[Delta | Finished | Failed]:
        """The items as they arrive, for one asyncio reader; ends after Finished or Failed."""
        aloop, arrived = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # called from the engine-loop thread
            try:
                aloop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the reader's event loop has closed: nobody is listening
                pass

        self._wake = wake
        try:
            while True:
                try:
                    item = self.outputs.get_nowait()
                except queue.Empty:
                    await arrived.wait()
                    arrived.clear()
                    continue
                yield item
                if not isinstance(item, Delta):
                    return
        finally:
            self._wake = None


@dataclasses.dataclass(frozen=True)
class Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class EngineLoop:
    def __init__(self, engine: Engine, limits: Limits = Limits(), *,
                 metrics: ServerMetrics | None = None):
        self.engine, self.limits = engine, limits
        self.metrics = metrics or ServerMetrics(engine.model_config.name)
        self.state = "starting"
        self.load = Load()
        self.failure: BaseException | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight: dict[str, Submission] = {}  # guarded by _lock
        self._queued_requests = 0  # guarded by _lock
        self._queued_tokens = 0  # guarded by _lock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.admission = engine.admission.limited(self.max_prompt_tokens())
        self._apply = {"add": self._add, "abort": self._abort,
                       "adapter": self._add_adapter, "unload": self._remove_adapter}

    # -- lifecycle ----------------------------------------------------------------------------

    def on_state(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(state)` on every change of state, from the thread that made it."""
        self._listeners.append(listener)

    def _set_state(self, state: str) -> None:
        self.state = state
        for listener in self._listeners:
            listener(state)

    def start(self) -> None:
        with _SERVED_LOCK:
            if id(self.engine) in _SERVED_ENGINES:
                raise ValueError("this engine is already served by another GenerationServer or "
                                 "engine loop; an engine has one owner (give each server its "
                                 "own engine)")
            _SERVED_ENGINES.add(id(self.engine))
        if self.engine.tokenizer is not None:
            self.engine.tokenizer.max_token_chars  # noqa: B018 (computed once, before any request)
        self._thread.start()

    def serving(self) -> None:
        """Every front end is up: health turns SERVING."""
        if self.state == "starting":
            self._set_state("serving")

    def drain(self, timeout: float) -> None:
        """Stops admitting, lets in-flight requests finish (up to `timeout`), then stops."""
        if self.state in ("starting", "serving"):
            self._set_state("draining")
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self._stopped.is_set():
            with self._lock:
                if not self._inflight:
                    break
            time.sleep(0.02)
        self.stop()

    def stop(self) -> None:
        """Stops the loop and fails what is left with `unavailable`; the engine ends empty."""
        if self.state != "failed":
            self._set_state("stopped")
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.fail_all("unavailable", "the server is shutting down")
        if self.failure is None:
            self.engine.shutdown()  # frees the pages of whatever the drain left
        self._release_engine()

    def wait(self) -> bool:
        """Blocks until the loop stops; True for a clean stop, False after an engine failure."""
        self._stopped.wait()
        return self.failure is None

    def is_stopped(self) -> bool:
        return self._stopped.is_set()

    def fail_all(self, kind: str, message: str) -> None:
        with self._lock:
            subs = list(self._inflight.values())
        for sub in subs:
            self._finish(sub, Failed(kind, message))

    def _release_engine(self) -> None:
        with _SERVED_LOCK:
            _SERVED_ENGINES.discard(id(self.engine))

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._once()
        except BaseException as err:  # noqa: BLE001 - any engine failure takes the server down
            log.exception("the engine loop failed; the server is going down")
            self.failure, self.state = err, "failed"  # admits nothing from here
            self.fail_all("internal", f"the engine failed: {err!r}")
            self._release_engine()
            self._set_state("failed")  # after every request has its failure: front ends stop
            self._stopped.set()

    def _once(self) -> None:
        changed = self._take_commands(block=not self.engine.has_unfinished())
        changed |= self._expire()
        if not self.engine.has_unfinished():
            if changed:  # the gauges after aborts; an idle loop changes nothing
                self.metrics.observe_step(self.engine, 0.0)
                self._publish_load()
            return
        started = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.observe_step(self.engine, time.perf_counter() - started)
        for output in outputs:
            self.metrics.observe_output(output)
            self._deliver(output)
        self._update_queued()
        self._publish_load()

    def _take_commands(self, *, block: bool) -> bool:
        """Applies every queued command; False if there was none."""
        try:
            command = (self._commands.get(timeout=_IDLE_WAIT) if block
                       else self._commands.get_nowait())
        except queue.Empty:
            return False
        while True:
            kind, payload = command
            self._apply[kind](payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, sub: Submission) -> None:
        if sub.request_id not in self._inflight:
            return  # cancelled before it reached the engine
        try:
            self.engine.enqueue(sub.admitted, priority=sub.priority)
        except ValueError as err:  # its LoRA adapter (admission checked the rest)
            self.metrics.observe_rejected("invalid")
            self._finish(sub, Failed("invalid", str(err)))
            return
        if sub.admitted.lora_request is not None:
            self.metrics.observe_adapter_request(sub.admitted.lora_request.lora_name)

    def _add_adapter(self, payload: tuple[LoRARequest, LoraAdapter]) -> None:
        lora_request, adapter = payload
        try:
            self.engine.adapters.add(lora_request, adapter)
        except ValueError as err:  # its id taken by another adapter: requests naming it fail
            log.error("LoRA adapter %r not kept: %s", lora_request.lora_name, err)

    def _remove_adapter(self, adapter_id: int) -> None:
        self.engine.adapters.remove(adapter_id)

    def _abort(self, request_id: str) -> None:
        sub = self._inflight.get(request_id)
        if sub is None:
            return
        request = self.engine.scheduler.get(request_id)
        self.engine.abort(request_id)
        if request is not None:
            self.metrics.observe_aborted(request_id)
        self._finish(sub, Finished(self._aborted_output(sub, request)))

    def _expire(self) -> bool:
        """Fails requests past their deadline, or waiting past the max queue time; False if none
        was."""
        now = time.monotonic()
        max_wait = self.limits.max_queue_time
        with self._lock:
            subs = list(self._inflight.values())
        expired = False
        for sub in subs:
            request = self.engine.scheduler.get(sub.request_id)
            if request is None:
                continue
            if sub.deadline is not None and now > sub.deadline:
                message = "the request's deadline passed"
                self.metrics.observe_aborted(sub.request_id)
            elif sub.is_queued and max_wait is not None and now - request.arrival_time > max_wait:
                message = f"the request waited longer than the max queue time of {max_wait} s"
                self.metrics.observe_rejected("deadline")  # it never ran: nothing to abort
            else:
                continue
            self.engine.abort(sub.request_id)
            self._finish(sub, Failed("deadline", message))
            expired = True
        return expired

    def _deliver(self, output: RequestOutput) -> None:
        sub = self._inflight.get(output.request_id)
        if sub is None:
            return
        completion = output.outputs[0]
        new_tokens = completion.token_ids[sub.sent_tokens:]
        new_text = completion.text[len(sub.text):]  # held-back text comes out at the end
        logprobs = (completion.logprobs[sub.sent_tokens:len(completion.token_ids)]
                    if completion.logprobs is not None else None)
        if new_tokens or new_text:
            sub.put(Delta(list(new_tokens), new_text, logprobs, output))
            sub.sent_tokens, sub.text = len(completion.token_ids), completion.text
        if output.finished:
            self._finish(sub, Finished(output))

    def _update_queued(self) -> None:
        with self._lock:
            for sub in self._inflight.values():
                if not sub.is_queued:
                    continue
                request = self.engine.scheduler.get(sub.request_id)
                if request is not None and request.status is RequestStatus.RUNNING:
                    self._release_queued(sub)

    def _publish_load(self) -> None:
        usage = self.engine.scheduler.kv_usage()
        self.load = Load(num_running=self.engine.scheduler.num_running,
                         num_waiting=self.engine.scheduler.num_waiting,
                         kv_cache_usage=usage.num_used_pages / max(usage.num_total_pages, 1))

    def _finish(self, sub: Submission, last: Finished | Failed) -> None:
        with self._lock:
            if self._inflight.pop(sub.request_id, None) is None:
                return
            self._release_queued(sub)
        sub.put(last)

    def _release_queued(self, sub: Submission) -> None:
        """Caller holds _lock."""
        if sub.is_queued:
            sub.is_queued = False
            self._queued_requests -= 1
            self._queued_tokens -= len(sub.prompt_ids)

    def _aborted_output(self, sub: Submission, request) -> RequestOutput:
        tokens = list(request.output_token_ids) if request is not None else []
        return RequestOutput(
            request_id=sub.request_id, prompt=sub.admitted.prompt_text,
            prompt_token_ids=sub.prompt_ids,
            prompt_logprobs=None, finished=True, metrics=RequestMetrics(),
            outputs=[CompletionOutput(index=0, text=sub.text, token_ids=tokens, logprobs=None,
                                      finish_reason="abort")])

    # -- the front ends' side -----------------------------------------------------------------

    def check_open(self) -> None:
        """Refuses with `draining` once the loop no longer admits (draining, stopped, failed)."""
        if self.state not in ("starting", "serving") or self._stopped.is_set():
            self.metrics.observe_rejected("draining")
            raise Refused("draining", "the server is draining; retry on another replica")

    def max_prompt_tokens(self) -> int:
        limit = self.engine.config.max_model_len - 1
        if self.limits.max_prompt_tokens is not None:
            limit = min(limit, self.limits.max_prompt_tokens)
        return min(limit, self.limits.max_queued_prompt_tokens)  # more could never be admitted

    def submit(self, admitted: Admitted, *, priority: int = 0,
               deadline: float | None = None) -> Submission:
        """Queues a request `admission` passed; raises Refused (duplicate, queue_full) to refuse
        it."""
        sub = Submission(admitted=admitted, priority=priority, deadline=deadline)
        request_id, prompt_ids = admitted.request_id, admitted.prompt_ids
        with self._lock:
            if request_id in self._inflight:
                raise Refused("duplicate", f"request_id {request_id!r} is already in flight",
                              param="request_id")
            limits = self.limits
            if self._queued_requests + 1 > limits.max_queued_requests:
                self.metrics.observe_rejected("queue_full")
                raise Refused("queue_full",
                              f"the queue is full ({self._queued_requests} requests waiting, "
                              f"max_queued_requests={limits.max_queued_requests}); retry later",
                              retry_after=RETRY_AFTER_SECONDS)
            if self._queued_tokens + len(prompt_ids) > limits.max_queued_prompt_tokens:
                self.metrics.observe_rejected("queue_full")
                raise Refused("queue_full",
                              f"the queue is full ({self._queued_tokens} prompt tokens waiting, "
                              f"max_queued_prompt_tokens={limits.max_queued_prompt_tokens}); "
                              f"retry later", retry_after=RETRY_AFTER_SECONDS)
            self._queued_requests += 1
            self._queued_tokens += len(prompt_ids)
            self._inflight[request_id] = sub
        self._commands.put(("add", sub))
        return sub

    def add_adapter(self, lora_request: LoRARequest, adapter: LoraAdapter) -> None:
        """Hands the engine a LoRA adapter read and checked on the caller's thread
        (`meshserve.serving.engine.served_adapters`): it is in the engine's registry before any
        request submitted after this call is queued, so that one never reads it on the engine's
        thread (unless the host LRU, `max_cpu_loras`, dropped it meanwhile)."""
        assert self.engine.adapters is not None, "the engine serves no LoRA adapters"
        self._commands.put(("adapter", (lora_request, adapter)))

    def remove_adapter(self, adapter_id: int) -> None:
        """Lets the engine drop a LoRA adapter's weights once no unfinished request runs with
        it; requests already submitted with it run to their end."""
        self._commands.put(("unload", adapter_id))

    def cancel(self, request_id: str) -> None:
        """Aborts the request at the next step (its pages are free after it); its queue gets a
        Finished with finish_reason "abort"."""
        self._commands.put(("abort", request_id))

    def is_inflight(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._inflight

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)
