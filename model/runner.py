"""The model runner: turns a step plan into padded device arrays and runs the compiled step.

It owns the weights, the KV cache and the jitted step. It pads every sub-batch to a bucket shape
`(rows, tokens, pages)`, so the number of compiled programs is bounded by the bucket sets, and it
makes one device-to-host copy per step (sampled tokens and their logprobs).

The buckets come from one function, `bucket_sizes`, used both by `warmup` and at run time.

Padding rows have `num_new = 0` and `kv_lens = 0`: they write to the dummy page 0 and their outputs
are dropped. Knobs that change compiled shapes (and so cost a compile each): the bucket sets,
`num_pages`, `page_size`, and whether prompt logprobs are asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.batching.buckets import bucket_sizes, pick_bucket
from tqdm.auto import tqdm

from meshserve.batching.plan import SamplingArrays, SubBatchPlan, empty_sub_batch, greedy_sampling
from meshserve.model.attention import KVCache, SubBatch, init_kv_cache
from meshserve.model.sampler import DeviceSampling, device_sampling
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
        return bucket_sizes(self.max_tokens, min_size=min(16, self.max_tokens))

    @property
    def page_buckets(self) -> tuple[int, ...]:
        return bucket_sizes(self.max_pages_per_seq, min_size=min(4, self.max_pages_per_seq))


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
    def __init__(self, model: nnx.Module, config: RunnerConfig = RunnerConfig()):
        self.model_config = model.config
        self.config = config
        self.graphdef, self.params = nnx.split(model)
        c = model.config
        self.cache: KVCache = init_kv_cache(
            num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, num_pages=config.num_pages,
            page_size=config.page_size, head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        step = functools.partial(sample_step, self.graphdef, num_top_logprobs=config.max_logprobs)
        self._step = jax.jit(step, donate_argnums=(1,))

    def padded_shape(self, plan: SubBatchPlan) -> tuple[int, int, int]:
        """The bucket `(rows, tokens, pages)` that `plan` runs at."""
        rows, width = plan.tokens.shape
        c = self.config
        tokens = 1 if width == 1 else pick_bucket(width, c.token_buckets)
        return (pick_bucket(rows, c.row_buckets), tokens,
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
        outputs = [self._dispatch(plan, s) for plan, s in zip(sub_batches, sampling)]
        host = jax.device_get(outputs)  # the step's one device-to-host copy
        return [_unpad(o, p) for o, p in zip(host, sub_batches)]

    def _dispatch(self, plan: SubBatchPlan, sampling: SamplingArrays):
        shape = self.padded_shape(plan)
        batch = pad_sub_batch(plan, shape)
        device = self._device_sampling(sampling, shape)
        (out,), self.cache = self._step(self.params, self.cache, (batch,), (device,))
        return out

    def _device_sampling(self, s: SamplingArrays, shape: tuple[int, int, int]) -> DeviceSampling:
        rows, _, pages = shape
        if s.banned_ids is not None and s.banned_ids.shape[1] > self.config.max_stop_ids:
            raise ValueError(f"{s.banned_ids.shape[1]} stop token ids exceed max_stop_ids="
                             f"{self.config.max_stop_ids}")
        return device_sampling(s, min_tokens=s.min_tokens, banned_ids=s.banned_ids, rows=rows,
                               history_width=pages * self.config.page_size,
                               banned_width=self.config.max_stop_ids)

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
        for shape in tqdm(shapes, desc="warming up", unit="bucket", disable=not progress):
            self.execute([empty_sub_batch(*shape)])


def pad_sub_batch(plan: SubBatchPlan, shape: tuple[int, int, int]) -> SubBatch:
    """Device arrays of `plan` padded to the bucket `(rows, tokens, pages)`.

    One `device_put` moves the whole sub-batch; `jnp.asarray` would compile a conversion per new
    shape.
    """
    rows, tokens, pages = shape
    pad = functools.partial(_pad_to, rows=rows)
    return jax.device_put(SubBatch(
        tokens=pad(plan.tokens, tokens), positions=pad(plan.positions, tokens),
        num_new=pad(plan.num_new), kv_lens=pad(plan.kv_lens),
        page_table=pad(plan.page_table, pages),
        targets=None if plan.targets is None else pad(plan.targets, tokens),
    ))


def _pad_to(array: np.ndarray, width: int | None = None, *, rows: int) -> np.ndarray:
    pad = [(0, rows - array.shape[0])]
    if width is not None:
        pad.append((0, width - array.shape[1]))
    return np.pad(array.astype(np.int32), pad)


def _unpad(out, plan: SubBatchPlan) -> SampledRows:
    rows, width = plan.tokens.shape
    prompt = lambda a: None if a is None else np.asarray(a)[:rows, :width]  # noqa: E731
    s = out.sampled
    return SampledRows(
        tokens=np.asarray(s.tokens)[:rows], logprobs=np.asarray(s.logprobs)[:rows],
        top_ids=np.asarray(s.top_ids)[:rows], top_logprobs=np.asarray(s.top_logprobs)[:rows],
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
