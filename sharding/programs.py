"""The runners' compiled programs, built without running them, for reading their HLO and memory.

`step_arguments` builds the arguments of `ModelRunner`'s step for one bucket as `run_calls`
builds them, for a sub-batch of padding rows (as in warm-up): a program depends only on shapes,
so the compiled program is the one that bucket runs. `compile_step` and `compile_pipeline_call`
lower and compile the two kinds of program; neither touches the runner's KV cache.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from meshserve.batching.pipeline import build_schedule
from meshserve.batching.plan import empty_sub_batch, greedy_sampling
from meshserve.model.pipeline import PipelineRunner
from meshserve.model.runner import ModelRunner, to_devices


def step_arguments(runner: ModelRunner, rows: int, tokens: int, pages: int) -> tuple:
    """The step's arguments for the bucket `(rows per replica, tokens, pages)`:
    `(params, cache, (batch,), (sampling,))`."""
    empty = empty_sub_batch(rows * runner.num_replicas, tokens, pages)
    replicas = np.repeat(np.arange(runner.num_replicas, dtype=np.int32), rows)
    plan = dataclasses.replace(empty, replicas=replicas)
    call = runner.host_call(plan, greedy_sampling(plan.num_rows))
    assert call.key[:3] == (rows, tokens, pages), f"{(rows, tokens, pages)} is not a bucket"
    sharding = None if runner.layout is None else runner.layout.rows
    batch, sampling = to_devices(call.arrays, sharding)
    return runner.params, runner.cache, (batch,), (sampling,)


def compile_step(runner: ModelRunner, shape: tuple[int, int, int]) -> jax.stages.Compiled:
    """The step program of the bucket `shape` (rows per replica, tokens, pages)."""
    return runner._step.lower(*step_arguments(runner, *shape)).compile()


def compile_pipeline_call(runner: PipelineRunner) -> jax.stages.Compiled:
    """The pipeline call: one program serves every schedule, so an empty one lowers it."""
    schedule = build_schedule([], runner.shape)
    units, kinds, ticks = runner.to_devices(runner.host_arrays(schedule))
    return runner._call.lower(runner.params, runner.cache, kinds, units, ticks).compile()
