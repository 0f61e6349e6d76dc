"""The pipeline runner: a whole `PipelineSchedule` in one compiled call over the stage axis.

The layer stack is split over the mesh's `stage` axis (`meshserve.sharding.pipeline_stages` pads
it so every stage holds the same number of layers); each stage holds its layers' weights and KV
pages, and the `model` axis still splits every layer Megatron-style inside a stage. The
embedding, final norm and output projection are on every stage (replicated over `stage`); only
stage 0 embeds and only the last stage samples.

Every unit of the schedule is a ragged batch (`RaggedBatch`), and every stage runs the parts of
the ragged step (`meshserve.model.executor.steps`) on it, so the attention backends (`jnp`,
`pallas-gpu`) and whatever the layers compute serve pipelines exactly as they serve one device.
The call is `jax.shard_map` over the manual axes `data` and `stage` (`model` stays automatic),
with one `lax.fori_loop` over ticks. At tick t stage s runs unit u = t - s of the schedule:

    x  = stage 0 ? embed(unit's tokens) : the activations received at the end of tick t - 1
    y  = `ragged_layers`: this stage's layers on x, reading and writing its own KV pages (a
         `lax.switch` on the unit's kind: IDLE passes through, DECODE is a ragged batch of R
         token slots, PREFILL one of T slots packing up to P prompt chunks)
    last stage: `ragged_outputs`: the unit's sampled tokens, and for a PREFILL unit with
         prompt-logprob rows the logprobs of every token too, written to the call's outputs
    ppermute    y to stage s + 1, and the last stage's tokens to stage 0 (the feedback)

A model served with LoRA adapters (`meshserve.model.lora`) holds their slabs among its layer
weights, so each stage holds its layers' rows of them, as it holds its layers' kernels (the
identity layers that pad a stage hold zeros). Every unit carries its tokens' adapter slots
(`RaggedBatch.adapters`), which reach the stage's layers with the unit; `load_adapter` writes
an adapter into a slot of every stage's slabs between calls, never during one (the engine holds
back the slots the call's rounds read: `meshserve.batching.adapters`).

Stage 0 keeps every fed-back token in a table [U, O] (O = max(R, P) sampled rows a unit); a decode
row whose input token is a PLACEHOLDER reads it there (`decode_source`), so K decode steps run
with no host round trip. The schedule guarantees that a row only reads a unit at least S ticks
older. Unit kinds are shared by all data-parallel replicas, so every device of a stage takes the
same branch and the collectives inside (the `model` axis' all-reduces) always meet their peers.

The compiled set is one program: it serves every schedule, the loop running only as many ticks
as the schedule has, and prompt logprobs are a branch of it taken only by the PREFILL units
that ask for them (their outputs come back to the host only from calls that have any). A call
whose schedule samples no constrained row neither builds nor copies the units' structured-output
masks: its key is `(0,)` (`has_mask`), its host units hold zero-width `allowed` columns, and
`run_calls` gives the program resident all-allowed masks instead, as `ModelRunner` does; the
same program runs either way. Masks are not overlapped with the call (`splits_sampling` is
false, whatever `overlap_masks` says): the last stage samples inside the call's loop and feeds
its tokens back to stage 0 on the device, so the sampling cannot wait for the host mid-call, and
a constrained row samples once a call, its mask computed before the call. Knobs
that cost a compile: the `UnitShape` (units per call, rows, prefill width and rows, pages), the
cache geometry, `max_logprobs` and the attention backend.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from meshserve.batching.pipeline_schedule import (IDLE, PREFILL, PipelineSchedule, UnitBatches,
                                                  UnitOutputs, UnitShape, build_schedule,
                                                  unit_results)
from meshserve.batching.runner_protocol import SampledRows
from meshserve.batching.sampling import SamplingArrays
from meshserve.batching.structured import mask_words
from meshserve.model.attention import KVCache, RaggedBatch, init_kv_cache
from meshserve.model.executor.device_layout import DeviceLayout, output_sharding, to_devices
from meshserve.model.executor.lora_slabs import LoraSlabs, Weights
from meshserve.model.executor.runner import PlanChannel, RunnerConfig, peer_errors
from meshserve.model.executor.sampler import Sampled, host_sampling
from meshserve.model.executor.steps import RaggedOutput, embed, ragged_layers, ragged_outputs
from meshserve.model.lora import lora_shape
from meshserve.model.transformer import stage_sliding_flags

STAGE_AXIS = "stage"
# The call's branch for a PREFILL unit that also returns prompt logprobs (the schedule's kinds
# are IDLE, DECODE and PREFILL).
PREFILL_LOGPROBS = 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineUnits:
    """A schedule's units on device; every leaf has leading axes [replica, unit]."""

    decode: RaggedBatch  # tokens [D, U, R], page_table [D, U, R, M], ...
    decode_source: jax.Array  # [D, U, R] flat index into the fed-back tokens, or -1
    prefill: RaggedBatch  # tokens [D, U, T], page_table [D, U, P, M], targets [D, U, T], ...
    decode_sampling: SamplingArrays  # [D, U, R, ...]
    prefill_sampling: SamplingArrays  # [D, U, P, ...]


class PipelineRunner:
    """Owns the stage-split weights, the KV cache and the compiled pipeline call.

    `model` is padded already (heads for `model`, layers for `stage`) with its layers stacked;
    `config` gives the cache geometry (per replica), the sampler's limits and the attention
    backend, settled for the model and `platform` (default: JAX's default platform) by the same
    `RunnerConfig.backend` as `ModelRunner`'s; `shape` the units. `layer_index` says where
    each of the model's own layers sits in the padded stack (`StageLayout.layer_index`;
    default: every layer is its own): a LoRA adapter, read for the unpadded model, is laid out
    by it.
    """

    splits_sampling = False  # a call samples inside its loop (see the module docstring)

    def __init__(self, model: nnx.Module, config: RunnerConfig, layout: DeviceLayout,
                 shape: UnitShape, *, platform: str | None = None,
                 layer_index: np.ndarray | None = None):
        self.model_config = model.config
        self.config, self.layout, self.shape = config, layout, shape
        self.num_replicas = layout.num_replicas
        self.num_stages = layout.mesh.shape[STAGE_AXIS]
        assert shape.num_stages == self.num_stages and shape.num_replicas == self.num_replicas
        assert model.config.num_layers % self.num_stages == 0, "pad the layers first"
        assert shape.max_pages <= config.page_table_width and shape.page_size == config.page_size
        self.last_wait_seconds = 0.0
        self.attention = config.backend(model.config, platform=platform)
        graphdef, params = nnx.split(model)
        self.graphdef, self.params = graphdef, jax.device_put(params, layout.params)
        self.layer_index = (np.arange(model.config.num_layers) if layer_index is None
                            else np.asarray(layer_index))
        assert self.layer_index.max(initial=-1) < model.config.num_layers
        self.lora = lora_shape(model)  # the LoRA slabs' sizes; None: served without LoRA
        self.lora_slabs = None if self.lora is None else LoraSlabs(self.params, layout)
        c = model.config
        init = functools.partial(
            init_kv_cache, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            num_pages=config.num_pages * self.num_replicas, page_size=config.page_size,
            head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self.cache: KVCache = jax.jit(init, out_shardings=layout.cache)()
        self._units_sharding = NamedSharding(layout.mesh, PartitionSpec(*layout.replica_axes))
        self._replicated = NamedSharding(layout.mesh, PartitionSpec())
        self._call = _jit_call(self.graphdef, layout,
                               jax.tree.map(lambda a: a.sharding, self.params),
                               num_stages=self.num_stages, num_top=config.max_logprobs,
                               attention=self.attention, block_pages=config.block_pages)
        self._programs: dict[tuple[int, ...], jax.stages.Compiled] = {}
        self._allow_all: dict[tuple[int, ...], jax.Array] = {}  # resident masks, by shape
        self.last_user: object | None = None  # whoever ran the last step (engines sharing the
        # runner take turns with its KV cache)
        self.channel: PlanChannel | None = None  # a multi-process run sets it on every process
        # (only process 0 sends; see meshserve.serving.engine.multihost)

    @staticmethod
    def step_keys() -> list[tuple[()]]:
        """The compiled set: one call, whose key is empty."""
        return [()]

    def warmup(self, keys: Sequence[tuple[()]] | None = None, *,
               progress: bool = True, prompt_logprobs: bool = True) -> list[tuple[int]]:
        """Compiles the pipeline call, whose branches serve prompt logprobs too (so
        `prompt_logprobs` changes nothing here); runs nothing. Returns the call keys it serves,
        with and without masks (`has_mask`: their host arrays differ in size)."""
        keys = self.step_keys() if keys is None else list(keys)
        if self.lora_slabs is not None:
            self.lora_slabs.compile()
        for key in tqdm(keys, desc="warming up", unit="program", disable=not progress):
            self.program(key)
        return [(1,), (0,)]

    def load_adapter(self, slot: int, weights: Weights) -> None:
        """Writes a LoRA adapter, its A and B stacked over the unpadded model's layers, into row
        `slot` (1..max_loras) of every stage's slabs, in place (`LoraSlabs.write`; identity
        layers get zeros). Never while a call runs: this runner's calls return only once their
        results are on the host."""
        assert self.lora_slabs is not None, "this runner serves no LoRA adapters"
        num_layers = self.model_config.num_layers

        def padded(array: np.ndarray) -> np.ndarray:  # [L own, ...] -> [L padded, ...]
            assert array.shape[0] == self.layer_index.size, (array.shape, self.layer_index.size)
            out = np.zeros((num_layers, *array.shape[1:]), array.dtype)
            out[self.layer_index] = array
            return out

        self.lora_slabs.write(slot, {target: (padded(a), padded(b))
                                     for target, (a, b) in weights.items()})

    def program(self, key: tuple[int, ...] = ()) -> jax.stages.Compiled:
        """The compiled call, compiled (or loaded from the persistent compilation cache) on
        first use; a call key's `has_mask` picks no other. Calls run it directly, so the
        compiled set is exactly this one."""
        if () not in self._programs:
            units, kinds, ticks = self.to_devices(self.template(()))
            self._programs[()] = self._call.lower(self.params, self.cache, kinds, units,
                                                  ticks).compile()
        return self._programs[()]

    def execute(self, schedule: PipelineSchedule) -> list[list[SampledRows]]:
        """Runs the schedule; per round, per sub-batch of its plan, each row's sampled token."""
        assert schedule.shape == self.shape, (schedule.shape, self.shape)
        has_mask = _has_mask(schedule)
        with peer_errors(self.channel):
            (out,) = self.run_calls([(has_mask,)], [self.host_arrays(schedule,
                                                                     has_mask=has_mask)])
            started = time.perf_counter()
            if not schedule.has_targets:  # no prompt logprobs to copy back
                out = RaggedOutput(sampled=out.sampled)
            host = jax.device_get(out)  # the call's one copy to the host
        self.last_wait_seconds = time.perf_counter() - started
        return unit_results(schedule, _last_stage(host, self.num_stages - 1))

    def host_arrays(self, schedule: PipelineSchedule, *, has_mask: int = 1
                    ) -> tuple[PipelineUnits, np.ndarray, np.ndarray]:
        """What the compiled call reads: the units, each unit's branch and the number of
        ticks; without `has_mask`, zero-width masks (see the module docstring)."""
        is_logprobs = (schedule.kinds == PREFILL) & (schedule.prompt_logprobs > 0)
        branches = np.where(is_logprobs, PREFILL_LOGPROBS, schedule.kinds).astype(np.int32)
        return (self.host_units(schedule, has_mask=has_mask), branches,
                np.array(schedule.num_ticks, np.int32))

    def template(self, key: tuple[int, ...] = ()) -> tuple[PipelineUnits, np.ndarray,
                                                            np.ndarray]:
        """Zero host arrays shaped like every call's with key `key` (one shape serves every
        schedule): the program's own `()`, or a call key `(has_mask,)`."""
        return self.host_arrays(build_schedule([], self.shape),
                                has_mask=key[0] if key else 1)

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
        for key, entry in zip(keys, arrays):
            units, kinds, ticks = self.to_devices(entry)
            units = self._with_resident_masks(units)
            out, self.cache = self.program(key)(self.params, self.cache, kinds, units, ticks)
            outs.append(out)
        return outs

    def _with_resident_masks(self, units: PipelineUnits) -> PipelineUnits:
        """`units` with each zero-width mask (a call without `has_mask`) replaced by an
        all-allowed one of its full shape, on the devices since its first use."""
        def full(sampling: SamplingArrays) -> SamplingArrays:
            if sampling.allowed.shape[-1] != 0:
                return sampling
            shape = (*sampling.allowed.shape[:-1], mask_words(self.model_config.vocab_size))
            if shape not in self._allow_all:
                self._allow_all[shape] = to_devices(np.full(shape, -1, np.int32),
                                                    self._units_sharding)
            return dataclasses.replace(sampling, allowed=self._allow_all[shape])

        return dataclasses.replace(units, decode_sampling=full(units.decode_sampling),
                                   prefill_sampling=full(units.prefill_sampling))

    def host_units(self, schedule: PipelineSchedule, *, has_mask: int = 1) -> PipelineUnits:
        """The schedule as numpy leaves shaped for the call; without `has_mask`, the masks
        zero words wide."""
        s, c = schedule, self.config
        D, U, R = s.decode_source.shape

        def sampling(arrays, rows):
            if not has_mask:
                arrays = dataclasses.replace(arrays, allowed=arrays.allowed[:, :0])
            flat = host_sampling(arrays, history_width=c.history_width,
                                 banned_width=c.max_stop_ids,
                                 mask_width=mask_words(self.model_config.vocab_size)
                                 if has_mask else None)
            return jax.tree.map(lambda a: a.reshape(D, U, rows, *a.shape[1:]), flat)

        return PipelineUnits(decode=self._ragged(s.decode), decode_source=s.decode_source,
                             prefill=self._ragged(s.prefill),
                             decode_sampling=sampling(s.decode_sampling, R),
                             prefill_sampling=sampling(s.prefill_sampling,
                                                       self.shape.prefill_rows))

    def _ragged(self, units: UnitBatches) -> RaggedBatch:
        """One kind's units as a `RaggedBatch` of numpy leaves, its page tables as wide as the
        attention's context blocks need."""
        fields = {f.name: getattr(units, f.name) for f in dataclasses.fields(units)}
        table = fields["page_table"]
        pad = self.config.page_table_width - table.shape[-1]
        fields["page_table"] = np.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, pad)])
        if self.lora is None:
            fields["adapters"] = None  # no slabs: the layers take no adapters
        return RaggedBatch(**fields)


def _has_mask(schedule: PipelineSchedule) -> int:
    """1 if a row of the schedule samples under a structured-output mask, else 0."""
    return int(bool(np.any(schedule.decode_sampling.is_constrained)
                    or np.any(schedule.prefill_sampling.is_constrained)))


def _last_stage(host: RaggedOutput, last: int) -> UnitOutputs:
    """The call's outputs [D, S, U, ...] as the last stage left them (only it samples)."""
    take = lambda a: None if a is None else np.asarray(a)[:, last]  # noqa: E731
    s = host.sampled
    return UnitOutputs(tokens=take(s.tokens), logprobs=take(s.logprobs),
                       top_ids=take(s.top_ids), top_logprobs=take(s.top_logprobs),
                       prompt_logprobs=take(host.prompt_logprobs),
                       prompt_top_ids=take(host.prompt_top_ids),
                       prompt_top_logprobs=take(host.prompt_top_logprobs))


def _jit_call(graphdef, layout: DeviceLayout, param_shardings, *, num_stages: int,
              num_top: int, attention: str, block_pages: int):
    assert layout.replica_axes, "pipeline units are laid out per data-parallel replica"
    manual = tuple(layout.replica_axes) + (STAGE_AXIS,)
    body = functools.partial(_pipeline_body, graphdef, num_stages=num_stages, num_top=num_top,
                             attention=attention, block_pages=block_pages,
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
                   num_ticks: jax.Array, *, num_stages: int, num_top: int, attention: str,
                   block_pages: int, constrain, replica_axes: tuple[str, ...]):
    """One stage of one replica: params hold this stage's layers, cache its layers' pages."""
    model = nnx.merge(graphdef, params)
    stage = jax.lax.axis_index(STAGE_AXIS)
    last = num_stages - 1
    units = jax.tree.map(lambda a: a[0], units)  # this replica's units
    num_units, rows = units.decode_source.shape
    width = units.prefill.tokens.shape[-1]
    out_rows = max(rows, units.prefill.kv_lens.shape[-1])  # O sampled rows a unit
    size = max(rows, width)  # the activations passed on: [size, D]
    constrain = constrain or (lambda x, axes: x)

    def padded(x):  # [n, D] -> [size, D]
        return jnp.pad(x, ((0, size - x.shape[0]), (0, 0)))

    def embed_unit(batch: RaggedBatch):
        return padded(embed(model, batch, constrain))

    sliding = stage_sliding_flags(model.config, stage, num_stages)  # this stage's layers

    def run(batch: RaggedBatch, x, k, v):
        n = batch.tokens.shape[0]
        y, stage_cache = ragged_layers(model, x[:n], KVCache(k, v), batch, attention=attention,
                                       block_pages=block_pages, constrain=constrain,
                                       sliding=sliding)
        return padded(y), stage_cache.k, stage_cache.v

    def whole_rows(logits):
        # Whole rows on every device of the stage: sorting a vocabulary split over `model` would
        # exchange it by collective-permute, and XLA:CPU makes every device of the program meet
        # at a collective-permute, which the other stages (in other branches) never reach.
        return constrain(logits, (None, None))

    def outputs(batch: RaggedBatch, y, sampling: SamplingArrays, *,
                with_targets: bool = False) -> RaggedOutput:
        if not with_targets:
            batch = dataclasses.replace(batch, targets=None)
        got = ragged_outputs(model, y[:batch.tokens.shape[0]], batch, sampling,
                             num_top_logprobs=num_top, replica_axes=replica_axes,
                             place_logits=whole_rows)
        return _unit_output(got, out_rows, width, num_top)

    def no_output() -> RaggedOutput:
        return _unit_output(None, out_rows, width, num_top)

    def tick(t, carry):
        buf, k, v, table, out = carry
        u = t - stage
        is_unit = (u >= 0) & (u < num_units)
        uc = jnp.clip(u, 0, num_units - 1)
        branch = jnp.where(is_unit, kinds[uc], IDLE)  # IDLE, DECODE, PREFILL, PREFILL_LOGPROBS
        kind = jnp.minimum(branch, PREFILL)  # what the layers see
        dec = jax.tree.map(lambda a: a[uc], units.decode)  # R slots
        source = units.decode_source[uc]  # [R]
        fed = table.reshape(-1)[jnp.maximum(source, 0)]
        dec = dataclasses.replace(dec, tokens=jnp.where(source >= 0, fed, dec.tokens))
        pre = jax.tree.map(lambda a: a[uc], units.prefill)  # T slots
        x = jax.lax.switch(jnp.where(stage == 0, kind, IDLE),
                           [lambda: buf, lambda: embed_unit(dec), lambda: embed_unit(pre)])
        y, k, v = jax.lax.switch(kind, [lambda: (x, k, v), lambda: run(dec, x, k, v),
                                        lambda: run(pre, x, k, v)])
        d_samp = jax.tree.map(lambda a: a[uc], units.decode_sampling)
        p_samp = jax.tree.map(lambda a: a[uc], units.prefill_sampling)
        result = jax.lax.switch(jnp.where(stage == last, branch, IDLE), [
            no_output, lambda: outputs(dec, y, d_samp), lambda: outputs(pre, y, p_samp),
            lambda: outputs(pre, y, p_samp, with_targets=True)])
        keep = is_unit & (stage == last)
        out = jax.tree.map(lambda o, new: o.at[uc].set(jnp.where(keep, new, o[uc])), out, result)
        fed_back = jax.lax.ppermute(result.sampled.tokens, STAGE_AXIS, [(last, 0)])
        exited = t - last  # the unit the last stage ran this tick
        arrived = (stage == 0) & (exited >= 0) & (exited < num_units)
        ec = jnp.clip(exited, 0, num_units - 1)
        table = table.at[ec].set(jnp.where(arrived, fed_back, table[ec]))
        buf = jax.lax.ppermute(y, STAGE_AXIS, [(s, s + 1) for s in range(last)])
        return buf, k, v, table, out

    carry = (jnp.zeros((size, model.config.hidden_size), jnp.dtype(model.config.dtype)),
             cache.k, cache.v, jnp.zeros((num_units, out_rows), jnp.int32),
             jax.tree.map(lambda a: jnp.zeros((num_units, *a.shape), a.dtype), no_output()))
    _, k, v, _, out = jax.lax.fori_loop(0, num_ticks, tick, carry)
    out = jax.tree.map(lambda a: a[None, None], out)  # [1 replica, 1 stage, U, ...]
    return out, KVCache(k=k, v=v)


def _unit_output(got: RaggedOutput | None, rows: int, width: int, num_top: int
                 ) -> RaggedOutput:
    """One unit's outputs in the call's fixed shapes: sampled rows padded to `rows`, and the
    prompt logprobs of `width` token slots (zeros where the unit computed none). `got` None: all
    zeros (a tick that samples nothing)."""
    def pad(a, n):
        return jnp.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

    if got is None:
        sampled = Sampled(tokens=jnp.zeros(rows, jnp.int32), logprobs=jnp.zeros(rows, jnp.float32),
                          top_ids=jnp.zeros((rows, num_top), jnp.int32),
                          top_logprobs=jnp.zeros((rows, num_top), jnp.float32))
    else:
        sampled = jax.tree.map(lambda a: pad(a, rows), got.sampled)
    if got is None or got.prompt_logprobs is None:
        return RaggedOutput(sampled=sampled, prompt_logprobs=jnp.zeros(width, jnp.float32),
                            prompt_top_ids=jnp.zeros((width, num_top), jnp.int32),
                            prompt_top_logprobs=jnp.zeros((width, num_top), jnp.float32))
    return dataclasses.replace(got, sampled=sampled)
