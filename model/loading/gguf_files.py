"""GGUF files: their metadata and tensors, and `load_gguf`, a GGUF -> `(ModelConfig, params)`.

The file's family (`meshserve.model.families`, by `general.architecture`) reads its config and
says which tensor fills each canonical param; `meshserve.model.loading.assembly` reads them.
Quantized tensors are dequantized to float32 with `gguf.quants` and then cast, or, under a
quantization plan, kept in their own blocks where those fit (`GGUFCheckpoint.read_blocks`).

This module imports neither jax nor flax.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshserve.model.canonical import check_params, require_dtype
from meshserve.model.config import ModelConfig
from meshserve.model.families import gguf_family
from meshserve.model.gguf_reader import GGUFFile, as_python, open_gguf
from meshserve.model.loading.assembly import Params, Place, Plans, assemble, plan_slots
from meshserve.model.loading.gguf_blocks import decode_blocks

_GGML = gguf.GGMLQuantizationType
GGUF_TYPES = (
    _GGML.F32, _GGML.F16, _GGML.BF16, _GGML.Q8_0, _GGML.Q4_0, _GGML.Q4_1, _GGML.Q5_0, _GGML.Q5_1,
    _GGML.Q2_K, _GGML.Q3_K, _GGML.Q4_K, _GGML.Q5_K, _GGML.Q6_K,
)
GGUF_EMBEDDING = "token_embd.weight"  # every architecture's token embedding


class GGUFCheckpoint:
    """The tensors of an open GGUF file, dequantized to float32 `[out, in]` on read."""

    def __init__(self, path: Path, reader: GGUFFile):
        self.origin = str(path)
        self._tensors = reader.tensors
        self.names = frozenset(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def qtype(self, name: str) -> gguf.GGMLQuantizationType:
        return self._tensors[name].ggml_type

    def read_blocks(self, name: str):
        """The tensor's block fields, not dequantized (`meshserve.model.loading.gguf_blocks`)."""
        tensor = self._tensors[name]
        return decode_blocks(tensor.data, tensor.ggml_type, tensor.shape)

    def read(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        return gguf.quants.dequantize(tensor.data, tensor.ggml_type).reshape(tensor.shape)


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32", place: Place | None = None,
              plans: Plans | None = None) -> tuple[ModelConfig, Params]:
    """Loads a GGUF file of any architecture `meshserve.model.families.FAMILIES` lists into a
    config and canonical params (the kernels `plans` names quantized, kept in the file's blocks
    where they fit)."""
    path = Path(path)
    require_dtype(dtype)
    reader = open_gguf(path)
    checkpoint = GGUFCheckpoint(path, reader)
    require_supported_types(checkpoint)
    fields = gguf_metadata(reader, checkpoint)
    family = gguf_family(fields)
    config = family.readers.gguf_config(fields).replace(dtype=dtype)
    layout = family.readers.gguf_layout(config, fields, checkpoint)
    config = layout.config
    params = assemble(config, plan_slots(layout), checkpoint, layout.ignored, place, plans)
    if place is None:  # placed tensors were checked one by one, before placing
        check_params(config, params, values=False)
    return config, params


def gguf_metadata(reader: GGUFFile, checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """The metadata fields as plain Python values (arrays as lists), plus the vocab size if the
    file omits it.

    The tokenizer's array fields (tokens, merges) are skipped: they are large and the config
    needs only their length, which the embedding's row count also gives. Other arrays are small
    (a sliding-window pattern, one flag per layer) and kept.
    """
    fields = {
        name: as_python(value)
        for name, value in reader.metadata.items()
        if not (name.startswith("tokenizer.") and isinstance(value, (list, np.ndarray)))
    }
    vocab_key = f"{fields.get('general.architecture')}.vocab_size"
    if vocab_key not in fields and GGUF_EMBEDDING in checkpoint.names:
        fields[vocab_key] = checkpoint.shape(GGUF_EMBEDDING)[0]
    return fields


def require_supported_types(checkpoint: GGUFCheckpoint) -> None:
    for name in sorted(checkpoint.names):
        qtype = checkpoint.qtype(name)
        if qtype not in GGUF_TYPES:
            raise ValueError(
                f"{checkpoint.origin}: tensor {name!r} has GGUF type {qtype.name}, "
                f"which meshserve cannot dequantize; supported: "
                f"{', '.join(t.name for t in GGUF_TYPES)}. Use a GGUF quantized with one of those."
            )
