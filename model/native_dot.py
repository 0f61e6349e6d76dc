"""The quantized dot as a native CPU kernel behind XLA's FFI, opt-in (`native_kernels`).

XLA:CPU converts a quantized kernel's codes to floats in a buffer before each dot: a layer's
codes are read, written out as float32 and read again, and at one row of x the conversion costs
as much as the product. `native/grouped_dot.cc` reads each code once: at one row it streams the
codes into a float buffer of one group's partial sums per output; at several rows (AVX-512) it
holds 8 rows x 32 outputs of partial sums in registers while a group's codes are read. It serves
int8 codes in groups with float scales and optional minimums (`QuantFormat(bits=8, group=G)`,
one contracted and one output axis: every kernel a GGUF's blocks are kept in on the CPU), one
thread, on the CPU.

It is built on first use with the system's C++ compiler against jaxlib's FFI headers, into
`~/.cache/meshserve/native/` (keyed by the source, jax's version and the machine), and
registered with XLA once per process. No compiler, or a failed build, is `NativeUnavailable`
with the reason. The runner turns it on while it traces its programs (`enabled`), only where its
config asks and only on one CPU device (`EngineConfig.native_kernels`); `quantized_matmul` then
sends every kernel it can serve here. `tests/model/test_native_dot.py` holds it to the jnp path.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp

from meshserve.model.quant_formats import QuantizedArray

SOURCE = Path(__file__).with_name("native") / "grouped_dot.cc"
TARGET = "meshserve_grouped_dot"
SYMBOL = "MeshserveGroupedDot"
TABLE_TARGET = "meshserve_table_dot"
TABLE_SYMBOL = "MeshserveTableDot"
_active = contextvars.ContextVar("meshserve_native_dot", default=False)


class NativeUnavailable(ValueError):
    """The native kernel cannot be built or loaded here; the message says why."""


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Within the block, programs traced send the dots they can to the native kernel (built and
    registered first)."""
    if on:
        if jax.default_backend() != "cpu":
            raise NativeUnavailable(f"native kernels run on the CPU; the default backend is "
                                    f"{jax.default_backend()}")
        ensure_registered()
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    return _active.get()


def serves(x: jax.Array, q: QuantizedArray) -> bool:
    """Whether the kernel computes `x [..., K] . q [K, N]`: int8 codes in groups, one
    contracted and one output axis, float32 activations."""
    return _served(x, q, num_out=1)


def grouped_dot(x: jax.Array, q: QuantizedArray) -> jax.Array:
    """`x [..., K] . dequantized q [K, N]` -> [..., N] through the native kernel."""
    return _call(TARGET, x, q, q.values.shape[1])


def serves_table(x: jax.Array, table: QuantizedArray) -> bool:
    """Whether the table kernel computes `x [..., D] . table [V, D]^T`: int8 codes in groups
    along D (the vocabulary a stack axis), float32 activations."""
    return _served(x, table, num_out=0)


def table_dot(x: jax.Array, table: QuantizedArray) -> jax.Array:
    """`x [..., D] . dequantized table [V, D]^T` -> [..., V] through the native kernel."""
    return _call(TABLE_TARGET, x, table, table.values.shape[0])


def _served(x: jax.Array, q: QuantizedArray, *, num_out: int) -> bool:
    fmt = q.format
    return (fmt.bits == 8 and fmt.group is not None and fmt.num_contracted == 1
            and fmt.num_out == num_out and q.values.ndim == 2 and x.dtype == jnp.float32)


def _call(target: str, x: jax.Array, q: QuantizedArray, width: int) -> jax.Array:
    """`target` on x's rows, q's codes and its scales and mins in float32 (no mins: an empty
    array) -> [..., width]."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct((rows.shape[0], width), jnp.float32)
    mins = q.mins if q.mins is not None else jnp.zeros((0, 0), jnp.float32)
    y = jax.ffi.ffi_call(target, out)(rows, q.values, q.scales.astype(jnp.float32),
                                      mins.astype(jnp.float32))
    return y.reshape(*x.shape[:-1], width)


@functools.cache
def ensure_registered() -> None:
    """Builds (once per cache) and registers the kernel with XLA (once per process)."""
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in ((TARGET, SYMBOL), (TABLE_TARGET, TABLE_SYMBOL)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """The kernel's shared library, compiled into the cache if it is not there yet."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeUnavailable("native kernels need a C++ compiler (g++ or $CXX); none found")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jax.__version__.encode() + platform.machine().encode()
                         + compiler.encode()).hexdigest()[:16]
    directory = Path(cache_dir or Path.home() / ".cache" / "meshserve" / "native")
    library = directory / f"grouped_dot-{key}.so"
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / library.name
        result = subprocess.run(
            [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
             f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)],
            capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeUnavailable(f"building {SOURCE.name} with {compiler} failed:\n"
                                    f"{result.stderr[-2000:]}")
        partial.replace(library)  # whole or not at all, for a concurrent builder
    return library
