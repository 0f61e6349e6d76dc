"""This machine's limits, measured, and the decode-step floor they imply.

    floor(B) = max(weight_bytes / bandwidth, 2 * B * params / matmul_rate)
               + B * kv_bytes_read / bandwidth

For a mixture of experts, `params` are those a token runs and `weight_bytes` leave out the
experts that B tokens are expected not to choose (`meshserve.sharding.planner.experts_read`).
A quantized model's `weight_bytes` are its weights as stored (codes, scales and float weights;
`decode_floor(weights_bytes=...)`); the FLOPs of its matmuls stay those of the float model.

Bandwidth is measured as a large array copy through XLA, counting bytes read plus bytes written;
the matmul rate as a large float32 matmul. Both are medians over several runs, measured in the
same process as the step they judge, since shared machines drift.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.config import ModelConfig, kv_bytes_per_token, weight_bytes
from meshserve.model.executor.runner import ModelRunner
from meshserve.sharding.planner import experts_read


@dataclasses.dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes / s, a copy: what the floor uses
    matmul_rate: float  # flop / s
    update_bandwidth: float | None = None  # bytes / s, an in-place update, for context


def median_seconds(fn: Callable[[], object], *, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int = 512 << 20, *, repeats: int = 10) -> float:
    """Bytes read plus written per second by a large array copy.

    The copy is STREAM's "scale" kernel, dst = 1.0001 * src: XLA emits a plain `copy` on one
    thread, while an elementwise op runs on every core. The destination is donated, so each run
    writes the same memory; a fresh output each run would measure page faults instead.
    """
    state = {"src": jnp.ones((num_bytes // 4,), jnp.float32),
             "dst": jnp.zeros((num_bytes // 4,), jnp.float32)}
    scale = jax.jit(lambda src, dst: dst.at[:].set(src * 1.0001), donate_argnums=1)

    def run():
        state["dst"] = scale(state["src"], state["dst"])
        return state["dst"]

    return 2 * num_bytes / median_seconds(run, repeats=repeats)


def measure_update_bandwidth(num_bytes: int = 512 << 20, *, repeats: int = 10) -> float:
    """Bytes read plus written per second by an in-place update of a large array (a += 1).

    Reported beside the copy for context: a buffer read and rewritten in place skips the read
    that a write to other memory costs first, so this figure is the higher one.
    """
    state = {"x": jnp.ones((num_bytes // 4,), jnp.float32)}
    bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def run():
        state["x"] = bump(state["x"])
        return state["x"]

    return 2 * num_bytes / median_seconds(run, repeats=repeats)


def measure_matmul_rate(n: int = 2048, *, repeats: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * n ** 3 / median_seconds(lambda: matmul(a), repeats=repeats)


def measure_machine() -> Machine:
    return Machine(bandwidth=measure_bandwidth(), matmul_rate=measure_matmul_rate(),
                   update_bandwidth=measure_update_bandwidth())


def decode_floor(config: ModelConfig, machine: Machine, *, batch: int, context: int,
                 weights_bytes: int | None = None) -> float:
    """Seconds one decode step of `batch` sequences of `context` tokens cannot beat.
    `weights_bytes` are the weights as stored (quantized kernels are smaller, every expert
    counted); by default the float weights a step of `batch` reads."""
    stored = read_weight_bytes(config, batch) if weights_bytes is None else weights_bytes
    weights = max(stored / machine.bandwidth,
                  2 * batch * config.num_active_params / machine.matmul_rate)
    return weights + batch * context * kv_bytes_per_token(config) / machine.bandwidth


def read_weight_bytes(config: ModelConfig, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads: all but the experts left idle."""
    if config.moe is None:
        return weight_bytes(config)
    experts = config.num_layers * config.moe.num_experts * 3 * config.hidden_size \
        * config.intermediate_size * weight_bytes(config) / config.num_params
    return weight_bytes(config) - experts * (1 - experts_read(config, batch))


def measure_decode_step(runner: ModelRunner, *, batch: int, context: int,
                        repeats: int = 20) -> float:
    """Median seconds of one decode step through the runner, host work included.

    Rows are dealt round robin over the runner's data-parallel replicas, each using its own pages.
    """
    size, replicas = runner.config.page_size, runner.num_replicas
    pages_each = -(-(context + 1) // size)
    rows_per_replica = -(-batch // replicas)
    if 1 + rows_per_replica * pages_each > runner.config.num_pages:
        raise ValueError(f"batch {batch} x context {context} needs more than "
                         f"{runner.config.num_pages} pages per replica")
    slot = [i // replicas for i in range(batch)]  # the row's index within its replica
    rows = [([1], context, list(range(1 + k * pages_each, 1 + (k + 1) * pages_each)))
            for k in slot]
    plan = dataclasses.replace(sub_batch_from_rows(rows, page_size=size),
                               replicas=np.arange(batch, dtype=np.int32) % replicas)
    return median_seconds(lambda: np.asarray(runner.run_step([plan])[0].tokens), repeats=repeats)
