"""The model runner: turns a step plan into one ragged device call and runs the compiled step.

It owns the weights, the KV cache and the jitted step. Every sub-batch of a plan (prefill chunks,
decodes, or both) is flattened into one `RaggedBatch`: the real new tokens back to back, padded
only to a token bucket T (powers of two up to `max_num_batched_tokens`), with S = min(T,
`max_num_seqs`) sequence slots. So the compiled set is one program per token bucket, plus one per
bucket of at least `MIN_TARGET_TOKENS` for steps that return prompt logprobs: at most 16 for the
default config, whatever the mix of prompt lengths, contexts and batch sizes. The page table
always has its full width; attention reads only the pages the step's contexts need
(`meshserve.model.attention`). One device-to-host copy per step brings back the sampled tokens
and their logprobs.

A lockstep sub-batch (the static baseline) keeps its rows padded: each row takes the sub-batch's
full width of token slots, and a padding row takes them too, so the baseline computes what static
batching computes. Padding slots write to the dummy page 0 and are never attended to.

Placement comes from a `DeviceLayout` (built by `meshserve.sharding.layout`): the weights, the KV
pages and the step arrays go to the devices already sharded, and the step runs under
`jax.shard_map` over the replica axes, so each data-parallel replica computes its own tokens
against its own slice of the page pool while XLA partitions the tensor-parallel axes inside. Each
replica's tokens sit in block r of the token slots and its sequences in block r of the sequence
slots, every block padded to the same bucket; sequence and token indices inside a block are local
to it, and page ids are local to the row's replica (each replica has its own dummy page 0).
Without a layout the step runs on the default device. Knobs that change compiled shapes (and so
cost a compile each): `max_num_batched_tokens`, `max_num_seqs`, `num_pages`, `page_size`,
`max_pages_per_seq`, `max_logprobs`, `max_stop_ids`, `attention` and `context_block_pages`.

A model served with LoRA adapters (`meshserve.model.lora`) has their slabs among its weights; every
step then carries each token's adapter slot (`RaggedBatch.adapters`, 0 for none), and
`load_adapter` writes an adapter into a slot with one more program, compiled at warm-up. Which
adapters run changes no shape.

Structured output's mask (`SamplingArrays.allowed`, [S, vocab words] int32) is an operand of every
program, but a step where no row is constrained neither builds nor copies it: its call key ends in
0 (`has_mask`), its host arrays hold a zero-width `allowed`, and `run_calls` hands the program a
resident all-allowed mask of that bucket's shape, put on the devices once (the sampler skips the
mask pass then anyway, by `is_constrained`). Both kinds of call run the same compiled program, so
the mask adds no program; a constrained step copies its masks as before.

A step whose constrained rows' masks are not computed yet can run as two calls instead
(`splits_sampling`; `overlap_masks`, unset: on unless JAX's backend is the CPU): `forward`
dispatches its forward pass and returns at once, and `sample` runs its sampling once the host has
the masks (`meshserve.model.executor.split_step`). That adds a forward pass per bucket key and a
sampler per count of sequence slots (`RunnerConfig.sampling_rows`), all compiled at warm-up: 37
programs in all for the default config (`num_programs()`).

Several processes (`meshserve.serving.engine.multihost`): `execute` is split into `host_call` (the
padded host arrays of the step's compiled call, keyed by its bucket and `has_mask`) and
`run_calls` (transfer and dispatch). Process 0 sends each step's host arrays through `channel`
before running them; the other processes rebuild the same shapes from the keys (`template`) and
call `run_calls` with the arrays they received. Sampled tokens then come back replicated
(`output_sharding`). A multi-process job runs every step as one call (`splits_sampling` is off,
and the warm-up compiles no split programs): the followers replay calls, not the host work
between them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from meshserve.batching.buckets import bucket_sizes, pick_bucket
from meshserve.batching.knobs import SchedulingKnobs, knob, same_knob
from meshserve.batching.plan import StepPlan, SubBatchPlan
from meshserve.batching.runner_protocol import SampledRows
from meshserve.batching.sampling import SamplingArrays, concat_sampling, greedy_sampling
from meshserve.batching.structured import mask_words
from meshserve.model import native_dot
from meshserve.model.attention import (ATTENTION_BACKENDS, KVCache, RaggedBatch, choose_backend,
                                       init_kv_cache)
from meshserve.model.config import ModelConfig
from meshserve.model.executor.device_layout import DeviceLayout, jit_step, to_devices
from meshserve.model.executor.lora_slabs import LoraSlabs
from meshserve.model.executor.sampler import host_sampling
from meshserve.model.executor.split_step import Forward, SplitPrograms
from meshserve.model.executor.steps import ragged_step
from meshserve.model.lora import lora_shape

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"
_BACKEND_COMPILE_EVENT = _COMPILE_EVENT_PREFIX + "backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# Steps that return prompt logprobs pad to at least this many token slots, so their variant of
# the step is compiled for the wider buckets only.
MIN_TARGET_TOKENS = 16
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Cache geometry and the largest step. Every field changes the compiled programs."""

    num_pages: int = same_knob(SchedulingKnobs, "num_pages")
    page_size: int = same_knob(SchedulingKnobs, "page_size")
    max_num_seqs: int = same_knob(SchedulingKnobs, "max_num_seqs")  # sequence slots per step
    max_num_batched_tokens: int = same_knob(SchedulingKnobs, "max_num_batched_tokens")
    max_pages_per_seq: int = 128  # context per sequence = max_pages_per_seq * page_size
    max_logprobs: int = knob(20, "top logprobs computed every step", compile=True)
    max_stop_ids: int = 16  # EOS and stop token ids masked per row under min_tokens
    attention: str = knob("auto", "attention backend: auto picks by platform (jnp on CPU, "
                                  "pallas-gpu on NVIDIA GPUs unless the model has a sliding "
                                  "window); jnp is the portable reference",
                          compile=True, choices=ATTENTION_CHOICES)
    context_block_pages: int = 8  # pages of cached context attention reads per loop iteration
    native_kernels: bool | None = knob(
        None, "a GGUF's kept blocks (int8, or packed in 4, 5 or 6 bits) and a kept LM head "
              "through native kernels built on first use with the system's C++ compiler; unset: "
              "on wherever they run (the CPU, one device, a compiler), else off", compile=True)
    overlap_masks: bool | None = knob(
        None, "a step with structured-output rows runs its forward pass and its sampling as "
              "two calls, the rows' masks computed on the host while the forward pass runs "
              "(adds a forward program per bucket and a sampler per sequence-slot count to the "
              "warm-up); off: one call, after the masks; unset: on where JAX's backend is not "
              "the CPU, whose cores the host's fill and XLA share", compile=True)

    def __post_init__(self):
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got "
                             f"{self.attention!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{field.name} must be >= 1, got {value}")
        if self.num_pages < 2:
            raise ValueError("num_pages must be >= 2: page 0 is the reserved dummy page")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}): every sequence needs a token "
                             "slot")

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token-slot counts a step is compiled for."""
        return bucket_sizes(self.max_num_batched_tokens)

    @property
    def target_buckets(self) -> tuple[int, ...]:
        """The token buckets of the prompt-logprobs variant."""
        return tuple(t for t in self.token_buckets
                     if t >= min(MIN_TARGET_TOKENS, self.max_num_batched_tokens))

    @property
    def block_pages(self) -> int:
        return min(self.context_block_pages, self.max_pages_per_seq)

    @property
    def page_table_width(self) -> int:
        """max_pages_per_seq rounded up to whole context blocks."""
        return -(-self.max_pages_per_seq // self.block_pages) * self.block_pages

    @property
    def history_width(self) -> int:
        """Token ids of history each sampled row carries, for the penalties: its whole context."""
        return self.max_pages_per_seq * self.page_size

    def num_seqs(self, num_tokens: int) -> int:
        """Sequence slots of a step with `num_tokens` token slots: every sequence has a token."""
        return min(num_tokens, self.max_num_seqs)

    def backend(self, model: ModelConfig, *, platform: str | None = None) -> str:
        """The attention backend for `model` on `platform` (default: JAX's default platform):
        `choose_backend` given the option, the model's sliding window (0 when no layer
        slides), its head_dim and this page size. Raises ValueError, naming the option, for a
        named backend that cannot run the model; "auto" never picks one."""
        return choose_backend(
            self.attention, platform=platform or jax.default_backend(),
            sliding_window=model.sliding_window if any(model.sliding_layers) else 0,
            head_dim=model.head_dim, page_size=self.page_size)

    def step_keys(self) -> list[tuple[int, int]]:
        """Every compiled call's key `(token slots per replica, has targets)`."""
        return ([(t, 0) for t in self.token_buckets]
                + [(t, 1) for t in self.target_buckets])

    def sampling_rows(self) -> list[int]:
        """The sequence slots per replica of the split steps' sampling programs: one program
        per distinct count (buckets wider than `max_num_seqs` share one)."""
        return sorted({self.num_seqs(t) for t in self.token_buckets})

    def overlaps_masks(self, *, platform: str | None = None) -> bool:
        """`overlap_masks` as set; unset, on unless `platform` (default: JAX's default
        backend) is the CPU."""
        if self.overlap_masks is not None:
            return self.overlap_masks
        return (platform or jax.default_backend()) != "cpu"


@dataclasses.dataclass(frozen=True)
class HostCall:
    """One compiled call's inputs on the host, padded to their bucket, and where each plan row's
    results sit in its outputs."""

    key: tuple[int, int, int]  # (token slots per replica, has targets, has mask); the first two
    # are the bucket, the program's key
    arrays: tuple[RaggedBatch, SamplingArrays]  # numpy leaves
    seq_index: tuple[np.ndarray, ...]  # per sub-batch [B]: each row's sequence slot
    token_index: tuple[np.ndarray, ...]  # per sub-batch [B, W]: each row's token slots


class PlanChannel(Protocol):
    """How process 0's runner tells the other processes what to run (multi-process only)."""

    def publish_run(self, keys: Sequence[tuple[int, ...]], arrays: Sequence[Any]) -> None: ...

    def failure(self, error: BaseException) -> BaseException: ...


class ModelRunner:
    """`config.num_pages`, `config.max_num_seqs` and `config.max_num_batched_tokens` are per
    replica."""

    def __init__(self, model: nnx.Module, config: RunnerConfig = RunnerConfig(),
                 layout: DeviceLayout | None = None, *, platform: str | None = None):
        """`platform` is the one `config.backend` settles the attention backend for (default:
        JAX's default platform)."""
        self.model_config = model.config
        self.config = config
        self.attention = config.backend(model.config, platform=platform)
        self.layout = layout
        self.native_kernels = native_dot.resolve(
            config.native_kernels, num_devices=1 if layout is None else layout.mesh.size)
        self.overlaps_masks = config.overlaps_masks(platform=platform)
        # Seconds the last `execute` waited for the device, after every call was dispatched:
        # the rest of its time is host work (flattening, transfers, dispatch).
        self.last_wait_seconds = 0.0
        self.num_replicas = layout.num_replicas if layout is not None else 1
        self.graphdef, params = nnx.split(model)
        self.params = params if layout is None else jax.device_put(params, layout.params)
        self.lora = lora_shape(model)  # the LoRA slabs' sizes; None: served without LoRA
        self.lora_slabs = None if self.lora is None else LoraSlabs(self.params, layout)
        c = model.config
        init = functools.partial(
            init_kv_cache, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            num_pages=config.num_pages * self.num_replicas, page_size=config.page_size,
            head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self.cache: KVCache = init() if layout is None else jax.jit(
            init, out_shardings=layout.cache)()
        step = functools.partial(
            ragged_step, self.graphdef, num_top_logprobs=config.max_logprobs,
            attention=self.attention, block_pages=config.block_pages,
            constrain=None if layout is None else layout.constrain,
            replica_axes=() if layout is None else layout.replica_axes)
        self._step = jit_step(step, layout, num_row_args=2)
        self._programs: dict[tuple[int, ...], jax.stages.Compiled] = {}
        self.split = SplitPrograms(self.graphdef, layout, num_top_logprobs=config.max_logprobs,
                                   attention=self.attention, block_pages=config.block_pages,
                                   vocab_size=c.vocab_size, native_kernels=self.native_kernels)
        self._allow_all: dict[tuple[int, ...], jax.Array] = {}  # resident masks, by shape
        self.last_user: object | None = None  # whoever ran the last step (engines sharing the
        # runner take turns with its KV cache)
        self.channel: PlanChannel | None = None  # a multi-process run sets it on every process
        # (only process 0 sends; see meshserve.serving.engine.multihost)

    def step_key(self, sub_batches: Sequence[SubBatchPlan]) -> tuple[int, int]:
        """The bucket `(token slots per replica, has targets)` that a step of `sub_batches`
        runs at."""
        slots = np.zeros(self.num_replicas, np.int64)
        for plan in sub_batches:
            np.add.at(slots, _replicas(plan), _row_slots(plan))
        has_targets = any(plan.targets is not None for plan in sub_batches)
        needed = int(slots.max(initial=1))
        if has_targets:
            needed = max(needed, self.config.target_buckets[0])
        if needed > self.config.max_num_batched_tokens:
            raise ValueError(f"a step of {needed} token slots exceeds max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}")
        return pick_bucket(needed, self.config.token_buckets), int(has_targets)

    @property
    def splits_sampling(self) -> bool:
        """Whether a step can run as `forward`, then `sample` (`overlap_masks`, and one
        process: see the module docstring)."""
        return self.overlaps_masks and jax.process_count() == 1

    def num_programs(self, *, prompt_logprobs: bool = True) -> int:
        """Programs `warmup(prompt_logprobs=...)` compiles: a step per bucket key (without
        `prompt_logprobs`, none of the keys with targets), and where steps split a forward pass
        per bucket key and a sampler per `RunnerConfig.sampling_rows` entry too; with LoRA, the
        slot write."""
        keys = len(self.warmup_keys(prompt_logprobs=prompt_logprobs))
        split = keys + len(self.config.sampling_rows()) if self.splits_sampling else 0
        return keys + split + (self.lora_slabs is not None)

    def padded_tokens(self, sub_batches: Sequence[SubBatchPlan]) -> int:
        """Token slots the step of `sub_batches` computes, on every replica together."""
        return self.step_key(sub_batches)[0] * self.num_replicas

    def execute(self, plan: StepPlan) -> list[SampledRows]:
        """Runs the plan as one compiled call: each sub-batch's real rows, sampled."""
        return self.run_step(plan.sub_batches, plan.sampling)

    def run_step(self, sub_batches: Sequence[SubBatchPlan],
                 sampling: Sequence[SamplingArrays] | None = None) -> list[SampledRows]:
        """Runs sub-batches as one step, one compiled call; returns each real row's sampled
        token (greedy when `sampling` is None)."""
        if sampling is None:
            sampling = [greedy_sampling(b.num_rows) for b in sub_batches]
        call = self.host_call(sub_batches, sampling)
        with peer_errors(self.channel):
            (out,) = self.run_calls([call.key], [call.arrays])
            started = time.perf_counter()
            host = jax.device_get(out)  # the step's one copy to the host
        self.last_wait_seconds = time.perf_counter() - started
        return [_unpad(host, seqs, slots)
                for seqs, slots in zip(call.seq_index, call.token_index)]

    def forward(self, sub_batches: Sequence[SubBatchPlan]) -> Forward:
        """Dispatches the forward pass of a step of `sub_batches` and returns at once (see the
        module docstring): the host is free while the device runs it, until `sample`."""
        assert self.splits_sampling, "overlap_masks is off, or the job has several processes"
        bucket = self.step_key(sub_batches)
        batch, seq_index, token_index = self._flatten(sub_batches, *bucket)
        batch = to_devices(batch, None if self.layout is None else self.layout.rows)
        program = self.split.forward_program(bucket, self.params, self.cache, batch)
        out, self.cache = program(self.params, self.cache, batch)
        return Forward(out=out, bucket=bucket, seq_index=seq_index, token_index=token_index,
                       finished_at=self.split.ready_times.watch(out.logits))

    def sample(self, forward: Forward, sampling: Sequence[SamplingArrays]
               ) -> list[SampledRows]:
        """Samples the step whose forward pass `forward` dispatched, under `sampling` (the
        plan's, its masks computed meanwhile): what `run_step` returns for the same step."""
        assert [s.num_rows for s in sampling] == [i.shape[0] for i in forward.seq_index]
        host = self._host_sampling(sampling, forward.bucket[0], forward.seq_index,
                                   has_mask=1)
        arrays = to_devices(host, None if self.layout is None else self.layout.rows)
        sampled = self.split.sampler_program(arrays)(forward.out.logits, arrays)
        started = time.perf_counter()
        host_out = jax.device_get(dataclasses.replace(forward.out, logits=None,
                                                      sampled=sampled))  # the one copy
        self.last_wait_seconds = time.perf_counter() - started
        return [_unpad(host_out, seqs, slots)
                for seqs, slots in zip(forward.seq_index, forward.token_index)]

    def finished_at(self, forward: Forward) -> float | None:
        """When the device finished `forward` (`time.perf_counter()`), asked once `sample`
        returned; None if the watching thread has not said within a second."""
        try:
            return forward.finished_at.result(timeout=1.0)
        except concurrent.futures.TimeoutError:
            return None

    def host_call(self, sub_batches: Sequence[SubBatchPlan],
                  sampling: Sequence[SamplingArrays]) -> HostCall:
        """The step's host arrays, flattened and padded to its bucket: exactly what its
        compiled call reads."""
        bucket = self.step_key(sub_batches)
        batch, seq_index, token_index = self._flatten(sub_batches, *bucket)
        has_mask = int(any(np.any(s.is_constrained) for s in sampling))
        host = self._host_sampling(sampling, bucket[0], seq_index, has_mask=has_mask)
        return HostCall(key=(*bucket, has_mask), arrays=(batch, host), seq_index=seq_index,
                        token_index=token_index)

    def _host_sampling(self, sampling: Sequence[SamplingArrays], tokens: int,
                       seq_index: Sequence[np.ndarray], *, has_mask: int) -> SamplingArrays:
        """The sub-batches' sampling arrays merged and padded for a step of `tokens` slots per
        replica, each row at its sequence slot."""
        if any(s.banned_ids.shape[1] > self.config.max_stop_ids for s in sampling):
            raise ValueError(f"more stop token ids than max_stop_ids={self.config.max_stop_ids}")
        index = np.concatenate(seq_index) if seq_index else np.zeros(0, np.int64)
        merged = concat_sampling(sampling) if sampling else greedy_sampling(0)
        return self._padded_sampling(merged, tokens, index, has_mask=has_mask)

    def template(self, key: tuple[int, ...]) -> tuple[RaggedBatch, SamplingArrays]:
        """Zero host arrays shaped like those of any call with key `key` (see `host_call`): a
        bucket `(tokens, has targets)`, which the program reads, or a call key with `has_mask`
        after it (0: a zero-width mask)."""
        tokens, has_targets, *rest = key
        batch, _, _ = self._flatten((), tokens, has_targets)
        return batch, self._padded_sampling(greedy_sampling(0), tokens, np.zeros(0, np.int64),
                                            has_mask=rest[0] if rest else 1)

    def _padded_sampling(self, merged: SamplingArrays, tokens: int, index: np.ndarray, *,
                         has_mask: int) -> SamplingArrays:
        """`merged`'s rows at sequence slots `index` of a step of `tokens` slots per replica,
        every width fixed; the other slots greedy and neutral. Without `has_mask`, `allowed` is
        zero words wide (`run_calls` puts the resident mask in its place)."""
        if not has_mask:
            merged = dataclasses.replace(merged, allowed=merged.allowed[:, :0])
        return host_sampling(merged, rows=self.config.num_seqs(tokens) * self.num_replicas,
                             history_width=self.config.history_width,
                             banned_width=self.config.max_stop_ids,
                             mask_width=mask_words(self.model_config.vocab_size) if has_mask
                             else None, index=index)

    def run_calls(self, keys: Sequence[tuple[int, ...]],
                  arrays: Sequence[tuple[RaggedBatch, SamplingArrays]]) -> list:
        """Dispatches one compiled call per entry of `arrays`; returns their device outputs.

        With a plan channel (multi-process, on process 0) the calls are first sent to the other
        processes, which run the same calls on their own devices (`meshserve.serving.engine.multihost`).
        """
        if self.channel is not None:
            self.channel.publish_run(keys, arrays)
        sharding = None if self.layout is None else self.layout.rows
        outs = []
        for key, (batch, sampling) in zip(keys, arrays):
            batch, sampling = to_devices((batch, sampling), sharding)
            if sampling.allowed.shape[1] == 0:  # no row is constrained: nothing was copied
                sampling = dataclasses.replace(sampling, allowed=self._resident_mask(
                    sampling.allowed.shape[0], sharding))
            out, self.cache = self.program(key)(self.params, self.cache, batch, sampling)
            outs.append(out)
        return outs

    def _resident_mask(self, rows: int, sharding) -> jax.Array:
        """An all-allowed mask of `rows` rows on the devices, copied there on first use only."""
        shape = (rows, mask_words(self.model_config.vocab_size))
        if shape not in self._allow_all:
            self._allow_all[shape] = to_devices(np.full(shape, -1, np.int32), sharding)
        return self._allow_all[shape]

    def program(self, key: tuple[int, ...]) -> jax.stages.Compiled:
        """The compiled step of `key` (a bucket, or a call key: `has_mask` after the bucket
        picks no other program), compiled (or loaded from the persistent compilation cache) on
        first use. Steps call it directly, so the compiled set is exactly these."""
        key = tuple(key)[:2]
        if key not in self._programs:
            sharding = None if self.layout is None else self.layout.rows
            batch, sampling = to_devices(self.template(key), sharding)
            with native_dot.enabled(self.native_kernels):
                self._programs[key] = self._step.lower(self.params, self.cache, batch,
                                                       sampling).compile()
        return self._programs[key]

    def _compile_split(self, key: tuple[int, ...]) -> None:
        """Compiles the forward pass of bucket key `key` and the sampler of its rows."""
        batch, sampling = to_devices(self.template((*key[:2], 1)),
                                     None if self.layout is None else self.layout.rows)
        self.split.forward_program(tuple(key[:2]), self.params, self.cache, batch)
        self.split.sampler_program(sampling)

    def warmup_keys(self, *, prompt_logprobs: bool = True) -> list[tuple[int, int]]:
        """The bucket keys `warmup` compiles by default: every step key, or without
        `prompt_logprobs` those of steps that return no prompt logprobs (a step with targets
        then compiles its variant on first use)."""
        return [key for key in self.config.step_keys() if prompt_logprobs or not key[1]]

    def warmup(self, keys: Sequence[tuple[int, int]] | None = None, *,
               progress: bool = True, prompt_logprobs: bool = True
               ) -> list[tuple[int, int, int]]:
        """Compiles the step for each bucket key (default: `warmup_keys(prompt_logprobs=...)`),
        and where steps split its forward pass and sampling too; runs nothing. Returns the call
        keys the steps serve, each bucket with and without a mask (their host arrays differ in
        size: a multi-process job warms up a broadcast of each)."""
        keys = (self.warmup_keys(prompt_logprobs=prompt_logprobs) if keys is None
                else list(keys))
        if self.lora_slabs is not None:
            self.lora_slabs.compile()
        for key in tqdm(keys, desc="warming up", unit="bucket", disable=not progress):
            self.program(key)
            if self.splits_sampling:
                self._compile_split(key)
        return [(*key[:2], has_mask) for key in keys for has_mask in (1, 0)]

    def load_adapter(self, slot: int, weights: Mapping[str, tuple[np.ndarray, np.ndarray]]
                     ) -> None:
        """Writes a LoRA adapter into row `slot` (1..max_loras) of every slab, in place on the
        devices (`LoraSlabs.write`): no compile, whatever the slot or adapter."""
        assert self.lora_slabs is not None, "this runner serves no LoRA adapters"
        self.lora_slabs.write(slot, weights)

    def _flatten(self, sub_batches: Sequence[SubBatchPlan], tokens_per_replica: int,
                 has_targets: int) -> tuple[RaggedBatch, tuple, tuple]:
        """Host `RaggedBatch` of `sub_batches`, and where each of their rows landed."""
        c, replicas = self.config, self.num_replicas
        num_tokens, num_seqs = tokens_per_replica, c.num_seqs(tokens_per_replica)
        width, page_size = c.page_table_width, c.page_size
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        out = dict(tokens=zeros(replicas * num_tokens), positions=zeros(replicas * num_tokens),
                   token_seq=zeros(replicas * num_tokens), is_real=zeros(replicas * num_tokens),
                   write_slots=zeros(replicas * num_tokens), kv_lens=zeros(replicas * num_seqs),
                   num_new=zeros(replicas * num_seqs), last=zeros(replicas * num_seqs),
                   page_table=zeros(replicas * num_seqs, width),
                   targets=zeros(replicas * num_tokens) if has_targets else None,
                   adapters=zeros(replicas * num_tokens) if self.lora is not None else None)
        next_token = [0] * replicas  # local to each replica's block
        next_seq = [0] * replicas
        seq_index, token_index = [], []
        for plan in sub_batches:
            if plan.page_table.shape[1] > width:
                raise ValueError(f"a row of {plan.page_table.shape[1]} pages exceeds "
                                 f"max_pages_per_seq={c.max_pages_per_seq}")
            row_slots = _row_slots(plan)
            seqs = np.empty(plan.num_rows, np.int64)
            slots = np.empty(plan.tokens.shape, np.int64)
            for i, replica in enumerate(_replicas(plan)):
                seq, start = next_seq[replica], next_token[replica]
                n, count = int(plan.num_new[i]), int(row_slots[i])
                assert seq < num_seqs and start + count <= num_tokens, "the bucket is too small"
                next_seq[replica], next_token[replica] = seq + 1, start + count
                s, t = replica * num_seqs + seq, replica * num_tokens + start
                seqs[i] = s
                slots[i] = np.minimum(t + np.arange(plan.tokens.shape[1]),
                                      replicas * num_tokens - 1)
                out["tokens"][t:t + count] = plan.tokens[i, :count]
                out["positions"][t:t + count] = plan.positions[i, :count]
                out["token_seq"][t:t + count] = seq
                out["is_real"][t:t + n] = 1
                positions = plan.positions[i, :n]
                pages = plan.page_table[i, positions // page_size]
                out["write_slots"][t:t + n] = pages * page_size + positions % page_size
                if has_targets and plan.targets is not None:
                    out["targets"][t:t + count] = plan.targets[i, :count]
                if self.lora is not None and plan.adapter_slots is not None:
                    out["adapters"][t:t + count] = plan.adapter_slots[i]
                out["kv_lens"][s] = plan.kv_lens[i]
                out["num_new"][s] = n
                out["last"][s] = start + max(n - 1, 0)
                out["page_table"][s, :plan.page_table.shape[1]] = plan.page_table[i]
            seq_index.append(seqs)
            token_index.append(slots)
        return RaggedBatch(**out), tuple(seq_index), tuple(token_index)


@contextlib.contextmanager
def peer_errors(channel: PlanChannel | None):
    """Turns a failed collective of a multi-process step into the channel's account of it (which
    process was lost)."""
    try:
        yield
    except Exception as err:
        if channel is None:
            raise
        raise channel.failure(err) from err


def _replicas(plan: SubBatchPlan) -> np.ndarray:
    return np.zeros(plan.num_rows, np.int32) if plan.replicas is None else plan.replicas


def _row_slots(plan: SubBatchPlan) -> np.ndarray:
    """Token slots each row takes: its new tokens, or the sub-batch's width when lockstep."""
    if plan.lockstep:
        return np.full(plan.num_rows, plan.tokens.shape[1], np.int64)
    return plan.num_new.astype(np.int64)


def _unpad(out, seqs: np.ndarray, slots: np.ndarray) -> SampledRows:
    prompt = lambda a: None if a is None else np.asarray(a)[slots]  # noqa: E731
    s = out.sampled
    return SampledRows(
        tokens=np.asarray(s.tokens)[seqs], logprobs=np.asarray(s.logprobs)[seqs],
        top_ids=np.asarray(s.top_ids)[seqs], top_logprobs=np.asarray(s.top_logprobs)[seqs],
        prompt_logprobs=prompt(out.prompt_logprobs), prompt_top_ids=prompt(out.prompt_top_ids),
        prompt_top_logprobs=prompt(out.prompt_top_logprobs))


class CompileCounter:
    """Counts programs compiled while active: `with CompileCounter() as c: ...; c.count`.

    A program loaded from the persistent compilation cache counts too (JAX reports it as a
    backend compile as well): it was still a miss of the in-memory cache. `num_cache_hits` says
    how many of them came from disk. `seconds` adds up tracing, lowering and compiling time, so
    callers can report throughput with compilation excluded.
    """

    def __init__(self):
        self.count = 0
        self.num_cache_hits = 0
        self.seconds = 0.0

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event.startswith(_COMPILE_EVENT_PREFIX):
            self.seconds += duration
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            self.num_cache_hits += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)


def enable_compilation_cache(directory: str | Path) -> None:
    """Persists compiled programs under `directory`, so a restart skips most of the warm-up."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
