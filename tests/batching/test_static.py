"""The static-batching baseline: same outputs, fixed batches padded to their longest member."""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import num_pages_for
from meshserve.batching.request import RequestStatus
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import FakeRunner, drive, make_request, random_requests, reference_outputs


def _static(**overrides) -> Scheduler:
    values = dict(num_pages=128, page_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  prefill_chunk=16, max_model_len=256, policy="static")
    return Scheduler(SchedulerConfig(**(values | overrides)))


def _runner(s: Scheduler) -> FakeRunner:
    return FakeRunner(num_pages=s.config.num_pages, page_size=s.config.page_size)


def _rows(plan):
    (batch,) = plan.sub_batches
    return list(zip(plan.row_requests[0], batch.num_new.tolist(), plan.row_samples[0].tolist()))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_outputs_equal_each_request_run_alone(seed, policy):
    s = _static(policy=policy)
    requests = random_requests(np.random.default_rng(seed), 11, max_prompt=40, max_output=20)
    for r in requests:
        s.add(r)
    drive(s, _runner(s))
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)


def test_batches_are_fixed_until_all_members_finish():
    s = _static()
    requests = random_requests(np.random.default_rng(7), 10, max_prompt=30, max_output=15)
    for r in requests:
        s.add(r)
    batches, padding_rows = [], []

    def check(plan):
        assert len(plan.sub_batches) == 1
        ids = plan.row_requests[0]
        if not batches or ids != batches[-1]:  # a new batch only once the last one is done
            assert not batches or all(s.get(rid) is None for rid in batches[-1])
            batches.append(ids)
        (batch,) = plan.sub_batches
        pad = batch.num_new == 0
        padding_rows.append(bool(pad.any()))
        assert not batch.kv_lens[pad].any() and not batch.page_table[pad].any()
        assert not plan.row_samples[0][pad].any()

    drive(s, _runner(s), on_step=check)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [rid for b in batches for rid in b] == [f"r{i}" for i in range(10)]  # FCFS, no rejoin
    assert any(padding_rows) and s.num_preemptions == 0


def test_nothing_joins_a_running_batch():
    s = _static(max_num_seqs=2)
    a, b = make_request("a", 4, max_tokens=6), make_request("b", 4, first=3, max_tokens=2)
    s.add(a)
    s.add(b)
    runner = _runner(s)
    plans = [s.schedule()]
    s.update(plans[0], runner.run(plans[0]))
    c = make_request("c", 2, max_tokens=1)
    s.add(c)
    while a.num_computed_tokens < a.max_kv_len:
        plan = s.schedule()
        assert plan.row_requests == (("a", "b"),)
        s.update(plan, runner.run(plan))
        s.allocator.check()
    assert b.is_finished and c.status is RequestStatus.WAITING and a.is_finished
    assert s.schedule().row_requests == (("c",),)


def test_prefill_is_lockstep_and_padded_to_the_longest_prompt():
    s = _static(max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk=16)
    a, b = make_request("a", 40, max_tokens=3), make_request("b", 10, max_tokens=2)
    s.add(a)
    s.add(b)
    runner = _runner(s)
    steps = []
    for _ in range(5):
        plan = s.schedule()
        steps.append((_rows(plan), plan.sub_batches[0].tokens.shape[1]))
        s.update(plan, runner.run(plan))
    assert steps == [
        ([("a", 16, False), ("b", 10, True)], 16),
        ([("a", 16, False), ("b", 0, False)], 16),
        ([("a", 8, True), ("b", 0, False)], 8),
        ([("a", 1, True), ("b", 1, True)], 1),  # b ends here: max_tokens 2
        ([("a", 1, True), ("b", 0, False)], 1),  # b stays as a padding row
    ]
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 2)
    assert a.is_finished and a.output_token_ids == reference_outputs(a.prompt_token_ids, 3)


def test_prefill_chunks_shrink_to_fit_the_token_budget():
    s = _static(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=8, bound_padded_prefill=False)
    for i in range(4):
        s.add(make_request(f"r{i}", 5, max_tokens=1))
    plan = s.schedule()
    assert plan.sub_batches[0].num_new.tolist() == [2, 2, 2, 2]


def test_pages_are_reserved_for_the_whole_request_so_nothing_is_preempted():
    s = _static(num_pages=1 + 20, page_size=4, max_num_seqs=4)
    requests = [make_request(f"r{i}", 12, first=i, max_tokens=21) for i in range(5)]  # 8 pages each
    for r in requests:
        s.add(r)
    plan = s.schedule()
    assert plan.row_requests == (("r0", "r1"),)  # a third would not fit
    assert s.allocator.num_used == 2 * num_pages_for(12 + 21 - 1, 4) == 16
    assert s.kv_usage().num_empty_slots == 16 * 4
    drive(s, _runner(s))
    assert s.num_preemptions == 0
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 21)


def test_an_aborted_member_becomes_padding():
    s = _static(max_num_seqs=2)
    a, b = make_request("a", 6, max_tokens=5), make_request("b", 6, first=4, max_tokens=5)
    s.add(a)
    s.add(b)
    runner = _runner(s)
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    used = s.allocator.num_used
    assert s.abort("a") and s.allocator.num_used == used // 2
    plan = s.schedule()
    assert _rows(plan) == [("a", 0, False), ("b", 1, True)]
    drive(s, runner)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 5)


def test_batch_shrinks_when_a_full_padded_chunk_cannot_fit():
    # Token buckets start at 8, so four rows pad to 32 slots against a budget of 8: one row only.
    s = _static(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=8)
    for i in range(4):
        s.add(make_request(f"r{i}", 5, max_tokens=1))
    plan = s.schedule()
    assert plan.row_requests == (("r0",),)
    assert plan.sub_batches[0].num_new.tolist() == [5]
