"""What a scheduling policy is, and the few scheduler primitives it may use.

A `Policy` picks each step's rows: which requests run, and how many new tokens each. It never
touches the queues or the pages itself; it reads them and moves requests through the scheduler's
`Primitives`, so every page and every status change goes through one place.

This module is plain Python; it must not import jax or anything from meshserve's model, serving
or sharding packages.
"""

from __future__ import annotations

from typing import Protocol

from meshserve.batching.buckets import bucket_sizes, pick_bucket
from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.plan import Row
from meshserve.batching.request import Request


class Primitives(Protocol):
    """The scheduler as a policy sees it: seven reads (the running list among them) and three
    moves."""

    running: list[Request]  # in admission order: the last is the newest

    def running_on(self, replica: int) -> list[Request]:
        """The running requests placed on `replica`, oldest first."""

    def replica_load(self, replica: int) -> int:
        """Tokens held by the requests running on `replica`."""

    def waiting_order(self, limit: int | None = None) -> list[Request]:
        """The first `limit` waiting requests, in the scheduler's `Ordering`."""

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached pages matching the request's leading full pages on its replica."""

    def can_hold_adapter(self, request: Request) -> bool:
        """Whether the request's LoRA adapter (if any) has a device slot for it now."""

    def preemption_cost(self, request: Request) -> float:
        """Computed tokens a preemption would throw away per page it frees (inf if none)."""

    def admit(self, request: Request, cached_pages: list[int], num_new: int, *,
              headroom: int = 0) -> bool:
        """Starts a waiting request on `request.replica` with pages for `num_new` tokens past
        `cached_pages`, if `headroom` pages stay available; False, nothing changed, if not."""

    def reserve_pages(self, request: Request, num_tokens: int) -> bool:
        """Grows a running request's pages to hold `num_tokens`; False (nothing taken) if short."""

    def preempt(self, request: Request) -> None:
        """Sends a running request back to the front of the queue, freeing its pages."""


class Policy(Protocol):
    splits_prefill_by_bucket: bool  # one prefill sub-batch per token bucket, or one in all
    is_lockstep: bool  # rows compute their sub-batch's full width, padding rows too (static)

    def pick_rows(self, scheduler: Primitives) -> list[Row]:
        """The rows of the next step; may admit, and (continuous only) preempt, requests."""


def fits_padded_budget(num_rows: int, longest: int, config: SchedulerConfig) -> bool:
    """Whether a prefill sub-batch of `num_rows` rows, the longest `longest` tokens, stays within
    the token budget once padded to its buckets. The runner compiles exactly these shapes, so
    the rule bounds both prefill padding and the compiled set. One row always fits."""
    tokens = pick_bucket(longest, config.token_buckets)
    rows = pick_bucket(num_rows, bucket_sizes(config.max_num_seqs))
    return rows * tokens <= max(config.max_num_batched_tokens, tokens)
