"""The runners' compiled programs, built without running them, for reading their HLO and memory.

`step_arguments` builds the arguments of `ModelRunner`'s step for one bucket as `_dispatch`
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
from meshserve.model.runner import ModelRunner, pad_sub_batch


def step_arguments(runner: ModelRunner, rows: int, tokens: int, pages: int) -> tuple:
    """The step's arguments for the bucket `(rows per replica, tokens, pages)`:
    `(params, cache, (batch,), (sampling,))`."""
    empty = empty_sub_batch(rows * runner.num_replicas, tokens, pages)
    replicas = np.repeat(np.arange(runner.num_replicas, dtype=np.int32), rows)
    plan = dataclasses.replace(empty, replicas=replicas)
    shape = runner.padded_shape(plan)
    assert shape == (rows, tokens, pages), f"{(rows, tokens, pages)} is not a bucket: {shape}"
    index = runner.row_index(plan, shape[0])
    total = shape[0] * runner.num_replicas
    sharding = None if runner.layout is None else runner.layout.rows
    batch = pad_sub_batch(plan, (total, *shape[1:]), index=index, sharding=sharding)
    sampling = runner._device_sampling(greedy_sampling(plan.num_rows), total, shape[2], index,
                                       sharding)
    return runner.params, runner.cache, (batch,), (sampling,)


def compile_step(runner: ModelRunner, shape: tuple[int, int, int]) -> jax.stages.Compiled:
    """The step program of the bucket `shape` (rows per replica, tokens, pages)."""
    return runner._step.lower(*step_arguments(runner, *shape)).compile()


def compile_pipeline_call(runner: PipelineRunner) -> jax.stages.Compiled:
    """The pipeline call: one program serves every schedule, so an empty one lowers it."""
    schedule = build_schedule([], runner.shape)
    units = jax.device_put(runner.host_units(schedule), runner._units_sharding)
    kinds, ticks = jax.device_put((schedule.kinds, np.int32(1)), runner._replicated)
    return runner._call.lower(runner.params, runner.cache, kinds, units, ticks).compile()
