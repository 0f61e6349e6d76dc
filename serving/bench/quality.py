"""`meshserve quality`: what quantized weights cost in quality, measured against float32.

    meshserve quality --quantization int8 --quantization int4 --from-float \\
        --text benchmarks/data/shakespeare-coriolanus.txt \\
        --output benchmarks/results/quality-smollm2-cpu.json

Everything runs through the serving engine (the ragged step, the sampler), greedy:
- the float32 model answers the workload's prompts (chat-mix by default, seeded) with
  `--max-tokens` greedy tokens each;
- each candidate reads the same prompt + those tokens as a prompt (teacher-forced, through
  `prompt_logprobs`): mean and max |logprob difference| of the float model's tokens, and the
  share of positions where its own top-1 token is the float model's (top-1 agreement);
- each candidate answers the prompts greedily itself: the share of its tokens equal to the float
  model's before their first divergence;
- perplexity on `--text`, read in windows of `--window` tokens, by every model.

Candidates are the model loaded with each `--quantization` as the engine loads it (a GGUF's
blocks kept where they fit, in the file's own bits where native kernels run, a stack mixing
block types as a mixed stack) and, with `--from-float`, the float32 model's kernels quantized by each scheme
(`quantize_model`): the load-time path of a float checkpoint. The reference is the same file's
weights dequantized to float32, so a GGUF's kept blocks (`auto`) should differ from it only by
summation order. Each candidate's row also counts its quantized kernels by format (bits, group,
minimums, scales: float, or integers times a float32 super scale per super group), the layouts
whose difference the row measures.
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path
from typing import Any

import numpy as np

from meshserve.batching.sampling import SamplingParams
from meshserve.model import native_dot
from meshserve.model.loading.hub import DEFAULT_MODEL
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.quantized_weights import quantize_model, quantized_arrays, weight_bytes
from meshserve.model.quant_formats import SCHEMES, describe
from meshserve.serving.bench import bench, result_files, workloads
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine

HELP = "quantized weights against float32: logprobs, top-1, greedy tokens, perplexity"
ENGINE = dict(num_pages=1024, max_num_seqs=16, max_num_batched_tokens=512, prefill_chunk=256,
              max_model_len=768, max_logprobs=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="known model name, .gguf file, HF directory, checkpoint")
    parser.add_argument("--quantization", action="append", choices=SCHEMES[1:], required=True,
                        help="a scheme to measure; repeat for several")
    parser.add_argument("--from-float", action="store_true",
                        help="also quantize the float32 model's kernels by each scheme")
    parser.add_argument("--workload", default="chat-mix")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--text", type=Path, required=True, help="text for the perplexity")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--output", type=Path, default=None,
                        help="write JSON to this new file; {date} and {commit} in the name are "
                             "filled in; a file that exists is refused")
    result_files.add_allow_dirty_argument(parser)


def run(args: argparse.Namespace) -> None:
    source, output = result_files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    reference = load_pretrained(args.model)
    if reference.tokenizer is None:
        raise ValueError(f"{args.model!r} has no tokenizer; the perplexity text needs one")
    requests = workloads.make_workload(args.workload, num_requests=args.num_prompts,
                                   vocab_size=reference.config.vocab_size)
    prompts = [r.prompt_token_ids[:ENGINE["max_model_len"] - args.max_tokens - 1]
               for r in requests]
    text_ids = reference.tokenizer.encode(args.text.read_text(encoding="utf-8"))
    windows = [text_ids[i:i + args.window] for i in range(0, len(text_ids) - 1, args.window)]
    native = native_dot.resolve(None)  # loaded as the engine loads it, in the layouts it serves
    candidates = {f"{scheme} (loaded)": lambda s=scheme: load_pretrained(
        args.model, quantization=s, native_kernels=native).model for scheme in args.quantization}
    if args.from_float:
        candidates |= {f"{scheme} (from float32)": lambda s=scheme: quantize_model(
            copy.deepcopy(reference.model), s) for scheme in args.quantization}
    engine = _engine(reference.model)
    want = greedy(engine, prompts, args.max_tokens)
    float_lp = teacher_forced(engine, prompts, want)
    rows = {"float32": {"weight_bytes": weight_bytes(reference.model),
                        "perplexity": perplexity(engine, windows)}}
    print(f"{'model':<22} {'MB':>6} {'mean |dlp|':>10} {'max |dlp|':>9} {'top-1':>7} "
          f"{'greedy prefix':>13} {'ppl':>7}")
    _print("float32", rows["float32"])
    for name, make in candidates.items():
        model = make()
        engine = _engine(model)
        lp = teacher_forced(engine, prompts, want)
        got = greedy(engine, prompts, args.max_tokens)
        diff = np.abs(np.concatenate(lp["logprobs"]) - np.concatenate(float_lp["logprobs"]))
        top1 = np.concatenate([t == w for t, w in zip(lp["top1"], want)])
        rows[name] = {
            "weight_bytes": weight_bytes(model), "formats": format_counts(model),
            "mean_abs_logprob_diff": float(diff.mean()), "max_abs_logprob_diff": float(diff.max()),
            "top1_agreement": float(top1.mean()),
            "greedy_prefix_share": sum(_prefix(g, w) for g, w in zip(got, want))
            / sum(len(w) for w in want),
            "perplexity": perplexity(engine, windows)}
        _print(name, rows[name])
    if output:
        result_files.write_json(output, {
            "command": "meshserve " + " ".join(args.argv), "model": args.model,
            "workload": args.workload, "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "text": str(args.text),
            "text_tokens": len(text_ids), "window": args.window,
            "environment": bench.environment(source), "models": rows})
        print(f"wrote {output}")


def _print(name: str, row: dict[str, Any]) -> None:
    cells = [row.get(k) for k in ("mean_abs_logprob_diff", "max_abs_logprob_diff",
                                  "top1_agreement", "greedy_prefix_share")]
    shown = ["-" if c is None else f"{c:.4f}" for c in cells]
    print(f"{name:<22} {row['weight_bytes'] / 1e6:>6.0f} {shown[0]:>10} {shown[1]:>9} "
          f"{shown[2]:>7} {shown[3]:>13} {row['perplexity']:>7.3f}", flush=True)
    for fmt, count in row.get("formats", {}).items():
        print(f"{'':<22} {count} x {fmt}", flush=True)


def format_counts(model) -> dict[str, int]:
    """How many of `model`'s quantized kernels each format holds, by `describe`."""
    counts: dict[str, int] = {}
    for q in quantized_arrays(model).values():
        counts[describe(q.format)] = counts.get(describe(q.format), 0) + 1
    return counts


def _engine(model) -> Engine:
    return Engine.from_model(model, None, EngineConfig(**ENGINE))


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `max_tokens` tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in _run(engine, prompts, params)]


def teacher_forced(engine: Engine, prompts: list[list[int]], continuations: list[list[int]]
                   ) -> dict[str, list[np.ndarray]]:
    """Per prompt, the model's logprob of each continuation token after the prompt and the
    tokens before it, and its own top-1 token there."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    outs = _run(engine, [p + c for p, c in zip(prompts, continuations)], params)
    logprobs, top1 = [], []
    for out, prompt, cont in zip(outs, prompts, continuations):
        entries = out.prompt_logprobs[len(prompt):len(prompt) + len(cont)]
        logprobs.append(np.array([e[t].logprob for e, t in zip(entries, cont)]))
        top1.append(np.array([next(t for t, lp in e.items() if lp.rank == 1)
                              for e in entries]))
    return {"logprobs": logprobs, "top1": top1}


def perplexity(engine: Engine, windows: list[list[int]]) -> float:
    """exp of the mean negative logprob of every token after the first of each window."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    logprobs = []
    for out, window in zip(_run(engine, windows, params), windows):
        logprobs += [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], window[1:])]
    return math.exp(-float(np.mean(logprobs)))


def _prefix(got: list[int], want: list[int]) -> int:
    """Tokens of `got` equal to `want` before their first difference."""
    n = 0
    for g, w in zip(got, want):
        if g != w:
            break
        n += 1
    return n
