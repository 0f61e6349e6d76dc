"""Where a step's time goes: the step timed whole, and with parts of it taken out.

    .venv/bin/python scripts/profile_step.py --batch 1 --batch 16 --batch 64 --prefill 512 \
        --quantization int4 --output benchmarks/results/profile-int4-cpu.json
    .venv/bin/python scripts/profile_step.py --workload chat-mix --num-requests 64 \
        --quantization int4 --output benchmarks/results/profile-chat-mix-int4-cpu.json

With `--output`, the JSON also names the command, the machine and the commit of the source it ran
from (`meshserve.serving.bench.result_files`): a tree with uncommitted changes is refused unless
`--allow-dirty`, and so is a file that exists (a result is never overwritten).

With `--lm-head`, only the tied LM head of the model's embedding is timed at each `--batch`:
float32 against the embedding's int8 codes in groups of 32 (as GGUF's Q8_0 stores it), read by
the served path (`meshserve.model.quantized_table`) with chunks of 1, 4 and 16 MiB, and
dequantized whole (CPU time, minimum over `--repeats`).

With `--workload`, the whole run is profiled instead: the workload's requests (seeded, every
output forced to its length, so every variant runs the very same steps) go through the
continuous engine once per variant, warmed up first, and each step's time is recorded with its
token bucket and its rows. Steps are grouped as decode-only steps by their rows, and steps with
prompt tokens by their bucket; each group's parts come from the variants' times of the same
steps. Steps are timed by this process's CPU time (`--clock cpu`, the default), which other
processes on a shared machine disturb far less than wall time; host time is then the steps'
wall time less their device wait.

Each step is one compiled call through a fresh runner on SmolLM2 (`--model`), timed with its
host work: decodes of `--batch` rows at `--context` tokens of context, and with `--prefill`, one
step of that many prompt tokens (chunks of 256 beside 16 decodes, as chat-mix's busy steps are).
Variants, each the same step with one part replaced:

  full          the step as it serves
  no-attention  attention replaced by an identity (the KV writes stay)
  no-sampler    the sampler replaced by an argmax (no logprobs, penalties or filters)
  no-lm-head    the final norm and LM head replaced by a broadcast of the hidden state
  no-layers     the layer scan replaced by an identity (no layer matmuls, no attention)

A part's time is the distance of its variant from `full` (layer matmuls: no-attention minus
no-layers, which also holds the norms, RoPE and activations); host is the step's wall time
minus the time it waited for the device; the rest (embedding, cache and transfer) is what is
left. The replacements compute nonsense tokens; they exist only to time the rest. Times are the
minimum over `--repeats` runs, interleaved over the variants, which on a shared machine is the
least disturbed run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model import attention, native_dot, quantized_table, transformer
from meshserve.model.executor import steps
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.executor.sampler import Sampled
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.quant_formats import SCHEMES, QuantFormat, dequantize, quantize
from meshserve.model.quantized_kernel import QuantizedKernel
from meshserve.model.quantized_weights import weight_bytes
from meshserve.serving.bench import bench, result_files
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig

PREFILL_CHUNK = 256
PREFILL_DECODES = 16


def _identity_attention(q, k, v, cache_k, cache_v, layer, meta, **_):
    return q, cache_k, cache_v


def _argmax_sampler(logits, s, *, num_top_logprobs, replica_axes):
    rows = logits.shape[0]
    return Sampled(tokens=jnp.argmax(logits, -1).astype(jnp.int32), logprobs=jnp.zeros(rows),
                   top_ids=jnp.zeros((rows, num_top_logprobs), jnp.int32),
                   top_logprobs=jnp.zeros((rows, num_top_logprobs)))


def _no_lm_head(self, x):
    return jnp.broadcast_to(x[..., :1], (*x.shape[:-1], self.config.vocab_size))


def _no_layers(model, x, positions, ctx, constrain=None, sliding=None, adapters=None):
    return x, ctx


@contextlib.contextmanager
def variant(name: str):
    """The step's code with part `name` replaced, for runners built inside the block."""
    saved = (attention.ATTENTION_BACKENDS["jnp"], steps.sample, transformer.Llama.logits,
             steps.apply_layers)
    if name == "no-attention":
        attention.ATTENTION_BACKENDS["jnp"] = _identity_attention
    elif name == "no-sampler":
        steps.sample = _argmax_sampler
    elif name == "no-lm-head":
        transformer.Llama.logits = _no_lm_head
    elif name == "no-layers":
        steps.apply_layers = _no_layers
    try:
        yield
    finally:
        (attention.ATTENTION_BACKENDS["jnp"], steps.sample, transformer.Llama.logits,
         steps.apply_layers) = saved


VARIANTS = ("full", "no-attention", "no-sampler", "no-lm-head", "no-layers")


def step_plans(kind: str, size: int, context: int, page_size: int):
    """(runner config, the step's sub-batch plans) of a decode of `size` rows, or a prefill
    step of `size` prompt tokens beside 16 decodes."""
    pages_each = -(-(context + PREFILL_CHUNK + 1) // page_size)
    if kind == "decode":
        rows = [([1], context, list(range(1 + k * pages_each, 1 + (k + 1) * pages_each)))
                for k in range(size)]
        plans = [sub_batch_from_rows(rows, page_size=page_size)]
        seqs, tokens = size, size
    else:
        chunks = size // PREFILL_CHUNK
        decode_rows = [([1], context, list(range(1 + k * pages_each, 1 + (k + 1) * pages_each)))
                       for k in range(PREFILL_DECODES)]
        first = 1 + PREFILL_DECODES * pages_each
        prefill_rows = [([7] * PREFILL_CHUNK, 0,
                         list(range(first + k * pages_each, first + (k + 1) * pages_each)))
                        for k in range(chunks)]
        plans = [sub_batch_from_rows(prefill_rows, page_size=page_size),
                 sub_batch_from_rows(decode_rows, page_size=page_size)]
        seqs, tokens = PREFILL_DECODES + chunks, size + PREFILL_DECODES
    num_tokens = 1 << (tokens - 1).bit_length()
    config = RunnerConfig(max_num_seqs=seqs, num_pages=1 + seqs * pages_each,
                          page_size=page_size, max_pages_per_seq=pages_each,
                          max_num_batched_tokens=num_tokens)
    return config, plans


def time_steps(runners: dict, plans, repeats: int) -> dict[str, dict[str, float]]:
    """Min wall seconds and min device-wait seconds of each (warm) runner's step, interleaved."""
    walls = {name: [] for name in runners}
    waits = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            started = time.perf_counter()
            np.asarray(runner.run_step(plans)[0].tokens)
            walls[name].append(time.perf_counter() - started)
            waits[name].append(runner.last_wait_seconds)
    return {name: {"wall": min(walls[name]), "wait": min(waits[name])} for name in runners}


def parts(t: dict[str, dict[str, float]]) -> dict[str, float]:
    """Seconds per part from the variants' times (see the module docstring)."""
    full = t["full"]["wall"]
    split = {
        "layer_matmuls": t["no-attention"]["wall"] - t["no-layers"]["wall"],
        "attention": full - t["no-attention"]["wall"],
        "lm_head": full - t["no-lm-head"]["wall"],
        "sampler": full - t["no-sampler"]["wall"],
        "host": t["full"].get("host", t["full"]["wall"] - t["full"]["wait"]),
    }
    split["rest"] = full - sum(split.values())
    return {"step": full, **split}


PARTS = ("layer_matmuls", "attention", "lm_head", "sampler", "host", "rest")


class StepLog:
    """Wraps a runner's `execute`: records each step's group, wall and device-wait seconds."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.steps = runner, []
        self._execute = runner.execute
        runner.execute = self

    def __call__(self, plan):
        started, cpu = time.perf_counter(), time.process_time()
        results = self._execute(plan)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        bucket = self.runner.step_key(plan.sub_batches)[0]
        decodes = sum(b.num_rows for b in plan.sub_batches if b.tokens.shape[1] == 1)
        prompt = plan.num_tokens - decodes
        group = f"decode {decodes:>2} rows" if not prompt else f"prompt, bucket {bucket:>3}"
        self.steps.append({"group": group, "wall": wall, "cpu": cpu,
                           "wait": self.runner.last_wait_seconds,
                           "prompt_tokens": prompt, "decodes": decodes})
        return results


def profile_run(model, args) -> dict:
    """The workload through the engine once per variant; per-step times of each."""
    requests = bench.make_workload(args.workload, num_requests=args.num_requests,
                                   vocab_size=model.config.vocab_size)
    config = EngineConfig(num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                          quantization=args.quantization, compilation_cache=False)
    logs = {}
    for name in args.variants or VARIANTS:
        with variant(name):
            engine = Engine.from_model(model, None, config)  # warms up: compiles every bucket
            log = StepLog(engine.runner)
            result = bench.run_offline(engine, requests)
        logs[name] = log.steps
        print(f"{name:<13} {result['wall_s']:.1f} s, {len(log.steps)} steps, "
              f"{result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    groups = sorted({step["group"] for step in logs["full"]})
    for name in VARIANTS:  # parts without their variant count as zero
        logs.setdefault(name, logs["full"])
    table = {}
    for group in groups + ["all steps"]:
        times = {}
        for name, steps in logs.items():
            chosen = [s for s in steps if group in ("all steps", s["group"])]
            times[name] = {"wall": sum(s[args.clock] for s in chosen),
                           "wait": sum(s["wait"] for s in chosen),
                           "host": sum(s["wall"] - s["wait"] for s in chosen)}
        count = sum(1 for s in logs["full"] if group in ("all steps", s["group"]))
        table[group] = {"steps": count, **parts(times)}
    assert all(len(steps) == len(logs["full"]) for steps in logs.values()), "runs differ"
    print(f"{'group':<22} {'steps':>5} {'s':>7} " + " ".join(f"{p:>13}" for p in PARTS))
    for group, row in table.items():
        print(f"{group:<22} {row['steps']:>5} {row['step']:>7.2f} " + " ".join(
            f"{row[p]:>6.2f} ({row[p] / row['step']:>3.0%})" for p in PARTS))
    return {"workload": args.workload, "num_requests": args.num_requests,
            "engine_config": {k: getattr(config, k) for k in (
                "num_pages", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                "max_model_len", "quantization")},
            "groups": table, "steps": logs}


def lm_head_times(model, batches: list[int], repeats: int,
                  chunk_mib: tuple[int, ...] = (1, 4, 16)) -> dict[int, dict[str, float]]:
    """CPU seconds of the tied LM head per batch: the float32 table against the same table in
    int8 codes of groups of 32 with float16 scales (GGUF's Q8_0; a model loaded with its table
    kept is timed on its own blocks), read by the served path (`table_logits`), which
    dequantizes `CHUNK_BYTES` of the table at a time: timed at each of `chunk_mib`, and
    dequantized whole for comparison."""
    kernel = model.embed.embedding
    if isinstance(kernel, QuantizedKernel):
        q = kernel.array()
        table = dequantize(q, xp=jnp)
    else:
        table = kernel[...]
        q = quantize(table, QuantFormat(bits=8, group=32, num_contracted=1, num_out=0,
                                        has_mins=False, scale_dtype="float16"), xp=jnp)
    variants = {"float32": (lambda x, t: jnp.einsum("sd,vd->sv", x, t), table, None),
                "int8 whole": (lambda x, q: jnp.einsum("sd,vd->sv", x, dequantize(q, xp=jnp)),
                               q, None)}
    for mib in chunk_mib:
        variants[f"int8 chunks of {mib} MiB"] = (quantized_table.table_logits, q, mib)
    results = {}
    for batch in batches:
        x = jnp.ones((batch, table.shape[1]), jnp.float32)
        compiled = {}
        for name, (fn, weights, mib) in variants.items():
            if mib is not None:  # read when the served path is traced
                quantized_table.CHUNK_BYTES = mib << 20
            compiled[name] = (jax.jit(fn).lower(x, weights).compile(), weights)
        times = {name: [] for name in compiled}
        for _ in range(repeats):
            for name, (fn, weights) in compiled.items():
                started = time.process_time()
                jax.block_until_ready(fn(x, weights))
                times[name].append(time.process_time() - started)
        results[batch] = {name: min(t) for name, t in times.items()}
        print(f"lm head, batch {batch:>3}: " + ", ".join(
            f"{name} {t * 1e3:.1f} ms" for name, t in results[batch].items()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", default=[],
                        help="decode rows; repeat for several")
    parser.add_argument("--prefill", type=int, action="append", default=[],
                        help="prompt tokens of a prefill step (a multiple of 256)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none", choices=SCHEMES)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, default=None,
                        help="also write JSON to this new file, stamped with the source's "
                             "commit; {date} and {commit} in the name are filled in")
    parser.add_argument("--lm-head", action="store_true",
                        help="time the tied LM head in float32 and int8 at each --batch")
    parser.add_argument("--workload", default=None, help="profile a whole run of this workload")
    parser.add_argument("--variant", dest="variants", action="append", choices=VARIANTS,
                        help="run only these variants (default: all; full always)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="--workload: time steps by this process's CPU time (robust on a "
                             "shared machine; host time is wall minus device wait) or wall time")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=768)
    result_files.add_allow_dirty_argument(parser)
    args = parser.parse_args()
    try:
        args.source, args.output = result_files.prepare_output(args.output,
                                                               allow_dirty=args.allow_dirty)
    except ValueError as err:
        parser.error(str(err))
    # As the engine loads it: where native kernels run, `auto` keeps the file's 4/5/6-bit blocks.
    model = load_pretrained(args.model, quantization=args.quantization,
                            native_kernels=native_dot.resolve(None)).model
    if args.lm_head:
        times = lm_head_times(model, args.batch, args.repeats)
        if args.output:
            _write(args, model, {"lm_head_cpu_s": times})
        return
    if args.workload:
        run = profile_run(model, args)
        if args.output:
            _write(args, model, {"run": run})
        return
    results = []
    print(f"{args.model} {args.quantization}: weights {weight_bytes(model) / 1e6:.0f} MB")
    print(f"{'step':<13} {'ms':>7} " + " ".join(f"{p:>13}" for p in PARTS))
    shapes = [("decode", b) for b in args.batch] + [("prefill", p) for p in args.prefill]
    for kind, size in shapes:
        config, plans = step_plans(kind, size, args.context, page_size=16)
        runners = {}
        for name in VARIANTS:
            with variant(name):  # the step traces and compiles on its first run
                runners[name] = ModelRunner(model, config)
                runners[name].run_step(plans)
        times = time_steps(runners, plans, args.repeats)
        split = parts(times)
        label = f"{kind} {size}"
        print(f"{label:<13} {split['step'] * 1e3:>7.1f} " + " ".join(
            f"{split[p] * 1e3:>7.1f} ({split[p] / split['step']:>3.0%})" for p in PARTS),
            flush=True)
        results.append({"kind": kind, "size": size, "variants": times,
                        "parts_s": split})
    if args.output:
        _write(args, model, {"context": args.context, "steps": results})


def _write(args, model, payload: dict) -> None:
    """The JSON result, stamped with the source's provenance, to the new file `args.output`."""
    result_files.write_json(args.output, {
        "command": " ".join(["scripts/profile_step.py", *sys.argv[1:]]),
        "model": args.model, "quantization": args.quantization,
        "weight_bytes": weight_bytes(model), "environment": bench.environment(args.source),
        **payload})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
