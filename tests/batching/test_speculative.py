"""Speculative decoding's host side: the config as vLLM spells it, prompt lookup, the sampling
rows of drafts and the acceptance rule. No jax."""

import numpy as np
import pytest

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.pages import num_pages_for
from meshserve.batching.plan import Row, sampling_arrays
from meshserve.batching.request import Request
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler
from meshserve.batching.speculative import (NgramProposer, SpeculativeConfig, SpeculativeStats,
                                            Speculator, accepted_length, draft_sampling,
                                            ngram_lookup)
from tests.batching.fake import FakeRunner, make_request


def test_the_config_reads_vllms_dict_and_json():
    fields = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}
    config = SpeculativeConfig.coerce(fields)
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 4)
    assert SpeculativeConfig.coerce('{"method": "ngram", "num_speculative_tokens": 4, '
                                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}') == config
    assert SpeculativeConfig.coerce(config) is config and SpeculativeConfig.coerce(None) is None
    # vLLM's defaults: each bound defaults to the other, both to 5; "[ngram]" as the model
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).prompt_lookup_min == 5
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=2).method == "ngram"
    draft = SpeculativeConfig(model="smollm2-135m-instruct", num_speculative_tokens=3)
    assert draft.method == "draft_model" and draft.model == "smollm2-135m-instruct"


@pytest.mark.parametrize("value,message", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an int"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes none"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model must name the draft model"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max applies to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     r"unknown fields \['lookahead'\]"),
    ("{not json", "must be a JSON object"),
    ([1, 2], "must be a dict"),
])
def test_a_bad_config_is_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.coerce(value)


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4]
    # the 4-gram 1 2 3 4 occurs once before: what followed it
    assert ngram_lookup(tokens, 2, 4, 3) == [9, 9, 2]
    # only 3-grams: 2 3 4 occurs at 1 and 6; the latest wins
    assert ngram_lookup(tokens, 2, 3, 3) == [7, 8, 1]
    assert ngram_lookup([5, 6, 7, 8], 1, 3, 2) == []  # no earlier occurrence
    assert ngram_lookup(tokens, 2, 4, 0) == []
    # an occurrence may overlap the suffix; the proposal stops at the end of the tokens
    assert ngram_lookup([3, 3, 3, 3], 2, 2, 4) == [3]
    request = Request("r", [1, 2, 3, 4, 9, 9], SamplingParams())
    request.output_token_ids = [2, 3, 4]
    assert NgramProposer(2, 4).propose([request], [2]) == [[9, 9]]


def test_draft_rows_sample_as_the_request_would_after_the_drafts():
    params = SamplingParams(temperature=0.7, seed=5, min_tokens=4, stop_token_ids=(9,),
                            repetition_penalty=1.2)
    request = Request("r", [10, 11, 12], params)
    request.output_token_ids = [13]
    request.num_computed_tokens = 3
    drafts = [14, 15]
    rows = draft_sampling(request, drafts, eos_token_ids=(0,))
    for j, token in enumerate(drafts, start=1):  # as the request's own row once it emitted them
        ahead = Request("r", [10, 11, 12], params)
        ahead.output_token_ids = [13, *drafts[:j]]
        ahead.num_computed_tokens = 3 + j
        want = sampling_arrays([Row(ahead, 1, is_decode=True)], eos_token_ids=(0,))
        for name in ("temperature", "seeds", "steps", "min_tokens", "banned_ids",
                     "repetition_penalty", "history", "history_is_output"):
            got = getattr(rows, name)[j - 1]
            np.testing.assert_array_equal(got[:getattr(want, name).shape[-1]]
                                          if got.ndim else got, getattr(want, name)[0], name)
    assert list(rows.steps) == [2, 3]


def test_acceptance_stops_at_the_first_mismatch():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3  # all, then the bonus
    assert accepted_length([5, 6, 7], [5, 1, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([], [4]) == 0


def test_stats_add_up_per_position_and_subtract():
    stats = SpeculativeStats(num_drafts=2, num_draft_tokens=5, num_accepted_tokens=3,
                             draft_tokens_per_position=[2, 2, 1],
                             accepted_tokens_per_position=[2, 1, 0])
    before = stats.copy()
    stats.num_drafts += 1
    stats.accepted_tokens_per_position += [0]
    grown = stats.since(before)
    assert grown.num_drafts == 1 and grown.accepted_tokens_per_position == [0, 0, 0, 0]
    summary = before.summary()
    assert summary["acceptance_rate"] == 3 / 5 and summary["mean_acceptance_length"] == 2.5
    assert summary["acceptance_rate_per_position"] == [1.0, 0.5, 0.0]


class _Repeat:
    """Proposes `token` as many times as allowed."""

    token = 7

    def propose(self, requests, max_drafts):
        return [[self.token] * k for k in max_drafts]


def _decoding_scheduler(**overrides):
    """A scheduler whose request "a" (5 prompt tokens, up to 30 outputs) is decoding."""
    config = SchedulerConfig(**(dict(
        num_pages=64, page_size=4, max_num_seqs=10, max_num_batched_tokens=32, prefill_chunk=8,
        max_model_len=64, token_buckets=(8,), bound_padded_prefill=False,
        step_buckets=(1, 2, 4, 8, 16, 32)) | overrides))
    scheduler = Scheduler(config)
    runner = FakeRunner(num_pages=config.num_pages, page_size=config.page_size)
    scheduler.add(make_request("a", 5, max_tokens=30, ignore_eos=True))
    while not scheduler.get("a").output_token_ids:  # its prompt, in chunks cut to buckets
        plan = scheduler.schedule()
        scheduler.update(plan, runner.run(plan))
    return scheduler, runner


def test_drafts_are_rows_after_the_plan_with_their_pages_reserved():
    scheduler, _ = _decoding_scheduler()
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                            proposer=_Repeat())
    plan = scheduler.schedule()
    request = scheduler.get("a")
    n = request.num_tokens  # 6: its last output is fed at position 5
    speculation = speculator.expand(plan, scheduler)
    drafts = speculation.plan.sub_batches[-1]
    assert all(a is b for a, b in zip(speculation.plan.sub_batches, plan.sub_batches))
    assert len(speculation.plan.sub_batches) == len(plan.sub_batches) + 1
    assert drafts.tokens[:, 0].tolist() == [7] * 4
    assert drafts.positions[:, 0].tolist() == [n, n + 1, n + 2, n + 3]
    assert drafts.kv_lens.tolist() == [n + 1, n + 2, n + 3, n + 4]
    assert len(request.pages) == num_pages_for(n + 4, 4) == 3  # reserved for the drafts
    assert speculation.plan.sampling[-1].steps.tolist() == [2, 3, 4, 5]
    # every draft rejected: round 0 only, and the draft pages go back
    tokens = [np.array([1], np.int32), np.array([1, 1, 1, 1], np.int32)]
    assert speculation.num_accepted(tokens) == [0]
    rounds = speculation.rounds(tokens)
    assert len(rounds) == 1 and rounds[0].sub_batches[-1].num_new.tolist() == [0] * 4
    scheduler.update(rounds[0], tokens)
    speculator.settle(speculation, tokens, scheduler)
    assert len(request.pages) == num_pages_for(request.num_tokens, 4) == 2
    scheduler.allocator.check()
    # two accepted: rounds 1 and 2 hold those draft rows
    tokens = [np.array([7], np.int32), np.array([7, 3, 7, 7], np.int32)]
    assert speculation.num_accepted(tokens) == [2]
    assert [r.sub_batches[-1].num_new.tolist() for r in speculation.rounds(tokens)[1:]] == [
        [1, 0, 0, 0], [0, 1, 0, 0]]


def test_a_prefill_step_takes_drafts_only_into_its_bucket_padding():
    scheduler, runner = _decoding_scheduler()
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=8),
                            proposer=_Repeat())
    scheduler.add(make_request("b", 20, max_tokens=4))
    plan = scheduler.schedule()  # a's decode and b's chunk, cut so that the step fills 8 slots
    assert plan.num_tokens == 8
    assert speculator.expand(plan, scheduler) is None
    scheduler.update(plan, runner.run(plan))
    scheduler.add(make_request("c", 3, max_tokens=4))
    plan = scheduler.schedule()  # a, b's next chunk (7), c's prompt (3): 11 of a 16-slot bucket
    speculation = speculator.expand(plan, scheduler)
    # 5 drafts fill the bucket, though the budget (32) and the seats (7 free) have more room
    assert plan.num_tokens == 11 and speculation.num_draft_tokens == 5


def test_the_load_rule_counts_the_rows_that_sample():
    scheduler, _ = _decoding_scheduler()
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                              disable_by_batch_size=1), proposer=_Repeat())
    scheduler.add(make_request("b", 2, max_tokens=4))
    plan = scheduler.schedule()  # a decodes, b's whole prompt samples: two rows sample
    assert speculator.expand(plan, scheduler) is None
    assert speculator.stats.num_steps_off == 1
