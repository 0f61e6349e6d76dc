"""The gRPC server: `meshserve.v1.Generation`, plus standard health and reflection.

Threads and queues:

    RPC handler threads (grpc's pool)         engine-loop thread (one; owns the Engine)
    ---------------------------------         -----------------------------------------
    check auth, parse, tokenize               loop:
    admission: bounded counters -> maybe        take every command from `commands`
      RESOURCE_EXHAUSTED at once                  (add a request, abort one)
    put AddCommand on `commands`  --------->    engine.step()
    read own `outputs` queue      <---------    put each request's deltas on its queue
    on cancel / disconnect / deadline:          abort requests past their deadline or the
      put AbortCommand            --------->      max queue time
    yield GenerateResponse                      publish a load snapshot for GetServerInfo

Only the engine-loop thread touches the Engine, so the engine needs no locks. Handlers share
with it only the `commands` queue, their own output queue, and the admission counters (guarded
by one lock). A cancelled or disconnected stream, or one past its deadline, is aborted at the
start of the next engine step, and its pages are free after it.

Admission is bounded by queued requests and by queued prompt tokens. A request counts as queued
from submission until the engine first schedules it, or until it ends. Past either bound the RPC
fails at once with RESOURCE_EXHAUSTED, never a hang. A request still waiting after
`max_queue_time` fails with DEADLINE_EXCEEDED.

Failure: an exception in the engine loop sets health to NOT_SERVING, fails every open stream
with INTERNAL, and stops the server. `wait()` then returns False, so `meshserve serve` exits
non-zero. A half-alive server is never kept.

Multi-process (`meshserve.serving.multihost`): when a peer process is lost, `peer_lost` sets
NOT_SERVING and fails every open stream with UNAVAILABLE, naming the lost process; then the
process exits non-zero.

Drain (`drain()`, on SIGTERM): health goes NOT_SERVING, and new requests get UNAVAILABLE.
In-flight requests run on for up to `drain_timeout`; whatever is left is aborted. Then the server
stops, and `wait()` returns True.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import queue
import threading
import time
import uuid
from concurrent import futures
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from meshserve.batching.config import knob
from meshserve.batching.request import RequestStatus
from meshserve.batching.sampling import SamplingParams
from meshserve.serving.api import generation_pb2 as pb
from meshserve.serving.api import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine import Engine, check_request_id
from meshserve.serving.metrics import ServerMetrics
from meshserve.serving.outputs import CompletionOutput, RequestMetrics, RequestOutput

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # meshserve.v1.Generation
_IDLE_WAIT = 0.05  # seconds the loop blocks for a command when the engine has nothing to do
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_SERVED_ENGINES: set[int] = set()  # ids of engines a running server owns
_SERVED_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = knob("127.0.0.1", "bind address; 0.0.0.0 to serve other machines")
    port: int = knob(50051, "port; 0 picks a free one")
    api_key: str | None = knob(None, "require `authorization: Bearer <key>` on Generation")
    api_key_file: str | None = knob(None, "read the api key from this file instead")
    tls_cert: str | None = knob(None, "PEM certificate chain; with --tls-key, serve TLS only")
    tls_key: str | None = knob(None, "PEM private key")
    max_queued_requests: int = knob(256, "waiting requests before RESOURCE_EXHAUSTED")
    max_queued_prompt_tokens: int = knob(262144, "waiting prompt tokens before "
                                                 "RESOURCE_EXHAUSTED")
    max_queue_time: float | None = knob(None, "seconds a request may wait before "
                                              "DEADLINE_EXCEEDED; unset: no limit")
    max_prompt_tokens: int | None = knob(None, "longest prompt accepted; unset: the engine's "
                                               "max_model_len - 1")
    max_message_bytes: int = knob(4 << 20, "largest request message")
    max_concurrent_streams: int = knob(512, "RPC handler threads")
    drain_timeout: float = knob(30.0, "seconds in-flight requests get after SIGTERM")
    metrics_port: int | None = knob(None, "serve Prometheus /metrics on this port")

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_message_bytes",
                     "max_concurrent_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_queue_time is not None and self.max_queue_time <= 0:
            raise ValueError(f"max_queue_time must be > 0, got {self.max_queue_time}")

    def resolved_api_key(self) -> str | None:
        if self.api_key_file is None:
            return self.api_key
        key = Path(self.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"api key file {self.api_key_file} is empty")
        return key


class RpcError(Exception):
    """A failure that ends one RPC with `code` and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# -- What handlers and the engine loop exchange ---------------------------------------------------

@dataclasses.dataclass
class _Submission:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    priority: int
    deadline: float | None  # time.monotonic() after which the request fails
    outputs: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    is_queued: bool = True  # still counted by admission (not yet scheduled)
    sent_tokens: int = 0
    text: str = ""  # the output text streamed so far


@dataclasses.dataclass(frozen=True)
class _Delta:
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None


@dataclasses.dataclass(frozen=True)
class _Finished:
    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class _Failed:
    code: grpc.StatusCode
    message: str


class GenerationServer:
    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig(), *,
                 metrics: ServerMetrics | None = None):
        self.engine, self.config = engine, config
        self.metrics = metrics or ServerMetrics(engine.model_config.name)
        self._api_key = config.resolved_api_key()
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight: dict[str, _Submission] = {}  # guarded by _lock
        self._queued_requests = 0  # guarded by _lock
        self._queued_tokens = 0  # guarded by _lock
        self._draining = False
        self._stopped = threading.Event()
        self._failed: BaseException | None = None
        self._load = pb.Load()
        self._health = health.HealthServicer()
        self._grpc = self._build_grpc_server()
        self._loop = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self.port: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> int:
        """Binds, starts serving and the engine loop; returns the bound port."""
        with _SERVED_LOCK:
            if id(self.engine) in _SERVED_ENGINES:
                raise ValueError("this engine is already served by another GenerationServer; "
                                 "an engine has one owner (give each server its own engine)")
            _SERVED_ENGINES.add(id(self.engine))
        try:
            return self._start()
        except BaseException:
            self._release_engine()
            raise

    def _start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert is not None:
            credentials = grpc.ssl_server_credentials([(Path(self.config.tls_key).read_bytes(),
                                                        Path(self.config.tls_cert).read_bytes())])
            self.port = self._grpc.add_secure_port(address, credentials)
        else:
            self.port = self._grpc.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"could not bind {address}")
        if self.engine.tokenizer is not None:
            self.engine.tokenizer.max_token_chars  # noqa: B018 (computed once, before any request)
        self._loop.start()
        self._grpc.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.start_http_server(self.config.metrics_port,
                                                               self.config.host)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self.port

    def drain(self, timeout: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish (up to `timeout`), then stops."""
        timeout = self.config.drain_timeout if timeout is None else timeout
        with self._lock:
            self._draining = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self._stopped.is_set():
            with self._lock:
                if not self._inflight:
                    break
            time.sleep(0.02)
        self.stop()

    def stop(self, grace: float = 1.0) -> None:
        """Aborts what is left and stops the engine loop and the gRPC server."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped.set()
        if self._loop.is_alive() and threading.current_thread() is not self._loop:
            self._loop.join()
        self._fail_all(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self._failed is None:
            self.engine.shutdown()  # frees the pages of whatever the drain left
        self._grpc.stop(grace).wait()
        if self.config.metrics_port is not None:
            self.metrics.stop_http_server()
        self._release_engine()

    def peer_lost(self, error: BaseException) -> None:
        """A process of a multi-process job is gone: NOT_SERVING at once, and every open stream
        fails with UNAVAILABLE and the account of what was lost. The process exits next."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._fail_all(grpc.StatusCode.UNAVAILABLE, str(error))

    def _release_engine(self) -> None:
        with _SERVED_LOCK:
            _SERVED_ENGINES.discard(id(self.engine))

    def wait(self) -> bool:
        """Blocks until the server stops; True for a clean stop, False after an engine failure."""
        self._stopped.wait()
        self._grpc.wait_for_termination()
        return self._failed is None

    # -- the engine loop ----------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while not self._stopped.is_set():
                changed = self._take_commands(block=not self.engine.has_unfinished())
                changed |= self._expire()
                if not self.engine.has_unfinished():
                    if changed:  # the gauges after aborts; an idle loop changes nothing
                        self.metrics.observe_step(self.engine, 0.0)
                        self._publish_load()
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                self.metrics.observe_step(self.engine, time.perf_counter() - started)
                for output in outputs:
                    self.metrics.observe_output(output)
                    self._deliver(output)
                self._update_queued()
                self._publish_load()
        except BaseException as err:  # noqa: BLE001 - any engine failure takes the server down
            log.exception("the engine loop failed; the server is going down")
            self._failed = err
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            self._fail_all(grpc.StatusCode.INTERNAL, f"the engine failed: {err!r}")
            self._release_engine()
            self._stopped.set()
            threading.Thread(target=self._grpc.stop, args=(0,), daemon=True).start()

    def _take_commands(self, *, block: bool) -> bool:
        """Applies every queued command; False if there was none."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, payload = command
            if kind == "add":
                self._add(payload)
            else:
                self._abort(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, sub: _Submission) -> None:
        if sub.request_id not in self._inflight:
            return  # cancelled before it reached the engine
        try:
            self.engine.add_request(sub.prompt_ids, sub.params, request_id=sub.request_id,
                                    priority=sub.priority)
        except ValueError as err:
            self.metrics.observe_rejected("invalid")
            self._finish_submission(sub, _Failed(grpc.StatusCode.INVALID_ARGUMENT, str(err)))

    def _abort(self, request_id: str) -> None:
        sub = self._inflight.get(request_id)
        if sub is None:
            return
        request = self.engine.scheduler.get(request_id)
        self.engine.abort(request_id)
        if request is not None:
            self.metrics.observe_aborted(request_id)
        self._finish_submission(sub, _Finished(self._aborted_output(sub, request)))

    def _expire(self) -> bool:
        """Fails requests past their client deadline, or waiting past the max queue time;
        False if none was."""
        now = time.monotonic()
        max_wait = self.config.max_queue_time
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
            self._finish_submission(sub, _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, message))
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
            sub.outputs.put(_Delta(list(new_tokens), new_text, logprobs))
            sub.sent_tokens, sub.text = len(completion.token_ids), completion.text
        if output.finished:
            self._finish_submission(sub, _Finished(output))

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
        self._load = pb.Load(num_running=self.engine.scheduler.num_running,
                             num_waiting=self.engine.scheduler.num_waiting,
                             kv_cache_usage=usage.num_used_pages / max(usage.num_total_pages, 1))

    def _finish_submission(self, sub: _Submission, last) -> None:
        with self._lock:
            if self._inflight.pop(sub.request_id, None) is None:
                return
            self._release_queued(sub)
        sub.outputs.put(last)

    def _release_queued(self, sub: _Submission) -> None:
        """Caller holds _lock."""
        if sub.is_queued:
            sub.is_queued = False
            self._queued_requests -= 1
            self._queued_tokens -= len(sub.prompt_ids)

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        with self._lock:
            subs = list(self._inflight.values())
        for sub in subs:
            self._finish_submission(sub, _Failed(code, message))

    def _aborted_output(self, sub: _Submission, request) -> RequestOutput:
        tokens = list(request.output_token_ids) if request is not None else []
        return RequestOutput(
            request_id=sub.request_id, prompt=sub.prompt_text, prompt_token_ids=sub.prompt_ids,
            prompt_logprobs=None, finished=True, metrics=RequestMetrics(),
            outputs=[CompletionOutput(index=0, text=sub.text, token_ids=tokens, logprobs=None,
                                      finish_reason="abort")])

    # -- handlers -----------------------------------------------------------------------------

    def submit(self, request: pb.GenerateRequest, deadline: float | None) -> _Submission:
        """Validates and admits a request (handler side); raises RpcError to refuse it."""
        with self._lock:
            if self._draining or self._stopped.is_set():
                self.metrics.observe_rejected("draining")
                raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on "
                               "another replica")
        try:
            prompt_ids, prompt_text = self._prompt(request)
            params = self._sampling_params(request.sampling)
            request_id = _request_id(request.request_id)
        except RpcError:
            self.metrics.observe_rejected("invalid")
            raise
        sub = _Submission(request_id=request_id, prompt_ids=prompt_ids, prompt_text=prompt_text,
                          params=params, priority=request.priority, deadline=deadline)
        with self._lock:
            if request_id in self._inflight:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {request_id!r} is already in flight")
            c = self.config
            if self._queued_requests + 1 > c.max_queued_requests:
                self.metrics.observe_rejected("queue_full")
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the queue is full ({self._queued_requests} requests waiting, "
                               f"max_queued_requests={c.max_queued_requests}); retry later")
            if self._queued_tokens + len(prompt_ids) > c.max_queued_prompt_tokens:
                self.metrics.observe_rejected("queue_full")
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the queue is full ({self._queued_tokens} prompt tokens waiting, "
                               f"max_queued_prompt_tokens={c.max_queued_prompt_tokens}); retry "
                               f"later")
            self._queued_requests += 1
            self._queued_tokens += len(prompt_ids)
            self._inflight[request_id] = sub
        self._commands.put(("add", sub))
        return sub

    def cancel(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def is_inflight(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._inflight

    def _sampling_params(self, message: pb.SamplingParams) -> SamplingParams:
        params = _sampling_params(message)
        try:
            self.engine.check_params(params)
        except ValueError as err:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {err}") from None
        return params

    def _prompt(self, request: pb.GenerateRequest) -> tuple[list[int], str | None]:
        kind = request.WhichOneof("prompt")
        limit = self._max_prompt_tokens()
        try:
            ids, text = self._prompt_ids(request, kind, limit)
        except ValueError as err:  # the tokenizer's or the chat template's refusal
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.{kind}: {err}") from None
        if not ids:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.{kind}: the prompt is empty")
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt.token_ids: {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) > limit:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt.{kind}: {len(ids)} tokens exceed the max prompt length of "
                           f"{limit}; shorten it (it is never truncated)")
        return ids, text

    def _max_prompt_tokens(self) -> int:
        limit = self.engine.config.max_model_len - 1
        if self.config.max_prompt_tokens is not None:
            limit = min(limit, self.config.max_prompt_tokens)
        return min(limit, self.config.max_queued_prompt_tokens)  # more could never be admitted

    def _prompt_ids(self, request: pb.GenerateRequest, kind: str | None,
                    limit: int) -> tuple[list[int], str | None]:
        """The prompt's token ids and text. A text too long to fit in `limit` tokens is refused
        by its length, before the tokenizer spends time on it."""
        tokenizer = self.engine.tokenizer
        if kind is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "prompt: set one of text, token_ids or chat")
        if kind in ("text", "chat") and tokenizer is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt.{kind}: this model has no tokenizer; send token_ids")
        if kind == "token_ids":
            return list(request.token_ids.ids), None
        if kind == "text":
            _check_text_fits(len(request.text), limit, tokenizer.max_token_chars)
            return tokenizer.encode(request.text, add_special_tokens=True), request.text
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise ValueError("no messages")
        _check_text_fits(sum(len(m.content) for m in request.chat.messages), limit,
                         tokenizer.max_token_chars)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=True), text

    def server_info(self) -> pb.ServerInfo:
        engine = self.engine
        return pb.ServerInfo(model=engine.model_config.name, mesh=engine.config.mesh,
                             max_model_len=engine.config.max_model_len, load=self._load,
                             version=_version(), vocab_size=engine.model_config.vocab_size,
                             warmup_programs=engine.stats.warmup_compiles,
                             warmup_seconds=engine.stats.warmup_seconds,
                             attention=engine.runner.attention)

    def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    def _build_grpc_server(self) -> grpc.Server:
        c = self.config
        options = [("grpc.max_receive_message_length", c.max_message_bytes),
                   ("grpc.max_send_message_length", c.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [_ParseInterceptor(self.metrics)]
        if self._api_key:
            interceptors.append(_ApiKeyInterceptor(self._api_key, self.metrics))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=c.max_concurrent_streams,
                                                        thread_name_prefix="rpc"),
                             options=options, interceptors=interceptors,
                             maximum_concurrent_rpcs=c.max_concurrent_streams)
        pb_grpc.add_GenerationServicer_to_server(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        return server


class _Servicer(pb_grpc.GenerationServicer):
    def __init__(self, server: GenerationServer):
        self.server = server

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateResponse]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            sub = self.server.submit(request, deadline)
        except RpcError as err:
            context.abort(err.code, err.message)
        context.add_callback(lambda: self._on_done(sub.request_id))
        if not context.is_active():  # it went away before the callback was in place
            self._on_done(sub.request_id)
        while True:
            item = sub.outputs.get()
            if isinstance(item, _Failed):
                context.abort(item.code, item.message)
            if isinstance(item, _Delta):
                yield pb.GenerateResponse(request_id=sub.request_id,
                                          chunk=_chunk(item, sub.params.logprobs))
                continue
            yield pb.GenerateResponse(request_id=sub.request_id,
                                      final=_final(item.output, sub.params))
            return

    def _on_done(self, request_id: str) -> None:
        """The RPC ended (finished, cancelled, disconnected or past its deadline)."""
        if self.server.is_inflight(request_id):
            self.server.cancel(request_id)

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        is_inflight = self.server.is_inflight(request.request_id)
        if is_inflight:
            self.server.cancel(request.request_id)
        return pb.AbortResponse(aborted=is_inflight)

    def GetServerInfo(self, request, context) -> pb.ServerInfo:
        return self.server.server_info()


class _ApiKeyInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <key>` on the Generation service (health and reflection
    stay open, so load balancers and grpcurl's discovery work)."""

    def __init__(self, api_key: str, metrics: ServerMetrics):
        self._expected = f"Bearer {api_key}"
        self._metrics = metrics

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong api key: send metadata 'authorization: Bearer <key>'")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return continuation(handler_call_details)
        metadata_ = dict(handler_call_details.invocation_metadata or ())
        if _constant_time_equal(metadata_.get("authorization", ""), self._expected):
            return continuation(handler_call_details)
        self._metrics.observe_rejected("unauthenticated")
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._deny, request_deserializer=handler.request_deserializer)
        return grpc.unary_unary_rpc_method_handler(
            self._deny, request_deserializer=None if handler is None
            else handler.request_deserializer)


class _Unparsed:
    """What a request that does not parse deserializes to, so its handler can refuse it."""

    def __init__(self, reason: str):
        self.reason = reason


class _ParseInterceptor(grpc.ServerInterceptor):
    """A unary request that does not parse (a string field with bad UTF-8, cut-off bytes) is the
    client's error: INVALID_ARGUMENT with protobuf's reason, where gRPC would answer INTERNAL."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError as err:
                return _Unparsed(f"{method}: the request message does not parse: {err}")

        def refuse(request: _Unparsed, context) -> None:
            self._metrics.observe_rejected("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

        if handler.response_streaming:
            def stream(request, context):
                if isinstance(request, _Unparsed):
                    refuse(request, context)
                yield from handler.unary_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=deserialize,
                response_serializer=handler.response_serializer)

        def unary(request, context):
            if isinstance(request, _Unparsed):
                refuse(request, context)
            return handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserialize,
            response_serializer=handler.response_serializer)


def _request_id(given: str) -> str:
    """The caller's id, checked (it is echoed in every message), or a fresh one."""
    if not given:
        return f"req-{uuid.uuid4().hex[:12]}"
    try:
        check_request_id(given)
    except ValueError as err:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
    return given


def _check_text_fits(num_chars: int, limit: int, max_token_chars: int) -> None:
    if num_chars > limit * max_token_chars:
        raise ValueError(f"{num_chars} characters cannot fit in the max prompt length of {limit} "
                         f"tokens (one token is at most {max_token_chars} characters); shorten it "
                         f"(it is never truncated)")


def _constant_time_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _sampling_params(message: pb.SamplingParams) -> SamplingParams:
    values: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(message, name)
        try:
            if message.HasField(name):
                values[name] = value
        except ValueError:  # a repeated field has no presence: empty means unset
            if value:
                values[name] = tuple(value)
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as err:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {err}") from None


def _chunk(delta: _Delta, num_top: int | None) -> pb.Chunk:
    chunk = pb.Chunk(token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs is not None:
        chunk.logprobs.extend(_logprobs(token, entry, num_top)
                              for token, entry in zip(delta.token_ids, delta.logprobs))
    return chunk


def _logprobs(token: int, entry: dict, num_top: int | None) -> pb.Logprobs:
    """The chosen token's logprob and the `num_top` most likely, by rank."""
    top = sorted(((t, lp) for t, lp in entry.items()
                  if lp.rank is not None and lp.rank <= (num_top or 0)),
                 key=lambda item: item[1].rank)
    return pb.Logprobs(chosen=_token_logprob(token, entry[token]),
                       top=[_token_logprob(t, lp) for t, lp in top])


def _token_logprob(token: int, lp) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token, logprob=lp.logprob, rank=lp.rank or 0,
                           text=lp.decoded_token or "")


def _final(output: RequestOutput, params: SamplingParams) -> pb.Final:
    completion = output.outputs[0]
    stop = completion.stop_reason
    prompt = [_logprobs(token, entry, params.prompt_logprobs)
              for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
              if entry is not None] if output.prompt_logprobs else []
    return pb.Final(finish_reason=completion.finish_reason or "", prompt_logprobs=prompt,
                    stop_reason="" if stop is None else str(stop),
                    text=completion.text,
                    usage=pb.Usage(prompt_tokens=len(output.prompt_token_ids),
                                   completion_tokens=len(completion.token_ids),
                                   cached_tokens=output.num_cached_tokens))


def _version() -> str:
    try:
        return metadata.version("meshserve")
    except metadata.PackageNotFoundError:
        return "unknown"
