"""The layer kernels at many rows of x (prefill chunks) against XLA's dequantize-and-dot and
against the kernels of another revision, interleaved in one process: to place
`meshserve.model.native_dot.max_rows`.

    .venv/bin/python scripts/quantized_dot_ffi/rows.py --baseline HEAD --rows 16 --rows 64

Times one call of `x [rows, K] . W [K, N]` for SmolLM2's MLP shapes (576 x 1536 and 1536 x 576)
in each format (Q4_1: 4 bits in groups of 32 with float16 scales and mins; Q8_0; Q5_0; Q6_K's
6 bits in groups of 16 with float32 scales), three ways: XLA's path (`quantized_matmul` without
native kernels), this tree's kernel, and the baseline revision's `model/native/grouped_dot.cc`
(built here and registered under other target names; a revision whose layer kernels take the
layer index operand, from the kernels reading layers in place on). Prints the median and minimum wall ms over
`--repeats` interleaved calls of 10 dots each."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model import native_dot
from meshserve.model.quant_formats import QuantFormat, from_codes
from meshserve.model.quantized_kernel import quantized_matmul

FORMATS = {
    "q4_1": QuantFormat(bits=4, group=32, num_contracted=1, num_out=1, has_mins=True,
                        scale_dtype="float16"),
    "q8_0": QuantFormat(bits=8, group=32, num_contracted=1, num_out=1, has_mins=False,
                        scale_dtype="float16"),
    "q5_0": QuantFormat(bits=5, group=32, num_contracted=1, num_out=1, has_mins=False,
                        scale_dtype="float16", offset=16),
    "q6_k": QuantFormat(bits=6, group=16, num_contracted=1, num_out=1, has_mins=False, offset=32),
}
SHAPES = ((576, 1536), (1536, 576))
CALLS = 10  # dots a timed call runs (a scan), so a call's overhead is a tenth of a dot's


def register_baseline(revision: str) -> str:
    """Builds the kernel source of `revision` (a git revision, or a path to a source file) and
    registers its targets with a `baseline_` prefix."""
    root = Path(__file__).resolve().parents[2]
    if Path(revision).is_file():
        source = Path(revision).read_text()
    else:
        source = subprocess.run(["git", "show", f"{revision}:model/native/grouped_dot.cc"],
                                cwd=root, check=True, capture_output=True, text=True).stdout
    scratch = Path(tempfile.mkdtemp())
    (scratch / "grouped_dot.cc").write_text(source)
    library = scratch / "baseline.so"
    subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
                    f"-I{jax.ffi.include_dir()}", f"-I{native_dot.HEADERS[0].parent}",
                    str(scratch / "grouped_dot.cc"), "-o",
                    str(library)], check=True)
    lib = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in ((native_dot.TARGET, native_dot.SYMBOL),
                           (native_dot.PACKED_TARGET, native_dot.PACKED_SYMBOL)):
        jax.ffi.register_ffi_target("baseline_" + target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return "baseline_"


def kernel(rng, fmt: QuantFormat, k: int, n: int):
    low, high = (-fmt.offset, (1 << fmt.bits) - 1 - fmt.offset) if fmt.bits < 8 else (-127, 127)
    codes = rng.integers(low, high + 1, (CALLS, k // fmt.group, fmt.group, n))
    scales = rng.uniform(0.001, 0.01, (CALLS, k // fmt.group, n))
    mins = rng.uniform(-0.1, 0.0, scales.shape) if fmt.has_mins else None
    return from_codes(codes, scales, mins, fmt).map(jnp.asarray)


def scan(dot):
    def run(x, q):
        return jax.lax.scan(lambda h, w: (h, dot(h, w)), x, q)[1]
    return jax.jit(run)


def baseline_dot(prefix: str):
    def dot(x, q):
        if q.format.bits == 8:
            return native_dot._call(prefix + native_dot.TARGET, x, q, q.values.shape[1], None)
        return native_dot._call(prefix + native_dot.PACKED_TARGET, x, q, q.values.shape[1], None,
                                keep_float16=True, bits=np.int64(q.format.bits),
                                offset=np.int64(q.format.offset))
    return dot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", default=None)
    parser.add_argument("--format", action="append", choices=list(FORMATS), default=None)
    parser.add_argument("--baseline", default="HEAD",
                        help="the old kernels: a git revision, or a path to their source")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    native_dot.ensure_registered()
    prefix = register_baseline(args.baseline)
    rng = np.random.default_rng(0)
    variants = {"xla": scan(lambda h, w: quantized_matmul("nd,df->nf", h, w)),
                "baseline": scan(baseline_dot(prefix)),
                "native": scan(native_dot.grouped_dot)}
    for name in args.format or list(FORMATS):
        for k, n in SHAPES:
            q = kernel(rng, FORMATS[name], k, n)
            for rows in args.rows or [16, 32, 64, 128, 272, 512]:
                x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
                want = np.asarray(variants["xla"](x, q))
                for variant in ("baseline", "native"):
                    got = np.asarray(variants[variant](x, q))
                    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
                times = {v: [] for v in variants}
                for _ in range(args.repeats):
                    for v, fn in variants.items():
                        start = time.perf_counter()
                        jax.block_until_ready(fn(x, q))
                        times[v].append((time.perf_counter() - start) * 1e3 / CALLS)
                print(f"{name} {k}x{n} rows {rows}: " + ", ".join(
                    f"{v} {statistics.median(t):.3f} (min {min(t):.3f})"
                    for v, t in times.items()) + " ms a dot", flush=True)


if __name__ == "__main__":
    main()
