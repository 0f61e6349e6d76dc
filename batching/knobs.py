"""The scheduler's settings: cache geometry, per-step limits and the policy knobs, validated once.

Every user knob is declared once, with its help text and whether it costs a compile, as dataclass
field metadata (`knob`); the engine's config holds these fields (it subclasses
`SchedulingKnobs`) and the command line is generated from the same metadata.

Plain Python; like the rest of `batching/` it never imports jax.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from meshserve.batching.buckets import token_bucket_sizes

POLICY_NAMES = ("continuous", "static")
ORDERINGS = ("fcfs", "predicted")
# Measured on the storm workload of tests/batching/test_kv_accounting.py (prompts that fill the
# cache, requests that still grow): preemptions 116 -> 21 and recomputed tokens 5236 -> 1195 for
# 2% more steps. 0.04 keeps twice as many preemptions; 0.15 and up mostly delays admission.
DEFAULT_KV_WATERMARK = 0.08


def knob(default: Any, help: str, *, compile: bool = False, **metadata: Any) -> Any:
    """A config field declared with its help text; `compile=True` marks a knob that changes
    compiled shapes (a new value costs a recompile). Extra metadata: `aliases` (more flag
    names), `metavar`, `choices`, `nargs` (a tuple field: one or more values), and `flag=False`
    for a field the command line leaves out."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "compile": compile, **metadata})


def same_knob(cls: type, name: str) -> Any:
    """Field `name` of config `cls`, with its default and metadata, for a config that holds
    the knob and hands it on: the declaration stays in `cls`."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulingKnobs:
    """The user's scheduling knobs, validated here once: `SchedulerConfig` adds what the engine
    settles at runtime, and the engine's config subclasses this for its own knobs.

    `max_model_len` may be None (the model's context) until an engine settles it."""

    num_pages: int = knob(512, "KV pages (page 0 is reserved), per data replica", compile=True)
    page_size: int = knob(16, "tokens per KV page", compile=True)
    max_num_seqs: int = knob(16, "running sequences per replica, and rows per sub-batch",
                             compile=True)
    max_num_batched_tokens: int = knob(512, "new tokens per step, all requests together, per "
                                            "replica; the widest token bucket", compile=True)
    prefill_chunk: int = knob(256, "longest prompt chunk per row per step", compile=True)
    max_model_len: int | None = knob(None, "prompt + output tokens per request; unset: the "
                                           "model's context, at most 2048", compile=True)
    policy: str = knob("continuous", "batching policy; static is the baseline",
                       choices=POLICY_NAMES)
    enable_prefix_caching: bool = knob(True, "share computed full prompt pages between requests "
                                             "with the same prefix (continuous only)",
                                       aliases=("--prefix-caching",))
    kv_watermark: float = knob(DEFAULT_KV_WATERMARK, "fraction of pages admission keeps "
                                                     "available for running requests' growth, "
                                                     "so preemption stays rare")
    ordering: str = knob("fcfs", "how waiting requests are taken; predicted: shortest "
                                 "predicted output first, with aging", choices=ORDERINGS)
    reserve_quantile: float = knob(0.9, "ordering predicted: the quantile of each request's "
                                        "predicted output length that pages are kept for")
    aging_tokens_per_step: float = knob(1.0, "ordering predicted: how many tokens a waiting "
                                             "request's predicted cost shrinks each step")

    def __post_init__(self):
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        if not isinstance(self.reserve_quantile, numbers.Real) or not (
                0 <= self.reserve_quantile <= 1):
            raise ValueError(f"reserve_quantile must be in [0, 1], got {self.reserve_quantile!r}")
        if not isinstance(self.aging_tokens_per_step, numbers.Real) or not (
                self.aging_tokens_per_step > 0):
            raise ValueError(f"aging_tokens_per_step must be > 0, got "
                             f"{self.aging_tokens_per_step!r}")
        self._check_watermark()
        self._check_sizes()
        self._check_budget()
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")

    def _check_watermark(self) -> None:
        """A fraction, stored as a float so that 0 is not taken for a count below 1."""
        value = self.kv_watermark
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
            raise ValueError(f"kv_watermark must be a fraction in [0, 1), got {value!r}")
        object.__setattr__(self, "kv_watermark", float(value))

    def _check_sizes(self) -> None:
        if not _is_int(self.num_pages) or self.num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the reserved dummy page), "
                             f"got {self.num_pages!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                     "max_model_len"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue  # settled against the model by the engine
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def _check_budget(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), so that every running request can decode each step")
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): a chunk must not exceed max_num_batched_tokens; "
                f"lower prefill_chunk or raise the budget")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulingKnobs):
    """The scheduling knobs (`SchedulingKnobs`) and what the engine settles at runtime.

    `max_model_len` caps one request's prompt + max_tokens; here it must be settled (an int).
    `token_buckets` are the padded prefill
    lengths the runner compiles; by default `token_bucket_sizes(prefill_chunk)`, powers of two
    from 8 up to `prefill_chunk`. `eos_token_ids` end a request unless it sets `ignore_eos`.

    `bound_padded_prefill` keeps every prefill sub-batch, once padded to its row and token
    buckets, within `max_num_batched_tokens` (`fits_padded_budget`). The model runner compiles
    exactly those shapes, so this is on whenever a runner consumes the plans; turning it off
    plans by real token counts alone.

    `kv_watermark` is the fraction of a replica's pages admission keeps available for running
    requests' growth (the watermark rule: `batching/continuous.py`); `enable_prefix_caching`
    shares full prompt pages between requests with the same prefix (continuous policy only).

    `ordering` is how waiting requests are taken: "fcfs", or "predicted" (shortest predicted
    first, with aging; the rules: `batching/ordering.py`). `reserve_quantile` is the quantile of
    each request's predicted output length that "predicted" keeps pages for, and
    `aging_tokens_per_step` how fast a waiting request's predicted cost shrinks while it waits.

    `step_buckets`, when given, are the token counts a runner pads a whole step to (the ragged
    step's buckets): a prefill chunk is then cut so that the step's tokens land on the bucket
    below, when that is nearer than the bucket above (`fit_step_bucket`). The cut-off tokens run
    next step, beside decodes that run anyway; padding up would compute more slots than that.

    `attention_window`, when not 0, is a sliding window every layer of the model keeps to (a
    query sees that many keys, its own included): a request's pages wholly behind the window of
    its next token are never read again, so they go back to the pool as it advances.
    """

    token_buckets: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bound_padded_prefill: bool = True
    num_replicas: int = 1
    step_buckets: tuple[int, ...] | None = None
    attention_window: int = 0
    max_loras: int = 0  # LoRA adapter slots on the device (batching/adapters.py); 0: no LoRA

    def __post_init__(self):
        if self.max_model_len is None:
            raise ValueError("max_model_len must be an int >= 1, got None")
        if not _is_int(self.max_loras) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an int >= 0, got {self.max_loras!r}")
        if not _is_int(self.num_replicas) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if not _is_int(self.attention_window) or self.attention_window < 0:
            raise ValueError(f"attention_window must be an int >= 0, got "
                             f"{self.attention_window!r}")
        super().__post_init__()
        self._normalise_buckets()
        eos = tuple(self.eos_token_ids)
        if not all(_is_int(t) and t >= 0 for t in eos):
            raise ValueError(f"eos_token_ids must be non-negative ints, got {self.eos_token_ids}")
        object.__setattr__(self, "eos_token_ids", eos)

    @property
    def is_prefix_caching(self) -> bool:
        """Whether pages are cached and looked up: on request, and never under static."""
        return self.enable_prefix_caching and self.policy == "continuous"

    @property
    def admission_lookahead(self) -> int:
        """How far past the head of the queue admission looks for same-bucket requests."""
        return 2 * self.max_num_seqs

    def _normalise_buckets(self) -> None:
        buckets = self.token_buckets
        if buckets is None:
            buckets = token_bucket_sizes(self.prefill_chunk)
        buckets = tuple(buckets)
        is_increasing = all(_is_int(b) and b >= 1 for b in buckets) and all(
            a < b for a, b in zip(buckets, buckets[1:]))
        if not buckets or not is_increasing or buckets[-1] < self.prefill_chunk:
            raise ValueError(f"token_buckets must be increasing positive ints ending at >= "
                             f"prefill_chunk ({self.prefill_chunk}), got {self.token_buckets}")
        object.__setattr__(self, "token_buckets", buckets)
        if self.step_buckets is not None:
            steps = tuple(self.step_buckets)
            if not steps or not all(_is_int(b) and b >= 1 for b in steps) or any(
                    a >= b for a, b in zip(steps, steps[1:])):
                raise ValueError(f"step_buckets must be increasing positive ints, got "
                                 f"{self.step_buckets}")
            object.__setattr__(self, "step_buckets", steps)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
