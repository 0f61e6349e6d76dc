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
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.batching.buckets import bucket_sizes, pick_bucket
from meshserve.batching.plan import SubBatchPlan
from meshserve.model.attention import KVCache, SubBatch, init_kv_cache
from meshserve.model.steps import greedy_step

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"
_BACKEND_COMPILE_EVENT = _COMPILE_EVENT_PREFIX + "backend_compile_duration"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Cache geometry and the largest shapes one step may have."""

    num_pages: int = 512
    page_size: int = 16
    max_rows: int = 16  # sequences per sub-batch
    max_tokens: int = 512  # new tokens per row in a prefill sub-batch
    max_pages_per_seq: int = 128  # context per sequence = max_pages_per_seq * page_size

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_rows", "max_tokens", "max_pages_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
    logprobs: np.ndarray  # [B] float32
    prompt_logprobs: np.ndarray | None = None  # [B, T]


class ModelRunner:
    def __init__(self, model: nnx.Module, config: RunnerConfig = RunnerConfig()):
        self.model_config = model.config
        self.config = config
        self.graphdef, self.params = nnx.split(model)
        c = model.config
        self.cache: KVCache = init_kv_cache(
            num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, num_pages=config.num_pages,
            page_size=config.page_size, head_dim=c.head_dim, dtype=jnp.dtype(c.dtype))
        self._step = jax.jit(functools.partial(greedy_step, self.graphdef), donate_argnums=(1,))

    def padded_shape(self, plan: SubBatchPlan) -> tuple[int, int, int]:
        """The bucket `(rows, tokens, pages)` that `plan` runs at."""
        rows, width = plan.tokens.shape
        c = self.config
        tokens = 1 if width == 1 else pick_bucket(width, c.token_buckets)
        return (pick_bucket(rows, c.row_buckets), tokens,
                pick_bucket(plan.page_table.shape[1], c.page_buckets))

    def execute(self, plans: Sequence[SubBatchPlan]) -> list[SampledRows]:
        """Runs one step over the sub-batches; returns greedy tokens per real row."""
        batches = tuple(self._to_device(p) for p in plans)
        outputs, self.cache = self._step(self.params, self.cache, batches)
        host = jax.device_get(outputs)  # the step's one device-to-host copy
        return [_unpad(o, p) for o, p in zip(host, plans)]

    def warmup(self, shapes: Sequence[Sequence[tuple[int, int, int]]]) -> None:
        """Compiles the step for each list of sub-batch bucket shapes, on padding only."""
        for step_shapes in shapes:
            self.execute([_padding_plan(*shape) for shape in step_shapes])

    def decode_shapes(self) -> list[list[tuple[int, int, int]]]:
        c = self.config
        return [[(rows, 1, pages)] for rows, pages in
                itertools.product(c.row_buckets, c.page_buckets)]

    def _to_device(self, plan: SubBatchPlan) -> SubBatch:
        return pad_sub_batch(plan, self.padded_shape(plan))


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


def _padding_plan(rows: int, tokens: int, pages: int) -> SubBatchPlan:
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return SubBatchPlan(tokens=zeros(rows, tokens), positions=zeros(rows, tokens),
                        num_new=zeros(rows), kv_lens=zeros(rows), page_table=zeros(rows, pages))


def _unpad(out, plan: SubBatchPlan) -> SampledRows:
    rows, width = plan.tokens.shape
    prompt = None if out.prompt_logprobs is None else np.asarray(out.prompt_logprobs)[:rows, :width]
    return SampledRows(tokens=np.asarray(out.tokens)[:rows],
                       logprobs=np.asarray(out.logprobs)[:rows], prompt_logprobs=prompt)


class CompileCounter:
    """Counts XLA backend compiles while active: `with CompileCounter() as c: ...; c.count`.

    `seconds` adds up tracing, lowering and compiling time, so callers can report throughput
    with compilation excluded.
    """

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event.startswith(_COMPILE_EVENT_PREFIX):
            self.seconds += duration
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
