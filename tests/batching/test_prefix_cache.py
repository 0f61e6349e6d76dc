"""Prefix caching: chained keys, LRU eviction, sharing between requests, and what it saves.

The fake runner keeps cached pages' KV and poisons free ones, so a hit on the wrong page, or on a
page that was evicted and overwritten, changes the outputs that every test compares with the
arithmetic rule run alone.
"""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import PageAllocator
from meshserve.batching.prefix_cache import ROOT_HASH, page_hash
from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import FakeRunner, drive, reference_outputs


def _scheduler(**overrides) -> Scheduler:
    values = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=256, bound_padded_prefill=False)
    return Scheduler(SchedulerConfig(**(values | overrides)))


def _runner(s: Scheduler) -> FakeRunner:
    c = s.config
    return FakeRunner(num_pages=c.num_pages, page_size=c.page_size, num_replicas=c.num_replicas)


def _request(rid: str, prompt, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(**({"ignore_eos": True} | params)),
                   arrival_time=0.0)


def _shared_prompt_requests(num: int, *, system_len: int, tail_len: int, max_tokens: int = 6,
                            rng_seed: int = 0) -> list[Request]:
    """`num` requests with one system prompt of `system_len` tokens, then their own tail."""
    rng = np.random.default_rng(rng_seed)
    system = rng.integers(0, 97, system_len).tolist()
    return [_request(f"r{i}", system + rng.integers(0, 97, tail_len).tolist(),
                     max_tokens=max_tokens) for i in range(num)]


def _assert_reference(requests) -> None:
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens), (
            r.request_id)
        assert r.is_finished and r.pages == []


def _run_alone_then_rest(s: Scheduler, runner: FakeRunner, requests) -> None:
    s.add(requests[0])
    drive(s, runner)
    for r in requests[1:]:
        s.add(r)
    drive(s, runner)


# Keys and the allocator.

def test_keys_chain_so_equal_pages_after_different_prefixes_differ():
    page = [5, 6, 7, 8]
    a = page_hash(page_hash(ROOT_HASH, [1, 2, 3, 4]), page)
    b = page_hash(page_hash(ROOT_HASH, [1, 2, 3, 9]), page)
    assert a != b and page_hash(ROOT_HASH, page) not in (a, b)
    assert a == page_hash(page_hash(ROOT_HASH, [1, 2, 3, 4]), page)
    r1, r2 = _request("x", [1, 2, 3, 4] + page + [0]), _request("y", [1, 2, 3, 9] + page + [0])
    assert r1.keys_of_pages(2, 4)[1] == a and r2.keys_of_pages(2, 4)[1] == b
    assert r1.keys_of_pages(5, 4) == r1.keys_of_pages(2, 4)  # only full pages have keys


def test_a_page_holding_an_unknown_token_gets_no_key():
    r = _request("x", [1, 2, 3, 4, 5, 6])
    r.output_token_ids += [-1, 7]  # an output the host does not know yet
    assert len(r.keys_of_pages(2, 4)) == 1
    r.output_token_ids[0] = 9
    assert len(r.keys_of_pages(2, 4)) == 2


def test_same_page_tokens_after_different_prefixes_do_not_share():
    s = _scheduler()
    runner = _runner(s)
    tail = [11, 12, 13, 14, 15, 16, 17, 18]
    a, b = _request("a", [1, 2, 3, 4] + tail + [1]), _request("b", [9, 9, 9, 9] + tail + [1])
    _run_alone_then_rest(s, runner, [a, b])
    assert b.num_cached_tokens == 0
    _assert_reference([a, b])


def test_cached_pages_are_evicted_least_recently_released_first():
    allocator = PageAllocator(5)
    pages = allocator.allocate(4)
    for i, page in enumerate(pages):
        allocator.register(page, bytes([i]))
    allocator.free([pages[2], pages[0]])
    allocator.free([pages[3], pages[1]])
    assert allocator.num_cached == 4 and allocator.num_free == 0 and allocator.num_used == 0
    allocator.share([pages[0]])  # a hit takes it out of the LRU order
    allocator.free([pages[0]])  # and releasing it makes it the most recent
    assert allocator.allocate(2) == [pages[2], pages[3]]
    assert allocator.lookup([bytes([0])]) == [pages[0]] and allocator.lookup([bytes([2])]) == []
    assert allocator.num_evictions == 2
    allocator.check()


def test_free_pages_are_used_before_cached_ones():
    allocator = PageAllocator(4)
    first, second = allocator.allocate(2)
    allocator.register(first, b"k")
    allocator.free([first, second])
    assert allocator.allocate(1) == [3] and allocator.allocate(1) == [second]
    assert allocator.lookup([b"k"]) == [first] and allocator.num_available == 1
    allocator.check()


def test_a_key_registered_twice_keeps_its_first_page():
    allocator = PageAllocator(4)
    a, b = allocator.allocate(2)
    allocator.register(a, b"k")
    allocator.register(b, b"k")
    allocator.free([a, b])
    assert allocator.num_cached == 1 and allocator.num_free == 2 and allocator.lookup([b"k"]) == [a]
    allocator.check()


# Sharing and what it saves.

def test_a_shared_system_prompt_is_computed_once():
    """8 requests: a 32-token system prompt (8 pages of 4) and 5 tokens of their own. The first
    runs alone; each of the other 7 finds the 8 system pages cached."""
    s = _scheduler()
    runner = _runner(s)
    requests = _shared_prompt_requests(8, system_len=32, tail_len=5)
    plans = []
    s.add(requests[0])
    plans += drive(s, runner)
    for r in requests[1:]:
        s.add(r)
    plans += drive(s, runner)
    prefill = sum(int(n) for p in plans for b in p.sub_batches for n in b.num_new if n > 1)
    assert [r.num_cached_tokens for r in requests] == [0] + [32] * 7
    assert s.num_cached_tokens == 7 * 32
    assert prefill == 37 + 7 * 5  # every prompt token computed once, bar the shared ones
    _assert_reference(requests)


def test_outputs_and_prefill_with_and_without_the_cache():
    def run(enable):
        s = _scheduler(enable_prefix_caching=enable, max_num_seqs=3)
        requests = _shared_prompt_requests(12, system_len=24, tail_len=7, max_tokens=9)
        for r in requests:
            s.add(r)
        plans = drive(s, _runner(s))
        return s, requests, sum(b.num_tokens for p in plans for b in p.sub_batches)

    cold, cold_requests, cold_tokens = run(False)
    warm, warm_requests, warm_tokens = run(True)
    assert [r.output_token_ids for r in cold_requests] == [r.output_token_ids
                                                           for r in warm_requests]
    _assert_reference(warm_requests)
    assert cold.num_cached_tokens == 0 and cold.allocator.num_cached == 0
    assert cold_tokens - warm_tokens == warm.num_cached_tokens > 0


def test_the_hit_leaves_the_last_token_to_compute():
    s = _scheduler()
    runner = _runner(s)
    prompt = list(range(1, 9))  # exactly two pages
    a, b = _request("a", prompt, max_tokens=3), _request("b", prompt, max_tokens=3)
    _run_alone_then_rest(s, runner, [a, b])
    assert b.num_cached_tokens == 4  # not 8: the prompt's last token must run to sample
    _assert_reference([a, b])


def test_pages_filled_by_decode_are_cached_too():
    s = _scheduler()
    runner = _runner(s)
    a = _request("a", [3, 1, 4, 1, 5], max_tokens=8)  # 12 tokens held: 3 full pages
    s.add(a)
    drive(s, runner)
    b = _request("b", a.prompt_token_ids + a.output_token_ids[:6], max_tokens=2)
    s.add(b)
    drive(s, runner)
    assert b.num_cached_tokens == 8
    _assert_reference([a, b])


def test_prompt_logprobs_skip_the_cache():
    s = _scheduler()
    runner = _runner(s)
    prompt = list(range(1, 14))
    _run_alone_then_rest(s, runner, [_request("a", prompt, max_tokens=2),
                                     b := _request("b", prompt, max_tokens=2, prompt_logprobs=1)])
    assert b.num_cached_tokens == 0 and s.num_cached_tokens == 0


def test_static_batching_never_caches():
    s = _scheduler(policy="static")
    requests = _shared_prompt_requests(6, system_len=16, tail_len=3)
    _run_alone_then_rest(s, _runner(s), requests)
    assert s.num_cached_tokens == 0 and s.allocator.num_cached == 0
    _assert_reference(requests)


# Pressure, preemption and abort.

@pytest.mark.parametrize("seed", range(4))
def test_eviction_under_pressure_keeps_the_invariant_and_the_outputs(seed):
    """A cache much smaller than the prompts' pages: hits, evictions and preemptions all happen,
    `check()` runs after every step (in `drive`) and kv_usage adds up."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 97, 12).tolist() for _ in range(3)]
    requests = [_request(f"r{i}", systems[i % 3] + rng.integers(0, 97, int(rng.integers(1, 9)))
                         .tolist(), max_tokens=int(rng.integers(1, 16))) for i in range(24)]
    s = _scheduler(num_pages=19, max_num_seqs=4)
    for r in requests:
        s.add(r)

    def check(plan):
        usage = s.kv_usage()
        assert (usage.num_free_pages + usage.num_used_pages + usage.num_cached_pages
                == usage.num_total_pages == 18)

    drive(s, _runner(s), on_step=check)
    assert s.num_cached_tokens > 0 and s.allocator.num_evictions > 0
    _assert_reference(requests)


def test_preempting_a_request_keeps_the_pages_it_shares():
    """a and b share a 4-page system prompt in a cache of 7 pages; when a grows, b (newer) is
    preempted: the shared pages stay with a, and b finds them again on readmission."""
    s = _scheduler(num_pages=8, max_num_seqs=2, kv_watermark=0)
    runner = _runner(s)
    system = list(range(1, 17))
    a = _request("a", system + [40], max_tokens=12)
    b = _request("b", system + [50], max_tokens=12)
    s.add(a)
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    s.add(b)
    shared = a.pages[:4]
    checked = []

    def on_step(plan):
        if b.num_preemptions and not checked:
            assert b.pages == [] and all(s.allocator.ref_count(p) == 1 for p in shared)
            checked.append(True)

    drive(s, runner, on_step=on_step)
    assert b.num_preemptions > 0 and checked and a.num_preemptions == 0
    assert b.num_cached_tokens == 16 and s.num_cached_tokens > 16  # its readmission hit too
    _assert_reference([a, b])


def test_abort_releases_shared_pages_to_the_cache():
    s = _scheduler()
    runner = _runner(s)
    system = list(range(1, 17))  # 4 pages
    a, b = _request("a", system + [1], max_tokens=20), _request("b", system + [2], max_tokens=20)
    s.add(a)
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    s.add(b)
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    shared = a.pages[:4]
    assert b.pages[:4] == shared and all(s.allocator.ref_count(p) == 2 for p in shared)
    s.abort("a")
    assert all(s.allocator.ref_count(p) == 1 for p in shared)
    s.abort("b")
    assert s.allocator.num_used == 0 and s.allocator.num_cached == 4
    s.allocator.check()
    c = _request("c", system + [3], max_tokens=2)
    s.add(c)
    drive(s, runner)
    assert c.num_cached_tokens == 16 and c.status is RequestStatus.FINISHED_LENGTH
    _assert_reference([c])


def test_placement_prefers_the_replica_with_the_longest_hit():
    s = _scheduler(num_replicas=2)
    runner = _runner(s)
    system = list(range(1, 25))
    a = _request("a", system + [1], max_tokens=2)
    s.add(a)
    drive(s, runner)
    s.add(filler := _request("f", [7] * 40, max_tokens=30))
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    assert a.replica == filler.replica == 0 and s.replica_load(0) > s.replica_load(1)
    b = _request("b", system + [2], max_tokens=2)
    s.add(b)
    drive(s, runner)
    assert b.replica == a.replica and b.num_cached_tokens == 24
    _assert_reference([a, b, filler])
