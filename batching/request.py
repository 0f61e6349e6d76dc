"""One request's host state: its tokens, how many of them are in the KV cache, and its pages.

A request has `num_tokens` tokens (prompt plus output so far) of which `num_computed_tokens` have
their KV in the cache; the scheduler hands out new tokens until `num_uncomputed` is 1, and every
step that computes a request's last uncomputed token samples its next output. This one rule covers
chunked prefill, decode, and resuming after preemption.

There is no PREEMPTED status: a preempted request is WAITING again with `num_computed_tokens = 0`
and no pages, and `num_preemptions` counts how often that happened. When it is scheduled again it
recomputes its prompt and the outputs it already has, then samples its next output.

A request stops (`stop_status`) on a stop token id or, unless it ignores EOS, an EOS id, once it
has `min_tokens` outputs; and always at `max_tokens`. A request with a structured-output
`constraint` (`batching/structured.py`) also stops when the constraint is complete ("stop"), or
when no token can continue it ("unsatisfiable").

This module is plain Python; it must not import jax or anything from meshserve's other packages.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import time
from typing import Sequence

from meshserve.batching.prefix_cache import page_hash, root_key
from meshserve.batching.length import LengthFeatures, LengthPrediction
from meshserve.batching.sampling import MAX_SEED, SamplingParams
from meshserve.batching.structured import Constraint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_UNSATISFIABLE = "unsatisfiable"  # its structured-output constraint cannot go on

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """What a finished request reports ("stop", "length", "abort" or "unsatisfiable"); None
        while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_UNSATISFIABLE})


@dataclasses.dataclass(eq=False)
class Request:
    """Mutable host state of one request. Compared by identity.

    `seed` is `params.seed`, or a random 32-bit seed drawn here, so that two unseeded requests with
    the same prompt still sample differently.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    priority: int = 0  # higher is admitted first among waiting requests; ties FCFS
    replica: int = 0  # the data-parallel replica whose pages it holds (set on admission)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    num_registered_pages: int = 0  # leading `pages` keyed in the prefix cache (or found there)
    num_released_pages: int = 0  # leading `pages` behind the attention window, given back
    # (their places in `pages` hold the dummy page 0)
    page_keys: list[bytes] = dataclasses.field(default_factory=list, repr=False)  # see below
    # Set by a scheduler with a length predictor, when the request is added:
    length_features: LengthFeatures | None = dataclasses.field(default=None, repr=False)
    predicted_length: LengthPrediction | None = None  # of its output, in tokens
    arrival_step: int = 0  # the scheduler's step count when it was added (for aging)
    # The compiled structured-output constraint of `params.structured` (set by the engine):
    constraint: Constraint | None = dataclasses.field(default=None, repr=False)
    adapter_id: int = 0  # its LoRA adapter's `lora_int_id`; 0: the base model
    adapter_slot: int = 0  # the device slot of that adapter while it runs (`batching/adapters.py`)
    seed: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.seed = self.params.seed if self.params.seed is not None else _random_seed()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not in the cache yet (1 for a request that is decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_kv_len(self) -> int:
        """The most tokens this request ever holds in the cache: its last output is never fed."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def awaits_output(self) -> bool:
        """Whether its constraint has not taken its last output yet: a pipeline call planned
        that output ahead of the device (a placeholder), and the mask of the next one needs the
        real token. Until it is known the request cannot sample, so policies leave it out of
        the step; other requests go on."""
        return (self.constraint is not None
                and self.constraint.num_consumed < len(self.output_token_ids))

    def keys_of_pages(self, num_pages: int, page_size: int) -> list[bytes]:
        """Prefix-cache keys of its first `num_pages` full pages (`prefix_cache.page_hash`).

        Computed once and kept in `page_keys`: a request's tokens never change. Fewer keys come
        back where a page is not full yet or holds an output the host does not know yet (a
        pipeline placeholder, < 0). The chain starts from its adapter's root key, so requests
        with other adapters (or none) never share its pages.
        """
        tokens = None
        while len(self.page_keys) < num_pages:
            tokens = self.all_token_ids if tokens is None else tokens
            start = len(self.page_keys) * page_size
            page = tokens[start:start + page_size]
            if len(page) < page_size or min(page) < 0:
                break
            parent = self.page_keys[-1] if self.page_keys else root_key(self.adapter_id)
            self.page_keys.append(page_hash(parent, page))
        return self.page_keys[:num_pages]


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


def constrained_stop(request: Request, stop: tuple[RequestStatus, int | None] | None,
                     end: tuple[RequestStatus, str | None] | None
                     ) -> tuple[RequestStatus, int | str | None] | None:
    """What ends a constrained request, given its newest output's token-level `stop` (None, or
    max_tokens: EOS and stop ids are never fed to the matcher) and the constraint's `end` of it:
    the constraint's end first; at max_tokens, "stop" when the output is complete (the
    constraint kept room to close it: `batching/structured.py`), "length" only when not."""
    if end is not None:
        return end
    if (stop is not None and stop[0] is RequestStatus.FINISHED_LENGTH
            and request.constraint is not None and request.constraint.is_complete()):
        return RequestStatus.FINISHED_STOPPED, None
    return stop


def _random_seed() -> int:
    return random.randrange(MAX_SEED)
