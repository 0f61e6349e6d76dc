"""The runners' compiled programs, built without running them, for reading their HLO and memory.

`step_arguments` builds the arguments of `ModelRunner`'s step for one key as `run_calls`
builds them, for a step of padding only (as in warm-up): a program depends only on shapes, so the
compiled program is the one that key runs. `compile_step` and `compile_pipeline_call`
lower and compile the two kinds of program; neither touches the runner's KV cache.
"""

from __future__ import annotations

import jax

from meshserve.model.executor.pipeline_runner import PipelineRunner
from meshserve.model.executor.device_layout import to_devices
from meshserve.model.executor.runner import ModelRunner


def step_arguments(runner: ModelRunner, key: tuple[int, int]) -> tuple:
    """The step's arguments for the key `(token slots per replica, has targets)`:
    `(params, cache, batch, sampling)`."""
    assert tuple(key) in runner.config.step_keys(), f"{key} is not a compiled key"
    sharding = None if runner.layout is None else runner.layout.rows
    batch, sampling = to_devices(runner.template(key), sharding)
    return runner.params, runner.cache, batch, sampling


def compile_step(runner: ModelRunner, key: tuple[int, int]) -> jax.stages.Compiled:
    """The step program of `key` (token slots per replica, has targets)."""
    return runner.program(key)


def compile_pipeline_call(runner: PipelineRunner) -> jax.stages.Compiled:
    """The pipeline call: one program serves every schedule."""
    return runner.program()
