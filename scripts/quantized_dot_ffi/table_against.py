"""The native table head of this tree against another revision's, interleaved in one process: the
kernel alone on a model's own table, and the model's whole decode step, at each `--batch` rows.

    .venv/bin/python scripts/quantized_dot_ffi/table_against.py --model gemma-3-270m \
        --batch 1 --batch 4 --batch 16 [--revision HEAD] [--repeats 15] [--steps 5]

The revision's `model/native/grouped_dot.cc` is built as `--native-kernels` builds it and its
table kernel registered under a target of its own, which is passed the table's scales converted
to float32 by XLA before each call (as the table kernel took them before it read a file's float16
scales in place); this tree's gets them as the model keeps them. Everything else in the step (the
layer kernels, which the revision's library also holds) is this tree's. The model loads as the
engine does (`--quantization auto`: a GGUF's Q8_0 table kept in its blocks).

Kernels alone: x drawn at random, [batch, D]; the largest difference of the two kernels' logits
relative to the largest logit is printed. Steps: decodes of `--batch` rows at `--context` tokens
of context (`scripts/profile_step.py`'s plans), whose tokens are compared (equal). Per
repeat, each variant's median of `--steps` calls, the variants alternating; printed: the median
and the minimum over repeats (wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_step import step_plans  # noqa: E402

from meshserve.model import native_dot  # noqa: E402
from meshserve.model.executor.runner import ModelRunner  # noqa: E402
from meshserve.model.quantized_kernel import QuantizedKernel  # noqa: E402
from meshserve.serving.python_api.llm import LLM  # noqa: E402

REVISION_TARGET = "meshserve_table_dot_revision"


def register_revision(revision: str) -> None:
    """Builds `revision`'s kernel source and registers its table kernel as `REVISION_TARGET`."""
    root = Path(native_dot.SOURCES[0]).resolve().parents[2]
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{revision}:model/native/grouped_dot.cc"],
        check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "grouped_dot.cc"
        path.write_bytes(source)
        ours, native_dot.SOURCES = native_dot.SOURCES, (path,)
        try:
            library = ctypes.cdll.LoadLibrary(str(native_dot.build()))
        finally:
            native_dot.SOURCES = ours
    jax.ffi.register_ffi_target(REVISION_TARGET, jax.ffi.pycapsule(library.MeshserveTableDot),
                                platform="cpu")


def revision_table_dot(x, table):
    """`native_dot.table_dot` through the revision's kernel, its scales and mins in float32."""
    rows = x.reshape(-1, x.shape[-1])
    mins = table.mins.astype(jnp.float32) if table.mins is not None else jnp.zeros((0, 0))
    out = jax.ShapeDtypeStruct((rows.shape[0], table.values.shape[0]), jnp.float32)
    y = jax.ffi.ffi_call(REVISION_TARGET, out)(rows, table.values,
                                               table.scales.astype(jnp.float32), mins)
    return y.reshape(*x.shape[:-1], table.values.shape[0])


@contextlib.contextmanager
def revision_head(on: bool):
    """Within the block (`on`), programs traced read the head through the revision's kernel."""
    ours = native_dot.table_dot
    if on:
        native_dot.table_dot = revision_table_dot
    try:
        yield
    finally:
        native_dot.table_dot = ours


def timed(calls: dict, repeats: int, steps: int) -> dict[str, list[float]]:
    """Each call's median over `steps`, per repeat, alternating between the calls (ms)."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            once = []
            for _ in range(steps):
                start = time.perf_counter()
                call()
                once.append((time.perf_counter() - start) * 1e3)
            times[name].append(statistics.median(once))
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    print(label + " | ".join(f"{name} median {statistics.median(t):7.2f} min {min(t):7.2f}"
                            for name, t in times.items()) + " ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--revision", default="HEAD")
    parser.add_argument("--batch", type=int, action="append", default=[])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-steps", action="store_true", help="time the kernels alone only")
    args = parser.parse_args()
    register_revision(args.revision)
    llm = LLM(args.model, native_kernels=True, warmup=False)
    model = llm.engine.model
    table = model.embed.embedding
    assert isinstance(table, QuantizedKernel), "the model's table is not kept quantized"
    table = table.array()
    print(f"{args.model}: table {table.values.shape} {table.values.dtype}, scales "
          f"{table.scales.dtype}, mins {None if table.mins is None else table.mins.dtype}")
    rng = np.random.default_rng(0)
    heads = {"revision": jax.jit(revision_table_dot), "tree": jax.jit(native_dot.table_dot)}
    for batch in args.batch or [1, 4, 16]:
        x = jnp.asarray(rng.standard_normal((batch, table.values.shape[1])), jnp.float32)
        got = {name: np.asarray(head(x, table)) for name, head in heads.items()}
        difference = (np.abs(got["tree"] - got["revision"]).max()
                      / np.abs(got["revision"]).max())
        times = timed({name: lambda head=head: head(x, table).block_until_ready()
                       for name, head in heads.items()}, args.repeats, args.steps)
        report(f"head  {batch:2d} rows (difference {difference:.1e}): ", times)
        if args.no_steps:
            continue
        config, plans = step_plans("decode", batch, args.context, llm.engine.config.page_size)
        runners, tokens = {}, {}
        for name in heads:
            runner = ModelRunner(model, config)
            with revision_head(name == "revision"):
                tokens[name] = np.asarray(runner.run_step(plans)[0].tokens)  # compiles the step
            runners[name] = runner
        same = np.array_equal(tokens["revision"], tokens["tree"])
        print(f"  step tokens {'equal' if same else 'DIFFER'}: {tokens['tree'].tolist()[:4]} ...")
        times = timed({name: lambda runner=runner: np.asarray(runner.run_step(plans)[0].tokens)
                       for name, runner in runners.items()}, args.repeats, args.steps)
        report(f"step  {batch:2d} rows: ", times)


if __name__ == "__main__":
    main()
