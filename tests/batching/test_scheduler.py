"""The continuous scheduler, driven by a fake runner: limits, order, chunking, preemption, stops."""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import num_pages_for
from meshserve.batching.request import RequestStatus
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import (FakeRunner, ScriptedRunner, drive, make_request, random_requests,
                                 reference_outputs)


def _config(**overrides) -> SchedulerConfig:
    values = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  prefill_chunk=16, max_model_len=256, bound_padded_prefill=False)
    return SchedulerConfig(**(values | overrides))


def _runner(scheduler: Scheduler) -> FakeRunner:
    return FakeRunner(num_pages=scheduler.config.num_pages, page_size=scheduler.config.page_size)


def _step(scheduler, runner):
    plan = scheduler.schedule()
    touched = scheduler.update(plan, runner.run(plan))
    scheduler.allocator.check()
    runner.poison_free_pages(scheduler)
    return plan, touched


def _rows(plan):
    """[(request_id, num_new, samples)] per sub-batch."""
    return [list(zip(ids, batch.num_new.tolist(), samples.tolist()))
            for ids, batch, samples in zip(plan.row_requests, plan.sub_batches, plan.row_samples)]


def _assert_reference_outputs(requests):
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens), (
            r.request_id)
        assert r.status is RequestStatus.FINISHED_LENGTH and r.pages == []


# Config and admission checks.

@pytest.mark.parametrize("overrides,message", [
    (dict(num_pages=1), "num_pages must be an int >= 2"),
    (dict(page_size=0), "page_size must be an int >= 1, got 0"),
    (dict(page_size=True), "page_size must be an int >= 1, got True"),
    (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1"),
    (dict(max_model_len=0), "max_model_len must be an int >= 1"),
    (dict(prefill_chunk=0), "prefill_chunk must be an int >= 1"),
    (dict(max_num_batched_tokens=2), r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"),
    (dict(prefill_chunk=64), r"prefill_chunk \(64\) must be <= max_num_batched_tokens \(32\)"),
    (dict(policy="dynamic"), "policy must be one of"),
    (dict(token_buckets=(8,)), r"ending at >= prefill_chunk \(16\)"),
    (dict(token_buckets=(16, 8, 32)), "token_buckets must be increasing"),
    (dict(token_buckets=()), "token_buckets must be increasing"),
    (dict(eos_token_ids=(-1,)), "eos_token_ids must be non-negative ints"),
])
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_config_defaults_and_normalisation():
    c = SchedulerConfig(num_pages=8, page_size=16, max_model_len=1024)
    assert c.token_buckets == (8, 16, 32, 64, 128, 256) and c.policy == "continuous"
    assert _config(prefill_chunk=8).token_buckets == (8,)
    assert _config(token_buckets=[4, 16], eos_token_ids=[2]).token_buckets == (4, 16)
    assert _config(eos_token_ids=[2]).eos_token_ids == (2,)


def test_add_rejects_requests_that_can_never_run():
    s = Scheduler(_config(num_pages=5, max_model_len=100))  # 4 usable pages of 4 tokens
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(make_request("a", 0))
    with pytest.raises(ValueError, match=r"prompt \(90 tokens\) \+ max_tokens \(16\) = 106 exceeds "
                                         r"max_model_len \(100\)"):
        s.add(make_request("b", 90))
    with pytest.raises(ValueError, match="needs 6 KV pages of 4 tokens, but the cache has 4"):
        s.add(make_request("c", 20, max_tokens=2))
    s.add(make_request("d", 16, max_tokens=1))  # exactly the whole cache
    with pytest.raises(ValueError, match="already in use"):
        s.add(make_request("d", 1))
    assert s.num_waiting == 1


# Results: continuous batching must not change any output.

@pytest.mark.parametrize("seed,overrides", [
    (0, {}),
    (1, dict(num_pages=400, page_size=1, prefill_chunk=8, max_num_batched_tokens=12)),
    (2, dict(num_pages=200, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=64)),
    (3, dict(page_size=16, max_num_seqs=1, max_num_batched_tokens=16)),
])
def test_outputs_equal_each_request_run_alone(seed, overrides):
    s = Scheduler(_config(**overrides))
    requests = random_requests(np.random.default_rng(seed), 12, max_prompt=40, max_output=20)
    for r in requests:
        s.add(r)
    drive(s, _runner(s))
    _assert_reference_outputs(requests)
    assert s.num_preemptions == 0 and s.allocator.num_used == 0


@pytest.mark.parametrize("seed,overrides", [
    (0, dict(num_pages=13)),
    (1, dict(num_pages=9, page_size=2, max_num_seqs=6, max_num_batched_tokens=24)),
    (2, dict(num_pages=7, page_size=8, prefill_chunk=8, max_num_batched_tokens=8)),
])
def test_outputs_survive_preemption(seed, overrides):
    s = Scheduler(_config(**overrides))
    requests = random_requests(np.random.default_rng(seed), 16, max_prompt=20, max_output=24)
    requests = [r for r in requests
                if num_pages_for(r.max_kv_len, s.config.page_size) < s.allocator.num_total]
    for r in requests:
        s.add(r)
    drive(s, _runner(s))
    assert s.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == s.num_preemptions
    _assert_reference_outputs(requests)


@pytest.mark.parametrize("seed", range(20))
def test_random_configs_always_drain(seed):
    rng = np.random.default_rng(100 + seed)
    page_size = int(rng.choice([1, 2, 4, 16]))
    max_num_seqs = int(rng.integers(1, 9))
    prefill_chunk = int(rng.integers(1, 40))
    budget = max(prefill_chunk, max_num_seqs) + int(rng.integers(0, 20))
    s = Scheduler(_config(num_pages=int(rng.integers(12, 80)) // page_size + 2, page_size=page_size,
                          max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
                          max_num_batched_tokens=budget, max_model_len=10_000))
    requests = []
    for r in random_requests(rng, int(rng.integers(1, 25)), max_prompt=30, max_output=30):
        if num_pages_for(r.max_kv_len, page_size) <= s.allocator.num_total:
            s.add(r)
            requests.append(r)
    drive(s, _runner(s), max_steps=5_000)
    _assert_reference_outputs(requests)


# Order, limits, chunking.

def test_budget_and_seat_limits_hold_every_step():
    s = Scheduler(_config(max_num_seqs=3, max_num_batched_tokens=10, prefill_chunk=7))
    for r in random_requests(np.random.default_rng(5), 10, max_prompt=30, max_output=10):
        s.add(r)
    seen = []
    drive(s, _runner(s), on_step=lambda plan: seen.append(
        (plan.num_tokens, sum(b.num_rows for b in plan.sub_batches))))
    assert max(t for t, _ in seen) == 10 and all(t <= 10 for t, _ in seen)
    assert max(n for _, n in seen) == 3 and all(n <= 3 for _, n in seen)


def test_admission_is_first_come_first_served():
    s = Scheduler(_config(max_num_seqs=2))
    for i in range(5):
        s.add(make_request(f"r{i}", 6, max_tokens=3 + i))
    first_step = {}
    plans = drive(s, _runner(s))
    for step, plan in enumerate(plans):
        for ids in plan.row_requests:
            for rid in ids:
                first_step.setdefault(rid, step)
    order = sorted(first_step, key=first_step.get)
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert first_step["r0"] == first_step["r1"] == 0 and first_step["r2"] > 0


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    s = Scheduler(_config(prefill_chunk=16, max_num_batched_tokens=32))
    r = make_request("a", 40, max_tokens=2)
    s.add(r)
    runner = _runner(s)
    chunks = []
    for _ in range(3):
        plan, touched = _step(s, runner)
        (batch,) = plan.sub_batches
        chunks.append((_rows(plan), batch.positions[0, 0], touched == [r]))
    assert chunks == [([[("a", 16, False)]], 0, False), ([[("a", 16, False)]], 16, False),
                      ([[("a", 8, True)]], 32, True)]
    assert r.num_computed_tokens == 40 and len(r.output_token_ids) == 1
    plan, _ = _step(s, runner)
    assert _rows(plan) == [[("a", 1, True)]] and r.is_finished
    assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 2)


def test_decode_proceeds_while_another_request_prefills():
    s = Scheduler(_config(prefill_chunk=8, max_num_batched_tokens=16))
    a, b = make_request("a", 4, max_tokens=10), make_request("b", 30, max_tokens=3)
    s.add(a)
    runner = _runner(s)
    _step(s, runner)
    s.add(b)
    plan, touched = _step(s, runner)
    assert _rows(plan) == [[("b", 8, False)], [("a", 1, True)]]
    assert plan.sub_batches[1].tokens.shape == (1, 1) and touched == [a]
    drive(s, runner)
    _assert_reference_outputs([a, b])


def test_a_one_token_prompt_runs():
    s = Scheduler(_config())
    r = make_request("a", 1, max_tokens=4)
    s.add(r)
    drive(s, _runner(s))
    _assert_reference_outputs([r])


def test_update_returns_the_requests_that_got_a_token_in_plan_order():
    s = Scheduler(_config(prefill_chunk=8, max_num_batched_tokens=16))
    a, b, c = (make_request(n, k, max_tokens=5) for n, k in (("a", 3), ("b", 20), ("c", 2)))
    for r in (a, b, c):
        s.add(r)
    _, touched = _step(s, _runner(s))  # a: all 3 tokens, b: 8 of 20, c: both
    assert touched == [a, c]


# Length bucketing.

def test_admission_groups_prompts_of_the_head_bucket():
    s = Scheduler(_config(max_num_seqs=2, prefill_chunk=64, max_num_batched_tokens=256))
    assert s.config.token_buckets == (8, 16, 32, 64)
    for name, length in (("a", 32), ("b", 8), ("c", 32), ("d", 8)):
        s.add(make_request(name, length, max_tokens=1))
    runner = _runner(s)
    plan, _ = _step(s, runner)
    assert plan.row_requests == (("a", "c"),)
    plan, _ = _step(s, runner)
    assert plan.row_requests == (("b", "d"),)


def test_the_head_is_admitted_first_even_in_a_lonely_bucket():
    s = Scheduler(_config(max_num_seqs=2, prefill_chunk=64, max_num_batched_tokens=256))
    for name, length in (("b", 8), ("a", 32), ("c", 32), ("d", 8)):
        s.add(make_request(name, length, max_tokens=1))
    plan, _ = _step(s, _runner(s))
    assert plan.row_requests == (("b", "d"),)


def test_bucketing_looks_no_further_than_the_lookahead():
    s = Scheduler(_config(max_num_seqs=2, prefill_chunk=64, max_num_batched_tokens=256))
    assert s.config.admission_lookahead == 4
    for i, length in enumerate((32, 8, 8, 8, 8, 32)):  # the other 32-bucket prompt is 5th
        s.add(make_request(f"r{i}", length, max_tokens=1))
    plan, _ = _step(s, _runner(s))
    assert plan.row_requests == (("r0",), ("r1",))  # one sub-batch per bucket


# Preemption.

def test_preemption_cost_ties_go_to_the_newest_running_request():
    s = Scheduler(_config(num_pages=7, page_size=2, max_num_seqs=3, max_num_batched_tokens=16,
                          kv_watermark=0))
    r0, r1, r2, r3 = (make_request(f"r{i}", 3, first=i, max_tokens=8) for i in range(4))
    for r in (r0, r1, r2, r3):
        s.add(r)
    runner = _runner(s)
    _step(s, runner)  # prefill: 2 pages each, the cache is full
    _step(s, runner)  # decode position 3 still fits
    assert s.allocator.num_free == 0 and s.num_preemptions == 0
    plan, _ = _step(s, runner)  # position 4 needs a third page each
    assert plan.row_requests == (("r0", "r1"),)
    assert r2.status is RequestStatus.WAITING and r2.num_computed_tokens == 0 and r2.pages == []
    assert r2.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [r2, r3]  # back at the front, nobody admitted in that step
    drive(s, runner)
    _assert_reference_outputs([r0, r1, r2, r3])


def test_the_newest_request_preempts_itself():
    s = Scheduler(_config(num_pages=5, page_size=2, max_num_seqs=2, max_num_batched_tokens=8,
                          prefill_chunk=8))
    r0, r1 = make_request("r0", 2, max_tokens=5), make_request("r1", 3, first=5, max_tokens=5)
    s.add(r0)
    s.add(r1)
    runner = _runner(s)
    _step(s, runner)
    _step(s, runner)  # r0 takes the last page
    plan, _ = _step(s, runner)  # r1 needs a page, and is the newest
    assert plan.row_requests == (("r0",),)
    assert r1.status is RequestStatus.WAITING and r1.num_preemptions == 1
    drive(s, runner)
    _assert_reference_outputs([r0, r1])


# Stopping.

def _run_scripted(config, request, tokens):
    s = Scheduler(config)
    s.add(request)
    drive(s, ScriptedRunner(lambda rid, step: tokens[step]))
    assert s.allocator.num_used == 0
    return request


@pytest.mark.parametrize("params,tokens,outputs,status,stop_reason", [
    (dict(), [5, 2, 5, 5], [5, 2], "stop", None),
    (dict(min_tokens=3), [2, 2, 2, 2, 2], [2, 2, 2], "stop", None),
    (dict(ignore_eos=True, max_tokens=4), [2, 2, 2, 2, 2], [2, 2, 2, 2], "length", None),
    (dict(stop_token_ids=[9]), [4, 9, 4], [4, 9], "stop", 9),
    (dict(stop_token_ids=[9], ignore_eos=True), [9, 2], [9], "stop", 9),
    (dict(stop_token_ids=[9], min_tokens=2), [9, 9, 9], [9, 9], "stop", 9),
    (dict(stop_token_ids=[9], max_tokens=2), [4, 9, 4], [4, 9], "stop", 9),
    (dict(max_tokens=3), [4, 5, 6, 7], [4, 5, 6], "length", None),
    (dict(max_tokens=1), [2, 5], [2], "stop", None),
])
def test_stops(params, tokens, outputs, status, stop_reason):
    r = _run_scripted(_config(eos_token_ids=(2,)), make_request("a", 5, **params), tokens)
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (outputs, status, stop_reason)


def test_eos_is_not_a_stop_without_eos_ids():
    r = _run_scripted(_config(), make_request("a", 5, max_tokens=3), [2, 2, 2])
    assert r.finish_reason == "length"


def test_finish_on_a_stop_string_frees_pages():
    s = Scheduler(_config())
    r = make_request("a", 12)
    s.add(r)
    _step(s, _runner(s))  # a chunk of 8 tokens, cut to its bucket: 2 pages of 4
    assert s.allocator.num_used == 2
    assert s.finish("a", "stop", stop_reason="\n")
    assert (r.finish_reason, r.stop_reason, r.pages) == ("stop", "\n", [])
    assert s.allocator.num_used == 0 and not s.has_unfinished() and s.get("a") is None
    assert not s.finish("a", RequestStatus.FINISHED_STOPPED)


# Abort.

def test_abort_frees_pages_at_once_whether_waiting_or_running():
    s = Scheduler(_config(max_num_seqs=1))
    a, b = make_request("a", 12), make_request("b", 12)
    s.add(a)
    s.add(b)
    _step(s, _runner(s))
    assert s.num_running == 1 and s.num_waiting == 1 and s.allocator.num_used == 2
    assert s.abort("b") and b.finish_reason == "abort" and s.num_waiting == 0
    assert s.abort("a") and a.status is RequestStatus.FINISHED_ABORTED and a.pages == []
    assert s.allocator.num_used == 0 and s.num_running == 0
    s.allocator.check()
    assert not s.abort("a") and not s.abort("nobody")
    assert s.schedule().is_empty


def test_abort_during_a_step_drops_its_row():
    s = Scheduler(_config())
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 4, first=9, max_tokens=3)
    s.add(a)
    s.add(b)
    runner = _runner(s)
    plan = s.schedule()
    tokens = runner.run(plan)
    s.abort("a")
    assert s.update(plan, tokens) == [b]
    s.allocator.check()
    drive(s, runner)
    _assert_reference_outputs([b])
    assert a.output_token_ids == []


# The plan's sampling arrays and prompt-logprob targets.

def test_sampling_arrays_follow_each_row():
    s = Scheduler(_config())
    a = make_request("a", 3, temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, seed=7,
                     repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5)
    b = make_request("b", 5, seed=2**32 - 1)
    s.add(a)
    s.add(b)
    runner = _runner(s)
    _step(s, runner)
    plan, _ = _step(s, runner)
    (sampling,) = plan.sampling
    np.testing.assert_allclose(sampling.temperature, [0.5, 1.0])
    np.testing.assert_array_equal(sampling.top_k, [0, 0])
    np.testing.assert_allclose(sampling.top_p, [0.9, 1.0])
    np.testing.assert_allclose(sampling.min_p, [0.1, 0.0])
    np.testing.assert_allclose(sampling.repetition_penalty, [1.2, 1.0], rtol=1e-6)
    np.testing.assert_allclose(sampling.presence_penalty, [0.5, 0.0])
    np.testing.assert_allclose(sampling.frequency_penalty, [-0.5, 0.0])
    assert sampling.seeds.dtype == np.uint32 and sampling.seeds.tolist() == [7, 2**32 - 1]
    assert sampling.steps.tolist() == [1, 1]
    history = [a.prompt_token_ids + a.output_token_ids[:1] + [-1, -1],
               b.prompt_token_ids + b.output_token_ids[:1]]
    assert sampling.history.tolist() == history
    assert sampling.history_is_output.tolist() == [[False] * 3 + [True, False, False],
                                                   [False] * 5 + [True]]


def test_history_stops_at_the_context_of_the_step():
    s = Scheduler(_config(prefill_chunk=8, max_num_batched_tokens=8))
    a = make_request("a", 20)
    s.add(a)
    plan = s.schedule()
    (sampling,) = plan.sampling
    assert sampling.history.tolist() == [a.prompt_token_ids[:8]]
    assert not sampling.history_is_output.any()


def test_stop_ids_are_banned_below_min_tokens():
    s = Scheduler(_config(eos_token_ids=(2, 3)))
    for name, params in (("a", dict(min_tokens=4, stop_token_ids=[9, 2])),
                         ("b", dict(ignore_eos=True)), ("c", dict(ignore_eos=True, min_tokens=1))):
        s.add(make_request(name, 4, **params))
    (sampling,) = s.schedule().sampling
    assert sampling.min_tokens.tolist() == [4, 0, 1]
    # EOS is banned whatever ignore_eos says (it only means EOS ends nothing); below min_tokens only
    assert sampling.banned_ids.tolist() == [[9, 2, 3], [2, 3, -1], [2, 3, -1]]
    assert sampling.banned_ids.dtype == np.int32


def test_prompt_logprob_targets_are_the_next_prompt_ids():
    s = Scheduler(_config(prefill_chunk=4, max_num_batched_tokens=8))
    a = make_request("a", 10, prompt_logprobs=1, max_tokens=2)
    s.add(a)
    s.add(make_request("b", 3, max_tokens=4))
    runner = _runner(s)
    targets = []
    for _ in range(4):
        plan, _ = _step(s, runner)
        targets.append([None if b.targets is None else b.targets.tolist()
                        for b in plan.sub_batches])
    p = a.prompt_token_ids
    assert targets[0] == [[p[1:5], [0, 0, 0, 0]]]  # a's first chunk, then b's prompt
    assert targets[1] == [[p[5:9]], None]  # b decodes alongside
    assert targets[2] == [[p[9:10] + [0]], None]
    assert targets[3] == [None]


# KV accounting.

def test_kv_usage_counts_pages_and_empty_slots():
    s = Scheduler(_config(page_size=8))
    for r in random_requests(np.random.default_rng(3), 6, max_prompt=30, max_output=12):
        s.add(r)

    def check(plan):
        usage = s.kv_usage()
        assert usage.num_used_pages == s.allocator.num_used and usage.num_total_pages == 63
        assert usage.num_filled_slots == sum(r.num_computed_tokens for r in s.running)
        assert usage.num_allocated_slots == 8 * usage.num_used_pages
        assert usage.num_used_pages <= usage.num_peak_used_pages <= usage.num_total_pages
        assert 0 <= usage.num_empty_slots < 8 * max(s.num_running, 1)

    drive(s, _runner(s), on_step=check)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_prefill_stays_within_the_budget(seed):
    """With bound_padded_prefill, every prefill sub-batch padded to its buckets fits the budget,
    so the runner needs only the shapes it warmed up; outputs are unchanged."""
    from meshserve.batching.buckets import bucket_sizes, pick_bucket

    config = _config(bound_padded_prefill=True, max_num_batched_tokens=64, prefill_chunk=32)
    s = Scheduler(config)
    requests = random_requests(np.random.default_rng(seed), 12, max_prompt=70, max_output=10)
    for r in requests:
        s.add(r)
    rows_buckets = bucket_sizes(config.max_num_seqs)

    def check(plan):
        for batch in plan.sub_batches:
            if batch.tokens.shape[1] > 1 or batch.num_tokens > batch.num_rows:
                rows = pick_bucket(batch.num_rows, rows_buckets)
                tokens = pick_bucket(batch.tokens.shape[1], config.token_buckets)
                assert rows * tokens <= max(config.max_num_batched_tokens, tokens)

    drive(s, _runner(s), on_step=check)
    _assert_reference_outputs(requests)


def test_a_chunk_is_cut_to_its_bucket_and_only_the_last_piece_pads():
    s = Scheduler(_config(prefill_chunk=32, max_num_batched_tokens=64))
    assert s.config.token_buckets == (8, 16, 32)
    r = make_request("a", 45, max_tokens=1)
    s.add(r)
    runner = _runner(s)
    pieces = [_rows(_step(s, runner)[0]) for _ in range(3)]
    assert pieces == [[[("a", 32, False)]], [[("a", 8, False)]], [[("a", 5, True)]]]
    assert r.is_finished and r.output_token_ids == reference_outputs(r.prompt_token_ids, 1)


def test_prefill_rows_of_different_buckets_run_as_separate_sub_batches():
    s = Scheduler(_config(prefill_chunk=32, max_num_batched_tokens=128, max_num_seqs=5))
    decoding = make_request("d", 3, max_tokens=4)
    s.add(decoding)
    runner = _runner(s)
    _step(s, runner)
    for name, length in (("a", 16), ("b", 32), ("c", 16), ("e", 8)):
        s.add(make_request(name, length, max_tokens=2))
    plan, _ = _step(s, runner)
    assert plan.row_requests == (("b",), ("a", "c"), ("e",), ("d",))
    assert [b.tokens.shape[1] for b in plan.sub_batches] == [32, 16, 8, 1]


@pytest.mark.parametrize("seed", range(4))
def test_every_prefill_row_fills_a_bucket_but_a_prompts_last_short_piece(seed):
    config = _config(bound_padded_prefill=True, max_num_batched_tokens=64, prefill_chunk=32)
    s = Scheduler(config)
    requests = random_requests(np.random.default_rng(seed), 12, max_prompt=90, max_output=6)
    for r in requests:
        s.add(r)

    def check(plan):
        for ids, batch, samples in zip(plan.row_requests, plan.sub_batches, plan.row_samples):
            for n, is_last in zip(batch.num_new.tolist(), samples.tolist()):
                if n > 1:
                    assert n in config.token_buckets or (is_last and n < config.token_buckets[0])

    drive(s, _runner(s), on_step=check)
    _assert_reference_outputs(requests)


def test_higher_priority_is_admitted_first_and_ties_stay_first_come_first_served():
    s = Scheduler(_config(max_num_seqs=1))
    low, high, high2, mid = (make_request("low", 4, max_tokens=1),
                             make_request("high", 4, max_tokens=1),
                             make_request("high2", 4, max_tokens=1),
                             make_request("mid", 4, max_tokens=1))
    low.priority, high.priority, high2.priority, mid.priority = 0, 2, 2, 1
    for r in (low, high, high2, mid):
        s.add(r)
    assert [r.request_id for r in s.waiting] == ["high", "high2", "mid", "low"]
    order = []
    drive(s, _runner(s), on_step=lambda plan: order.extend(
        rid for ids in plan.row_requests for rid in ids))
    assert order == ["high", "high2", "mid", "low"]


def test_fit_step_bucket_cuts_a_chunk_to_the_nearer_bucket():
    from meshserve.batching.continuous import fit_step_bucket

    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    assert fit_step_bucket(15, 64, buckets) == 49  # 79 tokens: 64 is nearer than 128
    assert fit_step_bucket(15, 90, buckets) == 90  # 105: 128 is nearer, pad up
    assert fit_step_bucket(0, 40, buckets) == 32  # 40: 32 is nearer than 64
    assert fit_step_bucket(30, 4, buckets) == 2  # 34: down to 32, 2 of the 4 run now
    assert fit_step_bucket(33, 2, buckets) == 2  # 35: 32 would leave none of the chunk
    assert fit_step_bucket(16, 16, buckets) == 16  # already on a bucket


def test_step_buckets_land_steps_on_buckets_and_lose_no_token():
    """With the ragged step's buckets, most steps' tokens land exactly on a bucket, and every
    request still gets exactly its reference outputs."""
    buckets = (1, 2, 4, 8, 16, 32, 64)
    s = Scheduler(_config(max_num_batched_tokens=64, prefill_chunk=64, step_buckets=buckets))
    requests = random_requests(np.random.default_rng(5), 24, max_prompt=90, max_output=20)
    for r in requests:
        s.add(r)
    plans = drive(s, _runner(s))
    totals = [plan.num_tokens for plan in plans]
    assert sum(t in buckets for t in totals) >= 0.75 * len(totals)
    _assert_reference_outputs(requests)
    with pytest.raises(ValueError, match="step_buckets must be increasing"):
        _config(step_buckets=(8, 4))
