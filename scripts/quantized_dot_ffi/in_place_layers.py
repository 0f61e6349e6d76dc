"""The one-row decode step with native kernels, each layer's quantized codes read in place from
the stacked weights, against the same step with the layer scan slicing them (XLA then copies each
layer's codes into a buffer of their own before every native call), interleaved in one process.

    .venv/bin/python scripts/quantized_dot_ffi/in_place_layers.py [--model smollm2-135m-instruct]
        [--repeats 15] [--steps 10] [--context 128] [--tokens 1]

`--tokens` over 1 steps a prefill chunk of that many tokens of one sequence instead.

Both runners share the loaded model; "sliced" is compiled with `layer_stacked_kernels` finding
no kernel, which is the scan as it runs without native kernels. Prints each program's count of
dynamic-slice instructions in the compiled HLO, the two steps' tokens (equal), then per repeat
the median of `--steps` steps of each, alternating, and the median and minimum over repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model import transformer
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.serving.python_api.llm import LLM


@contextlib.contextmanager
def sliced_layers():
    """Within the block, programs traced let the layer scan slice every layer weight."""
    found = transformer.layer_stacked_kernels
    transformer.layer_stacked_kernels = lambda layers: frozenset()
    try:
        yield
    finally:
        transformer.layer_stacked_kernels = found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=1, help="new tokens in the step's row")
    args = parser.parse_args()
    llm = LLM(args.model, native_kernels=True, warmup=False)
    size = llm.engine.config.page_size
    pages = -(-(args.context + args.tokens) // size)
    plan = dataclasses.replace(  # one row, as `meshserve roofline --batch 1` steps it
        sub_batch_from_rows([([1] * args.tokens, args.context, list(range(1, 1 + pages)))],
                            page_size=size),
        replicas=np.zeros(1, np.int32))
    runners = {}
    for name in ("sliced", "in place"):
        runner = ModelRunner(llm.engine.model, RunnerConfig(
            max_num_seqs=1, num_pages=1 + pages, page_size=size, max_pages_per_seq=pages,
            max_num_batched_tokens=args.tokens))
        with sliced_layers() if name == "sliced" else contextlib.nullcontext():
            tokens = np.asarray(runner.run_step([plan])[0].tokens)  # compiles the step
        hlo = runner.program(runner.step_key([plan])).as_text()
        print(f"{name:<8}: {hlo.count('dynamic-slice(')} dynamic-slice instructions, "
              f"token {tokens.tolist()}", flush=True)
        runners[name] = runner
    times = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                np.asarray(runner.run_step([plan])[0].tokens)
                steps.append(time.perf_counter() - start)
            times[name].append(statistics.median(steps))
    for name, repeats in times.items():
        print(f"{name:<8}: step median {statistics.median(repeats) * 1e3:.2f} ms, "
              f"min {min(repeats) * 1e3:.2f} ms over {args.repeats} repeats of "
              f"{args.steps} steps (each repeat's median)")


if __name__ == "__main__":
    main()
