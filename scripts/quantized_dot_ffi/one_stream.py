"""One stream of SmolLM2 (the default model and flags) through `LLM.generate`, with and without
`native_kernels`, interleaved: decode tokens/s (wall) and CPU seconds of each run.

    .venv/bin/python scripts/quantized_dot_ffi/one_stream.py [--runs 3] [--tokens 64]

Both engines are built (and warmed) first; then each run generates `--tokens` greedy tokens for
one prompt (ignore_eos), alternating the two, and prints the first tokens so a reader sees they
agree.
"""

from __future__ import annotations

import argparse
import time

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.python_api.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engines = {native: LLM(args.model, native_kernels=native) for native in (False, True)}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for _ in range(args.runs):
        for native, llm in engines.items():
            cpu, wall = time.process_time(), time.perf_counter()
            out = llm.generate(["Tell me about the sea."], params, use_tqdm=False)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"{'native' if native else 'plain':<6} {args.tokens / wall:.1f} tok/s wall, "
                  f"{cpu:.2f} s cpu, first tokens {list(out[0].outputs[0].token_ids[:5])}",
                  flush=True)


if __name__ == "__main__":
    main()
