"""The pipeline schedule, driven by the real scheduler and checked by a fake pipeline.

`FakePipeline` runs a schedule's units in order with the fake KV cache of `tests.batching.fake`
(the arithmetic next-token rule over each row's whole context). A decode row whose input is a
placeholder reads the token its source unit sampled, and the fake asserts the source is at least
S units older (it has left the last stage). With placeholders resolved after each call, every
request must produce exactly what the rule gives it alone: that checks the layout, the feedback
sources, the slot mapping and the host's planning ahead in one go.
"""

import dataclasses

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pipeline_schedule import (DECODE, IDLE, PLACEHOLDER, PREFILL, RowRef,
                                                  UnitOutputs, UnitShape, build_schedule,
                                                  unit_results)
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import EMPTY, make_request, next_token, random_requests, reference_outputs


class FakePipeline:
    def __init__(self, *, num_pages: int, page_size: int, num_replicas: int = 1):
        self.page_size = page_size
        self.kv = np.full((num_replicas, num_pages, page_size), EMPTY, np.int64)

    def run(self, s) -> np.ndarray:
        """Tokens sampled per slot [D, U, O]: each unit's rows, in the unit's ragged layout."""
        D, U, R = s.decode_source.shape
        O, stages = s.shape.sample_slots, s.shape.num_stages
        out = np.zeros((D, U, O), np.int64)
        for u in range(s.num_units):
            for d in range(D):
                if s.kinds[u] == IDLE:
                    continue
                batches = s.prefill if s.kinds[u] == PREFILL else s.decode
                for r in np.flatnonzero(batches.num_new[d, u]):
                    n, last = batches.num_new[d, u, r], batches.last[d, u, r]
                    span = slice(last - n + 1, last + 1)
                    assert (batches.token_seq[d, u, span] == r).all()
                    assert batches.is_real[d, u, span].all()
                    tokens = batches.tokens[d, u, span].copy()
                    if s.kinds[u] == DECODE and s.decode_source[d, u, r] >= 0:
                        source = s.decode_source[d, u, r]
                        assert tokens[0] == PLACEHOLDER
                        assert source // O + stages <= u, "a fed-back token read too early"
                        tokens[0] = out[d, source // O, source % O]
                    assert PLACEHOLDER not in tokens, "a placeholder without a source"
                    out[d, u, r] = self._row(d, tokens, batches.positions[d, u, span],
                                             batches.write_slots[d, u, span],
                                             batches.page_table[d, u, r], batches.kv_lens[d, u, r])
                assert batches.is_real[d, u].sum() == batches.num_new[d, u].sum()
        return out

    def _row(self, d, tokens, positions, write_slots, pages, kv_len) -> int:
        kv = self.kv[d].reshape(-1)
        for token, position, slot in zip(tokens, positions, write_slots):
            assert slot == pages[position // self.page_size] * self.page_size + (
                position % self.page_size)
            kv[slot] = token
        context = [int(kv[pages[p // self.page_size] * self.page_size + p % self.page_size])
                   for p in range(kv_len)]
        assert EMPTY not in context and 0 not in [pages[p // self.page_size]
                                                  for p in range(kv_len)]
        return next_token(context)


def _shape(config: SchedulerConfig, stages: int, rounds: int, prefill_rows: int = 4) -> UnitShape:
    per_round = config.max_num_seqs + 3 * stages
    return UnitShape(num_stages=stages, num_units=rounds * per_round,
                     decode_rows=-(-config.max_num_seqs // stages),
                     prefill_tokens=config.prefill_chunk, prefill_rows=prefill_rows,
                     max_pages=-(-config.max_model_len // config.page_size),
                     page_size=config.page_size, num_replicas=config.num_replicas)


def _drive(scheduler: Scheduler, requests, *, stages: int, rounds: int, fill: bool):
    """Serves `requests` in pipeline calls of up to `rounds` rounds; returns the schedules."""
    for r in requests:
        scheduler.add(r)
    c = scheduler.config
    shape = _shape(c, stages, rounds)
    fake = FakePipeline(num_pages=c.num_pages, page_size=c.page_size,
                        num_replicas=c.num_replicas)
    schedules = []
    while scheduler.has_unfinished():
        plans = []
        while len(plans) < rounds:
            preemptions = scheduler.num_preemptions
            plan = scheduler.schedule()
            if plan.is_empty:
                break
            plans.append(plan)
            scheduler.update(plan, [np.full(b.num_rows, PLACEHOLDER) for b in plan.sub_batches])
            if scheduler.num_preemptions != preemptions:
                break
        schedule = build_schedule(plans, shape, bubble_filling=fill)
        tokens = fake.run(schedule)
        by_id = {r.request_id: r for r in requests}
        for ref, slot in schedule.slots.items():
            plan = plans[ref.round]
            if plan.row_samples[ref.sub_batch][ref.row]:
                request = by_id[plan.row_requests[ref.sub_batch][ref.row]]
                step = plan.sampling[ref.sub_batch].steps[ref.row]
                request.output_token_ids[step] = int(tokens[slot])
        for allocator in scheduler.allocators:
            allocator.check()
        schedules.append(schedule)
    return schedules


def _config(**overrides) -> SchedulerConfig:
    values = dict(num_pages=96, page_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=96, token_buckets=(16,),
                  bound_padded_prefill=False)  # the engine's chunking under stages
    return SchedulerConfig(**(values | overrides))


@pytest.mark.parametrize("stages,rounds,fill", [(2, 4, True), (3, 3, True), (4, 5, True),
                                                (2, 4, False), (4, 1, False), (3, 6, True)])
@pytest.mark.parametrize("seed", range(3))
def test_every_request_gets_what_it_gets_alone(stages, rounds, fill, seed):
    requests = random_requests(np.random.default_rng(seed), 14, max_prompt=40, max_output=12)
    _drive(Scheduler(_config()), requests, stages=stages, rounds=rounds, fill=fill)
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)


def test_outputs_survive_preemption_inside_a_call():
    requests = random_requests(np.random.default_rng(7), 12, max_prompt=20, max_output=24)
    scheduler = Scheduler(_config(num_pages=20))
    _drive(scheduler, requests, stages=2, rounds=4, fill=True)
    assert scheduler.num_preemptions > 0
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)


def test_data_parallel_replicas_share_the_unit_kinds():
    requests = random_requests(np.random.default_rng(3), 16, max_prompt=30, max_output=10)
    schedules = _drive(Scheduler(_config(num_replicas=2)), requests, stages=2, rounds=3,
                       fill=True)
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)
    both = 0
    for s in schedules:
        for u in range(s.num_units):
            busy = [bool(s.decode.num_new[d, u].any() or s.prefill.num_new[d, u].any())
                    for d in range(2)]
            assert s.kinds[u] != IDLE or not any(busy)  # one kind for both replicas
            both += all(busy)
    assert both > 0


def test_every_plan_row_has_one_slot_and_lanes_are_kept_within_a_call():
    requests = random_requests(np.random.default_rng(5), 10, max_prompt=30, max_output=12)
    for s in _drive(Scheduler(_config()), requests, stages=3, rounds=4, fill=True):
        refs = {RowRef(k, i, j) for k, plan in enumerate(s.plans)
                for i, batch in enumerate(plan.sub_batches) for j in range(batch.num_rows)
                if batch.num_new[j]}
        assert set(s.slots) == refs
        assert len(set(s.slots.values())) == len(refs)
        lanes = {}
        for ref, (_, u, _) in s.slots.items():
            plan = s.plans[ref.round]
            if s.kinds[u] == DECODE:
                lanes.setdefault(plan.row_requests[ref.sub_batch][ref.row], []).append(u)
        for units in lanes.values():  # a request's decode units are a lane's: S apart at least
            assert all(b - a >= s.shape.num_stages for a, b in zip(units, units[1:]))


def test_plain_fill_drain_keeps_the_stages_busy_m_over_m_plus_s_minus_1():
    # 8 requests decoding on 4 stages: 4 lanes of 2 rows, every lane busy in every round.
    stages, rounds = 4, 3
    requests = [make_request(f"r{i}", 4, first=i, max_tokens=30, ignore_eos=True)
                for i in range(8)]
    scheduler = Scheduler(_config(max_num_seqs=8, max_num_batched_tokens=64))
    for r in requests:
        scheduler.add(r)
    plans = []
    for _ in range(2):  # the prompts, and a first decode, run before: their tokens are known
        plan = scheduler.schedule()
        scheduler.update(plan, [np.full(b.num_rows, 5) for b in plan.sub_batches])
    for _ in range(rounds):
        plan = scheduler.schedule()
        assert all(b.tokens.shape[1] == 1 for b in plan.sub_batches)
        plans.append(plan)
        scheduler.update(plan, [np.full(b.num_rows, PLACEHOLDER) for b in plan.sub_batches])
    shape = _shape(scheduler.config, stages, rounds)
    # The first round's tokens came from the host: no feedback needed, like any decode round.
    plain = build_schedule(plans[:1], shape, bubble_filling=False)
    assert plain.stage_utilisation == pytest.approx(4 / (4 + stages - 1))
    assert build_schedule(plans, shape, bubble_filling=False).stage_utilisation == (
        pytest.approx(4 / (4 + stages - 1)))
    filled = build_schedule(plans, shape, bubble_filling=True)
    assert filled.num_units == 4 * rounds
    assert filled.stage_utilisation == pytest.approx(12 / (12 + stages - 1))


def test_idle_lanes_are_filled_with_prefill_chunks():
    # Two requests decode on 4 stages while new prompts arrive: without filling, the two empty
    # lanes of every round idle; with it, prefill chunks take their ticks.
    def utilisation(fill: bool) -> float:
        scheduler = Scheduler(_config(max_num_seqs=8, max_num_batched_tokens=40))
        rng = np.random.default_rng(11)
        first = [make_request(f"d{i}", 3, first=i, max_tokens=40, ignore_eos=True)
                 for i in range(2)]
        later = random_requests(rng, 10, max_prompt=40, max_output=8)
        schedules = _drive(scheduler, first + later, stages=4, rounds=4, fill=fill)
        busy = sum(s.num_busy for s in schedules)
        return busy / sum(s.num_ticks for s in schedules)

    plain, filled = utilisation(False), utilisation(True)
    assert filled > plain + 0.15, (plain, filled)


def test_prefill_chunks_are_packed_first_fit_into_ragged_units():
    scheduler = Scheduler(_config())
    for i, n in enumerate([4, 9, 6, 3, 7, 2]):
        scheduler.add(make_request(f"r{i}", n, max_tokens=3))
    plan = scheduler.schedule()
    s = build_schedule([plan], _shape(scheduler.config, 2, 1, prefill_rows=3))
    # Units of 16 slots and 3 rows, each chunk in the first unit with room: 4 + 9 + 3, then
    # 6 + 7 + 2 (a next fit would close the first unit at 6 and open a third for 2).
    assert s.num_units == 2 and list(s.kinds[:2]) == [PREFILL, PREFILL]
    np.testing.assert_array_equal(s.prefill.num_new[0, :2], [[4, 9, 3], [6, 7, 2]])
    np.testing.assert_array_equal(s.prefill.last[0, :2], [[3, 12, 15], [5, 12, 14]])
    np.testing.assert_array_equal(s.prefill.token_seq[0, 0], [0] * 4 + [1] * 9 + [2] * 3)
    np.testing.assert_array_equal(s.prefill.is_real[0, 1], [1] * 15 + [0])
    assert not s.prefill.write_slots[0, 1, 15:].any()  # padding writes to the dummy page
    assert s.num_busy == 2 and s.prefill.busy_units() == 2 and not s.has_targets


def test_prompt_logprob_rows_go_to_prefill_units_and_come_back_per_token():
    """A one-token piece of a prompt with prompt logprobs is a prefill unit's row, not a decode
    lane's: only prefill units carry targets. Each row's prompt logprobs come back from its own
    token slots."""
    scheduler = Scheduler(_config(max_num_batched_tokens=17))
    a = make_request("a", 16, max_tokens=2, prompt_logprobs=1)
    b = make_request("b", 10, first=5, max_tokens=2, prompt_logprobs=1)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()  # a's 16 tokens, and the one token of b the budget leaves
    shape = dataclasses.replace(_shape(scheduler.config, 2, 1), prefill_tokens=32)
    s = build_schedule([plan], shape)  # one prefill unit: a in slots 0-15, b in slot 16
    assert s.has_targets and s.num_units == 1 and s.kinds[0] == PREFILL
    np.testing.assert_array_equal(s.prefill.num_new[0, 0, :2], [16, 1])
    np.testing.assert_array_equal(s.prefill.targets[0, 0, :17],
                                  a.prompt_token_ids[1:] + [0, b.prompt_token_ids[1]])
    U, O, T, K = s.shape.num_units, s.shape.sample_slots, s.shape.prefill_tokens, 2
    code = np.arange(U * T, dtype=np.float32).reshape(1, U, T)  # unit u, slot t -> u * T + t
    out = UnitOutputs(tokens=np.zeros((1, U, O), np.int32), logprobs=np.zeros((1, U, O)),
                      top_ids=np.zeros((1, U, O, K), np.int32),
                      top_logprobs=np.zeros((1, U, O, K)), prompt_logprobs=code,
                      prompt_top_ids=np.zeros((1, U, T, K), np.int32),
                      prompt_top_logprobs=np.zeros((1, U, T, K)))
    (rows,) = unit_results(s, out)[0]
    by_request = dict(zip(plan.row_requests[0], rows.prompt_logprobs))
    np.testing.assert_array_equal(by_request["a"], np.arange(16))
    assert by_request["b"][0] == 16


def test_a_call_that_does_not_fit_is_refused():
    scheduler = Scheduler(_config())
    for i in range(6):
        scheduler.add(make_request(f"r{i}", 16, max_tokens=5))
    plan = scheduler.schedule()
    shape = UnitShape(num_stages=2, num_units=1, decode_rows=3, prefill_tokens=16,
                      prefill_rows=1, max_pages=24, page_size=4)
    with pytest.raises(ValueError, match="need 2 pipeline units; the call holds 1"):
        build_schedule([plan], shape)
    narrow = UnitShape(num_stages=2, num_units=40, decode_rows=3, prefill_tokens=8,
                       prefill_rows=1, max_pages=24, page_size=4)
    with pytest.raises(ValueError, match="exceeds the pipeline's 8-token units"):
        build_schedule([plan], narrow)
