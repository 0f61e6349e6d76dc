"""Speculative decoding, host side: the config, the proposers, and a step's drafts as extra rows.

A request that is decoding gets up to k draft tokens from a `Proposer` (prompt lookup over its
own tokens, `NgramProposer`, or a draft model's argmax,
`meshserve.model.executor.draft_proposer`), the pages for them reserved first. The drafts ride
in the same ragged step as everything else, as one extra sub-batch of one-token rows: draft j of
a request whose next position is n - 1 is a row
of its own, at position n - 1 + j, with context n + j, over the request's pages. The row that
feeds the request's last token (position n - 1) is the scheduled decode row, untouched. So the
step computes logits at every draft position plus one (the bonus), each row sampled by the
ordinary sampler with its own sampling row (output index, history with the drafts before it),
and the compiled program set is the same as without speculation: the runner sees rows.

    scheduled plan:   [prefill chunk A ........] [decode B: x0] [decode C: x0]
    what runs:        [prefill chunk A ........] [decode B: x0] [decode C: x0] | B: d1 d2 d3
                                                                                 (draft rows)
    sampled:                                       y0                            y1 y2 y3

Verification (`Speculation.num_accepted`): y0 is exactly the token the step would have
sampled without speculation. Draft d1 is accepted when y0 == d1, then d2 when y1 == d2, and so
on; the request emits y0 .. ya, a being the accepted drafts (so a + 1 tokens, the last either a
correction or the bonus y_k). With the sampler's per-output-index keys this is rejection
sampling for a draft distribution q that is one-hot on the drafted token: accepting x with
min(1, p(x) / q(x)) = p(x), and on rejection drawing from normalize(max(p - q, 0)), which is p
with x removed, gives the same joint law as drawing y ~ p and accepting iff y == x. Drawing y
with the key non-speculative decoding would use for that output index makes every output,
greedy or seeded, token-identical to decoding without speculation. (A draft model proposes its
argmax, so its q is one-hot too; drafts with a general q would verify with
`meshserve.model.executor.verification.rejection_sample`.)

Applying the outcome (`Speculation.rounds`): the engine applies the step as rounds, round 0 the
scheduled plan and round j the draft rows at position j of the requests that accepted j drafts.
Each round goes through the scheduler's ordinary update (computed tokens + 1, full pages into
the prefix cache, one output appended, EOS, stop ids, max_tokens, stop strings), so a stop cuts
the accepted run where it falls and the prefix cache and preemption only ever see accepted
tokens. Rollback (`Speculator.settle`): the KV written at rejected positions stays in the cache
past the request's computed length, where no query reads it and the next tokens overwrite it;
pages taken for drafts beyond what the accepted tokens need go back to the pool.

When to speculate (`Speculator.expand`, the load rule): a step speculates only while at most
`disable_by_batch_size` of its rows sample an output (vLLM's knob: above it the verification
tokens cost more than they save; default 4), and only within the step's room: draft rows need a
sequence slot each (`max_num_seqs`), a token of the budget each, and free KV pages (never an
eviction or a preemption). A step that carries prefill chunks takes drafts only into the padding
of its token bucket, so drafts never make a prefill step wider. Constrained requests (structured
output) and requests that opted out (`SamplingParams.speculate` False) never draft; they run as usual beside
those that do.

This module is plain Python and numpy; it must not import jax or anything from meshserve's
model, serving or sharding packages.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from meshserve.batching.buckets import pick_bucket
from meshserve.batching.pages import num_pages_for
from meshserve.batching.plan import (Row, StepPlan, adapter_slots, sampling_arrays,
                                     sub_batch_from_rows)
from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import SamplingArrays, concat_sampling, take_rows

METHODS = ("ngram", "draft_model")
DEFAULT_NGRAM_SIZE = 5  # vLLM's prompt_lookup_min and _max when neither is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's `speculative_config` dict.

    method                  "ngram" (prompt lookup over the request's own prompt and output) or
                            "draft_model" (a second model; `model` names it). Unset: inferred,
                            "ngram" when `model` is "ngram" or "[ngram]", else "draft_model".
    num_speculative_tokens  k, the most drafts a request gets per step
    prompt_lookup_max/min   ngram: the longest and shortest suffix looked up (each defaults to
                            the other, both to 5 when neither is given, as vLLM does)
    model                   draft_model: the draft model (same vocabulary as the target)
    disable_by_batch_size   no speculation in a step where more rows than this sample an
                            output (the load rule); None: never off for load
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        self._settle_method()
        _check_count("num_speculative_tokens", self.num_speculative_tokens, required=True)
        if self.disable_by_batch_size is not None:
            _check_count("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            self._settle_lookup()
        else:
            self._refuse_lookup()
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model must name the draft model for method "
                                 f"'draft_model', got {self.model!r}")

    @classmethod
    def coerce(cls, value: Any) -> SpeculativeConfig | None:
        """A config from None (off), an instance, a dict of its fields, or that dict as JSON
        text (the command line's `--speculative-config`). Unknown fields are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config must be a JSON object, e.g. "
                                 f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}' "
                                 f"({err.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict (JSON object) of its fields, got "
                             f"{type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown fields {unknown}; known: {known}")
        return cls(**value)

    def _settle_method(self) -> None:
        method = self.method
        if method is None:
            method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got "
                             f"{self.method!r}")
        object.__setattr__(self, "method", method)
        if method == "ngram" and self.model in ("ngram", "[ngram]"):
            object.__setattr__(self, "model", None)

    def _settle_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_NGRAM_SIZE
        low = high if low is None else low
        high = low if high is None else high
        _check_count("prompt_lookup_min", low)
        _check_count("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= "
                             f"prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.model is not None:
            raise ValueError("speculative_config.model names a draft model; method 'ngram' "
                             f"takes none, got {self.model!r}")

    def _refuse_lookup(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} applies to method 'ngram' only, "
                                 f"not {self.method!r}")


def _check_count(name: str, value, *, required: bool = False) -> None:
    if value is None and required:
        raise ValueError(f"speculative_config.{name} is required (an int >= 1)")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")


# -- proposers ------------------------------------------------------------------------------------

class Proposer(Protocol):
    """What drafts tokens: given the requests of a step and the most drafts each may take, up
    to that many token ids to follow each request's tokens (fewer, or none, when it has no
    good guess). One call per step for all of them, so a draft model can batch its rows."""

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]
                ) -> list[list[int]]: ...


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's
    longest suffix of `min_n` to `max_n` tokens, in its prompt and output."""

    min_n: int
    max_n: int

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]
                ) -> list[list[int]]:
        return [ngram_lookup(r.all_token_ids, self.min_n, self.max_n, k)
                for r, k in zip(requests, max_drafts)]


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of `tokens`' last n tokens,
    for the largest n in [min_n, max_n] that occurs; [] when none does. An occurrence may
    overlap the suffix itself, but must be followed by at least one token."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    t = np.asarray(tokens, np.int64)
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        windows = sliding_window_view(t[:-1], n)  # [L - n, n]: the n-grams with a successor
        hits = np.flatnonzero((windows == t[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start:start + k].tolist()
    return []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The host-side proposer of `config`; a draft model is a device proposer, which whoever
    builds the runner builds (`meshserve.serving.engine.speculation`)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method {config.method!r} runs a model: build its "
                     "proposer where the runner is built (meshserve.serving.engine.speculation)")


# -- a step with drafts -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Drafted:
    """One request's drafts in a step: its scheduled row, and its draft rows (draft j at row
    `rows[j - 1]` of the draft sub-batch)."""

    request: Request
    drafts: tuple[int, ...]
    base_row: tuple[int, int]  # (sub-batch, row) of its scheduled row in the base plan
    rows: tuple[int, ...]
    num_pages_before: int  # pages it held before pages were taken for its drafts
    num_outputs_before: int  # its outputs before the step


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A scheduled plan (`base`) with drafts: `plan` is what runs, the base's sub-batches and
    then one sub-batch of draft rows."""

    base: StepPlan
    plan: StepPlan
    drafted: tuple[Drafted, ...]
    positions: np.ndarray  # [R] the draft position (1..k) of each draft row

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d.drafts) for d in self.drafted)

    def num_accepted(self, tokens: Sequence[np.ndarray]) -> list[int]:
        """Per drafted request, how many of its drafts the sampled tokens (one [B] array per
        sub-batch of `plan`) accept: draft j + 1 is accepted when the token sampled at
        position j equals it, and each needs all before it."""
        return [accepted_length(d.drafts, self.sampled(d, tokens)) for d in self.drafted]

    def sampled(self, drafted: Drafted, tokens: Sequence[np.ndarray]) -> list[int]:
        """The tokens sampled at the request's positions 0 .. k (its scheduled row, then its
        draft rows)."""
        batch, row = drafted.base_row
        return [int(tokens[batch][row])] + [int(tokens[-1][r]) for r in drafted.rows]

    def rounds(self, tokens: Sequence[np.ndarray]) -> list[StepPlan]:
        """The step as the engine applies it, each round a plan over the same sub-batches (so
        the step's results index it): round 0 the base plan's rows, round j the draft rows at
        position j of the requests that accepted at least j drafts."""
        num_base = len(self.base.sub_batches)
        draft_batch = self.plan.sub_batches[-1]
        accepted = np.zeros(draft_batch.num_rows, np.int64)  # per draft row: its owner's count
        for drafted, count in zip(self.drafted, self.num_accepted(tokens)):
            accepted[list(drafted.rows)] = count
        rounds = [_only_rows(self.plan, num_base, None)]
        for j in range(1, int(self.positions.max(initial=0)) + 1):
            rows = (self.positions == j) & (accepted >= j)
            if not rows.any():
                break
            rounds.append(_only_rows(self.plan, num_base, rows))
        return rounds


def accepted_length(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the sampled tokens accept: draft i is accepted when the token
    sampled at position i (`sampled[i]`, from the target's distribution there) equals it."""
    count = 0
    while count < len(drafts) and sampled[count] == drafts[count]:
        count += 1
    return count


def _only_rows(plan: StepPlan, num_base: int, draft_rows: np.ndarray | None) -> StepPlan:
    """`plan` with only some rows computing: the base sub-batches' (`draft_rows` None), or
    the draft rows marked in `draft_rows`; the others have num_new 0, so no round sees them."""
    keep = [np.full(b.num_rows, draft_rows is None) for b in plan.sub_batches[:num_base]]
    keep.append(np.zeros(plan.sub_batches[-1].num_rows, bool) if draft_rows is None
                else draft_rows)
    batches = tuple(
        batch if mask.all() else dataclasses.replace(
            batch, num_new=np.where(mask, batch.num_new, 0).astype(np.int32))
        for batch, mask in zip(plan.sub_batches, keep))
    return dataclasses.replace(plan, sub_batches=batches)


@dataclasses.dataclass
class SpeculativeStats:
    """What speculation did, over the engine's life (vLLM's counters, and a few of its own)."""

    num_drafts: int = 0  # verifications: (request, step) pairs that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts the verification accepted
    num_emitted_tokens: int = 0  # outputs the speculating requests got, stops applied
    num_steps: int = 0  # steps that carried drafts
    num_steps_off: int = 0  # steps the load rule kept from speculating
    draft_tokens_per_position: list[int] = dataclasses.field(default_factory=list)
    accepted_tokens_per_position: list[int] = dataclasses.field(default_factory=list)

    def copy(self) -> SpeculativeStats:
        return dataclasses.replace(
            self, draft_tokens_per_position=list(self.draft_tokens_per_position),
            accepted_tokens_per_position=list(self.accepted_tokens_per_position))

    def since(self, before: SpeculativeStats) -> SpeculativeStats:
        """The counts added after `before` (an earlier copy)."""
        def minus(now: list[int], then: list[int]) -> list[int]:
            return [a - (then[i] if i < len(then) else 0) for i, a in enumerate(now)]

        return SpeculativeStats(**{
            f.name: (minus(getattr(self, f.name), getattr(before, f.name))
                     if f.name.endswith("position")
                     else getattr(self, f.name) - getattr(before, f.name))
            for f in dataclasses.fields(self)})

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / drafted tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification yields on average: 1 + accepted drafts per verification."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def summary(self) -> dict[str, Any]:
        """The counts and their rates, for results files."""
        rates = [a / d if d else None for a, d in zip(self.accepted_tokens_per_position,
                                                      self.draft_tokens_per_position)]
        return dataclasses.asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": rates}

    def record(self, drafted: Sequence[Drafted], accepted: Sequence[int],
               emitted: int) -> None:
        self.num_steps += 1
        self.num_drafts += len(drafted)
        self.num_accepted_tokens += sum(accepted)
        self.num_emitted_tokens += emitted
        for d, count in zip(drafted, accepted):
            self.num_draft_tokens += len(d.drafts)
            _add_per_position(self.draft_tokens_per_position, len(d.drafts))
            _add_per_position(self.accepted_tokens_per_position, count)


def _add_per_position(counts: list[int], length: int) -> None:
    """One more at each of positions 0 .. length - 1."""
    counts.extend([0] * (length - len(counts)))
    for i in range(length):
        counts[i] += 1


class Speculator:
    """Turns scheduled plans into plans with drafts (`expand`), and settles each such step
    after the engine applied its rounds (`settle`). Holds the stats."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.stats = SpeculativeStats()

    def expand(self, plan: StepPlan, scheduler) -> Speculation | None:
        """`plan` with drafts for the requests that can take them, pages reserved for them; None
        when no request drafts (the load rule, no room, no proposal)."""
        candidates = list(_candidates(plan, scheduler))
        num_sampled = sum(row.is_sampled for row in plan.real_rows())
        limit = self.config.disable_by_batch_size
        if not candidates:
            return None
        if limit is not None and num_sampled > limit:
            self.stats.num_steps_off += 1
            return None
        held = [len(request.pages) for _, request in candidates]
        caps = self._reserve(plan, candidates, scheduler)
        proposals = self.proposer.propose([request for _, request in candidates], caps)
        drafted, draft_rows = [], []
        page_size = scheduler.config.page_size
        for (row, request), cap, proposal, num_held in zip(candidates, caps, proposals, held):
            drafts = [int(token) for token in proposal[:cap]]
            # pages were reserved for `cap` drafts: those for fewer go back at once
            scheduler.truncate_pages(request, max(num_held, num_pages_for(
                request.num_tokens + len(drafts), page_size)))
            if not drafts:
                continue
            rows = tuple(range(len(draft_rows), len(draft_rows) + len(drafts)))
            draft_rows += _draft_rows(request, drafts, page_size)
            drafted.append(Drafted(request=request, drafts=tuple(drafts),
                                   base_row=(row.batch, row.row), rows=rows,
                                   num_pages_before=num_held,
                                   num_outputs_before=len(request.output_token_ids)))
        if not drafted:
            return None
        return self._speculation(plan, drafted, draft_rows, scheduler.config)

    def _reserve(self, plan: StepPlan, candidates, scheduler) -> list[int]:
        """The most drafts each candidate may take this step, oldest row first, with pages
        reserved for them (a proposer that runs a model writes their KV before they are
        verified): within k, max_tokens and max_model_len, the step's room and free pages."""
        room = _room(plan, scheduler)
        caps = []
        for _, request in candidates:
            cap = min(self.config.num_speculative_tokens, _most_drafts(request, scheduler.config),
                      room[request.replica], _page_room(request, scheduler))
            is_reserved = scheduler.reserve_pages(request, request.num_tokens + cap)
            assert is_reserved, "_page_room counted only free pages"
            room[request.replica] -= cap
            caps.append(cap)
        return caps

    def warmup(self, *, progress: bool = True) -> None:
        """Compiles what the proposer runs, if it runs anything (a draft model)."""
        warmup = getattr(self.proposer, "warmup", None)
        if warmup is not None:
            warmup(progress=progress)

    def _speculation(self, plan: StepPlan, drafted: list[Drafted], draft_rows: list,
                     config) -> Speculation:
        batch = sub_batch_from_rows(draft_rows, page_size=config.page_size)
        if config.num_replicas > 1:
            replicas = [d.request.replica for d in drafted for _ in d.drafts]
            batch = dataclasses.replace(batch, replicas=np.array(replicas, np.int32))
        batch = dataclasses.replace(batch, adapter_slots=adapter_slots(
            [d.request for d in drafted for _ in d.drafts]))
        sampling = concat_sampling([draft_sampling(d.request, d.drafts, config.eos_token_ids)
                                    for d in drafted])
        ids = tuple(d.request.request_id for d in drafted for _ in d.drafts)
        full = StepPlan(sub_batches=plan.sub_batches + (batch,),
                        sampling=plan.sampling + (sampling,),
                        row_requests=plan.row_requests + (ids,),
                        row_samples=plan.row_samples + (np.ones(len(ids), bool),))
        positions = np.concatenate([np.arange(1, len(d.drafts) + 1) for d in drafted])
        return Speculation(base=plan, plan=full, drafted=tuple(drafted), positions=positions)

    def settle(self, speculation: Speculation, tokens: Sequence[np.ndarray],
               scheduler) -> None:
        """After the engine applied the rounds: gives back the pages taken for drafts that the
        accepted tokens do not need (the rollback), and counts what happened."""
        page_size = scheduler.config.page_size
        for d in speculation.drafted:
            request = d.request
            if request.status is RequestStatus.RUNNING:
                keep = max(d.num_pages_before, num_pages_for(request.num_tokens, page_size))
                scheduler.truncate_pages(request, keep)
        emitted = sum(max(0, len(d.request.output_token_ids) - d.num_outputs_before)
                      for d in speculation.drafted)
        self.stats.record(speculation.drafted, speculation.num_accepted(tokens), emitted)


def _candidates(plan: StepPlan, scheduler):
    """`(row, request)` for each row of `plan` that may draft: it computes the request's last
    uncomputed token (one new token) and samples its next output, and the request is neither
    constrained nor opted out."""
    for row in plan.real_rows():
        if not row.is_sampled or row.num_new != 1:
            continue
        request = scheduler.get(row.request_id)
        if request is None or request.constraint is not None or not request.params.speculate:
            continue
        yield row, request


def _most_drafts(request: Request, config) -> int:
    """Drafts that can still become outputs: the request emits at most accepted + 1 tokens,
    within max_tokens, and every draft position must be inside max_model_len."""
    left = request.params.max_tokens - len(request.output_token_ids) - 1
    return max(0, min(left, config.max_model_len - request.num_tokens))


def _room(plan: StepPlan, scheduler) -> list[int]:
    """Draft rows each replica's share of the step can still take: a sequence slot and a token
    each; a step with prefill chunks takes them only into the padding of its token bucket."""
    config = scheduler.config
    num_replicas = config.num_replicas
    rows, tokens = np.zeros(num_replicas, np.int64), np.zeros(num_replicas, np.int64)
    has_prefill = False
    for batch in plan.sub_batches:
        replicas = np.zeros(batch.num_rows, np.int64) if batch.replicas is None \
            else batch.replicas
        np.add.at(rows, replicas, 1)
        np.add.at(tokens, replicas, batch.num_new)
        has_prefill |= bool(np.any(batch.num_new > 1))
    budget = config.max_num_batched_tokens
    if has_prefill and config.step_buckets is not None:
        budget = pick_bucket(int(tokens.max()), config.step_buckets)
    return [int(max(0, min(config.max_num_seqs - r, budget - t))) for r, t in zip(rows, tokens)]


def _page_room(request: Request, scheduler) -> int:
    """Drafts whose KV fits in the request's pages plus the replica's free pages (drafts never
    evict a cached page nor preempt anybody)."""
    page_size = scheduler.config.page_size
    free = scheduler.allocators[request.replica].num_free
    return (len(request.pages) + free) * page_size - request.num_tokens


def _draft_rows(request: Request, drafts: Sequence[int], page_size: int) -> list:
    """`sub_batch_from_rows` rows of the drafts: draft j at position n - 1 + j (n tokens)."""
    n = request.num_tokens
    pages = request.pages[:num_pages_for(n + len(drafts), page_size)]
    return [([token], n - 1 + j, pages) for j, token in enumerate(drafts, start=1)]


def draft_sampling(request: Request, drafts: Sequence[int],
                   eos_token_ids: Sequence[int] = ()) -> SamplingArrays:
    """The sampling rows of a request's draft rows: the row of draft j samples output index
    `len(outputs) + j` with the drafts before it (and itself) in its history, as the request's
    ordinary row would once they were its outputs."""
    base = sampling_arrays([Row(request, 1, is_decode=True)], eos_token_ids=eos_token_ids)
    k, n = len(drafts), request.num_tokens
    tokens = np.asarray(request.all_token_ids + list(drafts), np.int32)
    history = np.full((k, n + k), -1, np.int32)
    is_output = np.zeros((k, n + k), bool)
    for j in range(1, k + 1):
        history[j - 1, :n + j] = tokens[:n + j]
        is_output[j - 1, request.num_prompt_tokens:n + j] = True
    rows = take_rows(base, [0] * k)
    return dataclasses.replace(rows, steps=base.steps[0] + np.arange(1, k + 1, dtype=np.int32),
                               history=history, history_is_output=is_output)
