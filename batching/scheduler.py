"""The scheduler: decides what each engine step computes, and owns every request's host state.

The engine loop is `plan = schedule()`, run the plan, `update(plan, tokens)`. A `Policy` picks the
step's rows (`batching/continuous.py`, the default, or `batching/static.py`) through the few
`Primitives` this class gives it; the rest is shared by every policy: the queues, page
accounting, the step plan (`batching/plan.py`), and stopping (`batching/request.py`). The waiting
queue is ordered by priority (higher first), then first come, first served; an `Ordering`
(`batching/ordering.py`), chosen once from the config, decides the order admission takes it in.
A length predictor, when given, predicts each request's output length when it is added and
learns every finished request's real length.

Preemption: a preempted request frees its pages, goes back to the front of the queue with
`num_computed_tokens = 0`, and later recomputes its prompt and outputs so far (what the prefix
cache still holds of them excepted); the token sampled after that recomputation is its next
output. Every request passes `add`'s check that it fits in the whole cache.

Prefix caching (`enable_prefix_caching`, continuous policy only). A full page whose tokens are
computed is registered in its replica's prefix cache under a chained hash of its tokens
(`batching/prefix_cache.py`) after the step that filled it, prompt or decode. On admission a
request (with `num_computed_tokens = 0`: new, or preempted) takes the longest run of cached pages
matching its leading full pages as its own first pages, shared and ref-counted, and starts with
those tokens computed. The hit is capped so the last token is always computed (it samples), and
new tokens go to new pages, so a shared page is never written. Requests asking for prompt
logprobs skip the lookup: they need every prompt token computed. A request's pages are released
last page first, so under pressure a prefix's tail is evicted before its head.

Sliding windows (`attention_window`, when every layer of the model keeps to one): after each
step a request's pages wholly behind the window of its next token are freed (cached, if keyed),
since no query of its will read them again; their places in its page list hold the dummy page,
so page indices stay positions // page_size. `num_window_freed_pages` counts them.

Structured output: the constrained requests of a step take their tokens in `update`, and their
next masks are computed together, in one fill of all of them (`batching/structured.py`). With
`defers_masks` the fill waits for `fill_due_masks`, which the engine calls while the device runs
the next step's forward pass: a plan made meanwhile leaves the due masks out, and `masked` puts
them in once computed. A request whose constraint ends it at the fill (the rare matcher that
goes on but whose next bytes no token spells) has then been planned once more; its row's
results are dropped, as an aborted request's are.

LoRA adapters (`max_loras` > 0): a request with an adapter (`Request.adapter_id`) pins a device
slot of it while it runs (`batching/adapters.py`), taken on admission and let go on preemption
or finish. A request whose adapter finds no slot (all pinned by other adapters' running
requests) waits, and admission passes over it to the requests behind it (`can_hold_adapter`);
the plan lists the slots given to adapters that the device must load first (`adapter_loads`).

Data parallelism (`num_replicas` > 1): every replica has its own page pool (and prefix cache),
seats, and token budget, each sized as one replica's `num_pages`, `max_num_seqs` and
`max_num_batched_tokens`. The waiting queue is shared; the policy places a request on a replica
when it admits it, and a preempted request may be placed elsewhere next time.

This module is plain Python and numpy; it must not import jax or anything from meshserve's model,
serving or sharding packages.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import numpy as np

from meshserve.batching.adapters import AdapterSlots
from meshserve.batching.continuous import ContinuousPolicy
from meshserve.batching.knobs import POLICY_NAMES, SchedulerConfig
from meshserve.batching.length import LengthPredictor, PriorPredictor, extract_features
from meshserve.batching.ordering import make_ordering
from meshserve.batching.pages import DUMMY_PAGE, PageAllocator, num_pages_for
from meshserve.batching.plan import StepPlan, build_plan, with_masks
from meshserve.batching.policy import Policy
from meshserve.batching.request import Request, RequestStatus, constrained_stop, stop_status
from meshserve.batching.static import StaticPolicy
from meshserve.batching.structured import MaskFiller, fill_due, fill_each


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


class Scheduler:
    """Engine API: add, schedule, update, finish, abort, and the counters. A policy uses the
    `Primitives` (reads: running_on, replica_load, waiting_order, cached_prefix,
    can_hold_adapter, preemption_cost; moves: admit, reserve_pages, preempt)."""

    def __init__(self, config: SchedulerConfig, predictor: LengthPredictor | None = None, *,
                 fill_masks: MaskFiller = fill_each, defers_masks: bool = False):
        """`predictor` predicts each request's output length when it is added, and learns from
        each that finishes; "predicted" ordering without one uses the prior. `fill_masks`
        computes the next masks of a step's constrained requests, all at once
        (`batching/structured.py`, `advance_all`); with `defers_masks`, not in `update` but in
        `fill_due_masks` (see the module docstring)."""
        self.config = config
        self.ordering = make_ordering(config)
        if predictor is None and self.ordering.needs_predictions:
            predictor = PriorPredictor()
        self.predictor = predictor
        self.num_steps = 0  # schedule() calls so far: the clock of aging
        self.allocators = [PageAllocator(config.num_pages) for _ in range(config.num_replicas)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._num_preemptions = 0
        self._num_cached_tokens = 0
        self.fill_masks = fill_masks
        self.defers_masks = defers_masks
        self._due: list[Request] = []  # requests whose constraint's mask is due
        self.constraint_seconds = 0.0  # host time advancing matchers and computing their masks
        self.num_constraint_advances = 0  # tokens the matchers took
        self.num_constraint_batches = 0  # steps (pipeline calls) in which some matcher took one
        self.num_window_freed_pages = 0  # pages given back behind a sliding window, in all
        self.adapter_slots = AdapterSlots(config.max_loras)
        self._policy: Policy = _POLICIES[config.policy](config, self.ordering)

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator, without data parallelism (one replica)."""
        assert len(self.allocators) == 1, "with several replicas, use allocators[replica]"
        return self.allocators[0]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_due_masks(self) -> bool:
        """Whether some constraint took a token whose next mask `fill_due_masks` computes."""
        return bool(self._due)

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
        plan = build_plan(self._policy.pick_rows(self), page_size=self.config.page_size,
                          eos_token_ids=self.config.eos_token_ids,
                          num_replicas=self.config.num_replicas,
                          token_buckets=(self.config.token_buckets
                                         if self._policy.splits_prefill_by_bucket else None),
                          lockstep=self._policy.is_lockstep)
        loads = self.adapter_slots.take_loads()
        return dataclasses.replace(plan, adapter_loads=loads) if loads else plan

    def update(self, plan: StepPlan, tokens: Sequence[np.ndarray]) -> list[Request]:
        """Applies a step's sampled tokens (one [B] array per sub-batch).

        Returns the requests that got a new output this step, in plan order; those that finished
        have left the scheduler and freed their pages.
        """
        assert len(tokens) == len(plan.sub_batches)
        touched, pending = [], []
        for row in plan.real_rows():
            request = self._requests.get(row.request_id)
            if request is None:  # aborted during the step
                continue
            assert request.status is RequestStatus.RUNNING, request.status
            request.num_computed_tokens += row.num_new
            self._register_full_pages(request)
            self._release_behind_window(request)
            if row.is_sampled:
                pending += self._append_output(request, int(tokens[row.batch][row.row]))
                touched.append(request)
        # The constrained requests' matchers take their tokens together: one fill of all masks
        # (with `defers_masks`, later, for the requests that go on).
        ends = self.advance_constraints([(request, token) for request, token, _ in pending],
                                        defer=[stop is None for _, _, stop in pending])
        for (request, _, stop), end in zip(pending, ends):
            stop = constrained_stop(request, stop, end)
            if stop is not None:
                self.finish(request.request_id, *stop)
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
        self._release_adapter(request)
        request.status, request.finish_reason = status, status.finish_reason
        request.stop_reason = stop_reason
        self._observe_length(request)
        return True

    def end_at(self, request: Request, num_outputs: int, reason: RequestStatus | str,
               stop_reason: int | str | None = None) -> None:
        """Ends `request` after its first `num_outputs` outputs, dropping those past them: a stop
        found after the step that sampled it (a stop string in the text, or a stop token in an
        earlier round of a pipeline call). A request that already ended (on length, later in the
        same call) takes the earlier stop's reason instead."""
        del request.output_token_ids[num_outputs:]
        if not self.finish(request.request_id, reason, stop_reason=stop_reason):
            status = RequestStatus(reason)
            request.status, request.finish_reason = status, status.finish_reason
            request.stop_reason = stop_reason

    def set_output(self, request: Request, index: int, token: int) -> None:
        """Puts a sampled token where a plan made ahead of it (pipeline rounds) left a
        placeholder. A constrained request's matcher takes it through `advance_constraints`
        (no plan ran ahead of the matcher: see `Request.awaits_output`)."""
        request.output_token_ids[index] = token

    def advance_constraints(self, pairs: Sequence[tuple[Request, int]], *,
                            defer: Sequence[bool] = ()
                            ) -> list[tuple[RequestStatus, str | None] | None]:
        """Each `(request, token)`'s constraint takes the token, and their next masks are
        computed together (`advance_all` with `fill_masks`); returns how each constraint ends
        its request, if it does (complete: "stop"; dead: "unsatisfiable"), for the caller to
        apply after the token-level stops (`constrained_stop`). With `defers_masks`, the masks
        of the pairs `defer` marks (requests no token-level stop ends) are left due for
        `fill_due_masks`; an ending request's last mask is computed at once, since it can still
        tell a dead constraint from a cut one."""
        if not pairs:
            return []
        started = time.perf_counter()
        ends = [request.constraint.consume(token) for request, token in pairs]
        going_on = [i for i, end in enumerate(ends) if end is None]
        later = {i for i in going_on if self.defers_masks and i < len(defer) and defer[i]}
        now = [i for i in going_on if i not in later]
        for i, end in zip(now, fill_due([pairs[i][0].constraint for i in now], self.fill_masks)):
            ends[i] = end
        self._due += [pairs[i][0] for i in sorted(later)]
        self.constraint_seconds += time.perf_counter() - started
        self.num_constraint_advances += len(pairs)
        self.num_constraint_batches += 1
        return [None if end is None else (RequestStatus(end[0]), end[1]) for end in ends]

    def fill_due_masks(self) -> list[Request]:
        """Computes the masks `update` left due, all in one fill, and ends each request whose
        mask ends it (nothing allowed: `Constraint.end`); returns those requests."""
        due, self._due = [r for r in self._due if not r.is_finished], []
        if not due:
            return []
        started = time.perf_counter()
        ends = fill_due([request.constraint for request in due], self.fill_masks)
        ended = []
        for request, end in zip(due, ends):
            if end is not None:
                self.finish(request.request_id, RequestStatus(end[0]), end[1])
                ended.append(request)
        self.constraint_seconds += time.perf_counter() - started
        return ended

    def masked(self, plan: StepPlan) -> StepPlan:
        """`plan` with each constrained row's mask as its constraint holds it now: a plan made
        while masks were due, once `fill_due_masks` has computed them. A row whose request
        ended meanwhile keeps the plan's all-allowed placeholder (its token is dropped)."""
        def mask_of(request_id: str):
            request = self._requests.get(request_id)
            return None if request is None else request.constraint.mask

        return with_masks(plan, mask_of)

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

    # The policies' `Primitives` (batching/policy.py): reads, then moves.

    def running_on(self, replica: int) -> list[Request]:
        """The running requests placed on `replica`, oldest first."""
        return [r for r in self.running if r.replica == replica]

    def replica_load(self, replica: int) -> int:
        """Tokens held by the requests running on `replica`: what placement balances."""
        return sum(r.num_tokens for r in self.running if r.replica == replica)

    def waiting_order(self, limit: int | None = None) -> list[Request]:
        """The first `limit` (default: all) waiting requests in the order admission takes them
        (the `Ordering`)."""
        return self.ordering.waiting_order(self.waiting, limit, self.num_steps)

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached pages matching the request's leading full pages on its replica, nothing
        held yet. At most `num_tokens - 1` tokens, so the last one is computed and samples; none
        without prefix caching or for a request asking for prompt logprobs."""
        if not self.config.is_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        num_pages = (request.num_tokens - 1) // self.config.page_size
        keys = request.keys_of_pages(num_pages, self.config.page_size)
        return self.allocators[request.replica].lookup(keys)

    def can_hold_adapter(self, request: Request) -> bool:
        """Whether the request's LoRA adapter has a device slot for it now (always, without
        one): the slot that holds it, or one that no running request pins."""
        return request.adapter_id == 0 or self.adapter_slots.can_acquire(request.adapter_id)

    def preemption_cost(self, request: Request) -> float:
        """Computed tokens a preemption would throw away per page it frees (inf if none)."""
        allocator = self.allocators[request.replica]
        num_freed = sum(allocator.ref_count(page) == 1 for page in request.pages)
        return request.num_computed_tokens / num_freed if num_freed else float("inf")

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
        if request.adapter_id:
            assert self.can_hold_adapter(request), "a policy admits only what can_hold_adapter"
            request.adapter_slot = self.adapter_slots.acquire(request.adapter_id)
        allocator.share(cached_pages)
        request.pages = cached_pages + allocator.allocate(num_missing)
        request.num_computed_tokens = num_cached
        request.num_registered_pages = len(cached_pages)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        self._num_cached_tokens += num_cached
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

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

    def truncate_pages(self, request: Request, num_pages: int) -> None:
        """Gives back the request's pages past its first `num_pages`, last first: pages taken
        for tokens it did not keep (rejected speculative drafts). They hold no computed token
        of it, so none is in the prefix cache."""
        tail = request.pages[num_pages:]
        assert num_pages * self.config.page_size >= request.num_computed_tokens, \
            "truncate_pages would drop computed tokens"
        self.allocators[request.replica].free(reversed(tail))
        del request.pages[num_pages:]

    def preempt(self, request: Request) -> None:
        """Sends a running request back to the front of the queue, freeing all its pages."""
        self.running.remove(request)
        self._release_pages(request)
        self._release_adapter(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _release_pages(self, request: Request) -> None:
        """Last page first: cached pages are evicted least recently released first, so a
        prefix's tail goes before its head, which more requests share."""
        held = request.pages[request.num_released_pages:]
        self.allocators[request.replica].free(reversed(held))
        request.pages = []
        request.num_registered_pages = 0
        request.num_released_pages = 0

    def _release_adapter(self, request: Request) -> None:
        """Unpins the request's adapter slot, if it holds one; it keeps its adapter id, so a
        preempted request takes a slot of the same adapter again."""
        if request.adapter_slot:
            self.adapter_slots.release(request.adapter_slot)
            request.adapter_slot = 0

    def _release_behind_window(self, request: Request) -> None:
        """Frees the request's pages wholly behind the window of its next token (at position
        `num_computed_tokens`, which sees keys from there - window + 1 on)."""
        window = self.config.attention_window
        if not window:
            return
        first_key = request.num_computed_tokens - window + 1
        num_behind = max(first_key, 0) // self.config.page_size
        start = request.num_released_pages
        if num_behind <= start:
            return
        self.allocators[request.replica].free(reversed(request.pages[start:num_behind]))
        request.pages[start:num_behind] = [DUMMY_PAGE] * (num_behind - start)
        request.num_released_pages = num_behind
        self.num_window_freed_pages += num_behind - start

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

    def _append_output(self, request: Request, token: int
                       ) -> list[tuple[Request, int, tuple[RequestStatus, int | None] | None]]:
        """A sampled token, or a pipeline placeholder (< 0) that `set_output` fills later; ends
        the request at a token-level stop. A constrained request's matcher must take the token
        first (`takes_token`): then nothing ends here, and `[(request, token, stop so far)]`
        comes back for the step's one `advance_constraints`."""
        request.output_token_ids.append(token)
        stop = stop_status(request, self.config.eos_token_ids)
        if takes_token(request, token, stop):
            return [(request, token, stop)]
        if stop is not None:
            self.finish(request.request_id, *stop)
        return []

    def _check_fits(self, request: Request) -> None:
        c, rid = self.config, request.request_id
        if request.adapter_id and not c.max_loras:
            raise ValueError(f"request {rid!r} names a LoRA adapter, but this scheduler serves "
                             "none (max_loras is 0)")
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
                f"cache has {self.allocators[0].num_total}; shorten it or give the cache more "
                "pages")


def takes_token(request: Request, token: int,
                stop: tuple[RequestStatus, int | None] | None) -> bool:
    """Whether a constrained request's matcher takes its newest output `token`: a real token
    (not a placeholder) at which no stop token ended it (EOS and stop ids never reach the
    matcher; max_tokens does, to tell a complete output from a cut one)."""
    return (request.constraint is not None and token >= 0
            and (stop is None or stop[0] is RequestStatus.FINISHED_LENGTH))


_POLICIES = {"continuous": ContinuousPolicy, "static": StaticPolicy}
assert tuple(_POLICIES) == POLICY_NAMES
