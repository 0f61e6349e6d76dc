"""The quantized dot as native CPU kernels behind XLA's FFI (`native_kernels`).

XLA:CPU converts a quantized kernel's codes to floats in a buffer before each dot: a layer's
codes are read, written out as float32 and read again, and at one row of x the conversion costs
as much as the product. `native/grouped_dot.cc` reads each code once: at one row it streams the
codes into a float buffer of one group's partial sums per output; at several rows (AVX-512) it
holds 8 rows x 32 outputs of partial sums in registers while a group's codes are read. It serves
codes in groups with float scales and optional minimums, one contracted and one output axis:
int8 codes, and codes packed in 4, 5 or 6 bits (decoded a unit at a time into a buffer in
cache), so a GGUF's Q4, Q5 and Q6 blocks stay in the bits the file spends on them. The outputs
are split into ranges that run on XLA's intra-op threads and the calling one. A third kernel
reads a table kept in 8 bits for the tied LM head.

Inside the layer scan the layer kernels take every layer's codes (and float16 scales and mins)
stacked, with the layer's index, and read that layer's where they lie (`matmul`'s `layer`,
`meshserve.model.transformer.apply_layers`): a custom call needs each operand in a buffer of its
own, so a slice of the stacks would be copied out before every call, about as many bytes written
as the kernel then reads.

Where the CPU has AVX-512 VNNI (and, for 5 and 6 bits, VBMI), the layer kernels (packed and
int8 codes in groups of 16 to 64) take integer dots instead: each row of x is rounded per group
of the kernel to 16 bits of the group's largest |x| (`hi * 256 + lo`, two int8 halves, one float
scale), and `vpdpbusd` multiplies four codes of a column (transposed in registers from their
rows; int8 codes plus 128, as unsigned bytes) by four bytes of x, 64 products an instruction,
into exact int32 sums per group, which then take x's scale, the codes' scale and the minimum
times x's rounded group sum in floats. The only rounding this adds to the float path is x's: at
most 1/65024 of its group's largest |x| (the bound `tests/model/test_native_dot.py` holds it to);
at several rows, a row with a massive activation (its largest |x| over 128 times its mean |x|)
keeps a third byte, 1/256 of that; greedy tokens stay those of HF's float model
(`tests/model/test_golden.py`). At several rows the codes of a block of 64 columns are
transposed once and every block of four rows runs the whole of K against them, so prefill
chunks (up to 512 rows) run here too, faster than XLA's dot of the dequantized layer
(`max_rows`). The table kernel takes integer dots too at several rows of x (16 rows of the table
a block, a lane a row); where the CPU has AMX, through its tile multiplies instead (`tdpbssd`:
16 rows of the table, read where they lie, by 16 rows of x's halves, the same exact int32 sums);
at one row it stays in floats, where it reads the table about as fast as memory allows. Without
VNNI, the float kernels serve everything.

It is built on first use with the system's C++ compiler against jaxlib's FFI headers, into
`~/.cache/meshserve/native/` (keyed by the source, jax's version and the machine), and
registered with XLA once per process. No compiler, or a failed build, is `NativeUnavailable`
with the reason. The runner turns it on while it traces its programs (`enabled`): by default
wherever it can run (one CPU device, a compiler; `resolve`), or as its config says
(`EngineConfig.native_kernels`); `quantized_matmul` then sends every kernel it can serve here.
`tests/model/test_native_dot.py` holds it to the jnp path.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model.quant_formats import QuantFormat, QuantizedArray, group_scales

# Compiled together into one library: the quantized dots, and attention over the paged KV
# cache's context (`meshserve.model.attention`).
SOURCES = tuple(Path(__file__).with_name("native") / name
                for name in ("grouped_dot.cc", "paged_attention.cc"))
# Included by the sources (the library's cache key covers them too).
HEADERS = (Path(__file__).with_name("native") / "parallel_for.h",)
TARGET = "meshserve_grouped_dot"
SYMBOL = "MeshserveGroupedDot"
TABLE_TARGET = "meshserve_table_dot"
TABLE_SYMBOL = "MeshserveTableDot"
PACKED_TARGET = "meshserve_packed_dot"
PACKED_SYMBOL = "MeshservePackedDot"
ATTENTION_TARGET = "meshserve_paged_attention"
ATTENTION_SYMBOL = "MeshservePagedAttention"
_active = contextvars.ContextVar("meshserve_native_dot", default=False)


class NativeUnavailable(ValueError):
    """The native kernel cannot be built or loaded here; the message says why."""


def resolve(requested: bool | None, *, num_devices: int = 1) -> bool:
    """Whether an engine runs native kernels. Asked for (True), they are refused with the
    reason where they cannot run; unset (None, the default), they run wherever they can: JAX's
    backend is the CPU, the model is on one device, and the kernels build here (a C++ compiler;
    a failed build is logged once and the engine runs without them)."""
    if requested is False:
        return False
    if requested is None and (jax.default_backend() != "cpu" or num_devices != 1):
        return False
    if requested and num_devices != 1:
        raise NativeUnavailable(f"native kernels run on one CPU device, not {num_devices}")
    if requested and jax.default_backend() != "cpu":
        raise NativeUnavailable(f"native kernels run on the CPU; the default backend is "
                                f"{jax.default_backend()}")
    reason = _unavailable()
    if reason is not None:
        if requested:
            raise NativeUnavailable(reason)
        return False
    return True


@functools.cache
def _unavailable() -> str | None:
    """Why the kernels cannot be built and registered here, once per process; None if they
    can."""
    try:
        ensure_registered()
    except NativeUnavailable as err:
        logging.getLogger(__name__).warning("native kernels are off: %s", err)
        return str(err)
    return None


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


def matmul(spec: str, x: jax.Array, q: QuantizedArray, layer: jax.Array | None = None
           ) -> jax.Array | None:
    """`quantized_matmul(spec, x, q)` through a native kernel, or None where none serves it
    (a format it does not read, or more rows than `max_rows` allows). With `layer` (an int32
    scalar), q is every layer's kernel stacked (a leading layer axis) and the product is layer
    `layer`'s, whose codes (and float16 scales and mins) the kernel reads where they lie.
    A kernel of several contracted or output axes (attention's q [D, H, hd], o [H, hd, D]) is
    the matrix of its contracted axes merged against its output axes merged: its codes, scales
    and mins are laid out so already (groups run along the last contracted axis, which a group
    never crosses), so only their shapes change."""
    fmt = q.format
    n = fmt.num_contracted
    stack = 0 if layer is None else 1  # leading axes before a kernel's own
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    if (out != lhs[:len(lhs) - n] + rhs[n:] or fmt.group is None
            or q.values.ndim != stack + n + fmt.num_out):
        return None

    def matrix(a):  # [*stack, *contracted, *out] -> [*stack, K, N]
        return a.reshape(*a.shape[:stack], math.prod(a.shape[stack:stack + n]), -1)

    two = dataclasses.replace(q.map(matrix),
                              format=dataclasses.replace(fmt, num_contracted=1, num_out=1))
    lead = x.shape[:x.ndim - n]
    rows = x.reshape(*lead, math.prod(x.shape[x.ndim - n:]))
    if (not serves(rows, two, stacked=layer is not None)
            or math.prod(lead) > max_rows(two.format)):
        return None
    return grouped_dot(rows, two, layer).reshape(*lead, *q.shape[stack + n:])


def max_rows(fmt: QuantFormat) -> int:
    """The most rows of x a layer kernel takes for codes of this format; beyond, XLA's dot of
    the dequantized layer. Where the CPU's integer dots serve the format's bits and groups
    (AVX-512 VNNI): every row count (prefill chunks of up to 512 rows run natively, faster than
    XLA's dot); otherwise, on the float kernels, 16 (a decode batch). The kernel library answers
    (`MeshserveMaxRows`, with the measurements behind it)."""
    return _max_rows(fmt.bits, fmt.group)


@functools.cache
def _max_rows(bits: int, group: int) -> int:
    function = _library().MeshserveMaxRows
    function.argtypes = (ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int64
    return function(bits, group)


def serves(x: jax.Array, q: QuantizedArray, *, stacked: bool = False) -> bool:
    """Whether a kernel computes `x [..., K] . q [K, N]` (`stacked`: q [L, K, N], a layer of
    it): codes in groups (int8, or packed in 4, 5 or 6 bits), one contracted and one output
    axis, float32 activations."""
    return _served(x, q, num_out=1, bits=(4, 5, 6, 8), stack=int(stacked))


def grouped_dot(x: jax.Array, q: QuantizedArray, layer: jax.Array | None = None) -> jax.Array:
    """`x [..., K] . dequantized q [K, N]` -> [..., N] through the native kernel; with `layer`,
    q [L, K, N] and the product with its layer `layer`."""
    if q.format.bits == 8:
        return _call(TARGET, x, q, q.values.shape[-1], layer)
    return _call(PACKED_TARGET, x, q, q.values.shape[-1], layer, keep_float16=True,
                 bits=np.int64(q.format.bits), offset=np.int64(q.format.offset))


def serves_table(x: jax.Array, table: QuantizedArray) -> bool:
    """Whether the table kernel computes `x [..., D] . table [V, D]^T`: int8 codes in groups
    along D (the vocabulary a stack axis), float32 activations."""
    return _served(x, table, num_out=0, bits=(8,))


def table_dot(x: jax.Array, table: QuantizedArray) -> jax.Array:
    """`x [..., D] . dequantized table [V, D]^T` -> [..., V] through the native kernel, which
    reads float16 scales and mins (a GGUF's Q8_0 blocks) in place."""
    return _call(TABLE_TARGET, x, table, table.values.shape[0], None, keep_float16=True)


def _served(x: jax.Array, q: QuantizedArray, *, num_out: int, bits: tuple[int, ...],
            stack: int = 0) -> bool:
    fmt = q.format
    return (fmt.bits in bits and fmt.group is not None and fmt.num_contracted == 1
            and fmt.num_out == num_out and q.values.ndim == stack + 2
            and x.dtype == jnp.float32)


def _call(target: str, x: jax.Array, q: QuantizedArray, width: int, layer: jax.Array | None,
          *, keep_float16: bool = False, **attributes) -> jax.Array:
    """`target` on x's rows, q's codes and its scales and mins in float32 (no mins: an empty
    array) -> [..., width]. With `keep_float16` (the packed and the table kernels, which read them
    so), float16 scales and mins are passed as they are: XLA's conversion would write twice
    their bytes before each call, which at one row of x costs about as much as reading the
    codes (Gemma 3's 262,144 x 640 table: 21 MB of float32 scales a step, written and read).

    With `layer`, q is a stack of layers' kernels ([L, K, N]; not the table kernel's): the
    layer kernels take the stacked codes (and float16 scales and mins) whole, and the index,
    and read that layer's where they lie; scales XLA computes in float32 are computed for that
    layer alone, from its slice of the stacks, and passed 2-D. Without, the index operand is 0
    and every array 2-D.

    A format in super groups (a K-quant's integer sub-scales times a float32 scale per 256
    weights) has its float32 scales computed here, by XLA, right before the call
    (`group_scales`, exact): a buffer of 4 bytes per group and array, written and read again
    every call (0.25 bytes a weight for a 4-bit kernel in groups of 32 with mins, beside its 0.59
    of codes, integer scales and super scales). Inside the layer scan a format of float32 scales
    costs the same write: they are computed from the layer's slice of the stacked scales.
    Measured (before the packed kernel read float16 scales): no difference beyond the noise.
    Gemma 3 270M's Q4_K_M (o and down in super groups), its one-row decode step as `meshserve
    roofline --context 128 --batch 1` times it, 11 interleaved runs against the same kernels with
    float32 scales per group: median 54.7 ms (min 46.7) against 55.2 (min 49.1); 30 layers of
    4-bit 768 x 2048 SwiGLU MLPs at one row: 25.8 ms against 27.7 (minimum of 15)."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct((rows.shape[0], width), jnp.float32)
    halves = q.scales.dtype == jnp.float16 and (q.mins is None or q.mins.dtype == jnp.float16)
    if q.format.super_group is None and keep_float16 and halves:
        scales, mins = q.scales, q.mins
        empty = jnp.float16
    else:
        scales, mins = group_scales(_scales_of_layer(q, layer), jnp)
        empty = jnp.float32
    mins = mins if mins is not None else jnp.zeros((0, 0), empty)
    index = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    # the layer kernels take a layer index; the table, read outside the scan, none
    args = (rows, q.values, scales, mins) + (() if target == TABLE_TARGET else (index,))
    y = jax.ffi.ffi_call(target, out)(*args, **attributes)
    return y.reshape(*x.shape[:-1], width)


def _scales_of_layer(q: QuantizedArray, layer: jax.Array | None) -> QuantizedArray:
    """q's scales, mins and super scales and mins (its codes left out); of a stack, layer
    `layer`'s alone."""
    scales = dataclasses.replace(q, values=None)
    if layer is None:
        return scales
    return scales.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False))


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernels' shared library, built (once per cache) and loaded (once per process)."""
    return ctypes.cdll.LoadLibrary(str(build()))


@functools.cache
def ensure_registered() -> None:
    """Builds (once per cache) and registers the kernels with XLA (once per process)."""
    library = _library()
    for target, symbol in ((TARGET, SYMBOL), (TABLE_TARGET, TABLE_SYMBOL),
                           (PACKED_TARGET, PACKED_SYMBOL),
                           (ATTENTION_TARGET, ATTENTION_SYMBOL)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """The kernels' shared library, compiled into the cache if it is not there yet."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeUnavailable("native kernels need a C++ compiler (g++ or $CXX); none found")
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
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
             f"-I{jax.ffi.include_dir()}", f"-I{HEADERS[0].parent}", *map(str, SOURCES), "-o",
             str(partial)],
            capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeUnavailable(f"building {', '.join(p.name for p in SOURCES)} with "
                                    f"{compiler} failed:\n"
                                    f"{result.stderr[-2000:]}")
        partial.replace(library)  # whole or not at all, for a concurrent builder
    return library
