"""Data-parallel scheduling: placement, per-replica pages and budgets, and preemption per replica.

The fake runner keeps one fake cache per replica, so a row that reads its pages on the wrong
replica, or a page id shared across replicas, changes the output.
"""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import num_pages_for
from meshserve.batching.request import RequestStatus
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import FakeRunner, drive, make_request, random_requests, reference_outputs


def _scheduler(**overrides) -> Scheduler:
    values = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=256, bound_padded_prefill=False,
                  num_replicas=2)
    return Scheduler(SchedulerConfig(**(values | overrides)))


def _runner(s: Scheduler) -> FakeRunner:
    c = s.config
    return FakeRunner(num_pages=c.num_pages, page_size=c.page_size, num_replicas=c.num_replicas)


def _assert_reference(requests) -> None:
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)
        assert r.status is RequestStatus.FINISHED_LENGTH and r.pages == []


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_every_request_gets_its_own_outputs_on_any_replica(policy, replicas):
    s = _scheduler(policy=policy, num_replicas=replicas)
    requests = random_requests(np.random.default_rng(replicas), 20, max_prompt=40, max_output=16)
    for r in requests:
        s.add(r)
    used = set()
    drive(s, _runner(s), on_step=lambda plan: used.update(
        int(x) for b in plan.sub_batches for x in b.replicas))
    _assert_reference(requests)
    assert used == set(range(replicas))
    assert all(a.num_used == 0 for a in s.allocators)


def test_placement_goes_to_the_least_loaded_replica():
    s = _scheduler(max_num_seqs=4)
    long, short = make_request("long", 30, max_tokens=4), make_request("short", 3, max_tokens=4)
    s.add(long)
    s.schedule()  # long goes to replica 0, the lowest index among equals
    assert long.replica == 0
    s.add(short)
    s.add(third := make_request("third", 3, max_tokens=4))
    s.schedule()
    # replica 1 holds nothing, so short goes there; then replica 1 holds 3 tokens against 30
    assert (short.replica, third.replica) == (1, 1)


def test_a_replica_without_pages_is_passed_over():
    """The least loaded replica by tokens can still be the one short of pages (many short
    requests, each holding a part-empty page); placement then goes to the next."""
    s = _scheduler(num_pages=9, page_size=4, max_num_seqs=8)  # 8 usable pages per replica
    s.add(big := make_request("big", 20, max_tokens=8))  # first chunk 16 tokens: 4 pages
    singles = [make_request(f"one{i}", 1, max_tokens=8) for i in range(7)]  # 1 page each
    for r in singles:
        s.add(r)
    s.add(late := make_request("late", 12, max_tokens=8))  # 3 pages
    s.schedule()
    assert big.replica == 0 and {r.replica for r in singles} == {1}
    assert s.replica_load(1) < s.replica_load(0) and s.allocators[1].num_free == 1
    assert late.status is RequestStatus.RUNNING and late.replica == 0


def test_preemption_picks_the_victim_on_the_needy_replica():
    """Replica 0 runs out of pages while the newest request overall runs on replica 1: the victim
    is the newest request on replica 0, since only its pages help."""
    s = _scheduler(num_pages=7, page_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    a, b, c = (make_request("a", 3, max_tokens=8), make_request("b", 4, max_tokens=2),
               make_request("c", 2, max_tokens=8))
    for r in (a, b, c):
        s.add(r)
    runner = _runner(s)
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    assert (a.replica, b.replica, c.replica) == (0, 1, 0)
    s.add(d := make_request("d", 1, max_tokens=6))
    victims = []
    preempt = s.preempt

    def record(victim):
        victims.append((victim.request_id, d.status))
        preempt(victim)

    s.preempt = record
    drive(s, runner)
    assert d.replica == 1
    assert victims[0] == ("c", RequestStatus.RUNNING)
    _assert_reference([a, b, c, d])


def test_kv_usage_per_replica_and_in_total():
    s = _scheduler(num_pages=17)
    for i in range(2):
        s.add(make_request(f"r{i}", 8, max_tokens=2))
    s.schedule()
    per = [s.kv_usage(r) for r in range(2)]
    total = s.kv_usage()
    assert [u.num_used_pages for u in per] == [2, 2]
    assert total.num_used_pages == 4 and total.num_total_pages == 32
    assert total.num_allocated_slots == sum(u.num_allocated_slots for u in per)


def test_num_replicas_is_validated():
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1"):
        _scheduler(num_replicas=0)
