"""The HTTP port's edge: what happens around the OpenAI app (`meshserve.serving.http_api.app`), so
that every answer on the port is a status code with OpenAI's error JSON, never a reset.

Two layers:

  `Edge`, an ASGI middleware in front of the app: CORS (preflight answered, or refused with 403;
  response headers for an allowed origin), the api key on /v1 (`Authorization: Bearer <key>`,
  the scheme in any case, the key compared in constant time), and the client's `x-request-id`
  echoed on every response.

  `GuardedH11Protocol`, uvicorn's h11 connection protocol with three answers where uvicorn would
  drop the connection or answer in plain text:
    - a request head over `max_header_bytes` is 431 (uvicorn: a plain-text 400, then a reset;
      or, for a head that arrives whole, no limit at all),
      one that is not HTTP a 400 in OpenAI's JSON; either is one info line naming the client
      (uvicorn's warning, which does not, is dropped);
    - a connection past `max_connections` is 503 with `Retry-After`;
    - a connection closed while its client is still sending (a 413, a 431) is closed gently:
      the write side is shut, and what the client still sends is read and dropped, until it
      closes, goes quiet for LINGER_IDLE seconds, or LINGER_MAX seconds pass. Closing a socket
      with unread bytes makes the kernel send a reset, which can reach the client before the
      response it would read.

This module must not touch the engine or the engine loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import json
import logging
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshserve.serving.auth import bearer_matches

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          403: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 431: "invalid_request_error", 408: "timeout_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
_UVICORN_INVALID = "Invalid HTTP request received."  # uvicorn's warning of a malformed head
log = logging.getLogger(__name__)
LINGER_IDLE = 2.0  # seconds of silence after which a closing connection is dropped
LINGER_MAX = 30.0  # seconds a closing connection may keep sending


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code}}


def error_bytes(status: int, message: str, **fields: Any) -> bytes:
    return json.dumps(error_body(status, message, **fields)).encode()


# -- CORS and the api key --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """Which browser origins may call the API (`*`: any), with which methods and headers."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def refusal(self, origin: str, method: str, headers: list[str]) -> str | None:
        """Why a preflight is refused, or None to allow it."""
        if not self.origins:
            return ("CORS is off: start the server with --allowed-origins to let a browser page "
                    "call this API")
        if not self.allows_origin(origin):
            return f"origin {origin!r} is not allowed (--allowed-origins)"
        if "*" not in self.methods and method.upper() not in self.methods:
            return f"method {method!r} is not allowed (--allowed-methods)"
        allowed = {h.lower() for h in self.headers}
        refused = [h for h in headers if "*" not in allowed and h not in allowed]
        if refused:
            return f"header {refused[0]!r} is not allowed (--allowed-headers)"
        return None

    def response_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        """The headers every response to an allowed origin carries."""
        is_any = "*" in self.origins and not self.allow_credentials
        headers = [(b"access-control-allow-origin", b"*" if is_any else origin.encode()),
                   (b"access-control-expose-headers", b"x-request-id, retry-after")]
        if not is_any:
            headers.append((b"vary", b"Origin"))
        if self.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        return headers

    def preflight_headers(self, origin: str, requested: list[str]) -> list[tuple[bytes, bytes]]:
        methods = "GET, POST, OPTIONS" if "*" in self.methods else ", ".join(self.methods)
        headers = ", ".join(requested) if "*" in self.headers else ", ".join(self.headers)
        return self.response_headers(origin) + [
            (b"access-control-allow-methods", methods.encode()),
            (b"access-control-allow-headers", headers.encode()),
            (b"access-control-max-age", b"600")]


class Edge:
    """ASGI middleware: CORS, the api key on /v1, and `x-request-id` echoed. `on_unauthorized` is
    told of each request refused for its key."""

    def __init__(self, app, *, cors: CorsPolicy, api_key: str | None,
                 on_unauthorized: Callable[[], None] = lambda: None):
        self.app, self.cors, self.api_key = app, cors, api_key
        self.on_unauthorized = on_unauthorized

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        origin = headers.get("origin")
        if scope["method"] == "OPTIONS" and origin and "access-control-request-method" in headers:
            return await self._preflight(send, origin, headers)
        extra = []
        if origin and self.cors.allows_origin(origin):
            extra += self.cors.response_headers(origin)
        if "x-request-id" in headers:
            extra.append((b"x-request-id", headers["x-request-id"].encode("latin-1")))
        send = _adding_headers(send, extra)
        if self._needs_key(scope["path"]) and not bearer_matches(headers.get("authorization"),
                                                                 self.api_key):
            self.on_unauthorized()
            return await respond(send, 401, error_bytes(
                401, "missing or wrong api key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)

    def _needs_key(self, path: str) -> bool:
        return self.api_key is not None and (path == "/v1" or path.startswith("/v1/"))

    async def _preflight(self, send, origin: str, headers: dict[str, str]) -> None:
        method = headers["access-control-request-method"]
        requested = [h.strip().lower() for h in
                     headers.get("access-control-request-headers", "").split(",") if h.strip()]
        why = self.cors.refusal(origin, method, requested)
        if why is not None:
            await respond(send, 403, error_bytes(403, f"CORS preflight refused: {why}",
                                                 code="cors_refused"), [(b"vary", b"Origin")])
            return
        await respond(send, 204, b"", self.cors.preflight_headers(origin, requested))


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _adding_headers(send, extra: list[tuple[bytes, bytes]]):
    """`send`, with `extra` headers on the response start (those the app set itself win)."""
    if not extra:
        return send

    async def sending(message) -> None:
        if message["type"] == "http.response.start":
            names = {k.lower() for k, _ in message.get("headers", [])}
            message = message | {"headers": [*message.get("headers", []),
                                             *(h for h in extra if h[0] not in names)]}
        await send(message)

    return sending


async def respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()
                  ) -> None:
    """A whole response, JSON unless the body is empty."""
    head = [(b"content-length", str(len(body)).encode()), *headers]
    if body:
        head.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


# -- the connection --------------------------------------------------------------------------------

class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that answers oversized heads (431) and connections past the cap
    (503) in OpenAI's JSON, and never resets a client that is still sending (see the module
    docstring). Make one per server with `guarded_protocol`."""

    max_connections: int = 1 << 30

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # connections are capped here, with a JSON answer
        self._is_lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        self._linger_end = 0.0

    def connection_made(self, transport) -> None:
        super().connection_made(_GentleTransport(transport, self))
        if len(self.connections) > self.max_connections:
            self.refuse(503, f"the server has {len(self.connections) - 1} open connections, its "
                             f"limit (--max-concurrent-streams); retry later",
                        code="too_many_connections", headers=[(b"retry-after", b"1")])

    def data_received(self, data: bytes) -> None:
        if self._is_lingering:
            self._last_data = self.loop.time()  # read and dropped
            return
        if self.conn.their_state is h11.IDLE and self._head_size(data) > self._max_head:
            self._refuse_head(431)
            return
        super().data_received(data)

    @property
    def _max_head(self) -> int:
        return self.config.h11_max_incomplete_event_size

    def _head_size(self, data: bytes) -> int:
        """How long the request head that `data` adds to is, as far as it has come. h11 bounds
        only a head still incomplete, so one that arrives whole is measured here."""
        buffered, _ = self.conn.trailing_data
        text = buffered + data if buffered else data
        end = text.find(b"\r\n\r\n")
        return len(text) if end < 0 else end

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request head: too large (431), or not HTTP (400)."""
        buffered, _ = self.conn.trailing_data
        self._refuse_head(431 if len(buffered) > self._max_head else 400)

    def _refuse_head(self, status: int) -> None:
        """Refuses the request head, with one info line naming the client (uvicorn's own line
        about it is dropped, `_drop_uvicorn_invalid`)."""
        if status == 431:
            message, code = (f"the request head (request line and headers) is over "
                             f"{self._max_head} bytes (--max-header-bytes)", "header_too_large")
        else:
            message, code = "the request head is not valid HTTP/1.1", "invalid_http"
        log.info("%s: answered %d: %s", _client_name(self.client), status, message)
        self.refuse(status, message, code=code)

    def refuse(self, status: int, message: str, *, code: str,
               headers: list[tuple[bytes, bytes]] = ()) -> None:
        """Answers `status` with OpenAI's error JSON outside any request cycle, then closes
        gently."""
        body = error_bytes(status, message, code=code)
        head = [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                *headers]
        lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
        lines += [name + b": " + value for name, value in head]
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        self.linger()

    def linger(self) -> None:
        """Shuts the write side (after what is queued), then reads and drops what the client
        still sends, until it closes or goes quiet."""
        if self._is_lingering:
            return
        self._is_lingering = True
        raw = self.transport.raw
        if raw.can_write_eof():
            raw.write_eof()
        self.flow.resume_reading()
        now = self.loop.time()
        self._last_data, self._linger_end = now, now + LINGER_MAX
        self._linger_timer = self.loop.call_later(LINGER_IDLE, self._check_linger)

    def _check_linger(self) -> None:
        now = self.loop.time()
        if now >= self._linger_end or now - self._last_data >= LINGER_IDLE:
            self.transport.raw.close()
            return
        self._linger_timer = self.loop.call_later(LINGER_IDLE, self._check_linger)

    def is_receiving(self) -> bool:
        """Whether the client may still be sending its request."""
        return self.conn.their_state in (h11.SEND_BODY, h11.ERROR) or self._is_lingering

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._is_lingering:
            self.transport.raw.close()
            return
        super().shutdown()


class _GentleTransport:
    """The connection's transport, as uvicorn sees it: `close()` while the client is still
    sending lingers (`GuardedH11Protocol.linger`) instead of resetting it."""

    def __init__(self, raw: asyncio.Transport, protocol: GuardedH11Protocol):
        self.raw, self._protocol = raw, protocol

    def close(self) -> None:
        if self._protocol.is_receiving() and not self.raw.is_closing():
            self._protocol.linger()
        else:
            self.raw.close()

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def guarded_protocol(max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class for one server, with its connection cap."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _drop_uvicorn_invalid not in uvicorn_log.filters:
        uvicorn_log.addFilter(_drop_uvicorn_invalid)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"max_connections": max_connections})


def _drop_uvicorn_invalid(record: logging.LogRecord) -> bool:
    """uvicorn warns of every malformed request head without naming the client, just before
    `send_400_response`, which logs it with the client's address: its line is dropped."""
    return record.getMessage() != _UVICORN_INVALID


def _client_name(client: tuple[str, int] | None) -> str:
    return "a client" if not client else f"{client[0]}:{client[1]}"
