"""The step plan: what the host decided one step will compute, as plain numpy arrays.

A `StepPlan` is a tuple of sub-batches. Each `SubBatchPlan` holds B rows with up to T new tokens
each (prefill chunks, or decodes with T = 1), unpadded in B and M; the model runner pads them to
its compiled buckets. Rows are right-padded in T; `num_new` says how many tokens of a row are real. The runner runs
only the real tokens, unless the sub-batch is `lockstep` (the static baseline): then every row
computes all T slots, as static batching does.

Each sub-batch carries `SamplingArrays`, one entry per row: how to sample the token that follows the
row's last new token. A row whose chunk does not end its prompt still gets a token sampled; the
host ignores it (`StepPlan.row_samples` says which rows' tokens count).

Invariants (asserted): all arrays int32; a row's new tokens sit at positions
`kv_lens - num_new ... kv_lens - 1`; its page table covers `kv_lens` tokens; page 0 is never a
real page. With data parallelism each row belongs to one replica (`replicas`), and its page ids
are that replica's own (every replica has its own pages 1..P-1 and its own dummy page 0).

This module imports numpy and `batching/sampling.py` only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from meshserve.batching.sampling import SamplingArrays


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

    def __post_init__(self):
        rows, width = self.tokens.shape
        assert self.positions.shape == (rows, width), self.positions.shape
        assert self.num_new.shape == (rows,) and self.kv_lens.shape == (rows,)
        assert self.page_table.shape[0] == rows
        assert self.targets is None or self.targets.shape == (rows, width)
        assert self.replicas is None or self.replicas.shape == (rows,)
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


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything one engine step computes. Prefill sub-batch first (if any), then decode.

    `row_requests[i][r]` is the request id of row r of sub-batch i; `row_samples[i][r]` says whether
    that row's sampled token is a real output (False for a prompt chunk that is not the last).
    """

    sub_batches: tuple[SubBatchPlan, ...]
    sampling: tuple[SamplingArrays, ...]
    row_requests: tuple[tuple[str, ...], ...]
    row_samples: tuple[np.ndarray, ...]  # per sub-batch [B] bool

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
