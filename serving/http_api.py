"""The OpenAI-compatible HTTP front end: FastAPI on uvicorn, on the same engine loop as gRPC.

`meshserve serve --http-port PORT` starts it beside the gRPC server (`GenerationServer` owns
both): one process, one `EngineLoop`, so both front ends share the engine, the admission bounds,
the drain and the metrics. Endpoints:

    GET  /v1/models             the served model
    POST /v1/completions        a text or token-id prompt
    POST /v1/chat/completions   messages, through the tokenizer's chat template
    GET  /health                200 while serving; 503 while starting, draining or after a failure
    GET  /metrics               the Prometheus text (the same registry as --metrics-port)

uvicorn runs its own asyncio event loop on one thread. A handler parses and checks the body,
submits to the engine loop (`EngineLoop.submit`, which never blocks), then reads the request's
own queue through `Submission.items()`. A stream is server-sent events in OpenAI's chunk format,
ending with `data: [DONE]`. A client that disconnects has its request cancelled; the engine loop
aborts it at its next step, which frees its pages.

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: bad input is 400
naming the field, a wrong or missing `Authorization: Bearer` key 401, an unknown model 404, a
full queue 429 with `Retry-After`, draining 503. A failure after a stream began comes as one
`data: {"error": ...}` event, then `data: [DONE]`.

This module must not touch the Engine: only the engine loop does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.loop import Delta, EngineLoop, Failed, Refused, Submission
from meshserve.serving.outputs import RequestOutput

_STATUS = {"invalid": 400, "duplicate": 409, "queue_full": 429, "draining": 503,
           "unavailable": 503, "deadline": 408, "internal": 500}
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error",
          408: "timeout_error", 409: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "min_tokens",
                    "stop_token_ids")
_UNSUPPORTED = {"suffix": "suffix", "tools": "tool calling", "functions": "function calling",
                "audio": "audio output", "prediction": "predicted outputs"}
_DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.is_counted = False  # already in the rejected-requests metric

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def _invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def _from_refused(refused: Refused, param: str | None = None) -> ApiError:
    headers = ({"Retry-After": str(refused.retry_after)} if refused.retry_after is not None
               else None)
    return ApiError(_STATUS[refused.kind], refused.message, param=param or refused.param,
                    code=refused.kind if refused.kind != "invalid" else "invalid_value",
                    headers=headers)


# -- the app --------------------------------------------------------------------------------------

def build_app(loop: EngineLoop, *, api_key: str | None = None,
              max_body_bytes: int = 4 << 20) -> FastAPI:
    """The ASGI app on `loop`; with `api_key`, /v1/* needs `Authorization: Bearer <key>`. A
    body over `max_body_bytes` is refused with 413."""
    app = FastAPI(title="meshserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(loop, api_key, max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if err.status == 400 and not err.is_counted:
            loop.metrics.observe_rejected("invalid")
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


class _Api:
    def __init__(self, loop: EngineLoop, api_key: str | None, max_body_bytes: int):
        self.loop, self.engine = loop, loop.engine
        self.max_body_bytes = max_body_bytes
        self.model = loop.engine.model_config.name
        self.created = int(time.time())
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def health(self) -> JSONResponse:
        state = self.loop.state
        return JSONResponse({"status": state}, status_code=200 if state == "serving" else 503)

    async def metrics(self) -> Response:
        return Response(self.loop.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "meshserve",
            "max_model_len": self.engine.config.max_model_len}]})

    async def completions(self, request: Request):
        self._authorize(request)
        body = await _json_body(request, self.max_body_bytes)
        self._check_common(body, chat=False)
        kind, value = _completion_prompt(body.get("prompt"))
        return await self._serve(request, body, kind, value, "prompt", chat=False)

    async def chat_completions(self, request: Request):
        self._authorize(request)
        body = await _json_body(request, self.max_body_bytes)
        self._check_common(body, chat=True)
        return await self._serve(request, body, "chat", _messages(body.get("messages")),
                                 "messages", chat=True)

    # -- one request --------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):  # constant time
            self.loop.metrics.observe_rejected("unauthenticated")
            raise ApiError(401, "missing or wrong api key: send the header "
                                "'Authorization: Bearer <key>'", code="invalid_api_key")

    def _check_common(self, body: dict, *, chat: bool) -> None:
        model = _typed(body, "model", str)
        if model is not None and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model!r}", param="model", code="model_not_found")
        if _typed(body, "n", int, 1) != 1:
            raise _invalid("n", "n must be 1: one completion per request is served; send n "
                                "requests (with different seeds) instead")
        if not chat and _typed(body, "best_of", int, 1) != 1:
            raise _invalid("best_of", "best_of must be 1: one completion per request is served")
        if not chat and _typed(body, "echo", bool, False):
            raise _invalid("echo", "echo is not supported; the prompt is in your request")
        if _typed(body, "logit_bias", dict):
            raise _invalid("logit_bias", "logit_bias is not supported")
        for name, what in _UNSUPPORTED.items():
            if body.get(name):
                raise _invalid(name, f"{name}: {what} is not supported")
        _typed(body, "user", str)  # accepted, and only checked
        stream_options = _typed(body, "stream_options", dict)
        if stream_options is not None and not _typed(body, "stream", bool, False):
            raise _invalid("stream_options", "stream_options needs stream: true")

    async def _serve(self, request: Request, body: dict, kind: str, value, field: str, *,
                     chat: bool):
        try:
            self.loop.check_open()
            prompt_ids, text = self.loop.encode_prompt(kind, value, field)
        except Refused as refused:
            raise _from_refused(refused) from None
        params = self._params(body, len(prompt_ids), chat=chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            sub = self.loop.submit(prompt_ids, params, prompt_text=text, request_id=request_id)
        except Refused as refused:
            raise _from_refused(refused) from None
        render = _Render(request_id, self.model, chat=chat, num_top=params.logprobs,
                         include_usage=bool((body.get("stream_options") or {})
                                            .get("include_usage")),
                         return_token_ids=_typed(body, "return_token_ids", bool, False))
        if _typed(body, "stream", bool, False):
            return StreamingResponse(self._events(sub, render), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        output = await self._collect(request, sub)
        if output is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(render.whole(output))

    def _params(self, body: dict, num_prompt: int, *, chat: bool) -> SamplingParams:
        values: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            value = body.get(name)
            if value is not None:
                values[name] = tuple(value) if isinstance(value, list) else value
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise _invalid("stop", "stop must be a string or a list of strings")
            values["stop"] = tuple(stop)
        max_model_len = self.engine.config.max_model_len
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = _typed(body, name, int)
        if max_tokens is None:  # chat: the rest of the context; completions: OpenAI's 16
            max_tokens = max(max_model_len - num_prompt, 1) if chat else 16
        elif max_tokens >= 1 and num_prompt + max_tokens > max_model_len:
            raise _invalid(name, f"{name}={max_tokens} and the prompt's {num_prompt} tokens "
                                 f"exceed the context of {max_model_len} tokens; lower {name} or "
                                 f"shorten the prompt (nothing is truncated)")
        values["max_tokens"] = max_tokens
        logprobs_field = self._logprobs(body, chat=chat)
        if logprobs_field is not None:
            values["logprobs"] = logprobs_field
        try:
            params = SamplingParams(**values)
            self.loop.check_params(params)
        except (ValueError, TypeError) as err:
            raise _invalid(_param_of(str(err), chat, name), str(err)) from None
        except Refused as refused:
            raise _invalid(_param_of(refused.message, chat, name), refused.message) from None
        return params

    @staticmethod
    def _logprobs(body: dict, *, chat: bool) -> int | None:
        if not chat:
            return _typed(body, "logprobs", int)
        top = _typed(body, "top_logprobs", int)
        if not _typed(body, "logprobs", bool, False):
            if top is not None:
                raise _invalid("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return top or 0

    async def _events(self, sub: Submission, render: _Render) -> AsyncIterator[str]:
        """The SSE stream; leaving it early (a disconnect) cancels the request."""
        is_done = False
        try:
            async for item in sub.items():
                if isinstance(item, Failed):
                    is_done = True
                    yield _sse(_from_refused(Refused(item.kind, item.message)).body())
                    break
                if isinstance(item, Delta):
                    for chunk in render.delta(item):
                        yield _sse(chunk)
                    continue
                is_done = True
                for chunk in render.finish(item.output):
                    yield _sse(chunk)
            yield "data: [DONE]\n\n"
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


async def _last(sub: Submission):
    last = None
    async for last in sub.items():
        pass
    return last


# -- the request body ---------------------------------------------------------------------------

async def _json_body(request: Request, max_bytes: int) -> dict:
    size = 0
    chunks = []
    async for chunk in request.stream():  # counted as it comes: a huge body is never held
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes "
                                f"(--max-message-bytes)", code="body_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise _invalid(None, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise _invalid(None, "the request body must be a JSON object")
    return body


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "an object", list: "a list"}


def _typed(body: dict, name: str, kind: type, default=None):
    value = body.get(name)
    if value is None:
        return default
    is_ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not is_ok:
        raise _invalid(name, f"{name} must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:60]}")
    return value


def _completion_prompt(prompt) -> tuple[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return "text", prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        return "token_ids", prompt
    if prompt is None:
        raise _invalid("prompt", "prompt is required: a string or a list of token ids")
    if isinstance(prompt, list):
        raise _invalid("prompt", "prompt must be one string or one list of token ids; a batch "
                                 "of prompts is not served: send one request per prompt")
    raise _invalid("prompt", f"prompt must be a string or a list of token ids, got "
                             f"{json.dumps(prompt)[:60]}")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{i}]", f"messages[{i}] must be an object with a role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise _invalid(f"messages[{i}].content", "only text content parts are served")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _invalid(f"messages[{i}].content", f"messages[{i}].content must be a string "
                                                     "or a list of text parts")
        out.append({"role": message["role"], "content": content})
    return out


def _param_of(message: str, chat: bool, max_tokens_name: str) -> str | None:
    """The request field a sampling error names (its message starts with the field)."""
    first = message.replace(":", " ").replace("=", " ").split(" ", 1)[0]
    if first == "logprobs" and chat:
        return "top_logprobs"
    if first == "max_tokens":
        return max_tokens_name
    if first in (*_SAMPLING_FIELDS, "logprobs", "stop"):
        return first
    if "stop strings" in message:
        return "stop"
    return None


# -- the response shapes ------------------------------------------------------------------------

class _Render:
    """One request's response objects, whole or as stream chunks, in OpenAI's shapes."""

    def __init__(self, request_id: str, model: str, *, chat: bool, num_top: int | None,
                 include_usage: bool, return_token_ids: bool = False):
        self.id, self.model, self.chat = request_id, model, chat
        self.num_top, self.include_usage = num_top, include_usage
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self.is_first = True
        self.num_chars = 0  # completions' text offset

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        logprobs = self._logprobs(completion.token_ids, completion.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                      "logprobs": logprobs, "finish_reason": completion.finish_reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": completion.text, "logprobs": logprobs,
                      "finish_reason": completion.finish_reason}
            body = self._base("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
        return body | {"choices": [choice], "usage": usage(output)}

    def delta(self, delta: Delta) -> list[dict]:
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        if not (delta.text or logprobs or self.is_first or self.return_token_ids):
            return []
        chunk = self._chunk(delta.text, logprobs, None)
        if self.return_token_ids:
            chunk["choices"][0]["token_ids"] = delta.token_ids
        return [chunk]

    def finish(self, output: RequestOutput) -> list[dict]:
        chunks = [self._chunk("", None, output.outputs[0].finish_reason)]
        if self.include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            chunks.append(self._base(kind) | {"choices": [], "usage": usage(output)})
        return chunks

    def _chunk(self, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            if self.is_first:
                delta = {"role": "assistant"} | delta
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._base("text_completion")
        self.is_first = False
        if self.include_usage:
            body["usage"] = None
        return body | {"choices": [choice]}

    def _logprobs(self, token_ids: list[int], entries: list[dict] | None) -> dict | None:
        if entries is None or self.num_top is None:
            return None
        tops = [_top(entry, self.num_top) for entry in entries]
        if self.chat:
            return {"content": [
                _chat_logprob(token, entry[token]) | {"top_logprobs": [
                    _chat_logprob(t, lp) for t, lp in top]}
                for token, entry, top in zip(token_ids, entries, tops)]}
        tokens = [_token_text(t, entry[t]) for t, entry in zip(token_ids, entries)]
        offsets = []
        for text in tokens:
            offsets.append(self.num_chars)
            self.num_chars += len(text)
        return {"tokens": tokens,
                "token_logprobs": [entry[t].logprob for t, entry in zip(token_ids, entries)],
                "top_logprobs": [{_token_text(t, lp): lp.logprob for t, lp in top}
                                 for top in tops],
                "text_offset": offsets}


def usage(output: RequestOutput) -> dict:
    num_prompt, num_completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def _top(entry: dict, num_top: int) -> list:
    """The `num_top` most likely tokens, by rank."""
    return sorted(((t, lp) for t, lp in entry.items()
                   if lp.rank is not None and lp.rank <= num_top), key=lambda item: item[1].rank)


def _token_text(token: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token}"


def _chat_logprob(token: int, lp) -> dict:
    text = _token_text(token, lp)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# -- the server -----------------------------------------------------------------------------------

class HttpServer:
    """uvicorn serving `build_app` on its own thread: binds `config.host`:`config.http_port`
    (0 picks a free one), with TLS from `config.tls_cert` and `config.tls_key`, bodies up to
    `config.max_message_bytes`, and at most `config.max_concurrent_streams` connections at once
    (uvicorn answers 503 past it)."""

    def __init__(self, loop: EngineLoop, config, *, api_key: str | None = None):
        self.config = config
        self.app = build_app(loop, api_key=api_key, max_body_bytes=config.max_message_bytes)
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
            limit_concurrency=config.max_concurrent_streams, timeout_graceful_shutdown=2))
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
