"""`ServedAdapters`: the LoRA adapters a server serves by name, shared by its front ends.

A server started with `--enable-lora --lora-modules name=path ...` serves each adapter under its
name: an HTTP request selects one by `"model": "<name>"`, a gRPC request by `lora_name`. A
module may also be vLLM's JSON object, `{"name": ..., "path": ..., "base_model_name": ...}`,
whose `base_model_name` (one of the names the base model is served under) is the adapter's
`parent` in `/v1/models` (else the first of those names).
With `--allow-runtime-lora-updating`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` add and remove names while serving.

Ids: each name gets a stable `lora_int_id`, 1, 2, ... in the order of `--lora-modules` (past
any id the engine was given before it was served), then the next one for each adapter loaded at
runtime. An id is never given twice, so a name unloaded and loaded again (perhaps from another
path) gets a new id, and shares no prefix-cache page with the old one.

Loading: an adapter is read and checked (`load_lora`) on the caller's thread (at start; a worker
thread for the HTTP route, never the event loop), before its name is served, and then handed
to the engine loop (`EngineLoop.add_adapter`), so the engine's thread does not read it. A bad
adapter is refused by name and nothing else changes.

Unloading takes the name away at once: a request naming it afterwards is an unknown model.
Requests already submitted with it run to their end (they hold its `LoRARequest`, and the
engine's registry keeps its weights while they run). Its weights leave host memory at once, or,
while such requests run, are the first the host LRU drops after them; its device slot goes to
the next adapter that needs one.

Thread-safe: one lock guards the table; an adapter is read outside it. Imports no front end.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from typing import Iterable, Sequence

from meshserve.batching.adapters import LoRARequest
from meshserve.model.loading.lora_files import LoraAdapter, load_lora
from meshserve.serving.engine.loop import EngineLoop


class AdapterError(ValueError):
    """A refused adapter operation: `param` is the field at fault (`lora_name`, `lora_path`),
    `is_unknown` says the name is not served (HTTP 404, gRPC NOT_FOUND)."""

    def __init__(self, param: str, message: str, *, is_unknown: bool = False):
        super().__init__(message)
        self.param, self.message, self.is_unknown = param, message, is_unknown


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry: the adapter's served name, its PEFT directory, and the served
    name of its base model (None: the first)."""

    name: str
    path: str
    base_model_name: str | None = None


MODULE_KEYS = ("name", "path", "base_model_name")  # of the JSON form, as vLLM spells them


def parse_lora_modules(values: Iterable[str]) -> tuple[LoraModule, ...]:
    """`--lora-modules` values, each `name=path` or a JSON object with the keys of
    `MODULE_KEYS` (`name` and `path` required); ValueError naming the flag, and the key at fault,
    for a malformed one or a name given twice."""
    modules = [_parse_module(str(value)) for value in values]
    names = [module.name for module in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules: the name {twice[0]!r} is given twice; give each "
                         "adapter a name of its own")
    return tuple(modules)


def _parse_module(value: str) -> LoraModule:
    if value.lstrip().startswith("{"):
        return _json_module(value)
    name, is_pair, path = value.partition("=")
    if not is_pair or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules: {value!r} is not name=path (an adapter's name, "
                         "then its PEFT directory) nor a JSON object with \"name\" and "
                         "\"path\"")
    return LoraModule(name.strip(), path.strip())


def _json_module(value: str) -> LoraModule:
    """vLLM's JSON form: {"name": ..., "path": ..., "base_model_name": ...}."""
    try:
        fields = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--lora-modules: {value!r} must be a JSON object")
    unknown = sorted(set(fields) - set(MODULE_KEYS))
    if unknown:
        raise ValueError(f"--lora-modules: {value!r}: unknown key {unknown[0]!r}; the keys are "
                         f"{', '.join(MODULE_KEYS)}")
    for key, what in (("name", "the adapter's name"), ("path", "its PEFT directory")):
        if key not in fields:
            raise ValueError(f"--lora-modules: {value!r} has no {key!r}; give {what}")
    for key in MODULE_KEYS:  # base_model_name may be null, as in vLLM: the first served name
        given = fields.get(key)
        if (key != "base_model_name" or given is not None) and (
                not isinstance(given, str) or not given.strip()):
            raise ValueError(f"--lora-modules: {value!r}: {key!r} must be a non-empty string, "
                             f"got {given!r}")
    base = fields.get("base_model_name")
    return LoraModule(fields["name"].strip(), fields["path"].strip(),
                      None if base is None else base.strip())


def check_base_model_names(modules: Iterable[LoraModule], served_names: Sequence[str]) -> None:
    """Each module's `base_model_name`, when given, must be a name the base model is served
    under; ValueError naming the module and the key otherwise."""
    for module in modules:
        if module.base_model_name is not None and module.base_model_name not in served_names:
            raise ValueError(f"--lora-modules {module.name}: base_model_name "
                             f"{module.base_model_name!r} is not a served model name; the "
                             f"model is served as {', '.join(map(repr, served_names))} "
                             "(--served-model-name)")


class ServedAdapters:
    """The served adapters by name (see the module docstring)."""

    def __init__(self, loop: EngineLoop, base_names: Sequence[str]):
        """`base_names`: the names the base model is served under, which no adapter may take.
        Made before `loop` starts (the engine's registry is read here)."""
        registry = loop.engine.adapters
        assert registry is not None, "ServedAdapters needs an engine with enable_lora"
        self._loop, self._registry = loop, registry
        self.base_names = tuple(base_names)
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}  # guarded by _lock
        self._parents: dict[str, str] = {}  # name -> its base model's name, where given
        self._ids = itertools.count(registry.max_id + 1)  # guarded by _lock

    @classmethod
    def start(cls, loop: EngineLoop, base_names: Sequence[str],
              modules: Sequence[LoraModule]) -> ServedAdapters:
        """Serves `modules` (`parse_lora_modules`), each read and checked now; ValueError
        naming `--lora-modules` and the module for one that cannot be served."""
        if modules and loop.engine.runner.channel is not None:
            raise ValueError("--lora-modules: a multi-process engine serves no LoRA adapters yet")
        check_base_model_names(modules, base_names)
        served = cls(loop, base_names)
        for module in modules:
            try:
                served.load(module.name, module.path, base_model_name=module.base_model_name)
            except AdapterError as err:
                raise ValueError(f"--lora-modules {module.name}={module.path}: "
                                 f"{err.message}") from None
        return served

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served as `name`, or None."""
        with self._lock:
            return self._by_name.get(name)

    def requests(self) -> list[LoRARequest]:
        """Every served adapter, by id."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.lora_int_id)

    def parent(self, name: str) -> str:
        """The served name of adapter `name`'s base model: its module's `base_model_name`, else
        the base model's first name."""
        with self._lock:
            return self._parents.get(name, self.base_names[0])

    def load(self, name: str, path: str, *, base_model_name: str | None = None) -> LoRARequest:
        """Reads and checks the adapter at `path` (slow: call it off an event loop), then serves
        it as `name` under a new id (`base_model_name`: its parent, one of `base_names`);
        AdapterError naming `lora_name` or `lora_path`."""
        assert base_model_name is None or base_model_name in self.base_names, base_model_name
        with self._lock:
            self._check_free(name)  # before the slow read
        adapter = self._read(path)
        with self._lock:
            self._check_free(name)  # another load may have taken it meanwhile
            lora_request = LoRARequest(name, next(self._ids), path)
            self._by_name[name] = lora_request
            if base_model_name is not None:
                self._parents[name] = base_model_name
            # Queued before the name can be looked up, so that the engine keeps the adapter
            # before any request naming it is queued.
            self._loop.add_adapter(lora_request, adapter)
        return lora_request

    def unload(self, name: str) -> LoRARequest:
        """Stops serving `name` (see the module docstring); AdapterError if it is not served."""
        with self._lock:
            lora_request = self._by_name.pop(name, None)
            if lora_request is None:
                raise AdapterError("lora_name", f"no LoRA adapter is served as {name!r}; "
                                   f"{self._listing()}", is_unknown=True)
            self._parents.pop(name, None)
            self._loop.remove_adapter(lora_request.lora_int_id)
        return lora_request

    def _check_free(self, name: str) -> None:
        """That `name` may name a new adapter (caller holds _lock)."""
        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name", "lora_name must be a non-empty string")
        if name in self.base_names:
            raise AdapterError("lora_name", f"{name!r} is the base model's served name; give "
                                            "the adapter another name")
        if name in self._by_name:
            raise AdapterError("lora_name", f"a LoRA adapter is already served as {name!r}; "
                                            "unload it first, or choose another name")

    def _read(self, path: str) -> LoraAdapter:
        if not isinstance(path, str) or not path:
            raise AdapterError("lora_path", "lora_path must be a non-empty string: the "
                                            "adapter's PEFT directory")
        registry = self._registry
        try:
            return load_lora(path, registry.model_config, max_rank=registry.max_rank,
                             head_multiple=registry.head_multiple)
        except (ValueError, OSError) as err:  # OSError: a file it may not read
            message = str(err)
            raise AdapterError("lora_path", message if message.startswith("lora_path")
                               else f"lora_path: {message}") from None

    def _listing(self) -> str:
        """What is served, for an unknown name's message (caller holds _lock)."""
        names = sorted(self._by_name)
        return ("the served adapters are " + ", ".join(repr(n) for n in names) if names
                else "none is served")
