"""Measuring one engine on its mesh: the compiled calls it runs, their time, their memory and the
collectives in them. `meshserve mesh-sweep` runs these on every mesh it sweeps.

Step times are the engine's own calls. A batch of requests goes through the real engine while
its runner's `execute` is recorded; one call is kept and run again `repeats` times, and the
median is reported (host preparation and the copy back included, as in `roofline`):

    prefill  the first call of the batch sent with max_tokens=1: prompt work only, as much of
             the prompts as one step's token budget holds
    decode   the first call after every request has its first token: decode rows only. A
             pipeline call runs several rounds (one token for every running row each), so its
             seconds are divided by its rounds

Running a kept call again rewrites the same KV slots with the same values, or writes pages no
request holds any more: nothing the engine reads later changes.

The program of the decode call is compiled again, unrun (`meshserve.sharding.programs`), for
XLA's `memory_analysis()` and its partitioned HLO, whose collectives `meshserve.sharding.hlo`
counts: the ops written in it, and what one call executes (the layer loop times its layers, a
pipeline's tick loop times the ticks of the kept call, a conditional its busiest branch), which
is divided by the call's rounds to give per step. Weight and KV bytes per device are read from
the placed arrays' shards, on the device holding the most.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.bench.roofline import median_seconds
from meshserve.sharding.hlo import (COLLECTIVES, Hlo, add_tallies, executed_collectives,
                                    static_collectives)
from meshserve.sharding.programs import compile_pipeline_call, compile_step

MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded `runner.execute` call: its arguments and what it computed."""

    args: tuple
    num_rounds: int  # steps it runs: 1, or a pipeline call's rounds
    num_rows: int  # rows with work, over all rounds
    num_tokens: int  # new tokens computed, over all rounds
    num_ticks: int | None  # a pipeline call's ticks


@contextlib.contextmanager
def recording(engine: Engine) -> Iterator[list[Call]]:
    """Records every call of `engine.runner.execute` made inside the block."""
    runner, calls = engine.runner, []
    execute = runner.execute

    def recorded(*args):
        calls.append(_describe(engine, args))
        return execute(*args)

    runner.execute = recorded
    try:
        yield calls
    finally:
        del runner.execute  # back to the class's method


def _describe(engine: Engine, args: tuple) -> Call:
    if engine.is_pipelined:
        (schedule,) = args
        units = (schedule.decode, schedule.prefill)
        tokens = sum(int(u.num_new.sum()) for u in units)
        rows = sum(int(np.count_nonzero(u.num_new)) for u in units)
        return Call(args, len(schedule.plans), rows, tokens, schedule.num_ticks)
    sub_batches = args[0].sub_batches
    return Call(args, 1, sum(int(np.count_nonzero(b.num_new)) for b in sub_batches),
                sum(b.num_tokens for b in sub_batches), None)


def warm_up(engine: Engine) -> None:
    """Compiles every program the engine can run (a bounded set: one per token bucket, or a
    pipeline's one call), so that measuring it compiles nothing."""
    engine.warmup(progress=False)


def step_times(engine: Engine, prompts: Sequence[Sequence[int]], *,
               repeats: int) -> dict[str, Any]:
    """Median seconds of the engine's prefill and decode calls for `prompts` sent together;
    the kept decode call comes back under "decode_call" for `decode_program`."""
    prefill = _first_call(engine, prompts, max_tokens=1, wait_for_first_tokens=False)
    prefill_s = _median(engine, prefill, repeats)
    decode = _first_call(engine, prompts, max_tokens=decode_tokens(engine.config),
                         wait_for_first_tokens=True)
    call_s = _median(engine, decode, repeats)
    return {
        "repeats": repeats, "batch": len(prompts),
        "prefill_step_s": prefill_s, "prefill_tokens": prefill.num_tokens,
        "prefill_tokens_per_s": prefill.num_tokens / prefill_s,
        "decode_step_s": call_s / decode.num_rounds, "decode_call_s": call_s,
        "decode_rounds_per_call": decode.num_rounds, "decode_rows": decode.num_rows,
        "decode_ticks_per_call": decode.num_ticks,
        "decode_call": decode,
    }


def decode_tokens(config: EngineConfig) -> int:
    """Output tokens each request of the decode timing asks for: enough to be still running in
    the call after its first token, since a pipeline call generates up to `pipeline_rounds`."""
    return 2 * config.pipeline_rounds + 2


def _first_call(engine: Engine, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                wait_for_first_tokens: bool) -> Call:
    """Sends `prompts` at once; returns the first call made (after every request has its
    first token, when `wait_for_first_tokens`), then aborts them all."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = {engine.add_request(list(p), params) for p in prompts}
    started: set[str] = set()
    while wait_for_first_tokens and started != ids:
        if not engine.has_unfinished():
            raise RuntimeError("the requests finished before every one had its first token")
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    with recording(engine) as calls:
        engine.step()
    engine.shutdown()
    assert calls, "the engine made no call with requests waiting"
    return calls[0]


def _median(engine: Engine, call: Call, repeats: int) -> float:
    return median_seconds(lambda: engine.runner.execute(*call.args), repeats=repeats)


def decode_program(engine: Engine, call: Call) -> dict[str, Any]:
    """XLA's memory analysis of the program that ran `call`, and its collectives: per kind,
    the ops in the program, and the count and result bytes executed per call and per step."""
    runner = engine.runner
    if engine.is_pipelined:
        compiled = [compile_pipeline_call(runner)]
    else:
        compiled = [compile_step(runner, runner.step_key(call.args[0].sub_batches))]
    hlos = [Hlo.parse(c.as_text()) for c in compiled]
    ticks, devices = call.num_ticks or 1, _num_devices(engine)
    written = add_tallies(*(static_collectives(h, devices) for h in hlos))
    executed = add_tallies(*(executed_collectives(h, devices, unknown_trips=ticks)
                             for h in hlos))
    collectives = {kind: {"ops": written[kind].count, "per_call": executed[kind].count,
                          "bytes_per_call": executed[kind].bytes,
                          "per_step": executed[kind].count / call.num_rounds,
                          "bytes_per_step": executed[kind].bytes / call.num_rounds}
                   for kind in COLLECTIVES}
    return {"collectives": collectives, "memory_analysis": _memory_analysis(compiled)}


def _memory_analysis(compiled: list) -> dict[str, int] | None:
    """Summed over the call's programs (one per sub-batch shape); None where the backend gives
    no analysis."""
    stats = [c.memory_analysis() for c in compiled]
    if any(s is None for s in stats):
        return None
    return {field: int(sum(getattr(s, field) for s in stats)) for field in MEMORY_FIELDS}


def device_bytes(engine: Engine) -> dict[str, int]:
    """Weight and KV bytes of the placed arrays on the device holding the most."""
    runner = engine.runner
    devices = _devices(engine)
    weights, kv = jax.tree.leaves(runner.params), jax.tree.leaves(runner.cache)
    return {"weight_bytes": max(_bytes_on(weights, d) for d in devices),
            "kv_bytes": max(_bytes_on(kv, d) for d in devices),
            "num_devices": len(devices)}


def _devices(engine: Engine) -> list:
    layout = engine.runner.layout
    return list(layout.mesh.devices.flat) if layout is not None else jax.devices()[:1]


def _num_devices(engine: Engine) -> int:
    return len(_devices(engine))


def _bytes_on(arrays: list[jax.Array], device) -> int:
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
