"""The quantized matmul alone: SmolLM2's down projection in a scan of 30 layers, per type.

    .venv/bin/python scripts/quant_matmul_bench.py --rows 1 --rows 16 --rows 128

Times (CPU milliseconds, the minimum of `--repeats` interleaved runs) of float32, meshserve's
int8 and int4 kernels (`meshserve.model.quantized_kernel`), and, when the qwix package is installed
(`pip install qwix`), qwix's weight-only int8 (per channel) and int4 (groups of 32, minmax)
`dot_general` on the same weights; with each compiled program's largest float buffer, against a
layer's kernel.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.quant_formats import quantize, scheme_format
from meshserve.model.quantized_kernel import QuantizedKernel, quantized_matmul

LAYERS, ROWS_IN, COLS = 30, 1536, 576  # SmolLM2's ffw -> embed


def _scan(matmul):
    """x [N, F] through LAYERS layers of h + tanh(matmul(h, layer))."""
    def run(x, stacked):
        def layer(h, w):
            y = matmul(h, w)  # [N, D]
            return h + 1e-3 * jnp.tanh(jnp.tile(y, (1, 3))[:, :ROWS_IN]), None
        return jax.lax.scan(layer, x, stacked)[0]
    return run


def variants(w: np.ndarray) -> dict:
    out = {"float32": (_scan(lambda h, k: h @ k), jnp.asarray(w))}
    for scheme in ("int8", "int4"):
        kernel = QuantizedKernel(quantize(w, scheme_format(scheme, 1, 1)).map(jnp.asarray),
                                 ("layers", "ffw", "embed"))
        graphdef, state = nnx.split(kernel)
        out[scheme] = (_scan(lambda h, s, g=graphdef: quantized_matmul(
            "nf,fd->nd", h, nnx.merge(g, s))), state)
    try:
        import qwix
    except ImportError:
        print("qwix is not installed: its rows are skipped")
        return out
    dims = (((1,), (0,)), ((), ()))
    stacked = jnp.asarray(w)
    int8 = jax.vmap(lambda a: qwix.quantize(a, jnp.int8, channelwise_axes=[1]))(stacked)
    int4 = jax.vmap(lambda a: qwix.quantize(a, jnp.int4, channelwise_axes=[1], tiled_axes={0: 32},
                                            calibration_method="minmax"))(stacked)
    out["qwix int8"] = (_scan(lambda h, q: qwix.dot_general(h, q, dims)), int8)
    out["qwix int4"] = (_scan(lambda h, q: qwix.dot_general(h, q, dims)), int4)
    return out


def largest_float_buffer(hlo: str) -> int:
    """Elements of the largest float32 array an instruction (not a parameter) produces."""
    sizes = [int(np.prod([int(d) for d in shape.split(",") if d]))
             for line in hlo.splitlines() if "parameter(" not in line
             for shape in re.findall(r"= f32\[([\d,]*)\]", line)]
    return max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    w = np.random.default_rng(0).standard_normal((LAYERS, ROWS_IN, COLS)).astype(np.float32) * .05
    cases = variants(w)
    for rows in args.rows:
        x = jnp.full((rows, ROWS_IN), 0.01, jnp.float32)
        compiled = {name: (jax.jit(fn).lower(x, p).compile(), p) for name, (fn, p) in cases.items()}
        times = {name: [] for name in compiled}
        for _ in range(args.repeats):
            for name, (fn, p) in compiled.items():
                started = time.process_time()
                jax.block_until_ready(fn(x, p))
                times[name].append(time.process_time() - started)
        print(f"{rows:>4} rows: " + ", ".join(
            f"{name} {min(t) * 1e3:.1f} ms" for name, t in times.items()), flush=True)
        if rows == args.rows[0]:
            print("      largest float buffer / a layer's kernel: " + ", ".join(
                f"{name} {largest_float_buffer(fn.as_text()) / (ROWS_IN * COLS):.2f}"
                for name, (fn, _) in compiled.items()))


if __name__ == "__main__":
    main()
