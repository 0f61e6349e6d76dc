"""Request: token counts, seeds, and statuses."""

from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import SamplingParams


def test_token_counts():
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    r.output_token_ids += [7, 8]
    r.num_computed_tokens = 4
    assert (r.num_prompt_tokens, r.num_tokens, r.num_uncomputed) == (3, 5, 1)
    assert r.all_token_ids == [1, 2, 3, 7, 8]
    assert r.max_kv_len == 3 + 5 - 1
    assert r.status is RequestStatus.WAITING and not r.is_finished


def test_seed_comes_from_params_or_is_drawn():
    assert Request("a", [1], SamplingParams(seed=123)).seed == 123
    seeds = {Request(str(i), [1]).seed for i in range(8)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)


def test_requests_compare_by_identity():
    assert Request("a", [1], arrival_time=0.0) != Request("a", [1], arrival_time=0.0)


def test_finished_statuses_and_reasons():
    assert [s.finish_reason for s in RequestStatus] == [None, None, "stop", "length", "abort",
                                                       "unsatisfiable"]
    assert [s.is_finished for s in RequestStatus] == [False, False, True, True, True, True]
