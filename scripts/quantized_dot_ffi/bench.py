"""The quantized dot as a CPU kernel behind XLA's FFI, against the path meshserve runs: a
prototype, to measure what a kernel that reads int8 codes without writing them out as floats
would give on XLA:CPU.

    .venv/bin/python scripts/quantized_dot_ffi/bench.py --rows 1 --rows 4 --rows 16 \
        --output 'benchmarks/results/quantized-dot-ffi-cpu-{date}-{commit}.json'

Builds `model/native/grouped_dot.cc` (`meshserve.model.native_dot`, as `--native-kernels` does),
checks it against `quantized_matmul` on random codes, then times a scan over
30 layers of SmolLM2's MLP shapes (gate and up 576 x 1536, down 1536 x 576; int8 codes in groups
of 32 with float32 scales and mins, as its Q4_1 blocks are kept on the CPU) three ways: float32
weights, meshserve's `quantized_matmul` (each layer's codes dequantized, then one dot), and the
FFI kernels (on XLA's intra-op threads) over the codes in int8 containers and packed two a byte
as the file stores them. CPU and wall ms, minimum over the repeats, interleaved. With
`--output`, the JSON is stamped with the source's commit (`meshserve.serving.bench.result_files`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model import native_dot
from meshserve.model.quant_formats import QuantFormat, QuantizedArray, dequantize, from_codes
from meshserve.model.quantized_kernel import quantized_matmul
from meshserve.serving.bench import bench, result_files

LAYERS, D, F, GROUP = 30, 576, 1536, 32
FORMAT = QuantFormat(bits=8, group=GROUP, num_contracted=1, num_out=1, has_mins=True)
PACKED = dataclasses.replace(FORMAT, bits=4, scale_dtype="float16")  # Q4_1 as a file keeps it


def ffi_dot(x: jax.Array, q: QuantizedArray) -> jax.Array:
    return native_dot.grouped_dot(x, q)


def kernels(rng, k: int, n: int) -> tuple[QuantizedArray, QuantizedArray]:
    """Random Q4_1-like codes (0..15) of [LAYERS, k, n], scales and mins per group of 32: in
    int8 containers, and packed two a byte."""
    codes = rng.integers(0, 16, (LAYERS, k // GROUP, GROUP, n))
    scales = rng.uniform(0.001, 0.01, (LAYERS, k // GROUP, n)).astype(np.float16)
    mins = -8 * scales
    return tuple(from_codes(codes, scales, mins, fmt).map(jnp.asarray)
                 for fmt in (FORMAT, PACKED))


def mlp_scan(dot):
    """SwiGLU MLPs over the layers, each through `dot(x, kernel)`."""
    def run(x, gate, up, down):
        def layer(h, w):
            g, u, d = w
            return h + dot(jax.nn.silu(dot(h, g)) * dot(h, u), d) * 0.01, None
        return jax.lax.scan(layer, x, (gate, up, down))[0]
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=None, help="also write JSON to this new file")
    result_files.add_allow_dirty_argument(parser)
    args = parser.parse_args()
    try:
        source, output = result_files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    except ValueError as err:
        parser.error(str(err))
    measured = {}
    native_dot.ensure_registered()
    rng = np.random.default_rng(0)
    (gate, gate4), (up, up4), (down, down4) = kernels(rng, D, F), kernels(rng, D, F), \
        kernels(rng, F, D)
    one = lambda q: q.map(lambda a: a[0])  # noqa: E731
    x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
    want = quantized_matmul("nd,df->nf", x, one(gate))
    np.testing.assert_allclose(ffi_dot(x, one(gate)), want, rtol=1e-4, atol=1e-4)
    floats = tuple(jnp.asarray(dequantize(q.map(np.asarray))) for q in (gate, up, down))
    variants = {
        "float32": (mlp_scan(lambda h, w: h @ w), floats),
        "quantized_matmul": (mlp_scan(lambda h, w: quantized_matmul("nd,df->nf", h, w)),
                             (gate, up, down)),
        "ffi kernel": (mlp_scan(ffi_dot), (gate, up, down)),
        "ffi kernel 4-bit": (mlp_scan(ffi_dot), (gate4, up4, down4)),
    }
    for rows in args.rows or [1, 16]:
        h = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
        results = {name: fn(h, *w) for name, (fn, w) in variants.items()}
        for name in ("ffi kernel", "ffi kernel 4-bit"):
            np.testing.assert_allclose(results[name], results["quantized_matmul"],
                                       rtol=1e-3, atol=1e-3)
        times = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (fn, w) in variants.items():
                cpu, wall = time.process_time(), time.perf_counter()
                jax.block_until_ready(fn(h, *w))
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
        measured[rows] = {name: {"cpu_s": min(c for c, _ in t), "wall_s": min(w for _, w in t)}
                          for name, t in times.items()}
        print(f"{rows} rows, 30 layers of MLP: " + ", ".join(
            f"{name} cpu {min(c for c, _ in t) * 1e3:.1f} ms wall "
            f"{min(w for _, w in t) * 1e3:.1f} ms" for name, t in times.items()), flush=True)
    if output:
        result_files.write_json(output, {
            "command": " ".join(["scripts/quantized_dot_ffi/bench.py", *sys.argv[1:]]),
            "shapes": {"layers": LAYERS, "embed": D, "ffw": F, "group": GROUP},
            "environment": bench.environment(source), "mlp_scan_seconds": measured})
        print(f"wrote {output}")


if __name__ == "__main__":
    main()
