"""Fake runners for scheduler tests, and the loop that drives a scheduler with one.

`FakeRunner` keeps a fake paged KV cache of token ids: every real row writes its new tokens through
its page table, then reads its whole context back through it, and its next token is an arithmetic
function of that context. A wrong page, a token never written, or a page another request wrote over
changes the output, so "each request's output equals what the rule gives when it runs alone" checks
the paging as well as the batching. Pages are poisoned when freed, so stale KV cannot pass for
recomputed KV; cached pages (prefix cache) keep their KV, as on the device, so a wrong cache hit
changes the output too. With data-parallel replicas each replica has its own fake cache, indexed by the
row's replica and its local page ids, so a page id read on the wrong replica shows too. No jax
anywhere.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from meshserve.batching.plan import StepPlan, SubBatchPlan
from meshserve.batching.request import Request
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler

VOCAB = 97
EMPTY = -1


def next_token(context: Sequence[int], window: int = 0) -> int:
    """The arithmetic rule: last token and position, plus a weighted sum of the whole context,
    or of its last `window` tokens (a sliding window; those before it count as 0)."""
    start = max(len(context) - window, 0) if window else 0
    weighted = sum((i + 1) * context[i] for i in range(start, len(context)))
    return (context[-1] * 7 + len(context) - 1 + weighted) % VOCAB


def reference_outputs(prompt: Sequence[int], max_tokens: int, window: int = 0) -> list[int]:
    """What the rule generates for `prompt` alone, with no stop but max_tokens."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context, window))
    return context[len(prompt):]


class FakeRunner:
    """`window`: each row reads only its last `window` tokens back, as a model whose every
    layer slides does, and never touches the pages before them."""

    def __init__(self, *, num_pages: int, page_size: int, num_replicas: int = 1,
                 window: int = 0):
        self.page_size = page_size
        self.window = window
        self.kv = np.full((num_replicas, num_pages, page_size), EMPTY, np.int64)

    def run(self, plan: StepPlan) -> list[np.ndarray]:
        return [self._run_sub_batch(batch) for batch in plan.sub_batches]

    def poison_free_pages(self, scheduler: Scheduler) -> None:
        for replica, allocator in enumerate(scheduler.allocators):
            free = [p for p in range(1, self.kv.shape[1]) if allocator.is_free(p)]
            self.kv[replica, free] = EMPTY

    def _run_sub_batch(self, batch: SubBatchPlan) -> np.ndarray:
        out = np.zeros(batch.num_rows, np.int32)
        replicas = np.zeros(batch.num_rows, int) if batch.replicas is None else batch.replicas
        for r in range(batch.num_rows):
            if batch.num_new[r] == 0:
                assert batch.kv_lens[r] == 0 and not batch.page_table[r].any(), "bad padding row"
                continue
            kv = self.kv[replicas[r]]
            self._write(kv, batch, r)
            out[r] = next_token(self._read(kv, batch, r), self.window)
        return out

    def _write(self, kv: np.ndarray, batch: SubBatchPlan, r: int) -> None:
        for j in range(batch.num_new[r]):
            page, slot = self._slot(batch.page_table[r], batch.positions[r, j])
            kv[page, slot] = batch.tokens[r, j]

    def _read(self, kv: np.ndarray, batch: SubBatchPlan, r: int) -> list[int]:
        length = int(batch.kv_lens[r])
        start = max(length - self.window, 0) if self.window else 0
        context = [0] * start + [int(kv[self._slot(batch.page_table[r], pos)])
                                 for pos in range(start, length)]
        assert EMPTY not in context, "a row read KV that was never written"
        return context

    def _slot(self, pages: np.ndarray, position: int) -> tuple[int, int]:
        page = pages[position // self.page_size]
        assert page != 0, "a real row reached the dummy page"
        return page, position % self.page_size


class ScriptedRunner:
    """Returns `script(request_id, output_index)` for every row; for stop tests."""

    def __init__(self, script: Callable[[str, int], int]):
        self.script = script

    def run(self, plan: StepPlan) -> list[np.ndarray]:
        return [np.array([self.script(rid, int(step)) for rid, step in zip(ids, sampling.steps)],
                         np.int32)
                for ids, sampling in zip(plan.row_requests, plan.sampling)]

    def poison_free_pages(self, scheduler: Scheduler) -> None:
        pass


def check_plan(plan: StepPlan, scheduler: Scheduler) -> None:
    """The limits every step must respect."""
    c = scheduler.config
    ids = [rid for batch_ids, batch in zip(plan.row_requests, plan.sub_batches)
           for rid, n in zip(batch_ids, batch.num_new) if n > 0]
    assert len(ids) == len(set(ids)), "a request has two rows in one step"
    for replica in range(c.num_replicas):
        mine = [_of_replica(b, replica) for b in plan.sub_batches]
        assert sum(int(b.num_new[m].sum()) for b, m in zip(plan.sub_batches, mine)) <= (
            c.max_num_batched_tokens), "a replica's token budget is exceeded"
        assert sum(int(m.sum()) for m in mine) <= c.max_num_seqs
    widths = [batch.tokens.shape[1] for batch in plan.sub_batches]
    assert widths == sorted(widths, reverse=True), "sub-batches go widest first, decode last"
    assert len(plan.sub_batches) <= len(c.token_buckets) + 1, "one sub-batch per bucket at most"
    for batch, samples in zip(plan.sub_batches, plan.row_samples):
        assert batch.page_table.size == 0 or batch.page_table.max() < c.num_pages
        assert not np.any(samples & (batch.num_new == 0)), "a padding row samples"


def drive(scheduler: Scheduler, runner, *, max_steps: int = 10_000,
          on_step: Callable[[StepPlan], None] | None = None) -> list[StepPlan]:
    """Runs the scheduler until it drains, checking the limits and the allocator every step."""
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return plans
        plan = scheduler.schedule()
        assert not plan.is_empty, "an idle step with unfinished requests"
        check_plan(plan, scheduler)
        scheduler.update(plan, runner.run(plan))
        for allocator in scheduler.allocators:
            allocator.check()
        runner.poison_free_pages(scheduler)
        if on_step is not None:
            on_step(plan)
        plans.append(plan)
    raise AssertionError(f"the scheduler did not drain in {max_steps} steps")


def _of_replica(batch: SubBatchPlan, replica: int) -> np.ndarray:
    replicas = np.zeros(batch.num_rows, int) if batch.replicas is None else batch.replicas
    return replicas == replica


def make_request(request_id: str, prompt_len: int, *, first: int = 1, **params) -> Request:
    """A request with a deterministic prompt; `params` go to SamplingParams."""
    prompt = [(first + 3 * i) % VOCAB for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(**params), arrival_time=0.0)


def storm_requests(seed: int) -> list[Request]:
    """64 requests of 60-63 prompt tokens (4 pages of 16) and 8-39 outputs (1-2 more pages):
    with 128 pages of 16 and 32 seats, the prompts alone fill the cache, and every request
    still grows."""
    rng = np.random.default_rng(seed)
    return [make_request(f"r{i}", int(rng.integers(60, 64)), first=int(rng.integers(97)),
                         max_tokens=int(rng.integers(8, 40)), ignore_eos=True)
            for i in range(64)]


def random_requests(rng: np.random.Generator, num: int, *, max_prompt: int,
                    max_output: int) -> list[Request]:
    return [make_request(f"r{i}", int(rng.integers(1, max_prompt + 1)), first=int(rng.integers(97)),
                         max_tokens=int(rng.integers(1, max_output + 1)), ignore_eos=True)
            for i in range(num)]
