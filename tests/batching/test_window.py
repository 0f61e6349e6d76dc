"""Pages behind a sliding window go back to the pool.

With `attention_window` W (a model whose every layer slides), a request's pages wholly behind
the window of its next token are freed after each step. The fake runner reads only each row's
last W tokens, through its page table, and freed pages are poisoned: a page freed while still
inside a window, or handed to another request and written over, changes an output or fails the
runner's read. So "every output equals the windowed rule run alone" checks the release.
"""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import DUMMY_PAGE
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import FakeRunner, drive, make_request, reference_outputs

WINDOW, PAGE_SIZE = 6, 4


def _scheduler(**overrides) -> Scheduler:
    values = dict(num_pages=64, page_size=PAGE_SIZE, max_num_seqs=4, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=256, bound_padded_prefill=False,
                  attention_window=WINDOW)
    return Scheduler(SchedulerConfig(**(values | overrides)))


def _runner(s: Scheduler) -> FakeRunner:
    return FakeRunner(num_pages=s.config.num_pages, page_size=PAGE_SIZE, window=WINDOW)


def test_a_request_holds_only_the_pages_its_window_still_reads():
    s = _scheduler()
    runner = _runner(s)
    s.add(request := make_request("a", 10, max_tokens=30, ignore_eos=True))
    held = []

    def check(plan):
        if request.is_finished:
            return
        first_key = max(request.num_computed_tokens - WINDOW + 1, 0)
        released = first_key // PAGE_SIZE
        assert request.num_released_pages == released
        assert request.pages[:released] == [DUMMY_PAGE] * released
        assert DUMMY_PAGE not in request.pages[released:]
        held.append(s.kv_usage().num_used_pages)

    drive(s, runner, on_step=check)
    assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 30, WINDOW)
    # 39 tokens in the cache would take 10 pages. Between steps the 5 keys the next token sees
    # span 2 pages; within a step, with the page it writes, 3.
    assert max(held) == 2 and s.kv_usage().num_peak_used_pages == 3
    assert s.num_window_freed_pages == (39 - WINDOW + 1) // PAGE_SIZE
    assert s.allocator.num_used == 0 and s.allocator.num_free + s.allocator.num_cached == 63


def _workload(seed: int) -> list:
    """24 requests, half of them with one of two shared 12-token prefixes (three full pages),
    20-40 outputs each."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(24):
        request = make_request(f"r{i}", int(rng.integers(3, 30)), first=int(rng.integers(97)),
                               max_tokens=int(rng.integers(20, 41)), ignore_eos=True)
        if i % 2:
            request.prompt_token_ids = [7 + i % 4 // 2] * 12 + request.prompt_token_ids
        requests.append(request)
    return requests


def _serve(seed: int, **overrides) -> tuple[Scheduler, dict]:
    s = _scheduler(num_pages=40, **overrides)
    requests = _workload(seed)
    for request in requests:
        s.add(request)
    drive(s, _runner(s))
    return s, {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_crowded_prefix_cached_workload_gets_each_request_its_own_outputs(seed):
    """39 usable pages for 24 requests of up to 71 tokens (18 pages each without the window):
    pages freed behind the window are reused at once, shared prefix pages are found in the
    cache, and requests are preempted; every output is still the rule's, alone."""
    s, outputs = _serve(seed)
    for request in _workload(seed):
        assert outputs[request.request_id] == reference_outputs(
            request.prompt_token_ids, request.params.max_tokens, WINDOW)
    assert s.num_window_freed_pages > 100 and s.num_cached_tokens > 0
    assert s.allocator.num_used == 0


def test_freeing_behind_the_window_cuts_peak_pages_and_preemptions():
    windowed, want = _serve(0)
    kept, got = _serve(0, attention_window=0)  # the same model, its pages all kept
    assert got == want
    assert kept.num_window_freed_pages == 0
    assert windowed.kv_usage().num_peak_used_pages < kept.kv_usage().num_peak_used_pages
    assert windowed.num_preemptions < kept.num_preemptions


def test_kv_usage_counts_only_the_pages_still_held():
    s = _scheduler()
    runner = _runner(s)
    s.add(make_request("a", 21, max_tokens=4, ignore_eos=True))
    plan = s.schedule()
    s.update(plan, runner.run(plan))  # 16 of 21 prompt tokens: keys from 11 on still read
    usage = s.kv_usage()
    assert s.num_window_freed_pages == 2  # pages 0 and 1 (positions 0-7)
    assert (usage.num_used_pages, usage.num_allocated_slots) == (2, 8)
    assert usage.num_filled_slots == 8 and usage.fragmentation == 0.0


@pytest.mark.parametrize("value", [-1, 2.5, None])
def test_attention_window_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="attention_window must be an int >= 0"):
        _scheduler(attention_window=value)
