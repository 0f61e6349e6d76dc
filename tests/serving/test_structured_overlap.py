"""Masks computed while the device runs the step's forward pass (serving/engine/core.py,
`_run_overlapped`; batching/scheduler.py, `defers_masks`), checked on the host side with the
greedy stand-in model of tests/serving/test_structured_budget.py, run both ways: one call a step,
or its forward pass and its sampling apart with the due masks computed between them.

A plan made while masks are due carries placeholders, which the computed masks replace before
sampling: the very masks a scheduler that fills them at once plans with. A matcher that stops
ends its request at once, as before. A constraint whose mask ends it (its next bytes spelled by
no token) ends its request with the same output and reason one step later, its row's results
from that step dropped, the requests beside it unchanged. No jax program runs here: tests/model/
test_mask_transfer.py and tests/serving/test_structured.py run the real split step."""

import numpy as np

from meshserve.batching.knobs import SchedulerConfig
from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler
from meshserve.batching.structured import Constraint, StructuredOutput, mask_words
from meshserve.serving.engine.admission import Admitted
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.grammar import fill_masks
# its fixtures too: the tiny tokenizer and a grammar compiler over it
from tests.serving.test_structured_budget import (ENGINE, RUNNERS, VOCAB, compiler,  # noqa: F401
                                                  tokenizer)
from tests.serving.tiny_tokenizer import EOS_ID

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "s": {"type": "string", "maxLength": 3}},
          "required": ["n", "s"], "additionalProperties": False}


def _scheduler(*, defers_masks: bool) -> Scheduler:
    return Scheduler(SchedulerConfig(num_pages=16, page_size=4, max_num_seqs=4,
                                     max_num_batched_tokens=16, prefill_chunk=16,
                                     max_model_len=64, eos_token_ids=(EOS_ID,)),
                     fill_masks=fill_masks, defers_masks=defers_masks)


def _add(scheduler: Scheduler, compiler, structured: StructuredOutput) -> Request:
    request = Request(request_id="r", prompt_token_ids=[5, 6, 7],
                      params=SamplingParams(max_tokens=16, structured=structured))
    request.constraint = Constraint(compiler.matcher(structured), num_words=mask_words(VOCAB),
                                    eos_token_ids=(EOS_ID,), max_tokens=16)
    scheduler.add(request)
    return request


def test_a_plan_made_while_masks_are_due_gets_them_before_sampling(compiler, tokenizer):
    structured = StructuredOutput(json_schema=SCHEMA)
    at_once, deferred = _scheduler(defers_masks=False), _scheduler(defers_masks=True)
    requests = [_add(scheduler, compiler, structured) for scheduler in (at_once, deferred)]
    for token in tokenizer.encode('{"n": 12, "s": "ab', add_special_tokens=False):
        want, got = at_once.schedule(), deferred.schedule()
        if deferred.has_due_masks:
            assert got.sampling[0].is_constrained[0] and np.all(got.sampling[0].allowed[0] == -1)
            assert deferred.fill_due_masks() == []  # nothing ends here
            got = deferred.masked(got)
        np.testing.assert_array_equal(got.sampling[0].allowed, want.sampling[0].allowed)
        np.testing.assert_array_equal(got.sub_batches[0].tokens, want.sub_batches[0].tokens)
        for scheduler, plan in ((at_once, want), (deferred, got)):
            scheduler.update(plan, [np.array([token], np.int32)])
        assert requests[1].constraint.is_mask_due and not requests[0].constraint.is_mask_due
        assert deferred.has_due_masks and not at_once.has_due_masks
    assert requests[0].output_token_ids == requests[1].output_token_ids


def test_a_stopped_matcher_ends_its_request_at_once(compiler, tokenizer):
    """Nothing but EOS may follow a complete choice: the request ends "stop" in the update
    that completed it, with no mask left due, as when every mask is filled at once."""
    scheduler = _scheduler(defers_masks=True)
    request = _add(scheduler, compiler, StructuredOutput(choice=["no", "yes"]))
    for token in tokenizer.encode("no", add_special_tokens=False):
        plan = scheduler.schedule()
        if scheduler.has_due_masks:
            assert scheduler.fill_due_masks() == []
            plan = scheduler.masked(plan)
        scheduler.update(plan, [np.array([token], np.int32)])
    assert request.status is RequestStatus.FINISHED_STOPPED and not scheduler.has_due_masks
    assert scheduler.kv_usage().num_used_pages == 0


class DeadEnd:
    """A matcher that allows every token but EOS for `length` tokens, then none, while it
    neither accepts nor stops: a constraint whose next bytes no token of the vocabulary
    spells, which only its mask tells."""

    def __init__(self, length: int):
        self.length, self.num_taken = length, 0

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = -1 if self.num_taken < self.length else 0
        out.view(np.uint32)[EOS_ID // 32] &= np.uint32(~(1 << EOS_ID % 32) & 0xFFFFFFFF)

    def advance(self, token: int) -> bool:
        self.num_taken += 1
        return True

    def is_accepting(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return False

    def error(self) -> str:
        return ""

    def num_closing_tokens(self) -> None:
        return None

    def num_closing_tokens_at_most(self) -> None:
        return None

    def fill_closing_mask(self, out: np.ndarray, budget: int) -> None:
        out[:] = 0


def _serve(runner_class, tokenizer) -> tuple[dict, Engine]:
    """A request held to a `DeadEnd` of 3 tokens, one to a JSON schema and an unconstrained
    one, all at once: each one's output and the step (counted from 1) that finished it."""
    config = EngineConfig(**ENGINE)
    preferred = [tokenizer.token_to_id(symbol) for symbol in (",", "1", "a")]
    engine = Engine(runner_class(config, preferred), tokenizer, config)
    engine.enqueue(Admitted("dead", [5, 6, 7], None, SamplingParams(max_tokens=10),
                            constraint=Constraint(DeadEnd(3), num_words=mask_words(VOCAB),
                                                  eos_token_ids=(EOS_ID,))))
    engine.add_request([5, 6], SamplingParams(max_tokens=12, structured=StructuredOutput(
        json_schema=SCHEMA)), request_id="json")
    engine.add_request([8, 9], SamplingParams(max_tokens=8, ignore_eos=True), request_id="plain")
    finished, num_steps = {}, 0
    while engine.has_unfinished():
        num_steps += 1
        for out in engine.step():
            assert out.request_id not in finished, "one final output each"
            if out.finished:
                finished[out.request_id] = (out.outputs[0], num_steps)
    assert engine.scheduler.kv_usage().num_used_pages == 0
    return finished, engine


def test_a_constraint_its_mask_ends_ends_its_request_with_the_same_output(tokenizer):
    (once, once_engine), (split, split_engine) = (_serve(RUNNERS[name], tokenizer) for name in
                                                  ("one call", "forward, then sampling"))
    for request_id in ("dead", "json", "plain"):
        got, want = split[request_id][0], once[request_id][0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), request_id
    dead = split["dead"][0]
    assert dead.finish_reason == "unsatisfiable" and len(dead.token_ids) == 3
    assert dead.stop_reason.startswith("no token of the vocabulary can continue")
    assert split["dead"][1] == once["dead"][1] + 1  # its mask, computed a step later, ended it
    assert split_engine.stats.overlap_steps > 0 and once_engine.stats.overlap_steps == 0
