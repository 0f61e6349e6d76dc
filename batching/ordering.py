"""How waiting requests are taken: first come, first served, or shortest predicted first.

The scheduler holds one `Ordering`, chosen once from `SchedulerConfig.ordering`. Within a priority
(higher first) "fcfs" keeps the queue as it is: arrival order, a preempted request at the front.

"predicted" uses the output length the scheduler predicts for each request when it is added (a
`LengthPredictor`: quantiles of the length, from the prompt and sampling params; the prior without
training). Then:
  - waiting requests go shortest predicted first: by tokens still to compute (prompt plus
    predicted median output), less `aging_tokens_per_step` for each step waited, so a long
    request's turn always comes. Within a priority, preempted requests go first;
  - admission keeps, besides the watermark, pages for every running request's growth up to the
    `reserve_quantile` (0.9) of its predicted length, and for the new request's own, so a
    request is rarely admitted into a shortage it will cause;
  - static batches are formed around the first request in that order, from the requests of the
    lookahead window whose prompt and predicted output are closest to its own, so a batch pads
    little and ends together.

Either way a step costs O(queue) at most, not a copy or a full sort of a long queue.

This module is plain Python; it must not import jax or anything from meshserve's model, serving
or sharding packages.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Protocol, Sequence

from meshserve.batching.knobs import ORDERINGS, SchedulerConfig
from meshserve.batching.pages import num_pages_for
from meshserve.batching.request import Request


class Ordering(Protocol):
    needs_predictions: bool  # without a length predictor, the scheduler uses the prior

    def waiting_order(self, waiting: Iterable[Request], limit: int | None,
                      num_steps: int) -> list[Request]:
        """The first `limit` (None: all) of `waiting` (the queue) in the order admission takes
        them, at scheduler step `num_steps`."""

    def growth_pages(self, running: Sequence[Request], request: Request, num_tokens: int) -> int:
        """Pages admitting `request` (with pages for `num_tokens` tokens) beside `running` must
        keep for their predicted growth; 0 without predictions."""

    def admission_order(self, window: list[Request],
                        bucket: Callable[[Request], int]) -> list[Request]:
        """Continuous admission: `window` (in waiting order), regrouped by token bucket or not."""

    def batch_order(self, window: list[Request]) -> list[Request]:
        """Static batching: `window` (in waiting order), regrouped by length or not."""


class FcfsOrdering:
    """The queue as it is. Admission takes the head, then the requests of the window whose first
    chunk falls in the head's token bucket, then the rest; a static batch is the queue's head."""

    needs_predictions = False

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def waiting_order(self, waiting: Iterable[Request], limit: int | None,
                      num_steps: int) -> list[Request]:
        return list(itertools.islice(waiting, limit))

    def growth_pages(self, running: Sequence[Request], request: Request, num_tokens: int) -> int:
        return 0

    def admission_order(self, window: list[Request],
                        bucket: Callable[[Request], int]) -> list[Request]:
        if not window:
            return window
        head, rest = window[0], window[1:]
        is_same = [bucket(r) == bucket(head) for r in rest]
        same = [r for r, s in zip(rest, is_same) if s]
        others = [r for r, s in zip(rest, is_same) if not s]
        return [head] + same + others

    def batch_order(self, window: list[Request]) -> list[Request]:
        return window


class PredictedOrdering:
    """Shortest predicted first, with aging; see the module docstring."""

    needs_predictions = True

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def waiting_order(self, waiting: Iterable[Request], limit: int | None,
                      num_steps: int) -> list[Request]:
        """Within a priority, requests that were preempted first (they hold outputs already, and
        their users are waiting), then by `cost`, lowest first."""
        key = lambda r: (-r.priority, r.num_preemptions == 0, self.cost(r, num_steps))  # noqa: E731
        if limit is None:
            return sorted(waiting, key=key)
        return heapq.nsmallest(limit, waiting, key=key)

    def cost(self, request: Request, num_steps: int) -> float:
        """Tokens the request still has to compute, by its predicted median output length,
        less `aging_tokens_per_step` for every step it has waited: shortest first, but a long
        request's cost keeps falling until it is first, so nothing starves."""
        num_outputs = predicted_outputs(request)
        waited = num_steps - request.arrival_step
        return (request.num_uncomputed + max(num_outputs - len(request.output_token_ids), 0)
                - self.config.aging_tokens_per_step * waited)

    def growth_pages(self, running: Sequence[Request], request: Request, num_tokens: int) -> int:
        return sum(self.growth(r) for r in running) + self.growth(request, num_tokens)

    def growth(self, request: Request, num_tokens: int | None = None) -> int:
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

    def admission_order(self, window: list[Request],
                        bucket: Callable[[Request], int]) -> list[Request]:
        """The waiting order already puts similar lengths together, so it is kept as it is."""
        return window

    def batch_order(self, window: list[Request]) -> list[Request]:
        """The head, then the others by how close their prompt and predicted output lengths are
        to its own, so that the batch pads little and ends together."""
        if not window:
            return window
        head, rest = window[0], window[1:]

        def distance(r: Request) -> int:
            return (abs(r.num_prompt_tokens - head.num_prompt_tokens)
                    + abs(predicted_outputs(r) - predicted_outputs(head)))

        return [head] + sorted(rest, key=distance)


def predicted_outputs(request: Request) -> int:
    """The request's predicted median output length; max_tokens without a prediction."""
    prediction = request.predicted_length
    return prediction.median if prediction is not None else request.params.max_tokens


_ORDERINGS = {"fcfs": FcfsOrdering, "predicted": PredictedOrdering}
assert tuple(_ORDERINGS) == ORDERINGS


def make_ordering(config: SchedulerConfig) -> Ordering:
    return _ORDERINGS[config.ordering](config)
