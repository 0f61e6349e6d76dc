"""Static batching: the fixed baseline of docs/benchmarks.md ("Baselines").

Batches of up to `max_num_seqs` requests are formed in the scheduler's waiting order (under
"predicted" ordering, grouped by length: see `batching/ordering.py`), reserving each request's
pages for its whole prompt and `max_tokens` up front, so it never preempts (a batch is smaller
when the cache cannot hold more). The batch prefills in lockstep chunks padded to the longest
prompt, as one sub-batch, then decodes until its longest request ends; a finished request keeps
its row as padding, so the batch never shrinks, and nothing joins until the whole batch is done.
It never uses the prefix cache: the baseline computes every prompt in full. With data parallelism
every replica forms its own batch.

This module is plain Python; it must not import jax or anything from meshserve's model, serving
or sharding packages.
"""

from __future__ import annotations

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.ordering import Ordering
from meshserve.batching.plan import Row
from meshserve.batching.policy import Primitives, fits_padded_budget
from meshserve.batching.request import Request


class StaticPolicy:
    """Static batching, the baseline; see the module docstring."""

    splits_prefill_by_bucket = False
    is_lockstep = True

    def __init__(self, config: SchedulerConfig, ordering: Ordering):
        self.config = config
        self.ordering = ordering
        # Per replica: the members, finished ones included, in seat order.
        self.batches: list[list[Request]] = [[] for _ in range(config.num_replicas)]

    def pick_rows(self, scheduler: Primitives) -> list[Row]:
        rows = []
        for replica, batch in enumerate(self.batches):
            if all(r.is_finished for r in batch):
                batch = self.batches[replica] = self._form_batch(scheduler, replica)
            if not batch:
                continue
            if any(_is_prefilling(r) for r in batch):
                rows += self._prefill_rows(batch)
            else:
                rows += [Row(r, 0 if r.is_finished or r.awaits_output else 1, is_decode=True)
                         for r in batch]  # a row awaiting its constraint's token pads
        return rows

    def _form_batch(self, scheduler: Primitives, replica: int) -> list[Request]:
        """Up to max_num_seqs waiting requests, each with pages for its whole life: the first
        in `Ordering.batch_order`, and the next ones while their pages fit."""
        window = scheduler.waiting_order(1 + self.config.admission_lookahead)
        batch = []
        for request in self.ordering.batch_order(window)[:self._max_batch_size()]:
            request.replica = replica
            if not scheduler.admit(request, [], request.max_kv_len):
                break
            batch.append(request)
        assert batch or not window, "an empty cache holds any request that passed add"
        return batch

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


def _is_prefilling(request: Request) -> bool:
    return not request.is_finished and _num_prompt_left(request) > 0


def _num_prompt_left(request: Request) -> int:
    return request.num_prompt_tokens - request.num_computed_tokens
