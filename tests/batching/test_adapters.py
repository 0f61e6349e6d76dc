"""LoRA adapters on the host: slots pinned by running requests and given out least recently used
first, requests that wait for a slot, the loads each plan lists, and prefix-cache keys per
adapter."""

import pytest

from meshserve.batching.adapters import AdapterSlots, LoRARequest
from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.prefix_cache import ROOT_HASH, root_key
from meshserve.batching.request import Request
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler
from meshserve.batching.speculative import SpeculativeConfig, Speculator
from tests.batching.fake import FakeRunner, reference_outputs


def _scheduler(**overrides) -> Scheduler:
    values = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=256, bound_padded_prefill=False, max_loras=1)
    return Scheduler(SchedulerConfig(**(values | overrides)))


def _request(rid: str, adapter_id: int, prompt=(3, 4, 5, 6, 7, 8), max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   adapter_id=adapter_id)


def _step(scheduler: Scheduler, runner: FakeRunner):
    plan = scheduler.schedule()
    scheduler.update(plan, runner.run(plan))
    scheduler.adapter_slots.check()
    return plan


def test_slots_are_pinned_while_used_and_reused_least_recently_used_first():
    slots = AdapterSlots(2)
    assert slots.acquire(7) == 1 and slots.acquire(8) == 2 and slots.acquire(7) == 1
    assert slots.take_loads() == ((1, 7), (2, 8))
    assert not slots.can_acquire(9)  # both pinned
    slots.release(2)
    assert slots.can_acquire(9) and slots.acquire(9) == 2  # 8 evicted
    assert slots.slot_of(8) is None and slots.take_loads() == ((2, 9),)
    slots.release(1)
    slots.release(1)
    slots.release(2)
    assert slots.acquire(8) == 1  # slot 1 was unpinned before slot 2: the older goes first
    assert slots.acquire(9) == 2 and slots.take_loads() == ((1, 8),)  # 9 still resident
    assert (slots.num_resident, slots.num_evictions) == (2, 2)  # 8 out, then 7 out
    slots.check()
    slots.release(1)
    slots.release(2)
    slots.forget()  # another engine wrote the slots: 9 must be loaded again
    assert slots.acquire(9) in (1, 2) and len(slots.take_loads()) == 1
    slots.check()


def test_releases_held_keep_their_slots_until_the_block_ends():
    """A pipeline call's rounds are planned before it runs: a slot let go of in one round keeps
    its adapter (no other adapter can take it) until the call's results are back."""
    slots = AdapterSlots(1)
    assert slots.acquire(7) == 1
    with slots.releases_held():
        slots.release(1)  # its request ended in round k; rows of rounds <= k still read slot 1
        assert not slots.can_acquire(8)  # a later round of the call cannot evict 7
        assert slots.acquire(7) == 1  # 7 itself may run on in its own slot
        slots.release(1)
        slots.check()
    assert slots.can_acquire(8) and slots.acquire(8) == 1
    assert slots.take_loads() == ((1, 7), (1, 8)) and slots.num_evictions == 1
    slots.check()


@pytest.mark.parametrize("fields, message", [
    (("", 1, "/a"), "lora_name"), (("x", 0, "/a"), "lora_int_id"),
    (("x", True, "/a"), "lora_int_id"), (("x", 1, ""), "lora_path")])
def test_lora_request_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


def test_a_request_waits_for_a_slot_while_others_go_on():
    """One slot: the second adapter's request waits until the first adapter's request ends,
    a base request behind it runs at once, and each step's plan lists its loads."""
    scheduler = _scheduler()
    runner = FakeRunner(num_pages=64, page_size=4)
    first, second, base = _request("a", 1), _request("b", 2), _request("c", 0)
    for request in (first, second, base):
        scheduler.add(request)
    plan = _step(scheduler, runner)
    assert plan.adapter_loads == ((1, 1),)
    assert {r.request_id for r in scheduler.running} == {"a", "c"}
    assert first.adapter_slot == 1 and base.adapter_slot == 0 and second.adapter_slot == 0
    slots = {rid: int(s) for batch, ids in zip(plan.sub_batches, plan.row_requests)
             for rid, s in zip(ids, batch.adapter_slots)}
    assert slots == {"a": 1, "c": 0}
    loads = []
    while scheduler.has_unfinished():
        loads += _step(scheduler, runner).adapter_loads
    assert loads == [(1, 2)]  # once "a" finished, slot 1 went to adapter 2
    for request in (first, second, base):  # the fake model ignores adapters
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 4)


def test_preemption_lets_the_slot_go_and_readmission_takes_it_back():
    scheduler = _scheduler(num_pages=5, max_loras=2, kv_watermark=0.0)  # 4 pages of 4 tokens
    runner = FakeRunner(num_pages=5, page_size=4)
    old, new = _request("old", 1, max_tokens=8), _request("new", 2, max_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    loads = []
    while scheduler.has_unfinished():
        loads += _step(scheduler, runner).adapter_loads
    assert scheduler.num_preemptions > 0
    assert sorted(loads) == [(1, 1), (2, 2)]  # both stayed resident: nothing reloaded
    for request in (old, new):
        assert request.adapter_id in (1, 2) and request.adapter_slot == 0
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 8)


def test_prefix_cache_keys_start_from_the_adapter():
    assert root_key(0) == ROOT_HASH and root_key(1) != root_key(2) != ROOT_HASH
    prompt = list(range(3, 12))
    keys = {a: _request(str(a), a, prompt).keys_of_pages(2, 4) for a in (0, 1, 2)}
    assert len({k for ks in keys.values() for k in ks}) == 6  # no page key shared
    scheduler = _scheduler(max_loras=2)
    runner = FakeRunner(num_pages=64, page_size=4)
    for rid, adapter in (("a", 1), ("b", 2), ("c", 1)):
        request = _request(rid, adapter, prompt)
        scheduler.add(request)
        while scheduler.has_unfinished():
            _step(scheduler, runner)
        assert request.num_cached_tokens == (8 if rid == "c" else 0), rid


def test_an_adapter_needs_slots():
    scheduler = _scheduler(max_loras=0)
    with pytest.raises(ValueError, match="max_loras is 0"):
        scheduler.add(_request("a", 1))
    with pytest.raises(ValueError, match="max_loras"):
        _scheduler(max_loras=-1)


class _Repeat:
    def propose(self, requests, max_drafts):
        return [[7] * k for k in max_drafts]


def test_draft_rows_run_with_their_requests_adapter():
    scheduler = _scheduler(max_num_seqs=8, token_buckets=(8,), prefill_chunk=8,
                           step_buckets=(1, 2, 4, 8, 16, 32))
    runner = FakeRunner(num_pages=64, page_size=4)
    scheduler.add(_request("a", 3, max_tokens=20))
    while not scheduler.get("a").output_token_ids:
        _step(scheduler, runner)
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                            proposer=_Repeat())
    speculation = speculator.expand(scheduler.schedule(), scheduler)
    assert [b.adapter_slots.tolist() for b in speculation.plan.sub_batches] == [[1], [1, 1, 1]]
