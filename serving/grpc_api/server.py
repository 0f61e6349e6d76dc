"""The gRPC server: `meshserve.v1.Generation`, plus standard health and reflection.

The engine loop (`meshserve.serving.engine.loop`) owns the Engine on its one thread; this module is
a front end on it, like the OpenAI-compatible HTTP app (`meshserve.serving.http_api.app`, started
here with `http_port`, on the same loop):

    RPC handler threads (grpc's pool)         engine loop (`EngineLoop`)
    ---------------------------------         --------------------------
    check auth, parse; `admission.admit`:
      every request check, tokenizing
    EngineLoop.submit: queue counters ->      takes the add, runs engine.step(),
      maybe RESOURCE_EXHAUSTED at once          puts each request's Deltas on its queue
    read own `outputs` queue      <---------    then Finished (or Failed)
    on cancel / disconnect / deadline:
      EngineLoop.cancel           --------->    aborts at the next step
    yield GenerateResponse

A cancelled or disconnected stream, or one past its deadline, is aborted at the start of the next
engine step, and its pages are free after it. The loop's refusal and failure kinds map to status
codes in `_CODES`.

With `--enable-lora`, the LoRA adapters served by name (`--lora-modules`,
`meshserve.serving.engine.served_adapters`) are shared with the HTTP front end: a request's
`lora_name` selects one (NOT_FOUND if none is served under it), and `GetServerInfo` lists them.

Admission is bounded by queued requests and by queued prompt tokens. A request counts as queued
from submission until the engine first schedules it, or until it ends. Past either bound the RPC
fails at once with RESOURCE_EXHAUSTED, never a hang. A request still waiting after
`max_queue_time` fails with DEADLINE_EXCEEDED.

Failure: an exception in the engine loop sets health to NOT_SERVING, fails every open stream
with INTERNAL, and stops the server. `wait()` then returns False, so `meshserve serve` exits
non-zero. A half-alive server is never kept.

Multi-process (`meshserve.serving.engine.multihost`): when a peer process is lost, `peer_lost` sets
NOT_SERVING and fails every open stream with UNAVAILABLE, naming the lost process; then the
process exits non-zero.

Drain (`drain()`, on SIGTERM): health goes NOT_SERVING, and new requests get UNAVAILABLE.
In-flight requests run on for up to `drain_timeout`; whatever is left is aborted. Then the server
stops, and `wait()` returns True.
"""

from __future__ import annotations

import dataclasses
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

from meshserve.batching.knobs import knob
from meshserve.batching.sampling import SamplingParams
from meshserve.serving.auth import bearer_matches
from meshserve.serving.grpc_api.structured_messages import structured_from_message
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine.admission import AdmissionError, Prompt
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.loop import Delta, EngineLoop, Failed, Limits, Refused, Submission
from meshserve.serving.engine.metrics import ServerMetrics
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.engine.served_adapters import (ServedAdapters, check_base_model_names,
                                                     parse_lora_modules)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # meshserve.v1.Generation
# A message of its own on the wire (`serving/grpc_api/structured_messages.py`):
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)
                    if f.name != "structured"]


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
    http_port: int | None = knob(None, "also serve the OpenAI-compatible HTTP API on this port "
                                       "(same host, api key and TLS); unset: gRPC only")
    served_model_name: tuple[str, ...] = knob(
        (), "the names the HTTP API serves the model under (responses carry the one asked for, "
            "else the first); unset: the --model value as given", nargs="+", metavar="NAME")
    max_header_bytes: int = knob(64 << 10, "largest HTTP request head (request line and "
                                           "headers); past it 431")
    allowed_origins: tuple[str, ...] = knob(
        (), "browser origins that may call the HTTP API (CORS), * for any; unset: none",
        nargs="+", metavar="ORIGIN")
    allowed_methods: tuple[str, ...] = knob(("*",), "HTTP methods CORS allows those origins",
                                            nargs="+", metavar="METHOD")
    allowed_headers: tuple[str, ...] = knob(("*",), "request headers CORS allows those origins",
                                            nargs="+", metavar="HEADER")
    allow_credentials: bool = knob(False, "CORS: let those origins send cookies and "
                                          "Authorization")
    lora_modules: tuple[str, ...] = knob(
        (), "with --enable-lora: LoRA adapters to serve, each name=path (a PEFT directory) or "
            "a JSON object {\"name\": ..., \"path\": ..., \"base_model_name\": ...}; a request "
            "names one as its model (HTTP) or lora_name (gRPC)", nargs="+",
        metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = knob(
        False, "with --enable-lora: serve POST /v1/load_lora_adapter and "
               "/v1/unload_lora_adapter")

    def __post_init__(self):
        for name in ("served_model_name", "allowed_origins", "allowed_methods",
                     "allowed_headers", "lora_modules"):
            self._check_names(name)
        parse_lora_modules(self.lora_modules)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_message_bytes",
                     "max_concurrent_streams", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_queue_time is not None and self.max_queue_time <= 0:
            raise ValueError(f"max_queue_time must be > 0, got {self.max_queue_time}")

    def _check_names(self, name: str) -> None:
        """A list field (a tuple; a list from the command line is taken) of non-empty strings."""
        value = getattr(self, name)
        value = (value,) if isinstance(value, str) else tuple(value)
        if not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{name} must hold non-empty strings, got {value!r}")
        object.__setattr__(self, name, value)

    def served_names(self, model_name: str) -> tuple[str, ...]:
        """The names the model is served under: `served_model_name`, else `model_name` (the
        model's own name; `meshserve serve` sets `served_model_name` to --model as given)."""
        return self.served_model_name or (model_name,)

    def resolved_api_key(self) -> str | None:
        if self.api_key_file is None:
            return self.api_key
        key = Path(self.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"api key file {self.api_key_file} is empty")
        return key

    def check_lora(self, enable_lora: bool) -> None:
        """The LoRA flags need an engine with `enable_lora`, and a module's `base_model_name`
        a name of `served_model_name` (when set; else the server checks it at start);
        ValueError naming them."""
        if enable_lora:
            if self.served_model_name:
                check_base_model_names(parse_lora_modules(self.lora_modules),
                                       self.served_model_name)
            return
        for name in ("lora_modules", "allow_runtime_lora_updating"):
            if getattr(self, name):
                raise ValueError(f"--{name.replace('_', '-')} needs --enable-lora (the engine "
                                 "then holds the adapters' slots)")

    def limits(self) -> Limits:
        return Limits(max_queued_requests=self.max_queued_requests,
                      max_queued_prompt_tokens=self.max_queued_prompt_tokens,
                      max_queue_time=self.max_queue_time, max_prompt_tokens=self.max_prompt_tokens)


class RpcError(Exception):
    """A failure that ends one RPC with `code` and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
          "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "draining": grpc.StatusCode.UNAVAILABLE, "unavailable": grpc.StatusCode.UNAVAILABLE,
          "deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "internal": grpc.StatusCode.INTERNAL}


def _rpc_error(refused: Refused) -> RpcError:
    return RpcError(_CODES[refused.kind], refused.message)


class GenerationServer:
    """The process's server: the engine loop (`meshserve.serving.engine.loop`), the gRPC front end,
    and with `http_port` the OpenAI-compatible HTTP front end (`meshserve.serving.http_api.app`) on
    the same loop."""

    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig(), *,
                 metrics: ServerMetrics | None = None):
        config.check_lora(engine.adapters is not None)
        self.engine, self.config = engine, config
        self.metrics = metrics or ServerMetrics(engine.model_config.name)
        self._api_key = config.resolved_api_key()
        self.loop = EngineLoop(engine, config.limits(), metrics=self.metrics)
        self.loop.on_state(self._on_state)
        # The LoRA adapters served by name (`serving/engine/served_adapters.py`), read now.
        self.adapters = None if engine.adapters is None else ServedAdapters.start(
            self.loop, config.served_names(engine.model_config.name),
            parse_lora_modules(config.lora_modules))
        self._health = health.HealthServicer()
        self._grpc = self._build_grpc_server()
        self.http = None  # the HTTP front end, with http_port
        self.port: int | None = None
        self.http_port: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> int:
        """Binds, starts serving and the engine loop; returns the bound gRPC port."""
        self.loop.start()
        try:
            return self._start()
        except BaseException:
            self.loop.stop()
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
        self._grpc.start()
        if self.config.http_port is not None:
            from meshserve.serving.http_api.app import HttpServer  # only when asked: fastapi

            self.http = HttpServer(self.loop, self.config, api_key=self._api_key,
                                   adapters=self.adapters)
            self.http_port = self.http.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.start_http_server(self.config.metrics_port,
                                                               self.config.host)
        self.loop.serving()
        return self.port

    def drain(self, timeout: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish (up to `timeout`), then stops."""
        self.loop.drain(self.config.drain_timeout if timeout is None else timeout)
        self.stop()

    def stop(self, grace: float = 1.0) -> None:
        """Aborts what is left and stops the engine loop and the front ends."""
        self.loop.stop()
        self._grpc.stop(grace).wait()
        if self.http is not None:
            self.http.stop()
        if self.config.metrics_port is not None:
            self.metrics.stop_http_server()

    def peer_lost(self, error: BaseException) -> None:
        """A process of a multi-process job is gone: NOT_SERVING at once, and every open stream
        fails with UNAVAILABLE and the account of what was lost. The process exits next."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.loop.fail_all("unavailable", str(error))

    def wait(self) -> bool:
        """Blocks until the server stops; True for a clean stop, False after an engine failure."""
        is_clean = self.loop.wait()
        self._grpc.wait_for_termination()
        if self.http is not None:
            self.http.wait()
        return is_clean

    def _on_state(self, state: str) -> None:
        self._set_health(health_pb2.HealthCheckResponse.SERVING if state == "serving"
                         else health_pb2.HealthCheckResponse.NOT_SERVING)
        if state == "failed":  # the loop thread: take the front ends down, never half-alive
            threading.Thread(target=self._stop_front_ends, daemon=True).start()

    def _stop_front_ends(self) -> None:
        # Every open request already holds its failure: the grace lets handlers send it, where
        # stop(0) would cancel them first
        self._grpc.stop(1.0)
        if self.http is not None:
            self.http.stop()

    @property
    def _inflight(self) -> int:
        return self.loop.num_inflight()

    # -- handlers -----------------------------------------------------------------------------

    def submit(self, request: pb.GenerateRequest, deadline: float | None) -> Submission:
        """Checks (`EngineLoop.admission`) and queues a request (handler side); raises RpcError
        to refuse it."""
        try:
            self.loop.check_open()
        except Refused as refused:
            raise _rpc_error(refused) from None
        try:
            lora_request = self._lora_request(request.lora_name)
            admitted = self.loop.admission.admit(
                _prompt(request), _sampling_params(request.sampling),
                request_id=request.request_id or f"req-{uuid.uuid4().hex[:12]}")
        except AdmissionError as err:
            self.metrics.observe_rejected("invalid")
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, _refusal(err)) from None
        except RpcError:
            self.metrics.observe_rejected("invalid")
            raise
        try:
            return self.loop.submit(dataclasses.replace(admitted, lora_request=lora_request),
                                    priority=request.priority, deadline=deadline)
        except Refused as refused:
            raise _rpc_error(refused) from None

    def _lora_request(self, name: str):
        """The adapter served as `name` (None for ""); RpcError NOT_FOUND if none is."""
        if not name:
            return None
        lora_request = None if self.adapters is None else self.adapters.get(name)
        if lora_request is None:
            served = [r.lora_name for r in self.adapters.requests()] if self.adapters else []
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"lora_name: no LoRA adapter is served as {name!r}; "
                           + (f"served: {', '.join(served)}" if served else
                              "this server serves none (--enable-lora --lora-modules)"))
        return lora_request

    def cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)

    def is_inflight(self, request_id: str) -> bool:
        return self.loop.is_inflight(request_id)

    def server_info(self) -> pb.ServerInfo:
        engine, load = self.engine, self.loop.load
        names = self.config.served_names(engine.model_config.name)
        return pb.ServerInfo(model=names[0], served_model_names=names,
                             root=engine.model_config.name, mesh=engine.config.mesh,
                             max_model_len=engine.config.max_model_len,
                             load=pb.Load(num_running=load.num_running,
                                          num_waiting=load.num_waiting,
                                          kv_cache_usage=load.kv_cache_usage),
                             version=_version(), vocab_size=engine.model_config.vocab_size,
                             warmup_programs=engine.stats.warmup_compiles,
                             warmup_seconds=engine.stats.warmup_seconds,
                             attention=engine.runner.attention,
                             lora_names=[r.lora_name for r in self.adapters.requests()]
                             if self.adapters is not None else [])

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
            if isinstance(item, Failed):
                context.abort(_CODES[item.kind], item.message)
            if isinstance(item, Delta):
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
    """Requires `authorization: Bearer <key>` on the Generation service, the scheme in any case
    (health and reflection stay open, so load balancers and grpcurl's discovery work)."""

    def __init__(self, api_key: str, metrics: ServerMetrics):
        self._api_key = api_key
        self._metrics = metrics

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong api key: send metadata 'authorization: Bearer <key>'")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return continuation(handler_call_details)
        metadata_ = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata_.get("authorization"), self._api_key):
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


def _prompt(request: pb.GenerateRequest) -> Prompt:
    """The request's prompt, named `prompt.<kind>` in refusals."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       "prompt: set one of text, token_ids or chat")
    if kind == "token_ids":
        value = list(request.token_ids.ids)
    elif kind == "text":
        value = request.text
    else:
        value = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return Prompt(kind, value, f"prompt.{kind}")


def _sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """The message's `SamplingParams` (the fields it sets; the rest keep their defaults), which
    checks its own values on construction; the engine's limits are the admission check's."""
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
        if message.HasField("structured"):
            values["structured"] = structured_from_message(message.structured)
        return SamplingParams(**values)
    except (ValueError, TypeError) as err:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {err}") from None


def _refusal(err: AdmissionError) -> str:
    """An admission refusal as the client reads it: a sampling field's under `sampling`."""
    return str(err) if err.param in ("prompt", "request_id") else f"sampling: {err}"


def _chunk(delta: Delta, num_top: int | None) -> pb.Chunk:
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
