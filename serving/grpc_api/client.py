"""Python clients of the gRPC server (`meshserve.v1.Generation`): `Client` and `AsyncClient`.

    with Client("127.0.0.1:50051") as client:
        completion = client.generate([{"role": "user", "content": "Hi!"}],
                                     SamplingParams(max_tokens=32, temperature=0))
        for item in client.stream("Once upon a time", {"max_tokens": 64}):
            print(item.text, end="")  # StreamChunks, then the Completion (its text is whole)

    async with AsyncClient("127.0.0.1:50051") as client:
        completions = await asyncio.gather(*(client.generate(p) for p in prompts))

Both clients have the same methods: `AsyncClient`'s are coroutines, and its `stream` is an async
iterator. A prompt is a `str` (text, tokenized by the server), a list of ints (token ids), or a
list of `{"role", "content"}` dicts (a chat, rendered by the server with the model's template).

Sampling: `params` is a `SamplingParams` or a dict of its fields; None means `SamplingParams()`.
It is built and validated here, so an invalid value raises the same `ValueError` the server's
would, before any RPC, and every field is sent explicitly: the defaults are the client's
`SamplingParams` defaults, which are the server's. Prompt logprobs come in the Completion.

Results are frozen dataclasses. Logprobs have the offline API's shape
(`CompletionOutput.logprobs`): one `{token_id: Logprob}` dict per output token, holding the
chosen token and the top alternatives; `Logprob.rank` is None where the server reports rank 0
(outside the computed top-K) and `Logprob.decoded_token` is None where it sends no text.

Errors: a failed RPC raises `ClientError`, which keeps the gRPC status code (`.code`, a
`grpc.StatusCode`) and the server's message (`.message`); the codes are the ones the proto
lists. Bad arguments raise `ValueError` (or `TypeError` for a wrong type) before any RPC.

The api key goes in `authorization: Bearer <key>` metadata on every call; without TLS it
travels in plain text. This module imports no jax.
"""

from __future__ import annotations

import asyncio
import dataclasses
import numbers
import os
from typing import Any, Iterator, Mapping, Sequence, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.structured_messages import structured_message
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine.outputs import Logprob

DEFAULT_TARGET = "127.0.0.1:50051"
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

Prompt = Union[str, Sequence[int], Sequence[Mapping[str, str]]]
Params = Union[SamplingParams, Mapping[str, Any], None]


class ClientError(Exception):
    """A failed RPC. `code` is its `grpc.StatusCode`, `message` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> ClientError:
        code = err.code() if callable(getattr(err, "code", None)) else None
        details = err.details() if callable(getattr(err, "details", None)) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


# -- results -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """New output since the previous chunk. `logprobs` has one entry per new token, or is None
    when the request asked for none. Text a stop string might still cut is held back by the
    server, so `text` can lag `token_ids` and come out in a later chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request. `token_ids` and `logprobs` are all the chunks' joined; `text` is the
    server's whole output text (stop string cut), which the chunks' texts add up to, aborts
    included. `finish_reason` is "stop", "length", "abort" or "unsatisfiable"; `stop_reason` is
    the stop string or the stop token id (an int) that ended the request, why a structured
    output could not go on, or None (EOS, length, abort)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[dict[int, Logprob]] | None
    # With prompt_logprobs: None for the first prompt token, then one entry per token (vLLM's).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(frozen=True)
class Load:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used / total pages, 0..1


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    model: str  # the first served name
    mesh: str
    max_model_len: int
    version: str
    vocab_size: int
    load: Load
    served_model_names: tuple[str, ...] = ()
    root: str = ""  # the model's own name
    lora_names: tuple[str, ...] = ()  # the served LoRA adapters, for `lora_name=`

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- requests ------------------------------------------------------------------------------------

def as_sampling_params(params: Params) -> SamplingParams:
    """`params` as a validated `SamplingParams`: None is the defaults, a dict names fields.

    Raises ValueError with `SamplingParams`' own message for a bad value, and for unknown names.
    """
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a SamplingParams or a dict of its fields, got "
                        f"{type(params).__name__}")
    unknown = sorted(set(params) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"unknown SamplingParams fields {unknown}; known: {_SAMPLING_FIELDS}")
    return SamplingParams(**params)


def sampling_message(params: SamplingParams) -> pb.SamplingParams:
    """The proto form of `params`, every field set explicitly (None fields stay unset, which
    the server reads as None too)."""
    message = pb.SamplingParams()
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is None:
            continue
        if name == "structured":
            message.structured.CopyFrom(structured_message(value))
        elif isinstance(value, tuple):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def generate_request(prompt: Prompt, params: SamplingParams, *, request_id: str | None = None,
                     priority: int = 0, lora_name: str | None = None) -> pb.GenerateRequest:
    """The `GenerateRequest` for a text, token-id or chat prompt; `lora_name` runs it with one
    of the server's LoRA adapters (`ServerInfo.lora_names`).

    Raises ValueError (or TypeError) for a prompt of none of the three forms. What only the
    server can judge (an empty prompt, an id outside the vocabulary, a missing tokenizer, the
    length) is left to it: it answers INVALID_ARGUMENT.
    """
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if request_id is not None and not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if lora_name is not None and not isinstance(lora_name, str):
        raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}")
    request = pb.GenerateRequest(request_id=request_id or "", sampling=sampling_message(params),
                                 priority=int(priority), lora_name=lora_name or "")
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a str, a list of token ids or a list of chat messages, "
                        f"got {type(prompt).__name__}")
    elif all(isinstance(m, Mapping) for m in prompt) and prompt:
        request.chat.messages.extend(_chat_message(m, i) for i, m in enumerate(prompt))
    elif all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        request.token_ids.SetInParent()  # set even when empty: the server refuses that
        request.token_ids.ids.extend(int(t) for t in prompt)
    else:
        raise ValueError("prompt: a list must hold only token ids (ints) or only chat messages "
                         "({'role', 'content'} dicts)")
    return request


def _chat_message(message: Mapping[str, str], index: int) -> pb.ChatMessage:
    if set(message) != {"role", "content"}:
        raise ValueError(f"prompt[{index}]: a chat message has exactly the keys 'role' and "
                         f"'content', got {sorted(message)}")
    if not all(isinstance(message[k], str) for k in ("role", "content")):
        raise ValueError(f"prompt[{index}]: role and content must be strings")
    return pb.ChatMessage(role=message["role"], content=message["content"])


def _credentials(tls: bool, tls_root_cert: str | os.PathLike | bytes | None
                 ) -> grpc.ChannelCredentials | None:
    if tls_root_cert is None:
        return grpc.ssl_channel_credentials() if tls else None
    if isinstance(tls_root_cert, (bytes, bytearray)):
        root = bytes(tls_root_cert)
    else:
        with open(tls_root_cert, "rb") as file:
            root = file.read()
    return grpc.ssl_channel_credentials(root_certificates=root)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _health_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _server_info(message: pb.ServerInfo) -> ServerInfo:
    load = message.load
    return ServerInfo(model=message.model, mesh=message.mesh, max_model_len=message.max_model_len,
                      version=message.version, vocab_size=message.vocab_size,
                      load=Load(num_running=load.num_running, num_waiting=load.num_waiting,
                                kv_cache_usage=load.kv_cache_usage),
                      served_model_names=tuple(message.served_model_names), root=message.root,
                      lora_names=tuple(message.lora_names))


# -- responses -----------------------------------------------------------------------------------

def _logprob(message: pb.TokenLogprob) -> Logprob:
    return Logprob(logprob=message.logprob, rank=message.rank or None,
                   decoded_token=message.text or None)


def _logprob_entry(message: pb.Logprobs) -> dict[int, Logprob]:
    entry = {message.chosen.token_id: _logprob(message.chosen)}
    for alternative in message.top:
        entry.setdefault(alternative.token_id, _logprob(alternative))
    return entry


class _Collector:
    """Turns one request's `GenerateResponse`s into StreamChunks and the Completion."""

    def __init__(self, params: SamplingParams, request_id: str | None):
        self.params = params
        self.request_id = request_id or ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if params.logprobs is not None else None)
        self.completion: Completion | None = None

    def add(self, response: pb.GenerateResponse) -> StreamChunk | Completion:
        if self.completion is not None:
            raise ClientError(grpc.StatusCode.INTERNAL, "the server sent a message after the "
                              "final one")
        self.request_id = response.request_id or self.request_id
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            return self._chunk(response.chunk)
        if kind == "final":
            return self._final(response.final)
        raise ClientError(grpc.StatusCode.INTERNAL, "the server sent a response with neither a "
                          "chunk nor a final")

    def _chunk(self, message: pb.Chunk) -> StreamChunk:
        token_ids = list(message.token_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = [_logprob_entry(m) for m in message.logprobs]
            self.logprobs.extend(logprobs)
        self.token_ids.extend(token_ids)
        return StreamChunk(request_id=self.request_id, token_ids=token_ids, text=message.text,
                           logprobs=logprobs)

    def _final(self, message: pb.Final) -> Completion:
        usage = message.usage
        self.completion = Completion(
            request_id=self.request_id, text=message.text, token_ids=list(self.token_ids),
            finish_reason=message.finish_reason, stop_reason=self._stop_reason(message),
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=None if self.params.prompt_logprobs is None else
            [None] + [_logprob_entry(m) for m in message.prompt_logprobs])
        return self.completion

    def _stop_reason(self, message: pb.Final) -> int | str | None:
        """The proto's string back as the offline API's value: a stop token id is an int (a
        decimal that names one of the request's stop tokens and none of its stop strings)."""
        reason = message.stop_reason
        if not reason:
            return None
        if (reason.isdecimal() and int(reason) in self.params.stop_token_ids
                and reason not in self.params.stop):
            return int(reason)
        return reason


# -- the sync client -----------------------------------------------------------------------------

class _CollectedStream:
    """What both streams expose of their collector."""

    _collector: _Collector

    @property
    def request_id(self) -> str:
        """The request's id: the one given, or the server's once the first message is in."""
        return self._collector.request_id

    @property
    def completion(self) -> Completion | None:
        """The Completion, once the iteration has reached it."""
        return self._collector.completion


class Stream(_CollectedStream):
    """One streaming Generate call, already sent. Iterating yields `StreamChunk`s as tokens
    arrive, then one `Completion`, then stops. A failed RPC raises `ClientError` from the
    iteration. `cancel()` (or leaving a `with` block early) ends the call; the server then
    aborts the request and frees its pages, and the iteration raises CANCELLED."""

    def __init__(self, call, collector: _Collector):
        self._call, self._collector = call, collector
        self._done = False

    def __iter__(self) -> Iterator[StreamChunk | Completion]:
        return self

    def __next__(self) -> StreamChunk | Completion:
        if self._done:
            raise StopIteration
        try:
            response = next(self._call)
        except StopIteration:
            self._done = True
            raise ClientError(grpc.StatusCode.INTERNAL,
                              "the stream ended without a final message") from None
        except grpc.RpcError as err:
            self._done = True
            raise ClientError.from_rpc_error(err) from None
        item = self._collector.add(response)
        self._done = isinstance(item, Completion)
        return item

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        if self._collector.completion is None:
            self.cancel()


class Client:
    """A blocking client over one gRPC channel; safe to share between threads.

    `target` is "host:port" (any gRPC target). `api_key` is sent as `authorization: Bearer`.
    `tls_root_cert` (a PEM path or its bytes) makes the channel TLS, trusting that certificate;
    `tls=True` alone trusts the system's roots. `timeout` (seconds) is every call's default
    deadline; for `stream` and `generate` it covers the whole stream. None: no deadline.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None,
                 tls_root_cert: str | os.PathLike | bytes | None = None, tls: bool = False,
                 timeout: float | None = None):
        credentials = _credentials(tls, tls_root_cert)
        self.target, self.timeout = target, timeout
        self._metadata = _metadata(api_key)
        self._channel = (grpc.insecure_channel(target) if credentials is None
                         else grpc.secure_channel(target, credentials))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
                 priority: int = 0, lora_name: str | None = None,
                 timeout: float | None = None) -> Completion:
        """Runs one request to its end and returns its Completion (finish_reason "abort" if it
        was aborted). Raises ValueError before any RPC for bad params or prompt, ClientError
        for a failed RPC."""
        with self.stream(prompt, params, request_id=request_id, priority=priority,
                         lora_name=lora_name, timeout=timeout) as items:
            for item in items:
                if isinstance(item, Completion):
                    return item
        raise AssertionError("unreachable: a Stream ends with a Completion or raises")

    def stream(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
               priority: int = 0, lora_name: str | None = None,
               timeout: float | None = None) -> Stream:
        """Sends one request and returns its `Stream`: StreamChunks, then the Completion.
        Raises ValueError before any RPC for bad params or prompt."""
        sampling = as_sampling_params(params)
        request = generate_request(prompt, sampling, request_id=request_id, priority=priority,
                                   lora_name=lora_name)
        call = self._stub.Generate(request, timeout=self._timeout(timeout),
                                   metadata=self._metadata)
        return Stream(call, _Collector(sampling, request_id))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Aborts an in-flight request; its stream ends with finish_reason "abort". False when
        no such request is in flight."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id),
                           timeout).aborted

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """The model, mesh, limits, version and current load."""
        return _server_info(self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(),
                                        timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status: "SERVING" or "NOT_SERVING" ("" is the whole server; the
        service "meshserve.v1.Generation" reads the same). An unreachable server raises
        ClientError(UNAVAILABLE)."""
        return _health_name(self._unary(self._health.Check,
                                        health_pb2.HealthCheckRequest(service=service), timeout))

    def close(self) -> None:
        """Closes the channel; calls still running end with CANCELLED."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from None


# -- the async client ----------------------------------------------------------------------------

class AsyncStream(_CollectedStream):
    """One streaming Generate call on `AsyncClient`: `async for` yields StreamChunks, then the
    Completion. As `Stream`, but the call is sent when the iteration starts."""

    def __init__(self, start, collector: _Collector):
        self._start, self._collector = start, collector
        self._call = None
        self._done = False
        self._cancelled = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamChunk | Completion:
        if self._done:
            raise StopAsyncIteration
        if self._cancelled:
            self._done = True
            raise ClientError(grpc.StatusCode.CANCELLED, "the call was cancelled")
        if self._call is None:
            self._call = await self._start()
        response = await self._read()
        if response is grpc.aio.EOF:
            self._done = True
            raise ClientError(grpc.StatusCode.INTERNAL,
                              "the stream ended without a final message")
        item = self._collector.add(response)
        self._done = isinstance(item, Completion)
        return item

    async def _read(self):
        try:
            return await self._call.read()
        except grpc.RpcError as err:
            self._done = True
            raise ClientError.from_rpc_error(err) from None
        except asyncio.CancelledError:
            if not self._cancelled:
                raise  # the caller's task was cancelled: that propagates as it is
            self._done = True
            raise ClientError(grpc.StatusCode.CANCELLED, "the call was cancelled") from None

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._collector.completion is None:
            self.cancel()


class AsyncClient:
    """`Client` on `grpc.aio`: the same arguments and methods, as coroutines, and `stream`
    returns an async iterator. The channel is made on the first call, on the running event
    loop; use one AsyncClient within one loop. Concurrent calls (asyncio.gather) share it."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None,
                 tls_root_cert: str | os.PathLike | bytes | None = None, tls: bool = False,
                 timeout: float | None = None):
        self._credentials = _credentials(tls, tls_root_cert)
        self.target, self.timeout = target, timeout
        self._metadata = _metadata(api_key)
        self._channel: grpc.aio.Channel | None = None
        self._stub = self._health = None

    async def generate(self, prompt: Prompt, params: Params = None, *,
                       request_id: str | None = None, priority: int = 0,
                       lora_name: str | None = None, timeout: float | None = None
                       ) -> Completion:
        """As `Client.generate`."""
        async with self.stream(prompt, params, request_id=request_id, priority=priority,
                               lora_name=lora_name, timeout=timeout) as items:
            async for item in items:
                if isinstance(item, Completion):
                    return item
        raise AssertionError("unreachable: a Stream ends with a Completion or raises")

    def stream(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
               priority: int = 0, lora_name: str | None = None,
               timeout: float | None = None) -> AsyncStream:
        """As `Client.stream`; validation (ValueError) happens here, at once, and the request
        is sent when the iteration starts."""
        sampling = as_sampling_params(params)
        request = generate_request(prompt, sampling, request_id=request_id, priority=priority,
                                   lora_name=lora_name)

        async def start():
            stub = self._stubs()[0]
            return stub.Generate(request, timeout=self._timeout(timeout), metadata=self._metadata)

        return AsyncStream(start, _Collector(sampling, request_id))

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """As `Client.abort`."""
        response = await self._unary(self._stubs()[0].Abort,
                                     pb.AbortRequest(request_id=request_id), timeout)
        return response.aborted

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """As `Client.server_info`."""
        return _server_info(await self._unary(self._stubs()[0].GetServerInfo,
                                              pb.GetServerInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """As `Client.health`."""
        return _health_name(await self._unary(self._stubs()[1].Check,
                                              health_pb2.HealthCheckRequest(service=service),
                                              timeout))

    async def close(self) -> None:
        """Closes the channel; calls still running end with CANCELLED."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _stubs(self):
        if self._channel is None:
            self._channel = (grpc.aio.insecure_channel(self.target) if self._credentials is None
                             else grpc.aio.secure_channel(self.target, self._credentials))
            self._stub = pb_grpc.GenerationStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub, self._health

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from None
