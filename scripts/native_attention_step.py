"""The decode step with the native kernel reading the paged KV cache's context in place, against
the same step with the portable backend's XLA loops (which gather each token's pages first),
interleaved in one process.

    .venv/bin/python scripts/native_attention_step.py [--model smollm2-135m-instruct]
        [--rows 1] [--context 128] [--repeats 11] [--steps 10]

`--rows` rows of one new token each, every one after `--context` cached tokens on pages of its
own. Both runners share the loaded model and run native quantized kernels; "xla loops" is
compiled with the native attention refused (`attention._native_serves`). Prints, per program,
its native attention calls and the copies of a cache-shaped array in the compiled HLO (none
expected: the kernel reads the caches the layer scan carries), whether the two steps' tokens are
equal, then the median and minimum over repeats of each repeat's median of `--steps` steps,
alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import statistics
import time

import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model import attention, native_dot
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.serving.python_api.llm import LLM


@contextlib.contextmanager
def xla_loops():
    """Within the block, programs traced read the context with the portable backend's loops."""
    serves = attention._native_serves
    attention._native_serves = lambda *arrays: False
    try:
        yield
    finally:
        attention._native_serves = serves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(args.model, native_kernels=True, warmup=False)
    size = llm.engine.config.page_size
    pages = -(-(args.context + 1) // size)  # each row's
    plan = dataclasses.replace(sub_batch_from_rows(
        [([1], args.context, list(range(1 + r * pages, 1 + (r + 1) * pages)))
         for r in range(args.rows)], page_size=size), replicas=np.zeros(args.rows, np.int32))
    runners, tokens = {}, {}
    for name in ("xla loops", "native"):
        runner = ModelRunner(llm.engine.model, RunnerConfig(
            max_num_seqs=args.rows, num_pages=1 + args.rows * pages, page_size=size,
            max_pages_per_seq=pages, max_num_batched_tokens=args.rows))
        with xla_loops() if name == "xla loops" else contextlib.nullcontext():
            tokens[name] = np.asarray(runner.run_step([plan])[0].tokens)  # compiles the step
        hlo = runner.program(runner.step_key([plan])).as_text()
        cache = "f32[" + ",".join(map(str, runner.cache.k.shape)) + "]"
        copies = sum(1 for line in hlo.splitlines() if re.search(r"\bcopy(-start)?\(", line)
                     and cache in line.split("=")[1])
        print(f"{name:<9}: {hlo.count(native_dot.ATTENTION_TARGET)} native attention calls, "
              f"{copies} copies of a {cache} cache", flush=True)
        runners[name] = runner
    print(f"same tokens: {np.array_equal(*tokens.values())}", flush=True)
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
        print(f"{name:<9}: step median {statistics.median(repeats) * 1e3:.2f} ms, "
              f"min {min(repeats) * 1e3:.2f} ms over {args.repeats} repeats of {args.steps} "
              f"steps ({args.rows} rows, {args.context} cached tokens each)")


if __name__ == "__main__":
    main()
