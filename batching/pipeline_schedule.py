"""The pipeline schedule: K step plans (rounds) laid out as units that enter stage 0 one per tick.

Under pipeline parallelism the layer stack is split over S stages. A *unit* is a microbatch that
passes through the stages one tick each: unit u runs on stage s at tick u + s, and every stage
works on a different unit at every tick. A unit is a ragged batch, laid out as the model's
`RaggedBatch` (the rows' new tokens back to back, each row one sequence), in one of two shapes
fixed per engine:

    DECODE   R token slots: up to R rows of one new token (decodes, and prompt pieces of one token)
    PREFILL  T token slots shared by up to P rows of prompt chunks, packed back to back
    IDLE     nothing: a bubble

One pipeline call runs K rounds: the K step plans the scheduler makes in a row, the host stepping
in only after all of them (for streaming, stops and admission). A round is laid out as its prefill
units (its chunks packed first fit, in plan order, at most T tokens and P rows a unit), then its
decode *lanes*: M = S units of decode rows, each request keeping its lane for the whole call. A
row whose sub-batch asks for prompt logprobs goes to a prefill unit whatever its length: only
prefill units carry targets. The last stage samples every row; a decode row of round k + 1 reads
the token its request sampled in round k straight from the last stage (fed back to stage 0 on
device), which is why unit u can only read the samples of units up to u - S. A lane's next round
comes at least S units later whenever the lanes are busy; where a gap is shorter, IDLE units are
put in between. Prefill rows never read a fed-back token: their tokens are known prompt (or
recomputed) tokens.

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

from meshserve.batching.plan import StepPlan, SubBatchPlan
from meshserve.batching.runner_protocol import SampledRows
from meshserve.batching.sampling import SamplingArrays, scatter_rows

IDLE, DECODE, PREFILL = 0, 1, 2
PLACEHOLDER = -1  # an output sampled on device in this call, not yet known to the host


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitShape:
    """The fixed shapes of a pipeline call. Every field costs a compile."""

    num_stages: int
    num_units: int  # U: units one call holds, idle ones included
    decode_rows: int  # R: rows (and token slots) of a DECODE unit
    prefill_tokens: int  # T: token slots of a PREFILL unit
    prefill_rows: int  # P: rows a PREFILL unit packs at most
    max_pages: int  # M: page-table width of every row
    page_size: int  # tokens per KV page (to place each token's write)
    num_replicas: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1, got {getattr(self, field.name)}")
        if self.prefill_rows > self.prefill_tokens:
            raise ValueError(f"prefill_rows ({self.prefill_rows}) must be <= prefill_tokens "
                             f"({self.prefill_tokens}): every row needs a token slot")

    @property
    def num_lanes(self) -> int:
        return self.num_stages

    @property
    def sample_slots(self) -> int:
        """Rows a unit samples at most, max(R, P): the width of a call's per-unit outputs."""
        return max(self.decode_rows, self.prefill_rows)


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
class UnitBatches:
    """Every (replica, unit) of one kind as a ragged batch: the fields of the model's
    `RaggedBatch`, with leading axes [D, U]. W token slots, Q rows (sequences). All int32.
    PREFILL units carry `targets` always (zeros where no row asks for prompt logprobs), and
    every unit `adapters`, each token's LoRA adapter slot (0 for the base model and padding; a
    runner serving no adapters drops them).

    A row's tokens sit in consecutive slots starting at `last - num_new + 1`; padding slots have
    `is_real = 0` and write to the dummy page 0, and a padding row has `kv_lens = 0`.
    """

    tokens: np.ndarray  # [D, U, W]; a DECODE unit's token may be a PLACEHOLDER
    positions: np.ndarray  # [D, U, W]
    token_seq: np.ndarray  # [D, U, W] the row each token belongs to
    is_real: np.ndarray  # [D, U, W]
    write_slots: np.ndarray  # [D, U, W] page * page_size + offset
    kv_lens: np.ndarray  # [D, U, Q]
    num_new: np.ndarray  # [D, U, Q]
    last: np.ndarray  # [D, U, Q] slot of each row's last token
    page_table: np.ndarray  # [D, U, Q, M]
    targets: np.ndarray | None = None  # [D, U, W] prompt-logprob targets
    adapters: np.ndarray | None = None  # [D, U, W] each token's LoRA adapter slot (0: none)

    @classmethod
    def empty(cls, shape: UnitShape, width: int, rows: int, *,
              with_targets: bool = False) -> "UnitBatches":
        lead = (shape.num_replicas, shape.num_units)
        zeros = lambda *s: np.zeros(lead + s, np.int32)  # noqa: E731
        return cls(tokens=zeros(width), positions=zeros(width), token_seq=zeros(width),
                   is_real=zeros(width), write_slots=zeros(width), kv_lens=zeros(rows),
                   num_new=zeros(rows), last=zeros(rows), page_table=zeros(rows, shape.max_pages),
                   targets=zeros(width) if with_targets else None, adapters=zeros(width))

    def put_row(self, d: int, u: int, seq: int, start: int, batch: SubBatchPlan, row: int,
                pages: np.ndarray, page_size: int) -> None:
        """Row `row` of `batch` as row `seq` of unit (d, u), its tokens from slot `start`."""
        n = int(batch.num_new[row])
        span = slice(start, start + n)
        positions = batch.positions[row, :n]
        self.tokens[d, u, span] = batch.tokens[row, :n]
        self.positions[d, u, span] = positions
        self.token_seq[d, u, span] = seq
        self.is_real[d, u, span] = 1
        self.write_slots[d, u, span] = (pages[positions // page_size] * page_size
                                        + positions % page_size)
        self.kv_lens[d, u, seq] = batch.kv_lens[row]
        self.num_new[d, u, seq] = n
        self.last[d, u, seq] = start + n - 1
        self.page_table[d, u, seq, :pages.size] = pages
        if self.targets is not None and batch.targets is not None:
            self.targets[d, u, span] = batch.targets[row, :n]
        if batch.adapter_slots is not None:
            self.adapters[d, u, span] = batch.adapter_slots[row]

    def busy_units(self) -> int:
        """(replica, unit) pairs holding a real row."""
        return int(np.count_nonzero(self.num_new.sum(axis=2)))


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A call's units as host arrays, padded to `shape`, with leading [replica, unit] axes.

    `decode` holds every unit's DECODE batch (R slots, R rows), `prefill` its PREFILL batch
    (T slots, P rows); `kinds[u]` says which one unit u runs, and `prompt_logprobs[u]` whether a
    PREFILL unit returns the logprobs of its targets (on any replica). `decode_source[d, u, r]`
    is the flat index `v * O + row` (O = `shape.sample_slots`) of the sampled row whose token is
    decode row r's input (a PLACEHOLDER in `decode.tokens`), or -1.
    """

    shape: UnitShape
    plans: tuple[StepPlan, ...]
    kinds: np.ndarray  # [U] int32
    prompt_logprobs: np.ndarray  # [U] int32, 1 for a PREFILL unit with prompt-logprob rows
    num_units: int  # units laid out (the rest of `kinds` is IDLE)
    decode: UnitBatches  # [D, U, R(, M)]
    prefill: UnitBatches  # [D, U, T | P(, M)]
    decode_source: np.ndarray  # [D, U, R]
    decode_sampling: SamplingArrays  # fields [D * U * R, ...], row-major over (d, u, r)
    prefill_sampling: SamplingArrays  # fields [D * U * P, ...]
    slots: dict[RowRef, tuple[int, int, int]]  # plan row -> (replica, unit, row in unit)
    starts: dict[RowRef, int]  # plan row -> the unit's token slot of its first new token
    num_busy: int  # units holding a real row, summed over replicas

    @property
    def has_targets(self) -> bool:
        """Whether the call returns any prompt logprobs."""
        return bool(self.prompt_logprobs.any())

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
    takes the lane with the fewest rows), unless its sub-batch has prompt-logprob targets; any
    other row is packed into a prefill unit.
    """
    replicas = shape.num_replicas
    lanes = [[[] for _ in range(replicas)] for _ in range(shape.num_lanes)]
    packed: list[list[_Packing]] = [[] for _ in range(replicas)]
    for i, batch in enumerate(plan.sub_batches):
        replica_of = np.zeros(batch.num_rows, int) if batch.replicas is None else batch.replicas
        for j in range(batch.num_rows):
            n = int(batch.num_new[j])
            if n == 0:
                continue  # a padding row (a finished request's seat under static batching)
            ref, d = RowRef(k, i, j), int(replica_of[j])
            if n > 1 or batch.targets is not None:
                if n > shape.prefill_tokens:
                    raise ValueError(f"a prefill chunk of {n} tokens exceeds the pipeline's "
                                     f"{shape.prefill_tokens}-token units")
                _pack(packed[d], ref, n, shape)
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
    num_prefill = max(len(units) for units in packed)
    prefill = [[units[p].rows if p < len(units) else [] for units in packed]
               for p in range(num_prefill)]
    return prefill, lanes


@dataclasses.dataclass
class _Packing:
    """A prefill unit being filled: its rows and the token slots they take."""

    rows: list[RowRef] = dataclasses.field(default_factory=list)
    num_tokens: int = 0


def _pack(units: list[_Packing], ref: RowRef, n: int, shape: UnitShape) -> None:
    """Puts a prefill row of `n` tokens into the first unit with room for it (first fit)."""
    for unit in units:
        if unit.num_tokens + n <= shape.prefill_tokens and len(unit.rows) < shape.prefill_rows:
            break
    else:
        unit = _Packing()
        units.append(unit)
    unit.rows.append(ref)
    unit.num_tokens += n


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
            assert unit.kind == DECODE, "a prefill row never reads a fed-back token"
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
    D, U, R, M = shape.num_replicas, shape.num_units, shape.decode_rows, shape.max_pages
    decode = UnitBatches.empty(shape, R, R)
    prefill = UnitBatches.empty(shape, shape.prefill_tokens, shape.prefill_rows,
                                with_targets=True)
    decode_source = np.full((D, U, R), -1, np.int32)
    kinds, prompt_logprobs = np.zeros(U, np.int32), np.zeros(U, np.int32)
    slots: dict[RowRef, tuple[int, int, int]] = {}
    starts: dict[RowRef, int] = {}
    sampled_rows = {DECODE: {}, PREFILL: {}}  # (d, u, row) -> RowRef, per kind
    num_busy = 0
    for u, unit in enumerate(units):
        kinds[u] = unit.kind
        batches = prefill if unit.kind == PREFILL else decode
        for d, rows in enumerate(unit.rows):
            num_busy += bool(rows)
            start = 0
            for r, ref in enumerate(rows):
                batch = plans[ref.round].sub_batches[ref.sub_batch]
                pages = batch.page_table[ref.row]
                if pages.size > M:
                    if pages[M:].any():
                        raise ValueError(f"a row needs {pages.size} pages; pipeline rows hold {M}")
                    pages = pages[:M]
                batches.put_row(d, u, r, start, batch, ref.row, pages, shape.page_size)
                prompt_logprobs[u] |= batch.targets is not None
                slots[ref], starts[ref] = (d, u, r), start
                sampled_rows[unit.kind][(d, u, r)] = ref
                start += int(batch.num_new[ref.row])
                if ref in source_of:
                    v, row = sampled_at[source_of[ref]]
                    decode_source[d, u, r] = v * shape.sample_slots + row
    return PipelineSchedule(
        shape=shape, plans=tuple(plans), kinds=kinds, prompt_logprobs=prompt_logprobs,
        num_units=len(units), decode=decode,
        prefill=prefill, decode_source=decode_source,
        decode_sampling=_gather_sampling(plans, sampled_rows[DECODE], (D, U, R)),
        prefill_sampling=_gather_sampling(plans, sampled_rows[PREFILL],
                                          (D, U, shape.prefill_rows)),
        slots=slots, starts=starts, num_busy=num_busy)


def _gather_sampling(plans: Sequence[StepPlan], rows: dict[tuple[int, int, int], RowRef],
                     grid: tuple[int, int, int]) -> SamplingArrays:
    """Every plan row's sampling parameters at its slot of `grid`, flattened row-major; empty
    slots greedy and neutral. 2-D columns are as wide as the widest source sub-batch's."""
    picks, slots = [], []
    for (d, u, r), ref in rows.items():
        picks.append((plans[ref.round].sampling[ref.sub_batch], ref.row))
        slots.append((d * grid[1] + u) * grid[2] + r)
    return scatter_rows(picks, slots, int(np.prod(grid)))


@dataclasses.dataclass(frozen=True)
class UnitOutputs:
    """What a call's last stage returned, on the host, per (replica, unit, slot)."""

    tokens: np.ndarray  # [D, U, O]
    logprobs: np.ndarray  # [D, U, O]
    top_ids: np.ndarray  # [D, U, O, K]
    top_logprobs: np.ndarray  # [D, U, O, K]
    prompt_logprobs: np.ndarray | None = None  # [D, U, T] per token slot of a PREFILL unit
    prompt_top_ids: np.ndarray | None = None  # [D, U, T, K]
    prompt_top_logprobs: np.ndarray | None = None  # [D, U, T, K]


def unit_results(schedule: PipelineSchedule, out: UnitOutputs) -> list[list[SampledRows]]:
    """Per round, per sub-batch of its plan, each row's sampled token (and its prompt logprobs
    when the sub-batch asked for them), gathered from the call's per-slot outputs."""
    return [[_sub_batch_rows(schedule, out, k, i, batch)
             for i, batch in enumerate(plan.sub_batches)] for k, plan in enumerate(schedule.plans)]


def _sub_batch_rows(schedule: PipelineSchedule, out: UnitOutputs, k: int, i: int,
                    batch: SubBatchPlan) -> SampledRows:
    n, width, K = batch.num_rows, batch.tokens.shape[1], out.top_ids.shape[-1]
    got = dict(tokens=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32),
               top_ids=np.zeros((n, K), np.int32), top_logprobs=np.zeros((n, K), np.float32))
    prompt = batch.targets is not None and out.prompt_logprobs is not None
    if prompt:
        got |= dict(prompt_logprobs=np.zeros((n, width), np.float32),
                    prompt_top_ids=np.zeros((n, width, K), np.int32),
                    prompt_top_logprobs=np.zeros((n, width, K), np.float32))
    for j in range(n):
        slot = schedule.slots.get(RowRef(k, i, j))
        if slot is None:
            continue
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            got[name][j] = getattr(out, name)[slot]
        if prompt:
            d, u, _ = slot
            start, count = schedule.starts[RowRef(k, i, j)], int(batch.num_new[j])
            for name in ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs"):
                got[name][j, :count] = getattr(out, name)[d, u, start:start + count]
    return SampledRows(**got)
