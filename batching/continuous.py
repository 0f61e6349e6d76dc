"""Continuous batching (the default policy; vLLM v1 style, no prefill or decode phase).

Every step has a budget of `max_num_batched_tokens` new tokens per replica, handed out in three
passes:
  1. running requests that are decoding (one uncomputed token) get 1 token each, oldest first;
  2. running requests still mid-prompt get their next chunk:
     min(prefill_chunk, budget left, tokens left), cut down to a token bucket (`floor_bucket`),
     so a chunk runs unpadded; only a piece shorter than the smallest bucket pads. With
     `step_buckets` (the engine's ragged step, which passes one token bucket and pads only the
     step's total) a chunk is instead cut so that the step lands on the nearer step bucket;
  3. waiting requests are admitted in the scheduler's waiting order while there is a free seat
     (`max_num_seqs`), budget, and pages for their first chunk with the watermark kept (below).
     The head of the queue always goes first, so it never starves. The others are taken from the
     next `admission_lookahead` (2 * max_num_seqs) requests, as the `Ordering` arranges them.
     Admission stops at the first request whose chunk finds no pages. A request whose LoRA
     adapter finds no device slot (`can_hold_adapter`) is passed over, the head included: it
     waits until a running request of another adapter lets its slot go.

The watermark: a request is admitted only if, once its first chunk has its pages, at least
`kv_watermark` of the replica's pages are still available (free or cached), so running requests
have room to grow and preemption stays rare. The exception is a request with nobody running on
its replica: it has the whole cache, and refusing it would hang.

Out of pages is a policy, never an error: a running request that needs a page and finds none
preempts a victim among the newer requests on its replica that are not yet in this step. The
victim is the cheapest: the fewest computed tokens lost per page its preemption frees (a page it
shares with another holder frees nothing, and a request that would free none is passed over),
ties going to the newest. With no such victim left the request preempts itself, and simply
waits. A replica that preempts admits nobody that step, so a request just sent back is not
readmitted straight into the same shortage. A request never preempts an older one, and every
request passed `add`'s check that it fits in the whole cache, so the oldest running request always
makes progress: no step can hang.

A constrained request whose last output is still a pipeline placeholder (`awaits_output`) is
left out of the step: its next mask needs that token. It keeps its seat and pages, and other
requests take their rows as usual.

Placement (`num_replicas` > 1): a request is placed when it is admitted, on the replica with the
longest prefix-cache hit, then the least loaded by tokens held, then the lowest index, among those
with a free seat, budget and pages for its first chunk. Preemption picks its victim on the needy
request's own replica, since only that frees the right pages.

This module is plain Python; it must not import jax or anything from meshserve's model, serving
or sharding packages.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

from meshserve.batching.buckets import floor_bucket, pick_bucket
from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.ordering import Ordering
from meshserve.batching.plan import Row
from meshserve.batching.policy import Primitives, fits_padded_budget
from meshserve.batching.request import Request, RequestStatus


@dataclasses.dataclass
class _Draft:
    """The rows of one replica's share of the step being planned, and what is left of its token
    budget."""

    num_free_tokens: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    scheduled: set[str] = dataclasses.field(default_factory=set)
    num_preempted: int = 0
    # Prefill rows per token bucket: each bucket is its own sub-batch (see `build_plan`).
    prefill_rows: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, row: Row) -> None:
        assert 0 < row.num_new <= self.num_free_tokens, (row.num_new, self.num_free_tokens)
        self.rows.append(row)
        self.scheduled.add(row.request.request_id)
        self.num_free_tokens -= row.num_new
        if not row.is_decode:
            self.prefill_rows[row.num_new] += 1

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self.scheduled

    def can_add_prefill(self, num_new: int, config: SchedulerConfig) -> bool:
        """Whether a prefill row of `num_new` tokens keeps its bucket's sub-batch, padded,
        within the budget."""
        if not config.bound_padded_prefill:
            return True
        bucket = pick_bucket(num_new, config.token_buckets)
        same = sum(n for width, n in self.prefill_rows.items()
                   if pick_bucket(width, config.token_buckets) == bucket)
        return fits_padded_budget(same + 1, num_new, config)


class ContinuousPolicy:
    """Continuous batching with chunked prefill; see the module docstring for the exact rules."""

    splits_prefill_by_bucket = True
    is_lockstep = False

    def __init__(self, config: SchedulerConfig, ordering: Ordering):
        self.config = config
        self.ordering = ordering
        # Page 0 of every replica is the dummy: `num_pages - 1` usable pages.
        self.watermark = math.ceil(config.kv_watermark * (config.num_pages - 1))

    def pick_rows(self, scheduler: Primitives) -> list[Row]:
        drafts = [_Draft(num_free_tokens=self.config.max_num_batched_tokens)
                  for _ in range(self.config.num_replicas)]
        self._continue_running(scheduler, drafts, is_decode=True)
        self._continue_running(scheduler, drafts, is_decode=False)
        self._admit_waiting(scheduler, drafts)
        return [row for draft in drafts for row in draft.rows]

    def _continue_running(self, scheduler: Primitives, drafts: list[_Draft], *,
                          is_decode: bool) -> None:
        """Schedules the running requests that are decoding (or mid-prompt), oldest first."""
        for request in list(scheduler.running):
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this pass
                continue
            if request.awaits_output:  # its next mask needs a token not known yet
                continue
            if (request.num_uncomputed == 1) != is_decode:
                continue
            draft = drafts[request.replica]
            num_new = self._chunk_len(request, draft)
            if not is_decode and not draft.can_add_prefill(num_new, self.config):
                continue  # its chunk waits a step rather than blow up the padded shape
            if num_new > 0 and self._make_room(scheduler, draft, request, num_new):
                draft.add(Row(request, num_new, is_decode))

    def _make_room(self, scheduler: Primitives, draft: _Draft, request: Request,
                   num_new: int) -> bool:
        """Reserves pages for the request's next `num_new` tokens, preempting `_victim`s until
        they fit. False if the request preempted itself."""
        while not scheduler.reserve_pages(request, request.num_computed_tokens + num_new):
            victim = self._victim(scheduler, draft, request)
            scheduler.preempt(victim)
            draft.num_preempted += 1
            if victim is request:
                return False
        return True

    @staticmethod
    def _victim(scheduler: Primitives, draft: _Draft, request: Request) -> Request:
        """Among the newer requests on `request`'s replica not yet in this step, and that would
        free a page, the cheapest to preempt (`preemption_cost`), ties going to the newest;
        `request` itself when there is none."""
        running = scheduler.running_on(request.replica)
        newer = running[running.index(request) + 1:]
        candidates = [r for r in newer if not draft.is_scheduled(r)
                      and scheduler.preemption_cost(r) != float("inf")]
        return min(reversed(candidates), key=scheduler.preemption_cost, default=request)

    def _admit_waiting(self, scheduler: Primitives, drafts: list[_Draft]) -> None:
        """Admits waiting requests in `_admission_order`, each on the first replica in
        `_placement_order` that can take it. A replica that preempted this step admits nobody."""
        seats = [len(scheduler.running_on(r)) for r in range(len(drafts))]
        for position, request in enumerate(self._admission_order(scheduler)):
            open_replicas = [r for r, d in enumerate(drafts)
                             if seats[r] < self.config.max_num_seqs and d.num_free_tokens > 0
                             and d.num_preempted == 0]
            if not open_replicas:
                return
            if not scheduler.can_hold_adapter(request):
                continue  # it waits for a slot of its adapter; the requests behind it go on
            placed, short_of_pages = False, False
            for replica, cached in self._placement_order(scheduler, request, open_replicas):
                draft = drafts[replica]
                request.replica = replica
                num_computed = len(cached) * self.config.page_size
                num_new = prefill_chunk_len(request.num_tokens - num_computed,
                                            draft.num_free_tokens, self.config)
                if not draft.can_add_prefill(num_new, self.config):
                    continue
                headroom = self._headroom(scheduler, replica, request, num_computed + num_new)
                if not scheduler.admit(request, cached, num_new, headroom=headroom):
                    short_of_pages = True
                    continue
                draft.add(Row(request, num_new, is_decode=False))
                seats[replica] += 1
                placed = True
                break
            if not placed and (position == 0 or short_of_pages):
                return  # nobody overtakes the head of the queue, nor a request short of pages

    @staticmethod
    def _placement_order(scheduler: Primitives, request: Request,
                         replicas: list[int]) -> list[tuple[int, list[int]]]:
        """`(replica, cached prefix pages there)`: the longest prefix-cache hit first, then the
        least loaded by tokens held, then the lowest index."""
        hits = {}
        for replica in replicas:
            request.replica = replica
            hits[replica] = scheduler.cached_prefix(request)
        order = sorted(replicas, key=lambda r: (-len(hits[r]), scheduler.replica_load(r), r))
        return [(r, hits[r]) for r in order]

    def _headroom(self, scheduler: Primitives, replica: int, request: Request,
                  num_tokens: int) -> int:
        """Pages admitting `request` (with pages for `num_tokens` tokens) must leave available on
        `replica`: the watermark, or the growth the `Ordering` keeps pages for, if that is more.
        0 while nothing runs there, so the head of the queue is always admitted into an idle
        replica."""
        running = scheduler.running_on(replica)
        if not running:
            return 0
        return max(self.watermark, self.ordering.growth_pages(running, request, num_tokens))

    def _admission_order(self, scheduler: Primitives) -> list[Request]:
        """The head, then the next `admission_lookahead` requests as the `Ordering` arranges them
        (under "fcfs": those in the head's token bucket first).

        The window holds more requests than there are seats, so looking no further never leaves a
        seat empty that FCFS would have filled.
        """
        window = scheduler.waiting_order(1 + self.config.admission_lookahead)
        return self.ordering.admission_order(window, self._bucket)

    def _chunk_len(self, request: Request, draft: _Draft) -> int:
        return prefill_chunk_len(request.num_uncomputed, draft.num_free_tokens, self.config)

    def _bucket(self, request: Request) -> int:
        """The token bucket of the request's next chunk, with the whole budget free."""
        chunk = prefill_chunk_len(request.num_uncomputed, self.config.max_num_batched_tokens,
                                  self.config)
        return pick_bucket(chunk, self.config.token_buckets)


def prefill_chunk_len(num_uncomputed: int, num_free_tokens: int, config: SchedulerConfig) -> int:
    """The next chunk of a prompt: as much as fits, cut down to a token bucket so that it runs
    unpadded. Only a piece shorter than the smallest bucket is padded; a decode is 1 token. With
    `step_buckets`, then cut so that the step ends on a bucket when that is the nearer one."""
    chunk = floor_bucket(min(num_uncomputed, config.prefill_chunk, num_free_tokens),
                         config.token_buckets)
    if config.step_buckets is None:
        return chunk
    return fit_step_bucket(config.max_num_batched_tokens - num_free_tokens, chunk,
                           config.step_buckets)


def fit_step_bucket(num_used: int, chunk: int, buckets: Sequence[int]) -> int:
    """`chunk` cut so that the step's `num_used + chunk` tokens land on the bucket below them,
    when that bucket is nearer than the one above and still leaves some of the chunk."""
    total = num_used + chunk
    below = floor_bucket(total, buckets)
    above = pick_bucket(total, buckets) if total <= buckets[-1] else total
    if num_used < below < total and total - below < above - total:
        return below - num_used
    return chunk
