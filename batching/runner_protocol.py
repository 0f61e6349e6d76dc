"""The runner contract: what the engine needs from whatever runs its plans.

    keys = runner.warmup()          # compile every program a plan can need; run nothing
    results = runner.execute(plan)  # one call: the plan's sampled tokens, back on the host

A runner whose `splits_sampling` is true can also run a step as two calls (`SplitRunner`):

    forward = runner.forward(plan.sub_batches)      # dispatched; returns at once
    ...                                             # the host computes the step's masks
    results = runner.sample(forward, plan.sampling) # what execute(plan) returns

Three runners keep it:
  - `ModelRunner` (model/executor/runner.py): a `StepPlan` runs as one compiled ragged step and
    returns one `SampledRows` per sub-batch;
  - `PipelineRunner` (model/executor/pipeline_runner.py): a `PipelineSchedule` of several rounds
    runs as one pipeline call and returns, per round, one `SampledRows` per sub-batch;
  - the tests' `FakeRunner` (tests/serving/fake_runner.py): an arithmetic model over a fake
    paged cache, with no jax, so engine and server tests assert exact streams and compile
    nothing.

Plain numpy, like the rest of `batching/`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

from meshserve.batching.plan import SubBatchPlan


@dataclasses.dataclass(frozen=True)
class SampledRows:
    """Host copy of one sub-batch's result, padding removed."""

    tokens: np.ndarray  # [B] int32
    logprobs: np.ndarray  # [B] float32, raw logprob of the sampled token
    top_ids: np.ndarray  # [B, K] int32
    top_logprobs: np.ndarray  # [B, K] float32
    prompt_logprobs: np.ndarray | None = None  # [B, T]
    prompt_top_ids: np.ndarray | None = None  # [B, T, K]
    prompt_top_logprobs: np.ndarray | None = None  # [B, T, K]


class Runner(Protocol):
    model_config: Any  # the model's sizes: vocab_size, eos_token_ids, max_position_embeddings
    config: Any  # the runner's settings (`RunnerConfig`): cache geometry, sampler limits
    num_replicas: int  # data-parallel replicas, each with its own pages
    attention: str  # the attention backend, as GetServerInfo reports it
    last_wait_seconds: float  # of the last `execute`, the time spent waiting for the device
    last_user: object | None  # the engine that ran last (engines sharing a runner take turns)
    channel: Any | None  # the plan stream of a multi-process run (serving/engine/multihost.py)
    splits_sampling: bool  # whether it is a `SplitRunner` that can split a step now

    def warmup(self, *, progress: bool = True, prompt_logprobs: bool = True
               ) -> list[tuple[int, ...]]:
        """Compiles every program a plan can need (those that return prompt logprobs only with
        `prompt_logprobs`; else each on first use), runs nothing; returns the keys of the calls
        they serve (with and without a structured-output mask: one program serves both)."""
        ...

    def execute(self, plan: Any) -> list:
        """Runs `plan` as one call and returns what it sampled (see the module docstring)."""
        ...


class StepRunner(Runner, Protocol):
    """A runner whose plan is one step (`StepPlan`): every runner but the pipeline's."""

    def padded_tokens(self, sub_batches: Sequence[SubBatchPlan]) -> int:
        """Token slots a step of `sub_batches` computes, padding included."""
        ...


class SplitRunner(StepRunner, Protocol):
    """A step runner that also runs a step as its forward pass, then its sampling, so the host
    works between them while the device runs the forward pass (see the module docstring)."""

    def forward(self, sub_batches: Sequence[SubBatchPlan]) -> Any:
        """Dispatches the forward pass of a step of `sub_batches`; returns without waiting."""
        ...

    def sample(self, forward: Any, sampling: Sequence[Any]) -> list[SampledRows]:
        """The step's sampled rows, `forward` sampled under `sampling` (`SamplingArrays`)."""
        ...

    def finished_at(self, forward: Any) -> float | None:
        """When the device finished `forward`, on `time.perf_counter()`'s clock, asked after
        `sample` returned; None if unknown."""
        ...
