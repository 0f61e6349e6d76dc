"""The step plan: what the host decided one step will compute, as plain numpy arrays.

A `StepPlan` is a tuple of sub-batches. Each `SubBatchPlan` holds B rows with up to T new tokens
each (prefill chunks, or decodes with T = 1), unpadded in B and M; the model runner pads them to
its compiled buckets. Rows are right-padded in T; `num_new` says how many tokens of a row are
real. The runner runs only the real tokens, unless the sub-batch is `lockstep` (the static
baseline): then every row computes all T slots, as static batching does.

Each sub-batch carries `SamplingArrays`, one entry per row: how to sample the token that follows the
row's last new token. A row whose chunk does not end its prompt still gets a token sampled; the
host ignores it (`StepPlan.row_samples` says which rows' tokens count).

`build_plan` lays out the rows a policy picked: one prefill sub-batch per token bucket, widest
first, then one sub-batch of all decode rows (rows with one token left); empty ones are left out.
Rows of different widths never share a sub-batch, so a short chunk is not padded to a long one. A
padding `Row` has `num_new = 0`, `kv_lens = 0` and no pages; it carries the id of the request
whose seat it holds and never samples.

Invariants (asserted): all arrays int32; a row's new tokens sit at positions
`kv_lens - num_new ... kv_lens - 1`; its page table covers `kv_lens` tokens; page 0 is never a
real page. With data parallelism each row belongs to one replica (`replicas`), and its page ids
are that replica's own (every replica has its own pages 1..P-1 and its own dummy page 0).

This module is plain Python and numpy; it must not import jax or anything from meshserve's
model, serving or sharding packages.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from meshserve.batching.buckets import pick_bucket
from meshserve.batching.pages import num_pages_for
from meshserve.batching.request import Request
from meshserve.batching.sampling import COLUMNS, SamplingArrays, SamplingParams, params_columns


@dataclasses.dataclass(frozen=True)
class SubBatchPlan:
    tokens: np.ndarray  # [B, T] new token ids, right-padded with 0
    positions: np.ndarray  # [B, T] position of each new token, 0 on padding
    num_new: np.ndarray  # [B] real new tokens per row
    kv_lens: np.ndarray  # [B] context length after this step
    page_table: np.ndarray  # [B, M] pages of each row, 0 past its last page
    targets: np.ndarray | None = None  # [B, T] next tokens whose logprobs are wanted
    replicas: np.ndarray | None = None  # [B] data-parallel replica of each row; None: all 0
    lockstep: bool = False  # every row, padding rows too, computes all T slots (static batching)
    adapter_slots: np.ndarray | None = None  # [B] LoRA adapter slot of each row (0: none);
    # None: no row runs an adapter

    def __post_init__(self):
        rows, width = self.tokens.shape
        assert self.positions.shape == (rows, width), self.positions.shape
        assert self.num_new.shape == (rows,) and self.kv_lens.shape == (rows,)
        assert self.page_table.shape[0] == rows
        assert self.targets is None or self.targets.shape == (rows, width)
        assert self.replicas is None or self.replicas.shape == (rows,)
        assert self.adapter_slots is None or self.adapter_slots.shape == (rows,)
        assert np.all(self.num_new <= width) and np.all(self.num_new <= self.kv_lens)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) new tokens in this sub-batch."""
        return int(self.num_new.sum())


def sub_batch_from_rows(rows: Sequence[tuple[Sequence[int], int, Sequence[int]]], *,
                        page_size: int, targets: Sequence[Sequence[int]] | None = None
                        ) -> SubBatchPlan:
    """Builds a sub-batch from `(new_token_ids, num_cached_tokens, pages)` per row.

    `targets[i]`, when given, are the ids that follow row i's new tokens (for prompt logprobs);
    shorter lists are padded with 0.
    """
    width = max(len(ids) for ids, _, _ in rows)
    num_pages = max(len(pages) for _, _, pages in rows)
    plan = empty_sub_batch(len(rows), width, num_pages, with_targets=targets is not None)
    for i, (ids, num_cached, pages) in enumerate(rows):
        n = len(ids)
        assert len(pages) * page_size >= num_cached + n, "row's pages cannot hold its tokens"
        plan.tokens[i, :n] = ids
        plan.positions[i, :n] = np.arange(num_cached, num_cached + n)
        plan.num_new[i] = n
        plan.kv_lens[i] = num_cached + n
        plan.page_table[i, :len(pages)] = pages
        if targets is not None:
            plan.targets[i, :len(targets[i])] = targets[i]
    return plan


def empty_sub_batch(rows: int, width: int, num_pages: int, *,
                    with_targets: bool = False) -> SubBatchPlan:
    """A sub-batch of padding rows (no new tokens); builders fill it in place."""
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return SubBatchPlan(
        tokens=zeros(rows, width), positions=zeros(rows, width), num_new=zeros(rows),
        kv_lens=zeros(rows), page_table=zeros(rows, num_pages),
        targets=zeros(rows, width) if with_targets else None,
    )


class PlannedRow(NamedTuple):
    """A row of a step that computes tokens: row `row` of sub-batch `batch`."""

    batch: int
    row: int
    request_id: str
    num_new: int
    is_sampled: bool  # its sampled token is a real output (the prompt's last chunk, or a decode)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything one engine step computes. Prefill sub-batch first (if any), then decode.

    `row_requests[i][r]` is the request id of row r of sub-batch i; `row_samples[i][r]` says whether
    that row's sampled token is a real output (False for a prompt chunk that is not the last).
    `adapter_loads` are the LoRA adapters to load into device slots before the step runs.
    """

    sub_batches: tuple[SubBatchPlan, ...]
    sampling: tuple[SamplingArrays, ...]
    row_requests: tuple[tuple[str, ...], ...]
    row_samples: tuple[np.ndarray, ...]  # per sub-batch [B] bool
    adapter_loads: tuple[tuple[int, int], ...] = ()  # (slot, adapter id) pairs

    def __post_init__(self):
        assert len(self.sub_batches) == len(self.sampling) == len(self.row_requests)
        assert len(self.row_samples) == len(self.sub_batches)
        for batch, sampling, ids, samples in zip(self.sub_batches, self.sampling,
                                                 self.row_requests, self.row_samples):
            assert batch.num_rows == sampling.num_rows == len(ids) == samples.shape[0]

    @property
    def is_empty(self) -> bool:
        return not self.sub_batches

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.sub_batches)

    def real_rows(self) -> Iterator[PlannedRow]:
        """Every row that computes tokens, sub-batch by sub-batch; padding rows are left out."""
        for i, (batch, ids, samples) in enumerate(zip(self.sub_batches, self.row_requests,
                                                      self.row_samples)):
            for r, request_id in enumerate(ids):
                if batch.num_new[r]:
                    yield PlannedRow(i, r, request_id, int(batch.num_new[r]), bool(samples[r]))


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a step: the next `num_new` tokens of `request`; 0 makes it a padding row."""

    request: Request
    num_new: int
    is_decode: bool

    @property
    def is_padding(self) -> bool:
        return self.num_new == 0

    @property
    def kv_len(self) -> int:
        """The row's context after this step; 0 for padding."""
        return 0 if self.is_padding else self.request.num_computed_tokens + self.num_new

    @property
    def is_sampled(self) -> bool:
        """Whether this row computes the request's last uncomputed token, so its sample counts."""
        return not self.is_padding and self.num_new == self.request.num_uncomputed


def build_plan(rows: Sequence[Row], *, page_size: int, eos_token_ids: Sequence[int] = (),
               num_replicas: int = 1, token_buckets: Sequence[int] | None = None,
               lockstep: bool = False) -> StepPlan:
    """One prefill sub-batch per token bucket (all prefill rows in one without `token_buckets`),
    widest first, then one decode sub-batch; an empty one is left out. `lockstep` sub-batches
    compute every row's full width (the static baseline)."""
    prefill = [row for row in rows if not row.is_decode]
    by_bucket: dict[int, list[Row]] = collections.defaultdict(list)
    for row in prefill:
        bucket = 0 if token_buckets is None else pick_bucket(row.num_new, token_buckets)
        by_bucket[bucket].append(row)
    decode = [row for row in rows if row.is_decode]
    groups = [by_bucket[b] for b in sorted(by_bucket, reverse=True)] + ([decode] if decode else [])
    return StepPlan(
        sub_batches=tuple(_sub_batch(group, page_size, num_replicas, lockstep)
                          for group in groups),
        sampling=tuple(sampling_arrays(group, eos_token_ids=eos_token_ids) for group in groups),
        row_requests=tuple(tuple(row.request.request_id for row in group) for group in groups),
        row_samples=tuple(np.array([row.is_sampled for row in group], bool) for group in groups),
    )


def _sub_batch(rows: Sequence[Row], page_size: int, num_replicas: int,
               lockstep: bool) -> SubBatchPlan:
    inputs = [_row_inputs(row, page_size) for row in rows]
    plan = sub_batch_from_rows(inputs, page_size=page_size, targets=_prompt_targets(rows))
    replicas = None if num_replicas == 1 else np.array([row.request.replica for row in rows],
                                                        np.int32)
    return dataclasses.replace(plan, replicas=replicas, lockstep=lockstep,
                               adapter_slots=adapter_slots([row.request for row in rows]))


def adapter_slots(requests: Sequence[Request]) -> np.ndarray | None:
    """Each request's LoRA adapter slot [B] int32, or None when none runs an adapter."""
    slots = np.array([request.adapter_slot for request in requests], np.int32)
    return slots if slots.any() else None


def _row_inputs(row: Row, page_size: int) -> tuple[list[int], int, list[int]]:
    """`(new_token_ids, num_cached_tokens, pages)`; pages only up to the row's context."""
    if row.is_padding:
        return [], 0, []
    start, end = row.request.num_computed_tokens, row.kv_len
    pages = row.request.pages[:num_pages_for(end, page_size)]
    return row.request.all_token_ids[start:end], start, pages


def _prompt_targets(rows: Sequence[Row]) -> list[list[int]] | None:
    """For rows that ask for prompt logprobs: the prompt ids that follow each new token.

    None when no row wants any, so the runner's plain step (no targets) is used.
    """
    targets = [_prompt_ids_after(row) if row.request.params.prompt_logprobs is not None else []
               for row in rows]
    return targets if any(targets) else None


def _prompt_ids_after(row: Row) -> list[int]:
    start = row.request.num_computed_tokens
    return row.request.prompt_token_ids[start + 1:start + row.num_new + 1]


def sampling_arrays(rows: Sequence[Row], *, eos_token_ids: Sequence[int] = ()) -> SamplingArrays:
    """Each row's sampling parameters, seed, output index, token history, stop ids and
    structured-output mask."""
    requests = [row.request for row in rows]
    params = [r.params for r in requests]
    history, is_output = _history(rows)
    return SamplingArrays(
        **params_columns(params),
        seeds=np.array([r.seed for r in requests], COLUMNS["seeds"].dtype),
        steps=np.array([len(r.output_token_ids) for r in requests], COLUMNS["steps"].dtype),
        history=history, history_is_output=is_output,
        banned_ids=_banned_ids(params, eos_token_ids), allowed=_allowed(rows),
        is_constrained=np.array([_is_constrained(row) for row in rows], np.bool_),
        num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params],
                              COLUMNS["num_logprobs"].dtype),
    )


def _is_constrained(row: Row) -> bool:
    return row.request.constraint is not None and row.is_sampled


def _allowed(rows: Sequence[Row]) -> np.ndarray:
    """Each sampled constrained row's mask of the tokens allowed next ([B, W]); -1 elsewhere,
    and one word wide when no row is constrained (the runner pads it). A mask still due (the
    engine computes it while the step's forward pass runs) stays -1 until `with_masks`."""
    masks = {i: row.request.constraint for i, row in enumerate(rows) if _is_constrained(row)}
    if not masks:
        return np.full((len(rows), 1), -1, np.int32)
    width = next(iter(masks.values())).num_words
    allowed = np.full((len(rows), width), -1, np.int32)
    for i, constraint in masks.items():
        # A policy never plans a constrained row ahead of its matcher (Request.awaits_output).
        assert constraint.num_consumed == len(rows[i].request.output_token_ids), \
            "a constrained row was planned before its last output was known"
        if not constraint.is_mask_due:
            allowed[i] = constraint.mask
    return allowed


def with_masks(plan: StepPlan, mask_of: Callable[[str], np.ndarray | None]) -> StepPlan:
    """`plan` with each constrained row's `allowed` mask replaced by `mask_of(request id)`
    (None: left as it is)."""
    sampling = []
    for arrays, ids in zip(plan.sampling, plan.row_requests):
        allowed = arrays.allowed.copy()
        for row in np.flatnonzero(arrays.is_constrained):
            mask = mask_of(ids[row])
            if mask is not None:
                allowed[row] = mask
        sampling.append(dataclasses.replace(arrays, allowed=allowed))
    return dataclasses.replace(plan, sampling=tuple(sampling))


def _history(rows: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's context after this step ([B, H], right-padded with -1), and which are outputs.

    Only the context: a chunk that does not end its prompt samples a token nobody keeps, and the
    history then never outgrows the row's pages.
    """
    lengths = [row.kv_len for row in rows]
    history = np.full((len(rows), max(max(lengths), 1)), -1, np.int32)
    is_output = np.zeros(history.shape, bool)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        history[i, :n] = row.request.all_token_ids[:n]
        is_output[i, row.request.num_prompt_tokens:n] = True
    return history, is_output


def _banned_ids(params: Sequence[SamplingParams], eos_token_ids: Sequence[int]) -> np.ndarray:
    """The ids the device masks while a row is below min_tokens: stop ids and EOS ([B, E],
    right-padded with -1). EOS is masked even with `ignore_eos`, as vLLM does: `ignore_eos` says
    EOS ends nothing, `min_tokens` that none comes before it."""
    ids = [list(dict.fromkeys(p.stop_token_ids + tuple(eos_token_ids))) for p in params]
    banned = np.full((len(ids), max(1, max(len(i) for i in ids))), -1, np.int32)
    for row, row_ids in enumerate(ids):
        banned[row, :len(row_ids)] = row_ids
    return banned
