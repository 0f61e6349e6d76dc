"""The HTTP API's LoRA adapters (`meshserve.serving.engine.served_adapters`): their model cards,
and vLLM's routes that load and unload one while serving, which only
`--allow-runtime-lora-updating` opens (else they are 404, saying so):

    POST /v1/load_lora_adapter    {"lora_name": "...", "lora_path": "..."}   200, plain text
    POST /v1/unload_lora_adapter  {"lora_name": "..."}                        200, plain text

Loading reads and checks the adapter on a worker thread, never on the event loop; a bad one is
a 400 naming `lora_path` (or `lora_name`: empty, or already served), and nothing changes.
Unloading an unknown name is a 404 (`model_not_found`). Unloading an adapter that requests
are running with lets them finish: the name is gone at once, their tokens are the adapter's
to the end. Every other field is a 400 naming it.

This module must not touch the Engine.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import PlainTextResponse

from meshserve.batching.adapters import LoRARequest
from meshserve.serving.engine.served_adapters import AdapterError, ServedAdapters

LOAD_ROUTE, UNLOAD_ROUTE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
RUNTIME_ROUTES = (LOAD_ROUTE, UNLOAD_ROUTE)
FLAG = "--allow-runtime-lora-updating"


def adapter_card(lora_request: LoRARequest, *, parent: str, created: int,
                 max_model_len: int) -> dict:
    """An adapter's card in GET /v1/models, as vLLM writes it: `root` is its path, `parent`
    its base model's served name (`ServedAdapters.parent`)."""
    return {"id": lora_request.lora_name, "object": "model", "created": created,
            "owned_by": "meshserve", "root": lora_request.lora_path, "parent": parent,
            "max_model_len": max_model_len}


def closed_route_message(path: str) -> str | None:
    """The 404's message for a runtime route the server does not open; None for other paths."""
    if path not in RUNTIME_ROUTES:
        return None
    return (f"POST {path} is off: start the server with --enable-lora and {FLAG} to load and "
            "unload LoRA adapters while serving")


class AdapterRoutes:
    """The two runtime routes over `adapters`; `read_body` reads a request's JSON object with
    the API's limits."""

    def __init__(self, adapters: ServedAdapters,
                 read_body: Callable[[Request], Awaitable[dict]]):
        self.adapters, self._read_body = adapters, read_body

    async def load(self, request: Request) -> PlainTextResponse:
        fields = _fields(await self._read_body(request), ("lora_name", "lora_path"))
        lora_request = await asyncio.to_thread(self.adapters.load, fields["lora_name"],
                                               fields["lora_path"])
        return PlainTextResponse(f"Success: LoRA adapter {lora_request.lora_name!r} added "
                                 f"successfully (lora_int_id {lora_request.lora_int_id}).")

    async def unload(self, request: Request) -> PlainTextResponse:
        fields = _fields(await self._read_body(request), ("lora_name",))
        lora_request = self.adapters.unload(fields["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter {lora_request.lora_name!r} removed "
                                 "successfully.")


def _fields(body: dict, names: tuple[str, ...]) -> dict[str, str]:
    """The route's fields, each a non-empty string; AdapterError naming any other field."""
    for name in body:
        if name not in names:
            raise AdapterError(name, f"{name}: not a field of this route; it takes "
                                     f"{', '.join(names)}")
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise AdapterError(name, f"{name}: required, a non-empty string")
    return {name: body[name] for name in names}
