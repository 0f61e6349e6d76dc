"""The model runner: turns a step plan into padded device arrays and runs the compiled step.

It owns the weights, the KV cache and the jitted step. It pads every sub-batch to a bucket shape
`(rows, tokens, pages)`, so the number of compiled programs is bounded by the bucket sets, and it
makes one device-to-host copy per step (sampled tokens and their logprobs).

The buckets come from one function, `bucket_sizes`, used both by `warmup` and at run time.

Padding rows have `num_new = 0` and `kv_lens = 0`: they write to the dummy page 0 and their outputs
are dropped.

Placement comes from a `DeviceLayout` (built by `meshserve.sharding.layout`): the weights, the KV
pages and the per-row arrays go to the devices already sharded, and the step runs under
`jax.shard_map` over the replica axes, so each data-parallel replica computes its own rows against
its own slice of the page pool while XLA partitions the tensor-parallel axes inside. Rows of
replica r sit in block r of every sub-batch, each block padded to the same row bucket; page ids in
a plan are local to the row's replica (each replica has its own dummy page 0). Without a layout the
step runs on the default device. Knobs that change compiled shapes (and so cost a compile each): the bucket sets,
`num_pages`, `page_size`, and whether prompt logprobs are asked for.

Several processes (`meshserve.serving.multihost`): `execute` is split into `host_call` (the
padded host arrays of one compiled call, keyed by its bucket) and `run_calls` (transfer and
dispatch). Process 0 sends each step's host arrays through `channel` before running them; the
other processes rebuild the same shapes from the keys (`template`) and call `run_calls` with the
arrays they received. Sampled tokens then come back replicated (`output_sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path
from typing import Sequence

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from meshserve.batching.buckets import bucket_sizes, pick_bucket, token_bucket_sizes

from meshserve.batching.plan import SamplingArrays, SubBatchPlan, empty_sub_batch, greedy_sampling
from meshserve.model.attention import KVCache, SubBatch, init_kv_cache
from meshserve.model.sampler import DeviceSampling, host_sampling
from meshserve.model.steps import sample_step

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"
_BACKEND_COMPILE_EVENT = _COMPILE_EVENT_PREFIX + "backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Cache geometry and the largest shapes one step may have. Every field costs compiles."""

    num_pages: int = 512
    page_size: int = 16
    max_rows: int = 16  # sequences per sub-batch
    max_tokens: int = 512  # new tokens per row in a prefill sub-batch
    max_pages_per_seq: int = 128  # context per sequence = max_pages_per_seq * page_size
    max_logprobs: int = 20  # top-K logprobs computed every step
    max_stop_ids: int = 16  # EOS and stop token ids masked per row under min_tokens

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1, got {getattr(self, field.name)}")
        if self.num_pages < 2:
            raise ValueError("num_pages must be >= 2: page 0 is the reserved dummy page")

    @property
    def row_buckets(self) -> tuple[int, ...]:
        return bucket_sizes(self.max_rows)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return token_bucket_sizes(self.max_tokens)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        return bucket_sizes(self.max_pages_per_seq, min_size=min(4, self.max_pages_per_seq))


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """Where the runner's arrays live and how its step is partitioned."""

    mesh: Mesh
    params: Any  # a NamedSharding per weight: a pytree prefix of the params state
    cache: NamedSharding  # K and V [L, K, P, S, h]
    rows: NamedSharding  # the leading axis of every per-row step array
    cache_manual: PartitionSpec  # the cache's spec over the replica axes (shard_map)
    rows_manual: PartitionSpec  # the rows' spec over the replica axes (shard_map)
    replica_axes: tuple[str, ...]  # mesh axes the step is mapped over; () for none
    num_replicas: int
    constrain: Callable[[jax.Array, tuple[str, ...]], jax.Array] | None = None


@dataclasses.dataclass(frozen=True)
class HostCall:
    """One compiled call's inputs on the host, padded to their bucket."""

    key: tuple[int, int, int, int]  # (rows per replica, tokens, pages, has targets): the bucket
    arrays: tuple[SubBatch, DeviceSampling]  # numpy leaves
    index: np.ndarray  # where each plan row sits in the padded rows


class PlanChannel(Protocol):
    """How process 0's runner tells the other processes what to run (multi-process only)."""

    def publish_run(self, keys: Sequence[tuple[int, ...]], arrays: Sequence[Any]) -> None: ...

    def failure(self, error: BaseException) -> BaseException: ...


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


class ModelRunner:
    """`config.num_pages` and `config.max_rows` are per replica."""

    def __init__(self, model: nnx.Module, config: RunnerConfig = RunnerConfig(),
                 layout: DeviceLayout | None = None):
        self.model_config = model.config
        self.config = config
        self.layout = layout
        # Seconds the last `execute` waited for the device, after every call was dispatched:
        # the rest of its time is host work (padding, transfers, dispatch).
        self.last_wait_seconds = 0.0
        self.num_replicas = layout.num_replicas if layout is not None else 1
        self.graphdef, params = nnx.split(model)
        self.params = params if layout is None else jax.device_put(params, layout.params)
        c = model.config
        init = functools.partial(
            init_kv_cache, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            num_pages=config.num_pages * self.num_replicas, page_size=config.page_size,
            head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self.cache: KVCache = init() if layout is None else jax.jit(
            init, out_shardings=layout.cache)()
        step = functools.partial(
            sample_step, self.graphdef, num_top_logprobs=config.max_logprobs,
            constrain=None if layout is None else layout.constrain,
            replica_axes=() if layout is None else layout.replica_axes)
        self._step = compile_step(step, layout)
        self.channel: PlanChannel | None = None  # a multi-process run sets it on every process
        # (only process 0 sends; see meshserve.serving.multihost)

    def padded_shape(self, plan: SubBatchPlan) -> tuple[int, int, int]:
        """The bucket `(rows per replica, tokens, pages)` that `plan` runs at."""
        rows = np.bincount(_replicas(plan), minlength=self.num_replicas).max()
        c = self.config
        width = plan.tokens.shape[1]
        tokens = 1 if width == 1 else pick_bucket(width, c.token_buckets)
        return (pick_bucket(int(rows), c.row_buckets), tokens,
                pick_bucket(plan.page_table.shape[1], c.page_buckets))

    def execute(self, sub_batches: Sequence[SubBatchPlan],
                sampling: Sequence[SamplingArrays] | None = None) -> list[SampledRows]:
        """Runs one step; returns each real row's sampled token (greedy when `sampling` is None).

        Each sub-batch is its own compiled call, so the compiled set is the union of the prefill
        and the decode shapes rather than their product. The calls are dispatched back to back
        and their results come to the host in one copy.
        """
        if sampling is None:
            sampling = [greedy_sampling(b.num_rows) for b in sub_batches]
        calls = [self.host_call(plan, s) for plan, s in zip(sub_batches, sampling)]
        with peer_errors(self.channel):
            outs = self.run_calls([c.key for c in calls], [c.arrays for c in calls])
            started = time.perf_counter()
            host = jax.device_get(outs)  # the step's one copy to the host
        self.last_wait_seconds = time.perf_counter() - started
        return [_unpad(o, p, c.index) for o, p, c in zip(host, sub_batches, calls)]

    def host_call(self, plan: SubBatchPlan, sampling: SamplingArrays) -> HostCall:
        """`plan`'s host arrays, padded to its bucket: exactly what its compiled call reads."""
        shape = self.padded_shape(plan)
        index = self.row_index(plan, shape[0])
        rows = shape[0] * self.num_replicas
        batch = pad_sub_batch(plan, (rows, *shape[1:]), index=index)
        banned = sampling.banned_ids
        if banned is not None and banned.shape[1] > self.config.max_stop_ids:
            raise ValueError(f"{banned.shape[1]} stop token ids exceed max_stop_ids="
                             f"{self.config.max_stop_ids}")
        host = host_sampling(sampling, min_tokens=sampling.min_tokens,
                             banned_ids=sampling.banned_ids, rows=rows,
                             history_width=shape[2] * self.config.page_size,
                             banned_width=self.config.max_stop_ids, index=index)
        return HostCall(key=(*shape, int(plan.targets is not None)), arrays=(batch, host),
                        index=index)

    def template(self, key: tuple[int, ...]) -> tuple[SubBatch, DeviceSampling]:
        """Zero host arrays shaped like those of any call with bucket `key` (see `host_call`)."""
        rows, tokens, pages, has_targets = key
        empty = empty_sub_batch(rows * self.num_replicas, tokens, pages,
                                with_targets=bool(has_targets))
        replicas = np.repeat(np.arange(self.num_replicas, dtype=np.int32), rows)
        plan = dataclasses.replace(empty, replicas=replicas)
        return self.host_call(plan, greedy_sampling(plan.num_rows)).arrays

    def run_calls(self, keys: Sequence[tuple[int, ...]],
                  arrays: Sequence[tuple[SubBatch, DeviceSampling]]) -> list:
        """Dispatches one compiled call per entry of `arrays`; returns their device outputs.

        With a plan channel (multi-process, on process 0) the calls are first sent to the other
        processes, which run the same calls on their own devices (`meshserve.serving.multihost`).
        """
        if self.channel is not None:
            self.channel.publish_run(keys, arrays)
        sharding = None if self.layout is None else self.layout.rows
        outs = []
        for batch, sampling in arrays:
            batch, sampling = to_devices((batch, sampling), sharding)
            (out,), self.cache = self._step(self.params, self.cache, (batch,), (sampling,))
            outs.append(out)
        return outs

    def row_index(self, plan: SubBatchPlan, rows_per_replica: int) -> np.ndarray:
        """Where each plan row sits in the padded sub-batch: block r holds replica r's rows."""
        replicas = _replicas(plan)
        assert replicas.max(initial=0) < self.num_replicas, "a row names a replica out of range"
        index = np.empty(plan.num_rows, np.int64)
        for r in range(self.num_replicas):
            (mine,) = np.nonzero(replicas == r)
            index[mine] = r * rows_per_replica + np.arange(mine.size)
        return index

    def warmup_shapes(self, *, max_batched_tokens: int) -> list[tuple[int, int, int]]:
        """Every bucket a step may use: decode shapes, then prefill shapes whose padded size
        `rows * tokens` stays within the token budget (the scheduler's `fits_padded_budget`)."""
        c = self.config
        decode = [(r, 1, p) for r in c.row_buckets for p in c.page_buckets]
        prefill = [(r, t, p) for r in c.row_buckets for t in c.token_buckets
                   for p in c.page_buckets if r * t <= max(max_batched_tokens, t)]
        return decode + prefill

    def warmup(self, shapes: Sequence[tuple[int, int, int]], *, progress: bool = True) -> None:
        """Compiles the step for each bucket shape, running padding rows only."""
        for rows, tokens, pages in tqdm(shapes, desc="warming up", unit="bucket",
                                        disable=not progress):
            empty = empty_sub_batch(rows * self.num_replicas, tokens, pages)
            replicas = np.repeat(np.arange(self.num_replicas, dtype=np.int32), rows)
            self.execute([dataclasses.replace(empty, replicas=replicas)])


def pad_sub_batch(plan: SubBatchPlan, shape: tuple[int, int, int], *,
                  index: np.ndarray | None = None) -> SubBatch:
    """Host arrays of `plan` padded to the bucket `(rows, tokens, pages)`, plan row i at padded
    row `index[i]` (default: in order)."""
    rows, tokens, pages = shape
    index = np.arange(plan.num_rows) if index is None else index
    pad = functools.partial(_pad_to, rows=rows, index=index)
    return SubBatch(
        tokens=pad(plan.tokens, tokens), positions=pad(plan.positions, tokens),
        num_new=pad(plan.num_new), kv_lens=pad(plan.kv_lens),
        page_table=pad(plan.page_table, pages),
        targets=None if plan.targets is None else pad(plan.targets, tokens),
    )


def to_devices(tree, sharding):
    """`tree`'s numpy leaves on device, placed by `sharding` (None: the default device).

    One `device_put` moves a whole tree (`jnp.asarray` would compile a conversion per shape).
    With several processes each one builds only its own devices' shards from its copy of the
    (identical) host arrays: `device_put` would first compare the copies across processes, a
    collective per transfer.
    """
    if sharding is None or jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index]), tree)


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


def _pad_to(array: np.ndarray, width: int | None = None, *, rows: int,
            index: np.ndarray) -> np.ndarray:
    if width is None:
        out = np.zeros(rows, np.int32)
        out[index] = array
    else:
        out = np.zeros((rows, width), np.int32)
        out[index, :array.shape[1]] = array
    return out


def _replicas(plan: SubBatchPlan) -> np.ndarray:
    return np.zeros(plan.num_rows, np.int32) if plan.replicas is None else plan.replicas


def _unpad(out, plan: SubBatchPlan, index: np.ndarray) -> SampledRows:
    width = plan.tokens.shape[1]
    prompt = lambda a: None if a is None else np.asarray(a)[index, :width]  # noqa: E731
    s = out.sampled
    return SampledRows(
        tokens=np.asarray(s.tokens)[index], logprobs=np.asarray(s.logprobs)[index],
        top_ids=np.asarray(s.top_ids)[index], top_logprobs=np.asarray(s.top_logprobs)[index],
        prompt_logprobs=prompt(out.prompt_logprobs), prompt_top_ids=prompt(out.prompt_top_ids),
        prompt_top_logprobs=prompt(out.prompt_top_logprobs))


def compile_step(step: Callable, layout: DeviceLayout | None) -> Callable:
    """The jitted step; with a layout, mapped over the replica axes and sharded in and out."""
    if layout is None:
        return jax.jit(step, donate_argnums=(1,))
    if layout.replica_axes:
        rows, cache = layout.rows_manual, layout.cache_manual
        step = jax.shard_map(step, mesh=layout.mesh, in_specs=(PartitionSpec(), cache, rows, rows),
                             out_specs=(rows, cache), axis_names=set(layout.replica_axes),
                             check_vma=False)
    return jax.jit(step, in_shardings=(layout.params, layout.cache, layout.rows, layout.rows),
                   out_shardings=(output_sharding(layout, layout.rows), layout.cache),
                   donate_argnums=(1,))


def output_sharding(layout: DeviceLayout, sharding: NamedSharding) -> NamedSharding:
    """Where a step's sampled tokens land: `sharding`, or every device when the mesh spans
    several processes, so that process 0 can read every row."""
    if jax.process_count() == 1:
        return sharding
    return NamedSharding(layout.mesh, PartitionSpec())


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
