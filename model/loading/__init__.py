"""Reading checkpoint files into canonical params: `load_weights` takes a GGUF file or an HF
safetensors directory and returns `(ModelConfig, params)`.

    gguf_files.py     GGUF files: metadata, tensors (dequantized, or their blocks), `load_gguf`
    hf_files.py       HF safetensors directories: config.json, tensors, `load_hf`
    assembly.py       the shared assembly: slots, reading, checks, load-time quantization
    gguf_blocks.py    GGUF quantized blocks read straight into quantized kernels

What is specific to a model family (its config readers, tensor names and conversions) is in
`meshserve.model.families`; the canonical keys, shapes and checks in `meshserve.model.canonical`.

This package imports neither jax nor flax; the model module places the arrays on devices.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshserve.model.config import ModelConfig
from meshserve.model.loading.assembly import Params, Place, Plans, require_file
from meshserve.model.loading.gguf_files import load_gguf
from meshserve.model.loading.hf_files import load_hf

__all__ = ["load_gguf", "load_hf", "load_weights", "weights_kind_and_path"]


def load_weights(files: Any, *, dtype: str = "float32", place: Place | None = None,
                 plans: Plans | None = None) -> tuple[ModelConfig, Params]:
    """Loads `files` (anything with `.kind` "gguf" | "hf" and `.path`, or a plain path)."""
    kind, path = weights_kind_and_path(files)
    if kind == "gguf":
        return load_gguf(path, dtype=dtype, place=place, plans=plans)
    if kind == "hf":
        return load_hf(path, dtype=dtype, place=place, plans=plans)
    raise ValueError(
        f"cannot load weights of kind {kind!r} from {path}; load_weights reads 'gguf' files and "
        "'hf' safetensors directories"
    )


def weights_kind_and_path(files: Any) -> tuple[str, Path]:
    """`(kind, path)` of a ModelFiles-like object, or of a path: a .gguf file or an HF directory."""
    if not isinstance(files, (str, os.PathLike)):
        return files.kind, Path(files.path)
    path = Path(files)
    if path.is_dir():
        return "hf", path
    if path.suffix == ".gguf":
        return "gguf", path
    require_file(path)
    raise ValueError(f"{path} is neither a .gguf file nor an HF safetensors directory")
