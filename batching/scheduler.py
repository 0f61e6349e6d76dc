"""The scheduler: decides what each engine step computes, and owns every request's host state.

The engine loop is `plan = schedule()`, run the plan, `update(plan, tokens)`. A policy picks the
step's rows (which requests, how many new tokens each); the rest is shared by every policy: page
accounting, the step plan, and stopping.

Continuous policy (the default; vLLM v1 style, no prefill or decode phase). Every step has a budget
of `max_num_batched_tokens` new tokens, handed out in three passes:
  1. running requests that are decoding (one uncomputed token) get 1 token each, oldest first;
  2. running requests still mid-prompt get their next chunk:
     min(prefill_chunk, budget left, tokens left), cut down to a token bucket (`floor_bucket`),
     so a chunk runs unpadded; only a piece shorter than the smallest bucket pads. With
     `step_buckets` (the engine's ragged step, which passes one token bucket and pads only the
     step's total) a chunk is instead cut so that the step lands on the nearer step bucket;
  3. waiting requests are admitted in queue order (higher `priority` first, then first come,
     first served), while there is a free seat
     (`max_num_seqs`), budget, and pages for their first chunk with the watermark kept (below).
     The head of the queue always goes first, so it never starves. The others are taken from the
     next `admission_lookahead` (2 * max_num_seqs) requests: first those whose first chunk falls
     in the head's token bucket, then the rest, each group in queue order. Admission stops at the
     first request whose chunk finds no pages.

The watermark: a request is admitted only if, once its first chunk has its pages, at least
`kv_watermark` of the replica's pages are still available (free or cached), so running requests
have room to grow and preemption stays rare. The exception is a request with nobody running on
its replica: it has the whole cache, and refusing it would hang.

Out of pages is a policy, never an error: a running request that needs a page and finds none
preempts a victim among the newer requests on its replica that are not yet in this step. The
victim is the cheapest: the fewest computed tokens lost per page its preemption frees (a page it
shares with another holder frees nothing, and a request that would free none is passed over),
ties going to the newest. With no such victim left the request preempts itself, and simply
waits. A preempted request frees its pages, goes back to the
front of the queue with `num_computed_tokens = 0`, and later recomputes its prompt and outputs so
far (what the prefix cache still holds of them excepted); the token sampled after that
recomputation is its next output. A replica that preempts admits nobody that step, so a request
just sent back is not readmitted straight into the same shortage. A request never preempts an
older one, and every request passed `add`'s check that it fits in the whole cache, so the oldest
running request always makes progress: no step can hang.

Prefix caching (`enable_prefix_caching`, continuous policy only). A full page whose tokens are
computed is registered in its replica's prefix cache under a chained hash of its tokens
(`batching/prefix_cache.py`) after the step that filled it, prompt or decode. On admission a
request (with `num_computed_tokens = 0`: new, or preempted) takes the longest run of cached pages
matching its leading full pages as its own first pages, shared and ref-counted, and starts with
those tokens computed. The hit is capped so the last token is always computed (it samples), and
new tokens go to new pages, so a shared page is never written. Requests asking for prompt
logprobs skip the lookup: they need every prompt token computed. A request's pages are released
last page first, so under pressure a prefix's tail is evicted before its head. With several
replicas each has its own cache, and placement prefers the replica with the longest hit. The
static policy never caches: it is the fixed baseline of BENCHMARKS.md, whose lockstep prefill
computes every prompt in full.

Predicted ordering (`ordering="predicted"`; "fcfs" is the default). The scheduler predicts each
request's output length when it is added (a `LengthPredictor`: quantiles of the length, from the
prompt and sampling params; the prior without training) and tells the predictor every finished
request's real length. Then:
  - waiting requests go shortest predicted first: by tokens still to compute (prompt plus
    predicted median output), less `aging_tokens_per_step` for each step waited, so a long
    request's turn always comes. Within a priority, preempted requests go first;
  - admission keeps, besides the watermark, pages for every running request's growth up to the
    `reserve_quantile` (0.9) of its predicted length, and for the new request's own, so a
    request is rarely admitted into a shortage it will cause;
  - static batches are formed around the first request in that order, from the requests of the
    lookahead window whose prompt and predicted output are closest to its own, so a batch pads
    little and ends together.

Static policy (the baseline of BENCHMARKS.md): batches of up to `max_num_seqs` requests are formed
first come, first served, reserving each request's pages for its whole prompt and `max_tokens` up
front, so it never preempts (a batch is smaller when the cache cannot hold more). The batch prefills
in lockstep chunks padded to the longest prompt, then decodes until its longest request ends; a
finished request keeps its row as padding, so the batch never shrinks, and nothing joins until the
whole batch is done.

Data parallelism (`num_replicas` > 1): every replica has its own page pool, seats, and token
budget, each sized as one replica's `num_pages`, `max_num_seqs` and `max_num_batched_tokens`. The
waiting queue is shared. A request is placed on a replica when it is admitted: the least loaded
one by tokens held (ties: the lowest index) among those with a free seat, budget and pages for its
first chunk. A preempted request frees its pages and may be placed elsewhere next time. Preemption
picks its victim on the needy request's own replica, since only that frees the right pages. Static
batching forms one batch per replica.

Plan layout (continuous): one prefill sub-batch per token bucket, widest first, then one sub-batch of all
decode rows (running requests with one token left); empty ones are left out. Rows of different
widths never share a sub-batch, so a short chunk is not padded to a long one. A padding row has `num_new = 0`,
`kv_lens = 0` and no pages; it carries the id of the request whose seat it holds and never samples.

This module is plain Python and numpy; it must not import jax or anything from meshserve's model,
serving or sharding packages.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import numbers
from typing import Protocol, Sequence

import numpy as np

from meshserve.batching.config import (DEFAULT_KV_WATERMARK, ORDERINGS, POLICY_NAMES,  # noqa: F401
                                        SchedulerConfig, _is_int)
from meshserve.batching.buckets import bucket_sizes, floor_bucket, pick_bucket, token_bucket_sizes
from meshserve.batching.length import LengthPredictor, PriorPredictor, extract_features
from meshserve.batching.pages import PageAllocator, num_pages_for
from meshserve.batching.plan import StepPlan, SubBatchPlan, sub_batch_from_rows
from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import COLUMNS, SamplingArrays, SamplingParams, params_columns

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVUsage:
    """KV-cache occupancy between steps: free + used + cached == total pages.

    Empty slots (allocated token slots that hold no KV) are internal fragmentation: the unfilled
    tail of each request's last page, plus whole pages reserved beyond its tokens (the static
    policy reserves a request's whole life up front).
    """

    num_total_pages: int
    num_free_pages: int
    num_used_pages: int  # held by running requests
    num_cached_pages: int  # held by nobody, kept for the prefix cache; evictable
    num_peak_used_pages: int  # the most in use at once so far, within steps included
    num_reserved_unused_pages: int  # pages of running requests beyond their current tokens
    num_filled_slots: int  # token slots that hold KV
    num_allocated_slots: int  # slots of the used pages

    @property
    def num_empty_slots(self) -> int:
        return self.num_allocated_slots - self.num_filled_slots

    @property
    def fragmentation(self) -> float:
        """Empty slots / allocated slots; 0 with nothing allocated."""
        return self.num_empty_slots / self.num_allocated_slots if self.num_allocated_slots else 0.0


class Policy(Protocol):
    splits_prefill_by_bucket: bool  # one prefill sub-batch per token bucket, or one in all
    is_lockstep: bool  # rows compute their sub-batch's full width, padding rows too (static)
    def pick_rows(self, scheduler: Scheduler) -> list[Row]:
        """The rows of the next step; may admit, and (continuous only) preempt, requests."""


class Scheduler:
    """Engine API: add, schedule, update, finish, abort. Policies use reserve_pages, start and
    preempt to move requests between the queues."""

    def __init__(self, config: SchedulerConfig, predictor: LengthPredictor | None = None):
        """`predictor` predicts each request's output length when it is added, and learns from
        each that finishes; "predicted" ordering without one uses the prior."""
        self.config = config
        if predictor is None and config.ordering == "predicted":
            predictor = PriorPredictor()
        self.predictor = predictor
        self.num_steps = 0  # schedule() calls so far: the clock of aging
        self.allocators = [PageAllocator(config.num_pages) for _ in range(config.num_replicas)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._num_preemptions = 0
        self._num_cached_tokens = 0
        self._policy: Policy = _POLICIES[config.policy](config)

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator, without data parallelism (one replica)."""
        assert len(self.allocators) == 1, "with several replicas, use allocators[replica]"
        return self.allocators[0]

    def running_on(self, replica: int) -> list[Request]:
        """The running requests placed on `replica`, oldest first."""
        return [r for r in self.running if r.replica == replica]

    def replica_load(self, replica: int) -> int:
        """Tokens held by the requests running on `replica`: what placement balances."""
        return sum(r.num_tokens for r in self.running if r.replica == replica)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_cached_tokens(self) -> int:
        """Tokens found in the prefix cache on admission, over all admissions: not computed."""
        return self._num_cached_tokens

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def add(self, request: Request) -> None:
        """Queues a new request; raises ValueError if it could never run."""
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
        if self.predictor is not None:
            request.length_features = extract_features(request.prompt_token_ids, request.params)
            request.predicted_length = self.predictor.predict([request.length_features])[0]
        request.arrival_step = self.num_steps
        self._requests[request.request_id] = request
        # Behind every waiting request of the same or higher priority: FCFS within a priority.
        position = next((i for i, r in enumerate(self.waiting) if r.priority < request.priority),
                        len(self.waiting))
        self.waiting.insert(position, request)

    def schedule(self) -> StepPlan:
        self.num_steps += 1
        return build_plan(self._policy.pick_rows(self), page_size=self.config.page_size,
                          eos_token_ids=self.config.eos_token_ids,
                          num_replicas=self.config.num_replicas,
                          token_buckets=(self.config.token_buckets
                                         if self._policy.splits_prefill_by_bucket else None),
                          lockstep=self._policy.is_lockstep)

    def update(self, plan: StepPlan, tokens: Sequence[np.ndarray]) -> list[Request]:
        """Applies a step's sampled tokens (one [B] array per sub-batch).

        Returns the requests that got a new output this step, in plan order; those that finished
        have left the scheduler and freed their pages.
        """
        assert len(tokens) == len(plan.sub_batches)
        touched = []
        for batch, ids, samples, sampled in zip(plan.sub_batches, plan.row_requests,
                                                plan.row_samples, tokens):
            for request_id, num_new, is_sampled, token in zip(ids, batch.num_new, samples, sampled):
                request = self._requests.get(request_id)
                if num_new == 0 or request is None:  # a padding row, or aborted during the step
                    continue
                assert request.status is RequestStatus.RUNNING, request.status
                request.num_computed_tokens += int(num_new)
                self._register_full_pages(request)
                if is_sampled:
                    self._append_output(request, int(token))
                    touched.append(request)
        return touched

    def finish(self, request_id: str, reason: RequestStatus | str,
               stop_reason: int | str | None = None) -> bool:
        """Ends a request (e.g. on a stop string) and frees its pages; False if it is unknown.

        `reason` is a finished status, or its finish reason: "stop", "length" or "abort".
        """
        status = RequestStatus(reason)
        assert status.is_finished, status
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        queue = self.waiting if request.status is RequestStatus.WAITING else self.running
        queue.remove(request)
        self._release_pages(request)
        request.status, request.finish_reason = status, status.finish_reason
        request.stop_reason = stop_reason
        self._observe_length(request)
        return True

    def _observe_length(self, request: Request) -> None:
        """Teaches the predictor a finished request's output length; an aborted request's
        length says nothing about what it would have been."""
        if (self.predictor is not None and request.length_features is not None
                and request.status is not RequestStatus.FINISHED_ABORTED
                and request.output_token_ids):
            self.predictor.observe(request.length_features, len(request.output_token_ids))

    def abort(self, request_id: str) -> bool:
        """Cancels a waiting or running request; its pages are free when this returns."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def forget_prefixes(self) -> None:
        """Drops every replica's prefix cache (see `PageAllocator.forget_prefixes`)."""
        for allocator in self.allocators:
            allocator.forget_prefixes()

    def kv_usage(self, replica: int | None = None) -> KVUsage:
        """Occupancy of one replica's pages, or of all replicas together (None).

        Only full computed pages are ever shared, so a request's empty slots all lie in its own
        pages: its allocated slots minus its computed tokens.
        """
        replicas = range(len(self.allocators)) if replica is None else [replica]
        allocators = [self.allocators[r] for r in replicas]
        running = [r for r in self.running if r.replica in replicas]
        page_size = self.config.page_size
        used = sum(a.num_used for a in allocators)
        empty = sum(len(r.pages) * page_size - r.num_computed_tokens for r in running)
        return KVUsage(
            num_total_pages=sum(a.num_total for a in allocators),
            num_free_pages=sum(a.num_free for a in allocators), num_used_pages=used,
            num_cached_pages=sum(a.num_cached for a in allocators),
            num_peak_used_pages=sum(a.num_peak_used for a in allocators),
            num_reserved_unused_pages=sum(
                max(0, len(r.pages) - num_pages_for(r.num_tokens, page_size)) for r in running),
            num_filled_slots=used * page_size - empty, num_allocated_slots=used * page_size)

    # What the policies use to order and admit requests.

    def waiting_order(self, limit: int | None = None) -> list[Request]:
        """The first `limit` (default: all) waiting requests in the order admission takes them.

        "fcfs": the queue (higher priority first, then arrival; a preempted request at the
        front). "predicted": within a priority, requests that were preempted first (they hold
        outputs already, and their users are waiting), then by `predicted_cost`, lowest first.
        Either way a step costs O(queue) at most, not a copy or a full sort of a long queue.
        """
        if self.config.ordering == "fcfs":
            return list(itertools.islice(self.waiting, limit))
        key = lambda r: (-r.priority, r.num_preemptions == 0, self.predicted_cost(r))  # noqa: E731
        if limit is None:
            return sorted(self.waiting, key=key)
        return heapq.nsmallest(limit, self.waiting, key=key)

    def predicted_cost(self, request: Request) -> float:
        """Tokens the request still has to compute, by its predicted median output length,
        less `aging_tokens_per_step` for every step it has waited: shortest first, but a long
        request's cost keeps falling until it is first, so nothing starves."""
        num_outputs = _predicted_outputs(request)
        waited = self.num_steps - request.arrival_step
        return (request.num_uncomputed + max(num_outputs - len(request.output_token_ids), 0)
                - self.config.aging_tokens_per_step * waited)

    def predicted_growth(self, request: Request, num_tokens: int | None = None) -> int:
        """Pages the request will still need, beyond those for `num_tokens` tokens (default: the
        pages it holds), if its output reaches the `reserve_quantile` of its predicted length."""
        prediction = request.predicted_length
        if prediction is None:
            return 0
        num_outputs = max(prediction.at(self.config.reserve_quantile),
                          len(request.output_token_ids))
        kv_len = min(request.num_prompt_tokens + num_outputs - 1, request.max_kv_len)
        held = (len(request.pages) if num_tokens is None
                else num_pages_for(num_tokens, self.config.page_size))
        return max(num_pages_for(kv_len, self.config.page_size) - held, 0)

    # What the policies use to change the queues.

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached pages matching the request's leading full pages on its replica, nothing
        held yet. At most `num_tokens - 1` tokens, so the last one is computed and samples; none
        without prefix caching or for a request asking for prompt logprobs."""
        if not self.config.is_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        num_pages = (request.num_tokens - 1) // self.config.page_size
        keys = request.keys_of_pages(num_pages, self.config.page_size)
        return self.allocators[request.replica].lookup(keys)

    def admit(self, request: Request, cached_pages: list[int], num_new: int, *,
              headroom: int = 0) -> bool:
        """Starts a waiting request on its replica: `cached_pages` (from `cached_prefix`) become
        its first pages, computed, and it gets pages for `num_new` more tokens. Only if at least
        `headroom` pages stay available afterwards; False, with nothing changed, otherwise."""
        assert request.num_computed_tokens == 0 and not request.pages
        allocator = self.allocators[request.replica]
        num_cached = len(cached_pages) * self.config.page_size
        num_missing = num_pages_for(num_cached + num_new, self.config.page_size) - len(cached_pages)
        num_left = allocator.num_available - allocator.num_cached_among(cached_pages) - num_missing
        if num_left < max(headroom, 0):
            return False
        allocator.share(cached_pages)
        request.pages = cached_pages + allocator.allocate(num_missing)
        request.num_computed_tokens = num_cached
        request.num_registered_pages = len(cached_pages)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        self._num_cached_tokens += num_cached
        self.start(request)
        return True

    def preemption_cost(self, request: Request) -> float:
        """Computed tokens a preemption would throw away per page it frees (inf if none)."""
        allocator = self.allocators[request.replica]
        num_freed = sum(allocator.ref_count(page) == 1 for page in request.pages)
        return request.num_computed_tokens / num_freed if num_freed else float("inf")

    def reserve_pages(self, request: Request, num_tokens: int) -> bool:
        """Grows the request's pages to hold `num_tokens` tokens; False (nothing taken) if short."""
        missing = num_pages_for(num_tokens, self.config.page_size) - len(request.pages)
        if missing <= 0:
            return True
        pages = self.allocators[request.replica].allocate(missing)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def start(self, request: Request) -> None:
        """Moves a waiting request to the end of the running list."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def preempt(self, request: Request) -> None:
        """Sends a running request back to the front of the queue, freeing all its pages."""
        self.running.remove(request)
        self._release_pages(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _release_pages(self, request: Request) -> None:
        """Last page first: cached pages are evicted least recently released first, so a
        prefix's tail goes before its head, which more requests share."""
        self.allocators[request.replica].free(reversed(request.pages))
        request.pages = []
        request.num_registered_pages = 0

    def _register_full_pages(self, request: Request) -> None:
        """Keys the request's newly full, computed pages in its replica's prefix cache."""
        num_full = request.num_computed_tokens // self.config.page_size
        if not self.config.is_prefix_caching or num_full <= request.num_registered_pages:
            return
        keys = request.keys_of_pages(num_full, self.config.page_size)
        allocator = self.allocators[request.replica]
        for index in range(request.num_registered_pages, len(keys)):
            allocator.register(request.pages[index], keys[index])
        request.num_registered_pages = max(request.num_registered_pages, len(keys))

    def _append_output(self, request: Request, token: int) -> None:
        request.output_token_ids.append(token)
        stop = stop_status(request, self.config.eos_token_ids)
        if stop is not None:
            self.finish(request.request_id, *stop)

    def _check_fits(self, request: Request) -> None:
        c, rid = self.config, request.request_id
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r} has an empty prompt; send at least one token")
        total = request.num_prompt_tokens + request.params.max_tokens
        if total > c.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {total} exceeds max_model_len "
                f"({c.max_model_len}); shorten the prompt or lower max_tokens")
        num_pages = num_pages_for(request.max_kv_len, c.page_size)
        if num_pages > self.allocators[0].num_total:
            raise ValueError(
                f"request {rid!r} needs {num_pages} KV pages of {c.page_size} tokens, but the "
                f"cache has {self.allocators[0].num_total}; shorten it or give the cache more pages")


def stop_status(request: Request, eos_token_ids: Sequence[int]
                ) -> tuple[RequestStatus, int | None] | None:
    """Whether the request's newest output ends it: `(status, stop_reason)`, or None to go on.

    Below `min_tokens` neither a stop token nor EOS counts; `max_tokens` always does.
    """
    return stop_status_at(request, len(request.output_token_ids) - 1, eos_token_ids)


def stop_status_at(request: Request, index: int, eos_token_ids: Sequence[int]
                   ) -> tuple[RequestStatus, int | None] | None:
    """`stop_status` as if output `index` were the newest."""
    params, token = request.params, request.output_token_ids[index]
    num_outputs = index + 1
    if num_outputs >= params.min_tokens:
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
    if num_outputs >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None


# The step plan, built from the rows a policy picked.

def build_plan(rows: Sequence[Row], *, page_size: int, eos_token_ids: Sequence[int] = (),
               num_replicas: int = 1, token_buckets: Sequence[int] | None = None,
               lockstep: bool = False) -> StepPlan:
    """One prefill sub-batch per token bucket (all prefill rows in one without `token_buckets`),
    widest first, then one decode sub-batch; an empty one is left out. `lockstep` sub-batches
    compute every row's full width (the static baseline)."""
    prefill = [row for row in rows if not row.is_decode]
    by_bucket: dict[int, list[Row]] = collections.defaultdict(list)
    for row in prefill:
        by_bucket[0 if token_buckets is None else pick_bucket(row.num_new, token_buckets)].append(row)
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
    return dataclasses.replace(plan, replicas=replicas, lockstep=lockstep)


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
    """Each row's sampling parameters, seed, output index, token history and stop ids."""
    requests = [row.request for row in rows]
    params = [r.params for r in requests]
    history, is_output = _history(rows)
    return SamplingArrays(
        **params_columns(params),
        seeds=np.array([r.seed for r in requests], COLUMNS["seeds"].dtype),
        steps=np.array([len(r.output_token_ids) for r in requests], COLUMNS["steps"].dtype),
        history=history, history_is_output=is_output,
        banned_ids=_banned_ids(params, eos_token_ids),
    )


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
    """The ids the device masks while a row is below min_tokens: stop ids, and EOS unless ignored
    ([B, E], right-padded with -1)."""
    ids = [list(dict.fromkeys(p.stop_token_ids + (() if p.ignore_eos else tuple(eos_token_ids))))
           for p in params]
    banned = np.full((len(ids), max(1, max(len(i) for i in ids))), -1, np.int32)
    for row, row_ids in enumerate(ids):
        banned[row, :len(row_ids)] = row_ids
    return banned


# Policies.

@dataclasses.dataclass
class _Draft:
    """The rows of the step being planned, and what is left of its token budget."""

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


def fits_padded_budget(num_rows: int, longest: int, config: SchedulerConfig) -> bool:
    """Whether a prefill sub-batch of `num_rows` rows, the longest `longest` tokens, stays within
    the token budget once padded to its buckets. The runner compiles exactly these shapes, so
    the rule bounds both prefill padding and the compiled set. One row always fits."""
    tokens = pick_bucket(longest, config.token_buckets)
    rows = pick_bucket(num_rows, bucket_sizes(config.max_num_seqs))
    return rows * tokens <= max(config.max_num_batched_tokens, tokens)


class ContinuousPolicy:
    """Continuous batching with chunked prefill; see the module docstring for the exact rules."""

    splits_prefill_by_bucket = True
    is_lockstep = False

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def pick_rows(self, scheduler: Scheduler) -> list[Row]:
        drafts = [_Draft(num_free_tokens=self.config.max_num_batched_tokens)
                  for _ in range(self.config.num_replicas)]
        self._continue_running(scheduler, drafts, is_decode=True)
        self._continue_running(scheduler, drafts, is_decode=False)
        self._admit_waiting(scheduler, drafts)
        return [row for draft in drafts for row in draft.rows]

    def _continue_running(self, scheduler: Scheduler, drafts: list[_Draft], *,
                          is_decode: bool) -> None:
        """Schedules the running requests that are decoding (or mid-prompt), oldest first."""
        for request in list(scheduler.running):
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this pass
                continue
            if (request.num_uncomputed == 1) != is_decode:
                continue
            draft = drafts[request.replica]
            num_new = self._chunk_len(request, draft)
            if not is_decode and not draft.can_add_prefill(num_new, self.config):
                continue  # its chunk waits a step rather than blow up the padded shape
            if num_new > 0 and self._make_room(scheduler, draft, request, num_new):
                draft.add(Row(request, num_new, is_decode))

    def _make_room(self, scheduler: Scheduler, draft: _Draft, request: Request,
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
    def _victim(scheduler: Scheduler, draft: _Draft, request: Request) -> Request:
        """Among the newer requests on `request`'s replica not yet in this step, and that would
        free a page, the cheapest to preempt (`Scheduler.preemption_cost`), ties going to the
        newest; `request` itself when there is none."""
        running = scheduler.running_on(request.replica)
        newer = running[running.index(request) + 1:]
        candidates = [r for r in newer if not draft.is_scheduled(r)
                      and scheduler.preemption_cost(r) != float("inf")]
        return min(reversed(candidates), key=scheduler.preemption_cost, default=request)

    def _admit_waiting(self, scheduler: Scheduler, drafts: list[_Draft]) -> None:
        """Admits waiting requests in `_admission_order`, each on the first replica in
        `_placement_order` that can take it. A replica that preempted this step admits nobody."""
        seats = [len(scheduler.running_on(r)) for r in range(len(drafts))]
        for position, request in enumerate(self._admission_order(scheduler)):
            open_replicas = [r for r, d in enumerate(drafts)
                             if seats[r] < self.config.max_num_seqs and d.num_free_tokens > 0
                             and d.num_preempted == 0]
            if not open_replicas:
                return
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
    def _placement_order(scheduler: Scheduler, request: Request,
                         replicas: list[int]) -> list[tuple[int, list[int]]]:
        """`(replica, cached prefix pages there)`: the longest prefix-cache hit first, then the
        least loaded by tokens held, then the lowest index."""
        hits = {}
        for replica in replicas:
            request.replica = replica
            hits[replica] = scheduler.cached_prefix(request)
        order = sorted(replicas, key=lambda r: (-len(hits[r]), scheduler.replica_load(r), r))
        return [(r, hits[r]) for r in order]

    def _headroom(self, scheduler: Scheduler, replica: int, request: Request,
                  num_tokens: int) -> int:
        """Pages admitting `request` (with pages for `num_tokens` tokens) must leave available on
        `replica`: the watermark, or under "predicted" ordering the growth still predicted for the
        requests running there and for this one, if that is more. None while nothing runs
        there, so the head of the queue is always admitted into an idle replica."""
        running = scheduler.running_on(replica)
        if not running:
            return 0
        watermark = math.ceil(self.config.kv_watermark * scheduler.allocators[replica].num_total)
        if self.config.ordering != "predicted":
            return watermark
        growth = (sum(scheduler.predicted_growth(r) for r in running)
                  + scheduler.predicted_growth(request, num_tokens))
        return max(watermark, growth)

    def _admission_order(self, scheduler: Scheduler) -> list[Request]:
        """The head first; then, among the next `admission_lookahead` requests, those in the head's
        token bucket, then the others, each in `Scheduler.waiting_order`.

        The window holds more requests than there are seats, so looking no further never leaves a
        seat empty that FCFS would have filled. Under "predicted" ordering the waiting order
        already puts similar lengths together, so it is kept as it is.
        """
        window = scheduler.waiting_order(1 + self.config.admission_lookahead)
        if not window or self.config.ordering == "predicted":
            return window
        head, rest = window[0], window[1:]
        is_same = [self._bucket(r) == self._bucket(head) for r in rest]
        same = [r for r, s in zip(rest, is_same) if s]
        others = [r for r, s in zip(rest, is_same) if not s]
        return [head] + same + others

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


class StaticPolicy:
    """Static batching, the baseline; see the module docstring. Its lockstep prefill is one
    sub-batch, every prompt padded to the longest."""

    splits_prefill_by_bucket = False
    is_lockstep = True

    def __init__(self, config: SchedulerConfig):
        self.config = config
        # Per replica: the members, finished ones included, in seat order.
        self.batches: list[list[Request]] = [[] for _ in range(config.num_replicas)]

    def pick_rows(self, scheduler: Scheduler) -> list[Row]:
        rows = []
        for replica, batch in enumerate(self.batches):
            if all(r.is_finished for r in batch):
                batch = self.batches[replica] = self._form_batch(scheduler, replica)
            if not batch:
                continue
            if any(_is_prefilling(r) for r in batch):
                rows += self._prefill_rows(batch)
            else:
                rows += [Row(r, 0 if r.is_finished else 1, is_decode=True) for r in batch]
        return rows

    def _form_batch(self, scheduler: Scheduler, replica: int) -> list[Request]:
        """Up to max_num_seqs waiting requests, each with pages for its whole life: the first
        in `_batch_order`, and the next ones while their pages fit."""
        batch = []
        for request in self._batch_order(scheduler)[:self._max_batch_size()]:
            request.replica = replica
            if not scheduler.reserve_pages(request, request.max_kv_len):
                break
            scheduler.start(request)
            batch.append(request)
        assert batch or not scheduler.waiting, "an empty cache holds any request that passed add"
        return batch

    def _batch_order(self, scheduler: Scheduler) -> list[Request]:
        """FCFS; or, under "predicted" ordering, the first in `Scheduler.waiting_order` followed
        by the requests of the next `admission_lookahead` whose prompt and predicted output
        lengths are closest to its own, so that the batch pads little and ends together (the
        brief's grouping by predicted length)."""
        order = scheduler.waiting_order(1 + self.config.admission_lookahead)
        if self.config.ordering != "predicted" or not order:
            return order
        head, window = order[0], order[1:]

        def distance(r: Request) -> int:
            return (abs(r.num_prompt_tokens - head.num_prompt_tokens)
                    + abs(_predicted_outputs(r) - _predicted_outputs(head)))

        return [head] + sorted(window, key=distance)

    def _prefill_rows(self, batch: list[Request]) -> list[Row]:
        """One lockstep chunk of every prompt; rows whose prompt is done are padding."""
        chunk = self._lockstep_chunk(len(batch))
        return [Row(r, min(chunk, _num_prompt_left(r)) if _is_prefilling(r) else 0,
                    is_decode=False) for r in batch]

    def _max_batch_size(self) -> int:
        """max_num_seqs, or fewer when even the smallest padded chunk of a full batch would
        overflow the token budget (finished rows stay on as padding, so the batch cannot shrink
        to fit later)."""
        c = self.config
        if not c.bound_padded_prefill:
            return c.max_num_seqs
        fitting = [n for n in range(1, c.max_num_seqs + 1)
                   if fits_padded_budget(n, c.token_buckets[0], c)]
        return max(fitting)

    def _lockstep_chunk(self, num_rows: int) -> int:
        """The longest chunk that every row can take in one step within the budget, padded to
        its buckets when `bound_padded_prefill`."""
        c = self.config
        chunk = min(c.prefill_chunk, c.max_num_batched_tokens // num_rows)
        if not c.bound_padded_prefill:
            return chunk
        fitting = [t for t in c.token_buckets
                   if t <= chunk and fits_padded_budget(num_rows, t, c)]
        return max(fitting, default=chunk)


def _predicted_outputs(request: Request) -> int:
    """The request's predicted median output length; max_tokens without a prediction."""
    prediction = request.predicted_length
    return prediction.median if prediction is not None else request.params.max_tokens


def _is_prefilling(request: Request) -> bool:
    return not request.is_finished and _num_prompt_left(request) > 0


def _num_prompt_left(request: Request) -> int:
    return request.num_prompt_tokens - request.num_computed_tokens


_POLICIES = {"continuous": ContinuousPolicy, "static": StaticPolicy}
assert tuple(_POLICIES) == POLICY_NAMES
