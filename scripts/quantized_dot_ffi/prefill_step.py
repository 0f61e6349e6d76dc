"""A whole engine step at many rows with the layer kernels native against the same step with
layer dots of more than 16 rows through XLA's dequantize-and-dot (as `native_dot.max_rows` had
it before the integer kernels took prefill chunks), interleaved in one process.

    .venv/bin/python scripts/quantized_dot_ffi/prefill_step.py --prefill 256 --batch 32

Steps as `scripts/profile_step.py` builds them: `--batch` decodes of that many rows at
`--context`, and `--prefill` prompt tokens in chunks of 256 beside 16 decodes (chat-mix's busy
steps; the program runs the token bucket, the next power of two). Prints the median and minimum
wall ms of `--repeats` interleaved steps."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_step import step_plans  # noqa: E402

from meshserve.model import native_dot  # noqa: E402
from meshserve.model.executor.runner import ModelRunner  # noqa: E402
from meshserve.model.loading.pretrained import load_pretrained  # noqa: E402

DECODE_ROWS = 16  # the limit the layer kernels had before they took prefill chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", default=[])
    parser.add_argument("--prefill", type=int, action="append", default=[])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--model", default=str(Path.home() / ".cache/meshserve/models/"
                        "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--quantization", default="auto", help="auto: the file's blocks")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = load_pretrained(args.model, quantization=args.quantization,
                            native_kernels=native_dot.resolve(True)).model
    limit = native_dot.max_rows
    shapes = [("decode", b) for b in args.batch] + [("prefill", p) for p in args.prefill]
    for kind, size in shapes:
        config, plans = step_plans(kind, size, args.context, page_size=16)
        runners = {}
        for name in ("native", f"xla beyond {DECODE_ROWS}"):
            if name != "native":  # read while the step traces, on its first run
                native_dot.max_rows = lambda fmt: min(limit(fmt), DECODE_ROWS)  # noqa: E731
            try:
                runners[name] = ModelRunner(model, config)
                runners[name].run_step(plans)
            finally:
                native_dot.max_rows = limit
        times = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                started = time.perf_counter()
                np.asarray(runner.run_step(plans)[0].tokens)
                times[name].append((time.perf_counter() - started) * 1e3)
        label = f"{Path(args.model).name} {kind} {size} ({config.max_num_batched_tokens} rows)"
        print(f"{label}: " + ", ".join(f"{name} {statistics.median(t):.1f} (min {min(t):.1f})"
                                       for name, t in times.items()) + " ms a step", flush=True)


if __name__ == "__main__":
    main()
