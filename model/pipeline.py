"""The pipeline runner: a whole `PipelineSchedule` in one compiled call over the stage axis.

The layer stack is split over the mesh's `stage` axis (`meshserve.sharding.stages` pads it so
every stage holds the same number of layers); each stage holds its layers' weights and KV pages,
and the `model` axis still splits every layer Megatron-style inside a stage. The embedding, final
norm and output projection are on every stage (replicated over `stage`); only stage 0 embeds and
only the last stage samples.

The call is `jax.shard_map` over the manual axes `data` and `stage` (`model` stays automatic), with
one `lax.fori_loop` over ticks. At tick t stage s runs unit u = t - s of the schedule:

    x  = stage 0 ? embed(unit's tokens) : the activations received at the end of tick t - 1
    y  = this stage's layers on x, reading and writing its own KV pages (a `lax.switch` on the
         unit's kind: IDLE passes through, DECODE is [R, 1] rows, PREFILL one row of T tokens)
    last stage: logits and the sampled tokens of unit u, written to the call's outputs
    ppermute    y to stage s + 1, and the last stage's tokens to stage 0 (the feedback)

Stage 0 keeps every fed-back token in a table [U, R]; a decode row whose input token is a
PLACEHOLDER reads it there (`decode_source`), so K decode steps run with no host round trip. The
schedule guarantees that a row only reads a unit at least S ticks older. Unit kinds are shared by
all data-parallel replicas, so every device of a stage takes the same branch and the collectives
inside (the `model` axis' all-reduces) always meet their peers.

Knobs that cost a compile: the `UnitShape` (units per call, rows, prefill width, pages), the
cache geometry and `max_logprobs`. One call shape serves every schedule: the loop runs only as
many ticks as the schedule has.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshserve.batching.pipeline import (DECODE, IDLE, PREFILL, PipelineSchedule, UnitShape,
                                         build_schedule, unit_results)
from meshserve.batching.runner import SampledRows
from meshserve.batching.sampling import SamplingArrays
from meshserve.batching.structured import mask_words
from meshserve.model.attention import KVCache, SubBatch, init_kv_cache, paged_context
from meshserve.model.runner import (DeviceLayout, PlanChannel, RunnerConfig,
                                    output_sharding, peer_errors, to_devices)
from meshserve.model.sampler import Sampled, host_sampling, sample
from meshserve.model.transformer import RESIDUAL_AXES, apply_layers

STAGE_AXIS = "stage"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineUnits:
    """A schedule's units on device; every leaf has leading axes [replica, unit]."""

    decode: SubBatch  # tokens [D, U, R, 1], page_table [D, U, R, M], ...
    decode_source: jax.Array  # [D, U, R] flat index into the fed-back tokens, or -1
    prefill: SubBatch  # tokens [D, U, 1, T], page_table [D, U, 1, M], ...
    decode_sampling: SamplingArrays  # [D, U, R, ...]
    prefill_sampling: SamplingArrays  # [D, U, 1, ...]


class PipelineRunner:
    """Owns the stage-split weights, the KV cache and the compiled pipeline call.

    `model` is padded already (heads for `model`, layers for `stage`) with its layers stacked;
    `config` gives the cache geometry (per replica) and the sampler's limits; `shape` the units.
    """

    def __init__(self, model: nnx.Module, config: RunnerConfig, layout: DeviceLayout,
                 shape: UnitShape):
        self.model_config = model.config
        self.config, self.layout, self.shape = config, layout, shape
        self.num_replicas = layout.num_replicas
        self.num_stages = layout.mesh.shape[STAGE_AXIS]
        assert shape.num_stages == self.num_stages and shape.num_replicas == self.num_replicas
        assert model.config.num_layers % self.num_stages == 0, "pad the layers first"
        self.last_wait_seconds = 0.0
        self.attention = "jnp"  # each stage's units run the portable sub-batch paged attention
        graphdef, params = nnx.split(model)
        self.graphdef, self.params = graphdef, jax.device_put(params, layout.params)
        c = model.config
        init = functools.partial(
            init_kv_cache, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            num_pages=config.num_pages * self.num_replicas, page_size=config.page_size,
            head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self.cache: KVCache = jax.jit(init, out_shardings=layout.cache)()
        self._units_sharding = NamedSharding(layout.mesh, PartitionSpec(*layout.replica_axes))
        self._replicated = NamedSharding(layout.mesh, PartitionSpec())
        self._call = _compile(self.graphdef, layout, jax.tree.map(lambda a: a.sharding,
                                                                  self.params),
                              num_stages=self.num_stages, num_top=config.max_logprobs)
        self.last_user: object | None = None  # whoever ran the last step (engines sharing the
        # runner take turns with its KV cache)
        self.channel: PlanChannel | None = None  # a multi-process run sets it on every process
        # (only process 0 sends; see meshserve.serving.multihost)

    def warmup(self, *, progress: bool = True) -> list[tuple[()]]:
        """Compiles the one pipeline call every schedule runs, by running an empty schedule
        (it computes nothing: every unit is idle)."""
        self.execute(build_schedule([], self.shape))
        return [()]

    def execute(self, schedule: PipelineSchedule) -> list[list[SampledRows]]:
        """Runs the schedule; per round, per sub-batch of its plan, each row's sampled token."""
        assert schedule.shape == self.shape, (schedule.shape, self.shape)
        with peer_errors(self.channel):
            (out,) = self.run_calls([()], [self.host_arrays(schedule)])
            started = time.perf_counter()
            host = jax.device_get(out)  # the call's one copy to the host
        self.last_wait_seconds = time.perf_counter() - started
        last = self.num_stages - 1  # only the last stage samples: take its copy
        tokens, logprobs, top_ids, top_logprobs = (np.asarray(a)[:, last] for a in (
            host.tokens, host.logprobs, host.top_ids, host.top_logprobs))
        rounds = unit_results(schedule, tokens, logprobs, top_ids, top_logprobs)
        return [[SampledRows(*batch) for batch in batches] for batches in rounds]

    def host_arrays(self, schedule: PipelineSchedule) -> tuple[PipelineUnits, np.ndarray,
                                                                np.ndarray]:
        """What the compiled call reads: the units, their kinds and the number of ticks."""
        return (self.host_units(schedule), np.asarray(schedule.kinds, np.int32),
                np.array(schedule.num_ticks, np.int32))

    def template(self, key: tuple[int, ...] = ()) -> tuple[PipelineUnits, np.ndarray,
                                                            np.ndarray]:
        """Zero host arrays shaped like every call's (one shape serves every schedule)."""
        return self.host_arrays(build_schedule([], self.shape))

    def to_devices(self, arrays):
        units, kinds, ticks = arrays
        return (to_devices(units, self._units_sharding),
                *to_devices((kinds, ticks), self._replicated))

    def run_calls(self, keys, arrays) -> list:
        """Dispatches the call for each entry of `arrays` (on process 0 of a multi-process run,
        after sending it to the others: see `ModelRunner.run_calls`)."""
        if self.channel is not None:
            self.channel.publish_run(keys, arrays)
        outs = []
        for entry in arrays:
            units, kinds, ticks = self.to_devices(entry)
            out, self.cache = self._call(self.params, self.cache, kinds, units, ticks)
            outs.append(out)
        return outs

    def host_units(self, schedule: PipelineSchedule) -> PipelineUnits:
        """The schedule as numpy leaves shaped for the call."""
        s, c = schedule, self.config
        D, U, R = s.decode_tokens.shape
        history = c.max_pages_per_seq * c.page_size
        decode = SubBatch(tokens=s.decode_tokens[..., None], positions=s.decode_positions[..., None],
                          num_new=s.decode_num_new, kv_lens=s.decode_kv_lens,
                          page_table=s.decode_pages)
        prefill = SubBatch(tokens=s.prefill_tokens[:, :, None], positions=s.prefill_positions[:, :, None],
                           num_new=s.prefill_num_new[..., None], kv_lens=s.prefill_kv_lens[..., None],
                           page_table=s.prefill_pages[:, :, None])

        def sampling(arrays, rows):
            flat = host_sampling(arrays, history_width=history, banned_width=c.max_stop_ids,
                                 mask_width=mask_words(self.model_config.vocab_size))
            return jax.tree.map(lambda a: a.reshape(D, U, rows, *a.shape[1:]), flat)

        return PipelineUnits(decode=decode, decode_source=s.decode_source, prefill=prefill,
                             decode_sampling=sampling(s.decode_sampling, R),
                             prefill_sampling=sampling(s.prefill_sampling, 1))


def _compile(graphdef, layout: DeviceLayout, param_shardings, *, num_stages: int, num_top: int):
    assert layout.replica_axes, "pipeline units are laid out per data-parallel replica"
    manual = tuple(layout.replica_axes) + (STAGE_AXIS,)
    body = functools.partial(_pipeline_body, graphdef, num_stages=num_stages, num_top=num_top,
                             constrain=layout.constrain, replica_axes=tuple(layout.replica_axes))
    params_spec = jax.tree.map(lambda sharding: _only(sharding.spec, manual), param_shardings)
    cache_spec = _only(layout.cache.spec, manual)
    units_spec = PartitionSpec(*layout.replica_axes)
    out_spec = PartitionSpec(*layout.replica_axes, STAGE_AXIS)
    mapped = jax.shard_map(body, mesh=layout.mesh,
                           in_specs=(params_spec, cache_spec, PartitionSpec(), units_spec,
                                     PartitionSpec()),
                           out_specs=(out_spec, cache_spec), axis_names=set(manual),
                           check_vma=False)
    units_sharding = NamedSharding(layout.mesh, units_spec)
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return jax.jit(mapped, in_shardings=(param_shardings, layout.cache, replicated,
                                         units_sharding, replicated),
                   out_shardings=(output_sharding(layout, NamedSharding(layout.mesh, out_spec)),
                                  layout.cache),
                   donate_argnums=(1,))


def _only(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """`spec` with every mesh axis outside `axes` dropped (a shard_map's manual axes)."""
    kept = [entry if entry in axes else None for entry in spec]
    while kept and kept[-1] is None:
        kept.pop()
    return PartitionSpec(*kept)


def _pipeline_body(graphdef, params, cache: KVCache, kinds: jax.Array, units: PipelineUnits,
                   num_ticks: jax.Array, *, num_stages: int, num_top: int, constrain,
                   replica_axes: tuple[str, ...]):
    """One stage of one replica: params hold this stage's layers, cache its layers' pages."""
    model = nnx.merge(graphdef, params)
    stage = jax.lax.axis_index(STAGE_AXIS)
    last = num_stages - 1
    units = jax.tree.map(lambda a: a[0], units)  # this replica's units
    num_units, rows = units.decode_source.shape
    width = units.prefill.tokens.shape[-1]
    size = max(rows, width)
    hidden = model.config.hidden_size
    constrain = constrain or (lambda x, axes: x)

    def padded(x):  # [n, D] -> [size, D]
        return jnp.pad(x, ((0, size - x.shape[0]), (0, 0)))

    def embed(sub: SubBatch):
        tokens, positions = sub.tokens.reshape(-1), sub.positions.reshape(-1)
        return padded(constrain(model.embed_tokens(tokens, positions), RESIDUAL_AXES))

    def run(sub: SubBatch, x, k, v):
        n = sub.tokens.size
        ctx = paged_context(KVCache(k, v), (sub,))
        y, ctx = apply_layers(model, x[:n], sub.positions.reshape(-1), ctx, constrain)
        return padded(y), ctx.k, ctx.v

    def sample_rows(logits, sampling: SamplingArrays) -> Sampled:
        # Whole rows on every device of the stage: sorting a vocabulary split over `model` would
        # exchange it by collective-permute, and XLA:CPU makes every device of the program meet
        # at a collective-permute, which the other stages (in other branches) never reach.
        logits = constrain(logits.astype(jnp.float32), (None, None))
        got = sample(logits, sampling, num_top_logprobs=num_top, replica_axes=replica_axes)
        return jax.tree.map(lambda a: jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)),
                            got)

    def no_sample() -> Sampled:
        return Sampled(tokens=jnp.zeros(rows, jnp.int32), logprobs=jnp.zeros(rows, jnp.float32),
                       top_ids=jnp.zeros((rows, num_top), jnp.int32),
                       top_logprobs=jnp.zeros((rows, num_top), jnp.float32))

    def tick(t, carry):
        buf, k, v, table, out = carry
        u = t - stage
        is_unit = (u >= 0) & (u < num_units)
        uc = jnp.clip(u, 0, num_units - 1)
        kind = jnp.where(is_unit, kinds[uc], IDLE)
        dec = jax.tree.map(lambda a: a[uc], units.decode)  # [R, 1]
        source = units.decode_source[uc]  # [R]
        fed = table.reshape(-1)[jnp.maximum(source, 0)]
        dec = dataclasses.replace(dec, tokens=jnp.where(source >= 0, fed, dec.tokens[:, 0])[:, None])
        pre = jax.tree.map(lambda a: a[uc], units.prefill)  # [1, T]
        x = jax.lax.switch(jnp.where(stage == 0, kind, IDLE),
                           [lambda: buf, lambda: embed(dec), lambda: embed(pre)])
        y, k, v = jax.lax.switch(kind, [lambda: (x, k, v), lambda: run(dec, x, k, v),
                                        lambda: run(pre, x, k, v)])
        d_samp = jax.tree.map(lambda a: a[uc], units.decode_sampling)
        p_samp = jax.tree.map(lambda a: a[uc], units.prefill_sampling)
        last_token = y[jnp.maximum(pre.num_new[0] - 1, 0)][None]  # [1, D]
        sampled = jax.lax.switch(jnp.where(stage == last, kind, IDLE), [
            no_sample,
            lambda: sample_rows(model.logits(y[:rows]), d_samp),
            lambda: sample_rows(model.logits(last_token), p_samp)])
        keep = is_unit & (stage == last)
        out = jax.tree.map(lambda o, new: o.at[uc].set(jnp.where(keep, new, o[uc])), out, sampled)
        fed_back = jax.lax.ppermute(sampled.tokens, STAGE_AXIS, [(last, 0)])
        exited = t - last  # the unit the last stage ran this tick
        arrived = (stage == 0) & (exited >= 0) & (exited < num_units)
        ec = jnp.clip(exited, 0, num_units - 1)
        table = table.at[ec].set(jnp.where(arrived, fed_back, table[ec]))
        buf = jax.lax.ppermute(y, STAGE_AXIS, [(s, s + 1) for s in range(last)])
        return buf, k, v, table, out

    carry = (jnp.zeros((size, hidden), jnp.dtype(model.config.dtype)), cache.k, cache.v,
             jnp.zeros((num_units, rows), jnp.int32),
             jax.tree.map(lambda a: jnp.zeros((num_units, *a.shape), a.dtype), no_sample()))
    _, k, v, _, out = jax.lax.fori_loop(0, num_ticks, tick, carry)
    out = jax.tree.map(lambda a: a[None, None], out)  # [1 replica, 1 stage, U, R, ...]
    return out, KVCache(k=k, v=v)
