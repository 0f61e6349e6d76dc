"""The step plan: what the host decided one step will compute, as plain numpy arrays.

A plan is a tuple of sub-batches. Each `SubBatchPlan` holds B rows with up to T new tokens each
(prefill chunks, or decodes with T = 1), unpadded in B and M; the model runner pads them to its
compiled buckets. Rows are right-padded in T; `num_new` says how many tokens of a row are real.

Invariants (asserted): all arrays int32; a row's new tokens sit at positions
`kv_lens - num_new ... kv_lens - 1`; its page table covers `kv_lens` tokens; page 0 is never a
real page.

This module imports numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SubBatchPlan:
    tokens: np.ndarray  # [B, T] new token ids, right-padded with 0
    positions: np.ndarray  # [B, T] position of each new token, 0 on padding
    num_new: np.ndarray  # [B] real new tokens per row
    kv_lens: np.ndarray  # [B] context length after this step
    page_table: np.ndarray  # [B, M] pages of each row, 0 past its last page
    targets: np.ndarray | None = None  # [B, T] next tokens whose logprobs are wanted

    def __post_init__(self):
        rows, width = self.tokens.shape
        assert self.positions.shape == (rows, width), self.positions.shape
        assert self.num_new.shape == (rows,) and self.kv_lens.shape == (rows,)
        assert self.page_table.shape[0] == rows
        assert self.targets is None or self.targets.shape == (rows, width)
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
    plan = _empty_plan(len(rows), width, num_pages, with_targets=targets is not None)
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


def _empty_plan(rows: int, width: int, num_pages: int, *, with_targets: bool) -> SubBatchPlan:
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return SubBatchPlan(
        tokens=zeros(rows, width), positions=zeros(rows, width), num_new=zeros(rows),
        kv_lens=zeros(rows), page_table=zeros(rows, num_pages),
        targets=zeros(rows, width) if with_targets else None,
    )
