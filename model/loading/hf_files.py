"""HF safetensors directories: their `config.json` and tensors, and `load_hf`, a directory ->
`(ModelConfig, params)`.

The directory's family (`meshserve.model.families`, by `model_type`) reads its config and says
which tensor fills each canonical param; `meshserve.model.loading.assembly` reads them. Tensors
are read as numpy arrays, bfloat16 ones mapped straight from the file; a mixture's per-expert
tensors are read as one stacked `[E, ...]` tensor (`StackedExperts`).

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open

from meshserve.model.canonical import Checkpoint, CheckpointLayout, check_params, require_dtype
from meshserve.model.config import ModelConfig
from meshserve.model.families import hf_family
from meshserve.model.loading.assembly import (Params, Place, Plans, Slot, assemble, plan_slots,
                                              require_file)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf(directory: str | os.PathLike, *, dtype: str = "float32",
            place: Place | None = None, plans: Plans | None = None
            ) -> tuple[ModelConfig, Params]:
    """Loads an HF safetensors directory of any `model_type` `meshserve.model.families.FAMILIES`
    lists into a config and params (the kernels `plans` names quantized as they are read)."""
    directory = Path(directory)
    require_dtype(dtype)
    if not directory.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    hf_config = read_hf_config(directory)
    family = hf_family(hf_config)
    config = family.readers.hf_config(hf_config).replace(dtype=dtype)
    with ExitStack() as stack:
        checkpoint = SafetensorsCheckpoint(directory, safetensors_files(directory), stack)
        layout = family.readers.hf_layout(config, hf_config, checkpoint)
        require_lm_head(layout, checkpoint)
        slots = plan_slots(layout)
        checkpoint = stacked_experts(config, slots, checkpoint)
        params = assemble(config, slots, checkpoint, layout.ignored, place, plans)
    if place is None:  # placed tensors were checked one by one, before placing
        check_params(config, params, values=False)
    return config, params


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    require_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err}); restore the model's config.json"
        ) from err


def require_lm_head(layout: CheckpointLayout, checkpoint: Checkpoint) -> None:
    head = layout.names.get("lm_head/kernel")
    if not layout.config.tie_embeddings and head is not None and head not in checkpoint.names:
        raise ValueError(
            f"{checkpoint.origin}: config.json sets tie_word_embeddings to false, but the "
            f"checkpoint has no {head!r}. Set tie_word_embeddings to "
            "true if the model shares its embedding with the output head, or add the missing shard."
        )


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: the index's shards, or its one safetensors file."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [directory / shard for shard in sorted(set(weight_map.values()))]
    if (directory / SAFETENSORS_FILE).is_file():
        return [directory / SAFETENSORS_FILE]
    found = sorted(directory.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if found:
        raise FileNotFoundError(
            f"{directory} has {len(found)} safetensors files but no {SAFETENSORS_INDEX}; "
            "add the index that lists the shards"
        )
    raise FileNotFoundError(
        f"{directory} has no safetensors weights ({SAFETENSORS_FILE} or {SAFETENSORS_INDEX}); "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )


class SafetensorsCheckpoint:
    """The tensors of one or more safetensors files, read as numpy arrays (bf16 included)."""

    def __init__(self, origin: Path, files: list[Path], stack: ExitStack):
        self.origin = str(origin)
        self._handles: dict[str, Any] = {}
        self._files: dict[str, Path] = {}
        self._headers: dict[Path, SafetensorsHeader] = {}
        for file in files:
            handle = stack.enter_context(open_safetensors(file))
            for name in handle.keys():
                self._handles[name] = handle
                self._files[name] = file
        self.names = frozenset(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        handle = self._handles[name]
        if handle.get_slice(name).get_dtype() == "BF16":
            return read_bf16(self._header(self._files[name]), name)
        return handle.get_tensor(name)

    def _header(self, path: Path) -> "SafetensorsHeader":
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path]


def open_safetensors(path: Path) -> Any:
    """Opens a safetensors file for numpy, turning a bad header into one clear error."""
    require_file(path)
    try:
        return safe_open(path, framework="numpy")
    except safetensors.SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file; it is corrupt or truncated ({err}). "
            "Download or save it again."
        ) from err


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: per tensor its dtype, shape and byte range in the data."""

    path: Path
    tensors: dict[str, Any]
    data_start: int


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parses the header: an 8-byte little-endian length, then that many bytes of JSON."""
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        tensors = json.loads(handle.read(length))
    return SafetensorsHeader(path, tensors, 8 + length)


def read_bf16(header: SafetensorsHeader, name: str) -> np.ndarray:
    """Maps one bfloat16 tensor straight from the file: safetensors' numpy API has no bf16."""
    info = header.tensors[name]
    begin, end = info["data_offsets"]
    raw = np.memmap(header.path, dtype=np.uint16, mode="r", offset=header.data_start + begin,
                    shape=((end - begin) // 2,))
    return raw.view(ml_dtypes.bfloat16).reshape(info["shape"])


class StackedExperts:
    """A checkpoint in which each `{e}` name of `stacked` reads as the [E, ...] stack of its
    experts' tensors (`name.format(e=j)`), and those tensors are no longer listed on their own."""

    def __init__(self, checkpoint: Checkpoint, stacked: set[str], num_experts: int):
        self.origin = checkpoint.origin
        self._inner = checkpoint
        self._parts = {name: [name.format(e=j) for j in range(num_experts)] for name in stacked
                       if all(name.format(e=j) in checkpoint.names for j in range(num_experts))}
        consumed = {part for parts in self._parts.values() for part in parts}
        self.names = frozenset((checkpoint.names - consumed) | set(self._parts))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return self._inner.shape(name)
        shapes = {part: self._inner.shape(part) for part in self._parts[name]}
        first = self._parts[name][0]
        for part, shape in shapes.items():
            if shape != shapes[first]:
                raise ValueError(f"{self.origin}: expert tensor {part!r} has shape {shape}, but "
                                 f"{first!r} has {shapes[first]}; every expert must have one shape")
        return (len(shapes), *shapes[first])

    def read(self, name: str) -> np.ndarray:
        if name not in self._parts:
            return self._inner.read(name)
        return np.stack([self._inner.read(part) for part in self._parts[name]])


def stacked_experts(config: ModelConfig, slots: list[Slot], checkpoint: Checkpoint
                    ) -> Checkpoint:
    """`checkpoint`, reading the per-expert tensors of `slots` stacked (as it is without
    experts)."""
    if config.moe is None:
        return checkpoint
    stacked = {slot.source for slot in slots if "{e}" in slot.source}
    return StackedExperts(checkpoint, stacked, config.moe.num_experts)
