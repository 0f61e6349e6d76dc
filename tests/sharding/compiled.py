"""Compiled steps of random-weight presets on fake devices, for the sharding tests.

The HLO parser lives in `meshserve.sharding.hlo` and the step's arguments in
`meshserve.sharding.programs`; they are re-exported here for the tests that read them.
"""

from __future__ import annotations

import dataclasses
import functools

from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.transformer import model_from_params
from meshserve.sharding.hlo import (COLLECTIVES, Hlo, Op, replica_groups,  # noqa: F401
                                    source_target_pairs)
from meshserve.sharding.layout import prepare
from meshserve.sharding.programs import step_arguments
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules
from tests.conftest import random_params

ROWS, PAGES = 4, 4  # the steps compiled below: 4 sequences per replica, 4 pages per sequence
RUNNER_CONFIG = RunnerConfig(num_pages=16, page_size=8, max_num_seqs=ROWS,
                             max_num_batched_tokens=ROWS * 16, max_pages_per_seq=PAGES,
                             max_logprobs=4)
RULES = {"default": DEFAULT_RULES, "ffw-replicated": ShardingRules({**DEFAULT_RULES.table,
                                                                     "ffw": None})}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    runner: ModelRunner
    args: tuple  # (params, cache, batch, sampling)
    compiled: object  # jax.stages.Compiled
    hlo: Hlo


def tensor_parallel_step(preset: str, mesh: str, tokens: int = 1, *, rules: str = "default",
                         overrides: tuple = ()) -> CompiledStep:
    """The runner of a random-weight `preset` on `mesh`, and its step compiled for ROWS
    sequences of `tokens` tokens each (ROWS * tokens token slots per replica). Cached: several
    test modules read the same programs."""
    return _tensor_parallel_step(preset, mesh, tokens, rules, overrides)


@functools.lru_cache(maxsize=None)
def _tensor_parallel_step(preset: str, mesh: str, tokens: int, rules: str,
                          overrides: tuple) -> CompiledStep:
    config = ModelConfig.preset(preset, **dict(overrides))
    prepared = prepare(model_from_params(config, random_params(config)), mesh,
                       rules=RULES[rules])
    runner = ModelRunner(prepared.model, RUNNER_CONFIG, prepared.layout)
    args = step_arguments(runner, (ROWS * tokens, 0))
    compiled = runner._step.lower(*args).compile()
    return CompiledStep(runner, args, compiled, Hlo.parse(compiled.as_text()))
