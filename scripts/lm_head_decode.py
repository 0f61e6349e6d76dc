"""Whole decodes with a GGUF's tied embedding table kept in its blocks against the same values as
a float32 table: CPU and wall seconds of greedy streams, interleaved.

    .venv/bin/python scripts/lm_head_decode.py --model gemma-3-270m --rows 8 --tokens 48

The model is loaded with `--quantization auto` on a GPU's plan (its table kept quantized whatever
the platform), and each run builds a fresh engine on the kept table or on its dequantized float32
copy, warms it with one short request, then decodes `--rows` streams of `--tokens` tokens
(prompts of 8 random ids, ignore_eos). Runs alternate float, kept, float, kept, ... `--repeats`
times; the minimum of each is printed. docs/models.md#quantized-weights quotes it: it is why the
CPU's tied table is dequantized at load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from flax import nnx

from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading.hub import resolve_model
from meshserve.model.loading import load_weights
from meshserve.model.loading.pretrained import scheme_plans
from meshserve.model.quant_formats import dequantize
from meshserve.model.quantized_kernel import QuantizedKernel
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig


def run(model, table, rows: int, tokens: int) -> tuple[float, float]:
    model.embed.embedding = table
    engine = Engine.from_model(model, None, EngineConfig(
        max_num_seqs=rows, max_model_len=256, num_pages=256, warmup=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, 8).tolist() for _ in range(rows)]
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens,
                                                  ignore_eos=True))
    cpu, wall = time.process_time(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    files = resolve_model(args.model)
    config, params = load_weights(files, plans=scheme_plans("auto", platform="gpu"))
    model = model_from_params(config, params)
    kept = model.embed.embedding
    if not isinstance(kept, QuantizedKernel):
        parser.error(f"{args.model}'s embedding table is not quantized in its file")
    floats = nnx.Param(dequantize(kept.array().map(np.asarray)), axes=("vocab", "embed"))
    tables = {"float32": floats, "kept": kept}
    times = {name: [] for name in tables}
    for _ in range(args.repeats):
        for name, table in tables.items():
            times[name].append(run(model, table, args.rows, args.tokens))
            print(f"{name}: cpu {times[name][-1][0]:.2f} s, wall {times[name][-1][1]:.2f} s",
                  flush=True)
    for name, runs in times.items():
        print(f"{name} minimum: cpu {min(c for c, _ in runs):.2f} s, "
              f"wall {min(w for _, w in runs):.2f} s")


if __name__ == "__main__":
    main()
