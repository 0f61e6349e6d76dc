"""The OpenAI-compatible HTTP front end: FastAPI on uvicorn, on the same engine loop as gRPC.

`meshserve serve --http-port PORT` starts it beside the gRPC server (`GenerationServer` owns
both): one process, one `EngineLoop`, so both front ends share the engine, the admission bounds,
the drain and the metrics. Endpoints:

    GET  /v1/models             the served names (--served-model-name, or --model as given),
                                then the LoRA adapters (--lora-modules), each with its parent
    GET  /v1/models/{id}        one of them
    POST /v1/completions        a text or token-id prompt
    POST /v1/chat/completions   messages, through the tokenizer's chat template
    POST /v1/responses          OpenAI's Responses API: its input read as chat messages
                                (`meshserve.serving.openai_api.responses`), answered as a response
                                or its events (`meshserve.serving.http_api.render_responses`);
                                nothing is stored
    GET  /health                200 while serving; 503 while starting, draining or after a failure
    GET  /metrics               the Prometheus text (the same registry as --metrics-port)
    POST /v1/load_lora_adapter    with --allow-runtime-lora-updating: serve one more LoRA
    POST /v1/unload_lora_adapter  adapter, or stop serving one (`serving/http_api/lora_routes.py`)

A request's `model` may name a LoRA adapter the server serves (`--enable-lora --lora-modules`):
it then runs with that adapter, and its response names the adapter.

Structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`) and tool calls
(`tools`, `tool_choice`, `parallel_tool_calls`) are read by
`meshserve.serving.openai_api.structured_fields` into the request's constraint, knowing what the chat
template does with tools (`meshserve.serving.openai_api.tool_calls`, found once); tool calls come
back as a `tool_calls` message, or as OpenAI's tool-call deltas when streamed.

One request, in order, on uvicorn's event loop thread:
  1. read the body, counted as it arrives (413 past --max-message-bytes; a client that goes away
     meanwhile is one info line in the log);
  2. `parse_request` checks every field against the field table (`meshserve.serving.
     openai_api.fields`; the Responses API's, `parse_responses_request`, against its own): a
     field that is not served is a 400 naming it;
  3. `_accept` checks the model name and the structured-output fields, then hands the request to
     the engine's admission check (`EngineLoop.admission`: the prompt's tokens, the context, the
     sampling values and the engine's limits), whose refusal names the engine's field, which the
     request maps to its own (`OpenAIRequest.field_of`);
  4. only then `EngineLoop.submit`; the response is written from the accepted request alone.
So a refused request never reaches the engine. A stream is server-sent events in OpenAI's chunk
format (`meshserve.serving.http_api.render`), ending with `data: [DONE]`, or the Responses API's
events, ending with response.completed. A client that disconnects
has its request cancelled; the engine loop aborts it at its next step, which frees its pages.

Every answer on the port is OpenAI's error JSON, `{"error": {"message", "type", "param",
"code"}}`: bad input 400 naming the field, a wrong or missing key 401, an unknown model or route
404, a wrong method 405, a body over the limit 413, a full queue 429 with `Retry-After`, draining
503. The edge (`meshserve.serving.http_api.edge`) adds CORS, the api key and `x-request-id`, and
answers what never reaches the app (431 for a huge head, 503 past the connection cap) without
resetting the client. A failure after a stream began comes as one `data: {"error": ...}` event,
then `data: [DONE]` (the Responses API: one response.failed event).

This module must not touch the Engine: only the engine loop does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import http
import json
import logging
import socket
import threading
import time
import uuid
from importlib import metadata
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from meshserve.batching.adapters import LoRARequest
from meshserve.serving.engine.admission import Admitted, AdmissionError, Prompt, check_request_id
from meshserve.serving.engine.served_adapters import AdapterError, ServedAdapters
from meshserve.serving.http_api.lora_routes import (AdapterRoutes, adapter_card,
                                                 closed_route_message)
from meshserve.serving.http_api.edge import CorsPolicy, Edge, error_body, guarded_protocol
from meshserve.serving.http_api.render import Render
from meshserve.serving.http_api.render_responses import ResponsesRender
from meshserve.serving.engine.loop import Delta, EngineLoop, Failed, Refused, Submission
from meshserve.serving.openai_api.checks import RequestError
from meshserve.serving.openai_api.request_model import OpenAIRequest, decode_body, parse_request
from meshserve.serving.openai_api.responses import parse_responses_request
from meshserve.serving.openai_api.structured_fields import (FieldError, Structured, prompt_messages,
                                                     read_request)
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.openai_api.tool_calls import chat_tools

log = logging.getLogger(__name__)

_STATUS = {"invalid": 400, "duplicate": 409, "queue_full": 429, "draining": 503,
           "unavailable": 503, "deadline": 408, "internal": 500}
_DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there
_ID_PREFIXES = {"completions": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.is_counted = False  # already in the rejected-requests metric

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


class _ClientGone(Exception):
    """The client disconnected before its request was read: nobody to answer."""


def _from_refused(refused: Refused, param: str | None = None) -> ApiError:
    headers = ({"Retry-After": str(refused.retry_after)} if refused.retry_after is not None
               else None)
    return ApiError(_STATUS[refused.kind], refused.message, param=param or refused.param,
                    code=refused.kind if refused.kind != "invalid" else "invalid_value",
                    headers=headers)


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A request that passed every check, in the engine's terms; only these are submitted."""

    request: OpenAIRequest
    model: str  # the served name the response carries
    response_id: str
    echo_id: str  # the x-request-id answered
    admitted: Admitted  # in the engine's terms, its id unique in flight
    structured: Structured  # the constraint, and the tool calls the output makes


# -- the app --------------------------------------------------------------------------------------

def build_app(loop: EngineLoop, config, *, api_key: str | None = None,
              adapters: ServedAdapters | None = None):
    """The ASGI app on `loop`: the OpenAI API behind its edge (CORS, the api key, x-request-id).
    `config` is the server's config (`ServerConfig`): served names, body limit, CORS, the
    runtime LoRA routes; `adapters`, the LoRA adapters served by name (with `enable_lora`)."""
    app = FastAPI(title="meshserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(loop, config, adapters)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if err.status == 400 and not err.is_counted:
            loop.metrics.observe_rejected("invalid")
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        loop.metrics.observe_rejected("invalid")
        return JSONResponse(error_body(400, err.message, param=err.param, code=err.code),
                            status_code=400)

    @app.exception_handler(AdapterError)
    async def adapter_error(request: Request, err: AdapterError) -> JSONResponse:
        status = 404 if err.is_unknown else 400
        return JSONResponse(error_body(status, err.message, param=err.param,
                                       code="model_not_found" if err.is_unknown
                                       else "invalid_value"), status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(err.status_code, _route_message(request, err.status_code),
                                       code="not_found" if err.status_code == 404 else None),
                            status_code=err.status_code, headers=err.headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, err: _ClientGone) -> Response:
        return Response(status_code=499)  # never sent: the client is gone

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {err!r}", code="internal"),
                            status_code=500)

    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/responses")(api.responses)
    if adapters is not None and config.allow_runtime_lora_updating:
        routes = AdapterRoutes(adapters, api._read_body)
        app.post("/v1/load_lora_adapter")(routes.load)
        app.post("/v1/unload_lora_adapter")(routes.unload)
    cors = CorsPolicy(origins=tuple(config.allowed_origins),
                      methods=tuple(m.upper() for m in config.allowed_methods),
                      headers=tuple(config.allowed_headers),
                      allow_credentials=config.allow_credentials)
    return Edge(app, cors=cors, api_key=api_key,
                on_unauthorized=lambda: loop.metrics.observe_rejected("unauthenticated"))


def _route_message(request: Request, status: int) -> str:
    where = f"{request.method} {request.url.path}"
    closed = closed_route_message(request.url.path)
    if status == 404 and closed is not None:
        return closed
    if status == 404:
        return (f"no such route: {where}; the API is /v1/models, /v1/completions, "
                f"/v1/chat/completions and /v1/responses (and /health, /metrics)")
    if status == 405:
        return f"method not allowed: {where}"
    return f"{http.HTTPStatus(status).phrase}: {where}"


class _Api:
    def __init__(self, loop: EngineLoop, config, adapters: ServedAdapters | None = None):
        self.loop, self.engine, self.adapters = loop, loop.engine, adapters
        self.max_body_bytes = config.max_message_bytes
        self.names = config.served_names(loop.engine.model_config.name)
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(loop)
        self.chat_tools = chat_tools(loop.engine.tokenizer)

    async def health(self) -> JSONResponse:
        state = self.loop.state
        return JSONResponse({"status": state}, status_code=200 if state == "serving" else 503)

    async def metrics(self) -> Response:
        return Response(self.loop.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> JSONResponse:
        adapters = self.adapters.requests() if self.adapters is not None else []
        return JSONResponse({"object": "list", "data": [self._card(n) for n in self.names]
                             + [self._card(a.lora_name, a) for a in adapters]})

    async def model(self, model_id: str) -> JSONResponse:
        return JSONResponse(self._card(*self._served_model(model_id, param=None)))

    def _card(self, name: str, lora_request: LoRARequest | None = None) -> dict:
        max_model_len = self.engine.config.max_model_len
        if lora_request is not None:
            return adapter_card(lora_request, parent=self.adapters.parent(name),
                                created=self.created, max_model_len=max_model_len)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "meshserve",
                "root": self.engine.model_config.name, "parent": None,
                "max_model_len": max_model_len}

    def _served_model(self, given: str | None, *, param: str | None = "model"
                      ) -> tuple[str, LoRARequest | None]:
        """The served name asked for and its LoRA adapter (None: the base model), looked up
        once (an adapter unloaded meanwhile is unknown, never the base model)."""
        if given is None:
            return self.names[0], None
        if given in self.names:
            return given, None
        lora_request = self.adapters.get(given) if self.adapters is not None else None
        if lora_request is None:
            adapters = self.adapters.requests() if self.adapters is not None else []
            names = [*self.names, *(a.lora_name for a in adapters)]
            raise ApiError(404, f"the model {given!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in names)}", param=param,
                           code="model_not_found")
        return given, lora_request

    async def completions(self, request: Request):
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request):
        return await self._serve(request, "chat")

    async def responses(self, request: Request):
        return await self._serve(request, "responses")

    # -- one request --------------------------------------------------------------------------

    async def _serve(self, request: Request, endpoint: str):
        body = await self._read_body(request)
        # Parsing, the chat template, tokenizing and compiling a grammar (a second or more for a
        # large schema) run on a worker thread (asyncio's bounded default pool), so that they
        # never hold the event loop, and with it every other request's stream.
        accepted = await asyncio.to_thread(
            lambda: self._accept(_parse(body, endpoint), request.headers.get("x-request-id")))
        try:
            sub = self.loop.submit(accepted.admitted,
                                   priority=-accepted.request.priority)  # vLLM: lower first
        except Refused as refused:
            raise _from_refused(refused) from None
        render = self._render(accepted)
        headers = {"x-request-id": accepted.echo_id}
        if accepted.request.stream:
            return StreamingResponse(self._events(sub, render), media_type="text/event-stream",
                                     headers=headers | {"Cache-Control": "no-cache"})
        output = await self._collect(request, sub)
        if output is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(render.whole(output), headers=headers)

    async def _read_body(self, request: Request) -> dict:
        """The body's JSON object, counted as it arrives: a huge body is never held."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        size, chunks = 0, []
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
        except ClientDisconnect:
            client = request.client
            log.info("%s %s: the client%s went away while sending its body (%d bytes read)",
                     request.method, request.url.path,
                     f" {client.host}:{client.port}" if client else "", size)
            raise _ClientGone() from None
        return decode_body(b"".join(chunks))

    def _accept(self, request: OpenAIRequest, header_id: str | None) -> Accepted:
        """The checks that need the engine, all before submission (the served name, the
        structured-output fields, then the engine's admission check); raises ApiError or
        RequestError."""
        model, lora_request = self._served_model(request.model)
        prefix = _ID_PREFIXES[request.endpoint]
        fresh = uuid.uuid4().hex[:24]
        echo_id = self._echo_id(header_id, request.request_id) or f"{prefix}{fresh}"
        base = header_id or request.request_id or fresh
        structured = self._structured(request)
        prompt, tools = request.prompt, None
        if request.is_chat:  # the model learns of its tools from the prompt
            prompt, tools = prompt_messages(prompt, structured.tools, self.chat_tools)
        try:
            self.loop.check_open()
        except Refused as refused:
            raise _from_refused(refused) from None
        try:
            admitted = self.loop.admission.admit(
                Prompt(request.prompt_kind, prompt, request.prompt_field, tools),
                request.sampling_values(structured.output), request_id=f"{prefix}{fresh}",
                fill_context=request.is_chat)
        except AdmissionError as err:
            raise _refusal(request, structured, err) from None
        return Accepted(request=request, model=model, response_id=f"{prefix}{base}",
                        echo_id=echo_id,
                        admitted=dataclasses.replace(admitted, lora_request=lora_request),
                        structured=structured)

    def _structured(self, request: OpenAIRequest) -> Structured:
        """The request's constraint (`meshserve.serving.openai_api.structured_fields`); tool
        calls depend on what the chat template does with tools. A refusal names the request's
        own field (`OpenAIRequest.own_names`)."""
        try:
            return read_request(request.structured_fields, chat=request.is_chat,
                                chat_tools=self.chat_tools)
        except FieldError as err:
            raise RequestError(request.own_names(err.param), request.own_names(str(err)),
                               code=err.code) from None

    def _render(self, accepted: Accepted) -> Render | ResponsesRender:
        request, tools = accepted.request, accepted.structured.tools
        if request.endpoint == "responses":
            return ResponsesRender(accepted.response_id, accepted.model, request, tools=tools)
        return Render(accepted.response_id, accepted.model, self.fingerprint, request,
                      tools=tools)

    @staticmethod
    def _echo_id(header_id: str | None, body_id: str | None) -> str | None:
        for param, given in (("x-request-id", header_id), ("request_id", body_id)):
            if given is None:
                continue
            try:
                check_request_id(given)
            except ValueError as err:
                raise RequestError(param, f"{param}: {err}") from None
            return given
        return None

    async def _events(self, sub: Submission,
                      render: Render | ResponsesRender) -> AsyncIterator[str]:
        """The SSE stream; leaving it early (a disconnect) cancels the request."""
        is_done = False
        try:
            for event in render.opening():
                yield render.sse(event)
            async for item in sub.items():
                if isinstance(item, Failed):
                    is_done = True
                    error = _from_refused(Refused(item.kind, item.message)).body()
                    for event in render.failure(error):
                        yield render.sse(event)
                    break
                if isinstance(item, Delta):
                    for event in render.delta(item):
                        yield render.sse(event)
                    continue
                is_done = True
                for event in render.finish(item.output):
                    yield render.sse(event)
            if render.END:
                yield render.END
        finally:
            if not is_done:
                self.loop.cancel(sub.request_id)

    async def _collect(self, request: Request, sub: Submission) -> RequestOutput | None:
        """The finished output, or None if the client went away (its request is cancelled)."""
        reader = asyncio.ensure_future(_last(sub))
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=_DISCONNECT_POLL)
                if not reader.done() and await request.is_disconnected():
                    return None
        finally:
            if not reader.done():
                reader.cancel()
                self.loop.cancel(sub.request_id)
        item = reader.result()
        if isinstance(item, Failed):
            err = _from_refused(Refused(item.kind, item.message))
            err.is_counted = True  # the engine loop counted it
            raise err
        return item.output


def _refusal(request: OpenAIRequest, structured: Structured,
             err: AdmissionError) -> RequestError:
    """The admission check's refusal, naming the request's field: a constraint's names the field
    that asked for it."""
    if err.param == "structured" and structured.field is not None:
        field = request.own_names(structured.field)
        return RequestError(field, f"{field}: {err.reason}")
    return RequestError(request.field_of(err.param), err.message)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes (--max-message-bytes)",
                    code="body_too_large")


def _parse(body: dict, endpoint: str) -> OpenAIRequest:
    if endpoint == "responses":
        return parse_responses_request(body)
    return parse_request(body, endpoint)


async def _last(sub: Submission):
    last = None
    async for last in sub.items():
        pass
    return last


def system_fingerprint(loop: EngineLoop) -> str:
    """OpenAI's `system_fingerprint`: it changes when the version, the model or the engine's
    configuration does, as outputs may then change too."""
    try:
        version = metadata.version("meshserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    engine = loop.engine
    described = json.dumps([version, engine.model_config.name, repr(engine.config)])
    return "fp_" + hashlib.sha256(described.encode()).hexdigest()[:12]


# -- the server -----------------------------------------------------------------------------------

class HttpServer:
    """uvicorn serving `build_app` on its own thread: binds `config.host`:`config.http_port`
    (0 picks a free one), with TLS from `config.tls_cert` and `config.tls_key`, bodies up to
    `config.max_message_bytes`, request heads up to `config.max_header_bytes` (431 past it) and
    at most `config.max_concurrent_streams` connections at once (503 past it)."""

    def __init__(self, loop: EngineLoop, config, *, api_key: str | None = None,
                 adapters: ServedAdapters | None = None):
        self.config = config
        self.app = build_app(loop, config, api_key=api_key, adapters=adapters)
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            http=guarded_protocol(config.max_concurrent_streams),
            h11_max_incomplete_event_size=config.max_header_bytes,
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
            timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> int:
        host = self.config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self.config.http_port))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs=dict(sockets=[sock]),
                                        name="http", daemon=True)
        self._thread.start()
        end = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the HTTP server did not start on {host}:{self.port}")
            time.sleep(0.01)
        return self.port

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
