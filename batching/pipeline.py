"""The pipeline schedule: K step plans (rounds) laid out as units that enter stage 0 one per tick.

Under pipeline parallelism the layer stack is split over S stages. A *unit* is a small batch of
rows that passes through the stages one tick each: unit u runs on stage s at tick u + s, and
every stage works on a different unit at every tick. Two unit shapes exist, fixed per engine:

    DECODE   up to R rows of one new token each (decodes, and prompt pieces of one token)
    PREFILL  one row of up to T prompt tokens (a prefill chunk)
    IDLE     nothing: a bubble

One pipeline call runs K rounds: the K step plans the scheduler makes in a row, the host stepping
in only after all of them (for streaming, stops and admission). A round is laid out as its prefill
units, then its decode *lanes*: M = S units of decode rows, each request keeping its lane for the
whole call. The last stage samples every row; a decode row of round k + 1 reads the token its
request sampled in round k straight from the last stage (fed back to stage 0 on device), which is
why unit u can only read the samples of units up to u - S. A lane's next round comes at least S
units later whenever the lanes are busy; where a gap is shorter, IDLE units are put in between.

Bubbles, and what fills them:
  * plain fill-drain (`bubble_filling=False`): every round keeps its M lanes, empty ones IDLE,
    and drains (S - 1 IDLE units) before the next round starts. A round of M busy units then
    keeps the stages busy M / (M + S - 1) of the time.
  * with bubble filling: rounds follow each other without draining, empty lanes are dropped,
    and the ticks they would have idled are taken by prefill chunks of waiting requests (the
    scheduler admits them into the same rounds). Only the call's own fill and drain, and gaps
    the feedback rule forces, stay idle.

The composition of every unit is decided here, once, and all stages (and all data-parallel
replicas: unit kinds are shared, a replica without rows in a unit carries padding rows) run the
same schedule by construction. Stage utilisation is measured from this schedule: busy stage-slots
over all stage-slots, where a replica's unit is busy if it holds a real row.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from meshserve.batching.plan import StepPlan
from meshserve.batching.sampling import SamplingArrays, scatter_rows

IDLE, DECODE, PREFILL = 0, 1, 2
PLACEHOLDER = -1  # an output sampled on device in this call, not yet known to the host


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitShape:
    """The fixed shapes of a pipeline call. Every field costs a compile."""

    num_stages: int
    num_units: int  # U: units one call holds, idle ones included
    decode_rows: int  # R: rows of a DECODE unit
    prefill_tokens: int  # T: tokens of a PREFILL unit's one row
    max_pages: int  # M: page-table width of every row
    num_replicas: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1, got {getattr(self, field.name)}")

    @property
    def num_lanes(self) -> int:
        return self.num_stages


@dataclasses.dataclass(frozen=True)
class RowRef:
    """Row `row` of sub-batch `sub_batch` of round `round`."""

    round: int
    sub_batch: int
    row: int


@dataclasses.dataclass
class _Unit:
    kind: int
    rows: list[list[RowRef]]  # per replica


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A call's units as host arrays, padded to `shape`, with leading [replica, unit] axes.

    Decode slots: `decode_*` [D, U, R(, T=1 | M)]; prefill slots: `prefill_*` [D, U(, T | M)].
    `decode_source[d, u, r]` is the flat index `v * R + row` of the decode slot whose sample is
    this row's input token (a PLACEHOLDER in `decode_tokens`), or -1.
    """

    shape: UnitShape
    plans: tuple[StepPlan, ...]
    kinds: np.ndarray  # [U] int32
    num_units: int  # units laid out (the rest of `kinds` is IDLE)
    decode_tokens: np.ndarray  # [D, U, R]
    decode_source: np.ndarray  # [D, U, R]
    decode_positions: np.ndarray  # [D, U, R]
    decode_num_new: np.ndarray  # [D, U, R]
    decode_kv_lens: np.ndarray  # [D, U, R]
    decode_pages: np.ndarray  # [D, U, R, M]
    prefill_tokens: np.ndarray  # [D, U, T]
    prefill_positions: np.ndarray  # [D, U, T]
    prefill_num_new: np.ndarray  # [D, U]
    prefill_kv_lens: np.ndarray  # [D, U]
    prefill_pages: np.ndarray  # [D, U, M]
    decode_sampling: SamplingArrays  # fields [D * U * R, ...], row-major over (d, u, r)
    prefill_sampling: SamplingArrays  # fields [D * U, ...]
    slots: dict[RowRef, tuple[int, int, int]]  # plan row -> (replica, unit, row in unit)
    num_busy: int  # units holding a real row, summed over replicas

    @property
    def num_ticks(self) -> int:
        """Ticks the call runs: every unit through every stage."""
        return self.num_units + self.shape.num_stages - 1

    @property
    def stage_utilisation(self) -> float:
        """Busy stage-slots / all stage-slots of this call."""
        return self.num_busy / (self.num_ticks * self.shape.num_replicas)


def build_schedule(plans: Sequence[StepPlan], shape: UnitShape, *,
                   bubble_filling: bool = True) -> PipelineSchedule:
    """Lays out `plans` (consecutive rounds) as units; raises ValueError if they do not fit."""
    units: list[_Unit] = []
    sampled_at: dict[tuple[str, int], tuple[int, int]] = {}  # (request, output) -> (unit, row)
    lane_of: dict[str, int] = {}
    source_of: dict[RowRef, tuple[str, int]] = {}  # decode rows fed back: (request, output idx)
    for k, plan in enumerate(plans):
        prefill, lanes = _round_rows(plan, k, shape, lane_of)
        round_units = [_Unit(PREFILL, rows) for rows in prefill]
        round_units += [_Unit(DECODE if any(rows) else IDLE, rows) for rows in lanes]
        if bubble_filling:
            round_units = [u for u in round_units if u.kind != IDLE]
        for unit in round_units:
            _place(unit, units, plans, sampled_at, source_of, shape)
        if not bubble_filling and k + 1 < len(plans):
            units += [_Unit(IDLE, [[] for _ in range(shape.num_replicas)])
                      for _ in range(shape.num_stages - 1)]  # drain before the next round
    while units and units[-1].kind == IDLE:
        units.pop()
    if len(units) > shape.num_units:
        raise ValueError(f"{len(plans)} rounds need {len(units)} pipeline units; the call holds "
                         f"{shape.num_units}")
    return _to_arrays(plans, units, shape, source_of, sampled_at)


def _round_rows(plan: StepPlan, k: int, shape: UnitShape, lane_of: dict[str, int]
                ) -> tuple[list[list[list[RowRef]]], list[list[list[RowRef]]]]:
    """One round's prefill units and decode lanes, each as rows per replica.

    A row of one new token goes to its request's lane (kept for the whole call; a new request
    takes the lane with the fewest rows); a longer row is one prefill unit.
    """
    replicas = shape.num_replicas
    lanes = [[[] for _ in range(replicas)] for _ in range(shape.num_lanes)]
    prefill: list[list[list[RowRef]]] = []
    per_replica_prefill: list[list[RowRef]] = [[] for _ in range(replicas)]
    for i, batch in enumerate(plan.sub_batches):
        replica_of = np.zeros(batch.num_rows, int) if batch.replicas is None else batch.replicas
        for j in range(batch.num_rows):
            n = int(batch.num_new[j])
            if n == 0:
                continue  # a padding row (a finished request's seat under static batching)
            ref, d = RowRef(k, i, j), int(replica_of[j])
            if n > 1:
                if n > shape.prefill_tokens:
                    raise ValueError(f"a prefill chunk of {n} tokens exceeds the pipeline's "
                                     f"{shape.prefill_tokens}-token units")
                per_replica_prefill[d].append(ref)
                continue
            rid = plan.row_requests[i][j]
            lane = lane_of.get(rid)
            if lane is None or len(lanes[lane][d]) >= shape.decode_rows:
                lane = min(range(shape.num_lanes), key=lambda m: (len(lanes[m][d]), m))
                if len(lanes[lane][d]) >= shape.decode_rows:
                    raise ValueError(f"more than {shape.num_lanes} x {shape.decode_rows} "
                                     f"one-token rows in one round on replica {d}")
                lane_of[rid] = lane
            lanes[lane][d].append(ref)
    for p in range(max(len(rows) for rows in per_replica_prefill)):
        prefill.append([[rows[p]] if p < len(rows) else [] for rows in per_replica_prefill])
    return prefill, lanes


def _place(unit: _Unit, units: list[_Unit], plans: Sequence[StepPlan],
           sampled_at: dict[tuple[str, int], tuple[int, int]],
           source_of: dict[RowRef, tuple[str, int]], shape: UnitShape) -> None:
    """Appends `unit`, after IDLE units if a row's fed-back token would not be ready yet."""
    earliest = len(units)
    for rows in unit.rows:
        for ref in rows:
            plan = plans[ref.round]
            if plan.sub_batches[ref.sub_batch].tokens[ref.row, 0] != PLACEHOLDER:
                continue
            key = _fed_back_output(plan, ref)
            if key not in sampled_at:
                raise ValueError(f"request {key[0]!r} reads output {key[1]}, which no earlier "
                                 f"round of this call samples")
            source_of[ref] = key
            earliest = max(earliest, sampled_at[key][0] + shape.num_stages)
    while len(units) < earliest:
        units.append(_Unit(IDLE, [[] for _ in range(shape.num_replicas)]))
    index = len(units)
    units.append(unit)
    for rows in unit.rows:
        for r, ref in enumerate(rows):
            plan = plans[ref.round]
            if plan.row_samples[ref.sub_batch][ref.row]:
                step = int(plan.sampling[ref.sub_batch].steps[ref.row])
                sampled_at[(plan.row_requests[ref.sub_batch][ref.row], step)] = (index, r)


def _fed_back_output(plan: StepPlan, ref: RowRef) -> tuple[str, int]:
    """The (request, output index) whose token a one-token row takes as its input."""
    rid = plan.row_requests[ref.sub_batch][ref.row]
    # The row's new token is the request's latest output: the one before the output it samples.
    return rid, int(plan.sampling[ref.sub_batch].steps[ref.row]) - 1


def _to_arrays(plans: Sequence[StepPlan], units: list[_Unit], shape: UnitShape,
               source_of: dict[RowRef, tuple[str, int]],
               sampled_at: dict[tuple[str, int], tuple[int, int]]) -> PipelineSchedule:
    D, U, R, T, M = (shape.num_replicas, shape.num_units, shape.decode_rows,
                     shape.prefill_tokens, shape.max_pages)
    zeros = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    arrays = dict(
        decode_tokens=zeros(D, U, R), decode_source=np.full((D, U, R), -1, np.int32),
        decode_positions=zeros(D, U, R), decode_num_new=zeros(D, U, R),
        decode_kv_lens=zeros(D, U, R), decode_pages=zeros(D, U, R, M),
        prefill_tokens=zeros(D, U, T), prefill_positions=zeros(D, U, T),
        prefill_num_new=zeros(D, U), prefill_kv_lens=zeros(D, U), prefill_pages=zeros(D, U, M))
    kinds = zeros(U)
    slots: dict[RowRef, tuple[int, int, int]] = {}
    decode_rows: dict[tuple[int, int, int], RowRef] = {}
    prefill_rows: dict[tuple[int, int], RowRef] = {}
    num_busy = 0
    for u, unit in enumerate(units):
        kinds[u] = unit.kind
        for d, rows in enumerate(unit.rows):
            num_busy += bool(rows)
            for r, ref in enumerate(rows):
                batch = plans[ref.round].sub_batches[ref.sub_batch]
                pages = batch.page_table[ref.row]
                if pages.size > M:
                    if pages[M:].any():
                        raise ValueError(f"a row needs {pages.size} pages; pipeline rows hold {M}")
                    pages = pages[:M]
                n = int(batch.num_new[ref.row])
                slots[ref] = (d, u, r)
                if unit.kind == PREFILL:
                    prefill_rows[(d, u)] = ref
                    arrays["prefill_tokens"][d, u, :n] = batch.tokens[ref.row, :n]
                    arrays["prefill_positions"][d, u, :n] = batch.positions[ref.row, :n]
                    arrays["prefill_num_new"][d, u] = n
                    arrays["prefill_kv_lens"][d, u] = batch.kv_lens[ref.row]
                    arrays["prefill_pages"][d, u, :pages.size] = pages
                    continue
                decode_rows[(d, u, r)] = ref
                arrays["decode_tokens"][d, u, r] = batch.tokens[ref.row, 0]
                arrays["decode_positions"][d, u, r] = batch.positions[ref.row, 0]
                arrays["decode_num_new"][d, u, r] = n
                arrays["decode_kv_lens"][d, u, r] = batch.kv_lens[ref.row]
                arrays["decode_pages"][d, u, r, :pages.size] = pages
                if ref in source_of:
                    v, row = sampled_at[source_of[ref]]
                    arrays["decode_source"][d, u, r] = v * R + row
    decode_sampling = _gather_sampling(plans, decode_rows, (D, U, R))
    prefill_sampling = _gather_sampling(plans, {(d, u, 0): ref
                                                for (d, u), ref in prefill_rows.items()},
                                        (D, U, 1))
    return PipelineSchedule(shape=shape, plans=tuple(plans), kinds=kinds, num_units=len(units),
                            decode_sampling=decode_sampling, prefill_sampling=prefill_sampling,
                            slots=slots, num_busy=num_busy, **arrays)


def _gather_sampling(plans: Sequence[StepPlan], rows: dict[tuple[int, int, int], RowRef],
                     grid: tuple[int, int, int]) -> SamplingArrays:
    """Every plan row's sampling parameters at its slot of `grid`, flattened row-major; empty
    slots greedy and neutral. 2-D columns are as wide as the widest source sub-batch's."""
    picks, slots = [], []
    for (d, u, r), ref in rows.items():
        picks.append((plans[ref.round].sampling[ref.sub_batch], ref.row))
        slots.append((d * grid[1] + u) * grid[2] + r)
    return scatter_rows(picks, slots, int(np.prod(grid)))


def unit_results(schedule: PipelineSchedule, tokens: np.ndarray, logprobs: np.ndarray,
                 top_ids: np.ndarray, top_logprobs: np.ndarray
                 ) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]:
    """Per round, per sub-batch: (tokens [B], logprobs [B], top_ids [B, K], top_logprobs [B, K])
    gathered from the per-slot results [D, U, R(, K)] (a prefill unit's row is slot 0)."""
    out = []
    for k, plan in enumerate(schedule.plans):
        batches = []
        for i, batch in enumerate(plan.sub_batches):
            n, K = batch.num_rows, top_ids.shape[-1]
            got = (np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros((n, K), np.int32),
                   np.zeros((n, K), np.float32))
            for j in range(n):
                slot = schedule.slots.get(RowRef(k, i, j))
                if slot is None:
                    continue
                for array, source in zip(got, (tokens, logprobs, top_ids, top_logprobs)):
                    array[j] = source[slot]
            batches.append(got)
        out.append(batches)
    return out
