"""`AdapterRegistry`: the LoRA adapters an engine knows, read once and kept in host memory.

A request names its adapter with a `LoRARequest`. The first request with a new `lora_int_id`
reads and checks the adapter's directory (`meshserve.model.loading.lora_files`) at the door, so a
bad adapter is refused with the request, by name, and the engine goes on serving. The registry
keeps up to `max_cpu_loras` read adapters, least recently used first out, trimmed whenever it
reads one; an adapter that a queued or running request still needs is never dropped (the limit
is exceeded instead until those requests finish), and one dropped is read again when a later
request names it.

The device side is the scheduler's (`batching/adapters.py`, which slot holds which adapter) and
the runner's (`ModelRunner.load_adapter`, which writes an adapter into a slot); the engine takes
each step's loads from the plan and hands the registry's weights to the runner.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable

from meshserve.batching.adapters import LoRARequest
from meshserve.model.config import ModelConfig
from meshserve.model.loading.lora_files import LoraAdapter, load_lora


class AdapterRegistry:
    def __init__(self, model_config: ModelConfig, *, max_rank: int, max_cpu_loras: int,
                 in_use: Callable[[], Iterable[int]], head_multiple: int = 1):
        """`in_use()` gives the adapter ids that unfinished requests run with; `head_multiple`
        is the mesh's `model` axis, to which the served model's heads may be padded
        (`load_lora`)."""
        self.model_config = model_config
        self.head_multiple = head_multiple
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.in_use = in_use
        self._requests: dict[int, LoRARequest] = {}  # every adapter named so far, by id
        self._loaded: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    @property
    def max_id(self) -> int:
        """The largest adapter id named so far (0: none)."""
        return max(self._requests, default=0)

    def resolve(self, lora_request: LoRARequest) -> int:
        """The adapter id of a request's `LoRARequest`, its adapter read and checked (ValueError,
        naming what to change, if it cannot be served). An id already known must come with the
        same name and path."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        adapter_id = lora_request.lora_int_id
        self._check_id(lora_request)
        self.weights(adapter_id, lora_request)
        self._requests[adapter_id] = lora_request
        return adapter_id

    def add(self, lora_request: LoRARequest, adapter: LoraAdapter) -> None:
        """Keeps an adapter read and checked elsewhere (a server reads one off the engine's
        thread, `meshserve.serving.engine.served_adapters`), as if a request had named it."""
        self._check_id(lora_request)
        adapter_id = lora_request.lora_int_id
        self._requests[adapter_id] = lora_request
        self._loaded[adapter_id] = adapter
        self._loaded.move_to_end(adapter_id)
        self._evict(keep=adapter_id)

    def remove(self, adapter_id: int) -> None:
        """Drops an adapter's weights from host memory; while unfinished requests still run
        with it, makes it the least recently used instead (the first the LRU drops once they
        are done). Its id stays taken by its name and path."""
        if adapter_id not in self._loaded:
            return
        if adapter_id in set(self.in_use()):
            self._loaded.move_to_end(adapter_id, last=False)
        else:
            del self._loaded[adapter_id]

    def _check_id(self, lora_request: LoRARequest) -> None:
        """An id already known must come with the same name and path."""
        adapter_id = lora_request.lora_int_id
        known = self._requests.get(adapter_id)
        if known is not None and known != lora_request:
            raise ValueError(f"lora_int_id {adapter_id} is already adapter "
                             f"{known.lora_name!r} at {known.lora_path!r}; give this adapter "
                             "an id of its own")

    def weights(self, adapter_id: int, lora_request: LoRARequest | None = None) -> LoraAdapter:
        """The adapter, read now unless it is kept; the most recently used afterwards."""
        adapter = self._loaded.get(adapter_id)
        if adapter is None:
            request = lora_request or self._requests[adapter_id]
            adapter = load_lora(request.lora_path, self.model_config, max_rank=self.max_rank,
                                head_multiple=self.head_multiple)
            self._loaded[adapter_id] = adapter
            self._evict(keep=adapter_id)
        self._loaded.move_to_end(adapter_id)
        return adapter

    def _evict(self, keep: int) -> None:
        """Drops the least recently used adapters that no request needs, down to the limit."""
        if len(self._loaded) <= self.max_cpu_loras:
            return
        needed = set(self.in_use()) | {keep}
        for adapter_id in [a for a in self._loaded if a not in needed]:
            if len(self._loaded) <= self.max_cpu_loras:
                break
            del self._loaded[adapter_id]
