"""The "predicted" ordering: shortest predicted first with aging, pages kept for the predicted
growth, and static batches grouped by predicted length. Driven with the fake runners, no jax.

Requests with `ignore_eos` and no stops have a known length (every quantile is max_tokens), so
the prior predictor is exact for them: these tests check what the scheduler does with a
prediction, not how good the prediction is (tests/model/test_length_predictor.py does that).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.length import LengthFeatures, LengthPrediction, PriorPredictor
from meshserve.batching.scheduler import Scheduler
from tests.batching.fake import (FakeRunner, ScriptedRunner, drive, make_request,
                                 reference_outputs, storm_requests)

EOS = 0


def _config(**overrides) -> SchedulerConfig:
    base = dict(num_pages=129, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                prefill_chunk=64, max_model_len=512, bound_padded_prefill=False,
                enable_prefix_caching=False)
    return SchedulerConfig(**{**base, **overrides})


@pytest.mark.parametrize("field,value", [("ordering", "sjf"), ("reserve_quantile", 1.5),
                                         ("aging_tokens_per_step", 0)])
def test_bad_ordering_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        _config(**{field: value})


def test_fcfs_keeps_the_queue_and_predicted_sorts_by_predicted_cost():
    lengths = {"long": (40, 100), "short": (8, 4), "mid": (20, 30)}
    for ordering, expected in [("fcfs", ["long", "short", "mid"]),
                               ("predicted", ["short", "mid", "long"])]:
        s = Scheduler(_config(ordering=ordering))
        for rid, (prompt, output) in lengths.items():
            s.add(make_request(rid, prompt, max_tokens=output, ignore_eos=True))
        assert [r.request_id for r in s.waiting_order()] == expected


def test_predicted_ordering_cuts_the_mean_completion_step_and_keeps_every_output():
    """64 requests of one prompt length and outputs of 4-128 tokens, 8 seats: shortest first
    finishes the short ones early, so the mean step at which a request ends falls."""
    rng = np.random.default_rng(0)
    specs = [(f"r{i}", int(rng.integers(4, 129))) for i in range(64)]

    def mean_finish(ordering: str) -> float:
        s = Scheduler(_config(ordering=ordering))
        requests = [make_request(rid, 16, first=i, max_tokens=n, ignore_eos=True)
                    for i, (rid, n) in enumerate(specs)]
        for r in requests:
            s.add(r)
        finished: dict[str, int] = {}
        plans = []

        def on_step(plan):
            plans.append(plan)
            for r in requests:
                if r.is_finished and r.request_id not in finished:
                    finished[r.request_id] = len(plans)

        drive(s, FakeRunner(num_pages=129, page_size=16), on_step=on_step)
        for r in requests:
            assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)
        return float(np.mean(list(finished.values())))

    fcfs, predicted = mean_finish("fcfs"), mean_finish("predicted")
    assert predicted < 0.85 * fcfs, (fcfs, predicted)  # measured: 283 -> 218 steps


def test_aging_admits_a_long_request_while_short_ones_keep_arriving():
    """A long request waits behind a stream of short ones only until its cost has aged below
    theirs: with 2 seats and a new short request every step, it still starts."""
    s = Scheduler(_config(ordering="predicted", max_num_seqs=2, aging_tokens_per_step=4.0))
    long = make_request("long", 8, max_tokens=200, ignore_eos=True)
    s.add(long)
    runner = FakeRunner(num_pages=129, page_size=16)
    s.add(make_request("s0", 8, max_tokens=2, ignore_eos=True))
    s.add(make_request("s1", 8, max_tokens=2, ignore_eos=True))
    for step in range(200):
        s.add(make_request(f"t{step}", 8, first=step, max_tokens=2, ignore_eos=True))
        plan = s.schedule()
        s.update(plan, runner.run(plan))
        if long.num_computed_tokens > 0:
            break
    else:
        pytest.fail("the long request starved")
    # Its cost (8 + 200) ages past a short one's (8 + 2) after about (208 - 10) / 4 steps.
    assert 30 <= step <= 70, step


def _storm_preemptions(ordering: str, seed: int) -> int:
    """The storm of test_kv_accounting (prompts that fill the cache, outputs that grow),
    with the default watermark."""
    s = Scheduler(_config(ordering=ordering, max_num_seqs=32))
    requests = storm_requests(seed)
    for r in requests:
        s.add(r)
    drive(s, FakeRunner(num_pages=129, page_size=16))
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)
    return s.num_preemptions


def test_pages_kept_for_the_predicted_growth_prevent_preemption():
    """Where the watermark still leaves some preemptions, keeping pages for each running
    request's predicted length leaves none when the prediction is exact."""
    fcfs = sum(_storm_preemptions("fcfs", seed) for seed in range(4))
    predicted = sum(_storm_preemptions("predicted", seed) for seed in range(4))
    assert fcfs >= 10 and predicted == 0, (fcfs, predicted)


def _static_decode_padding(ordering: str) -> float:
    s = Scheduler(_config(policy="static", ordering=ordering, max_num_seqs=4,
                          bound_padded_prefill=True))
    rng = np.random.default_rng(1)
    requests = [make_request(f"r{i}", 16, first=i, max_tokens=int(rng.choice([4, 64])),
                             ignore_eos=True) for i in range(32)]
    for r in requests:
        s.add(r)
    plans = drive(s, FakeRunner(num_pages=129, page_size=16))
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.params.max_tokens)
    decode = [b for p in plans for b in p.sub_batches if b.tokens.shape[1] == 1]
    rows = sum(b.num_rows for b in decode)
    return sum(int((b.num_new == 0).sum()) for b in decode) / rows


def test_static_batches_grouped_by_predicted_length_pad_less():
    """Outputs of 4 or 64 tokens in random order: FCFS batches mix them, so short rows decode
    on as padding; grouped batches end together."""
    fcfs, predicted = _static_decode_padding("fcfs"), _static_decode_padding("predicted")
    assert fcfs > 0.3 and predicted < 0.1, (fcfs, predicted)


class _Recorder(PriorPredictor):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def observe(self, features: LengthFeatures, output_len: int) -> None:
        super().observe(features, output_len)
        self.seen.append((features.num_prompt_tokens, output_len))


def test_the_predictor_learns_every_finished_length_and_no_aborted_one():
    """Lengths the model decides (EOS at a planted position) are observed when the request
    finishes; an aborted request teaches nothing."""
    planted = {"a": 3, "b": 7}
    predictor = _Recorder()
    s = Scheduler(_config(eos_token_ids=(EOS,)), predictor=predictor)
    for rid, prompt in (("a", 5), ("b", 9), ("c", 4)):
        s.add(make_request(rid, prompt, max_tokens=20))
    assert all(isinstance(s.get(r).predicted_length, LengthPrediction) for r in "abc")
    s.abort("c")
    drive(s, ScriptedRunner(lambda rid, i: EOS if i + 1 == planted[rid] else 5))
    assert sorted(predictor.seen) == [(5, 3), (9, 7)]
