"""The native table head (`meshserve.model.native_dot.table_dot`) on a tied LM head's shape,
against the float32 product it stands for: ms and GFLOP/s per call at each row count.

    .venv/bin/python scripts/quantized_dot_ffi/table_head.py                  # Gemma 3's head
    .venv/bin/python scripts/quantized_dot_ffi/table_head.py --vocab 49152 --dim 576  # SmolLM2's

Random Q8_0-like codes (-127..127, a float32 scale per 32) of [vocab, dim]; x [rows, dim]. Each
row count is called once to compile and check (the largest difference from numpy's float32
product, relative to its largest value, is printed), then `--repeats` times; the minimum is
reported. The kernel is built from `model/native/grouped_dot.cc` as `--native-kernels` builds
it; timing another revision of that file means checking it out first.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model import native_dot
from meshserve.model.quant_formats import QuantFormat, QuantizedArray

GROUP = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--rows", type=int, action="append", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, size=(args.vocab, args.dim), dtype=np.int8)
    scales = (rng.random((args.vocab, args.dim // GROUP), dtype=np.float32) * 0.01)
    fmt = QuantFormat(bits=8, group=GROUP, num_contracted=1, num_out=0, has_mins=False)
    native_dot.ensure_registered()
    head = jax.jit(lambda x, values, s: native_dot.table_dot(
        x, QuantizedArray(values=values, scales=s, mins=None, format=fmt)))
    values, scale_array = jnp.asarray(codes), jnp.asarray(scales)
    table = None
    print(f"table [{args.vocab}, {args.dim}] int8 codes, a float32 scale per {GROUP}")
    for rows in args.rows or [1, 16, 64]:
        x = rng.standard_normal((rows, args.dim), dtype=np.float32)
        got = np.asarray(head(jnp.asarray(x), values, scale_array))
        if rows <= 16:  # the float32 product, for the check, on a slice of the vocabulary
            if table is None:
                table = codes[:4096].astype(np.float32) * np.repeat(scales[:4096], GROUP, axis=1)
            want = x @ table.T
            error = np.abs(got[:, :4096] - want).max() / np.abs(want).max()
            print(f"rows {rows}: relative difference from float32 {error:.1e}")
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            head(jnp.asarray(x), values, scale_array).block_until_ready()
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"rows {rows:3d}: {best * 1e3:8.2f} ms, "
              f"{2 * rows * args.vocab * args.dim / best / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
