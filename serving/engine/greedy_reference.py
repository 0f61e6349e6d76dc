"""Greedy generation for a fixed batch of prompts, straight on the model runner.

This is the simplest loop over the paged steps: every prompt gets its own contiguous run of pages,
prompts are prefilled together in chunks of at most `max_tokens`, then all rows decode in lockstep
until each has `max_new_tokens` tokens or hits a stop id. The continuous-batching engine replaces
it for serving; it stays as the plainest reference of how a plan drives the runner.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.executor.runner import ModelRunner


@dataclasses.dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    is_finished: bool = False


def generate_greedy(runner: ModelRunner, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[Generation]:
    _check_fits(runner, prompts, max_new_tokens)
    rows = [Generation(prompt_ids=list(p)) for p in prompts]
    pages = _assign_pages(runner, [len(p) + max_new_tokens for p in prompts])
    _prefill(runner, rows, pages, stop_token_ids, max_new_tokens)
    while not all(r.is_finished for r in rows):
        live = [i for i, r in enumerate(rows) if not r.is_finished]
        plan = sub_batch_from_rows(
            [([rows[i].token_ids[-1]], _context_len(rows[i]) - 1, pages[i]) for i in live],
            page_size=runner.config.page_size)
        (out,) = runner.run_step([plan])
        for i, token, logprob in zip(live, out.tokens, out.logprobs):
            _append(rows[i], int(token), float(logprob), stop_token_ids, max_new_tokens)
    return rows


def _prefill(runner, rows, pages, stop_token_ids, max_new_tokens) -> None:
    chunk = runner.config.max_num_batched_tokens // len(rows)  # every row's chunk in one step
    longest = max(len(r.prompt_ids) for r in rows)
    for start in range(0, longest, chunk):
        live = [i for i, r in enumerate(rows) if len(r.prompt_ids) > start]
        plan = sub_batch_from_rows(
            [(rows[i].prompt_ids[start:start + chunk], start, pages[i]) for i in live],
            page_size=runner.config.page_size)
        (out,) = runner.run_step([plan])
        for i, token, logprob in zip(live, out.tokens, out.logprobs):
            if len(rows[i].prompt_ids) <= start + chunk:  # this chunk ended the prompt
                _append(rows[i], int(token), float(logprob), stop_token_ids, max_new_tokens)


def _append(row: Generation, token: int, logprob: float, stop_token_ids, max_new_tokens) -> None:
    row.token_ids.append(token)
    row.logprobs.append(logprob)
    row.is_finished = token in stop_token_ids or len(row.token_ids) >= max_new_tokens


def _context_len(row: Generation) -> int:
    return len(row.prompt_ids) + len(row.token_ids)


def _assign_pages(runner: ModelRunner, lengths: Sequence[int]) -> list[list[int]]:
    size = runner.config.page_size
    counts = [math.ceil(n / size) for n in lengths]
    starts = np.cumsum([1] + counts[:-1])  # page 0 is the dummy
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


def _check_fits(runner: ModelRunner, prompts, max_new_tokens: int) -> None:
    c = runner.config
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if len(prompts) > c.max_num_seqs:
        raise ValueError(f"{len(prompts)} prompts exceed max_rows, the runner's "
                         f"max_num_seqs={c.max_num_seqs}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > c.max_pages_per_seq * c.page_size:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds the context of "
                         f"{c.max_pages_per_seq * c.page_size}; raise max_pages_per_seq")
    needed = sum(math.ceil((len(p) + max_new_tokens) / c.page_size) for p in prompts)
    if needed > c.num_pages - 1:
        raise ValueError(f"the batch needs {needed} KV pages but the cache has "
                         f"{c.num_pages - 1}; raise num_pages")
