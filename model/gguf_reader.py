"""A GGUF file opened once: `open_gguf`, shared by the weight loader and the tokenizer.

Parsing a GGUF's metadata (a 49k-token vocabulary and its merges) takes seconds, and loading a
model reads it twice, for the weights (`meshserve.model.loading.gguf_files`) and for the tokenizer
(`meshserve.model.tokenizer`), so the reader of the file last opened is kept while the file is
unchanged (its size and modification time). This module imports neither jax nor flax.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Opens a GGUF file, turning the reader's low-level failures into one clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    stat = path.stat()
    return _read_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    del size, mtime_ns  # part of the cache key only: a rewritten file is read again
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as err:
        raise ValueError(
            f"{path} is not a readable GGUF file; it is corrupt or truncated ({err}). "
            "Download it again."
        ) from err
