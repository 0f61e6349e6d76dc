"""The grammar library binding (serving/engine/grammar.py) and a request's Constraint, on SmolLM2's
real tokenizer: compile once per distinct constraint, masks that allow exactly the continuations,
when a constraint ends a request, and refusals that name the field."""

import json

import numpy as np
import pytest

from meshserve.batching.request import Request, RequestStatus
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import Constraint, StructuredOutput, allowed_ids, mask_words
from meshserve.serving.engine.grammar import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(smollm2_files):
    from meshserve.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_files.path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.to_json(), vocab_size=49152,
                           eos_token_ids=tokenizer.eos_token_ids)


def _constraint(compiler, structured, *, ignore_eos=False, eos=(2,)) -> Constraint:
    return Constraint(compiler.matcher(structured), num_words=mask_words(49152),
                      eos_token_ids=eos, ignore_eos=ignore_eos)


def _texts(tokenizer, mask) -> set[str]:
    return {tokenizer.decode([int(t)], skip_special_tokens=False) for t in allowed_ids(mask)}


def test_each_distinct_constraint_compiles_once(tokenizer):
    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size=49152, eos_token_ids=(2,),
                               max_cached=2)
    schema = StructuredOutput(json_schema=SCHEMA)
    for _ in range(3):
        compiler.check(schema)
        compiler.matcher(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    assert compiler.num_compiles == 1
    compiler.check(StructuredOutput(regex="a+"))
    compiler.check(StructuredOutput(regex="b+"))  # the cache holds 2: the schema goes
    compiler.check(schema)
    assert compiler.num_compiles == 4


def test_a_choice_mask_allows_exactly_the_prefixes(compiler, tokenizer):
    constraint = _constraint(compiler, StructuredOutput(choice=["yes", "no"]))
    texts = _texts(tokenizer, constraint.mask)
    assert {"yes", "no", "y", "n"} <= texts
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert constraint.advance(token) is None or constraint.has_allowed() is False
    assert constraint.end() == ("stop", None)  # complete: ends at once, no EOS to sample


def test_a_json_schema_walks_a_valid_document_and_ends_at_its_close(compiler, tokenizer):
    constraint = _constraint(compiler, StructuredOutput(json_schema=SCHEMA))
    assert _texts(tokenizer, constraint.mask) <= {"{", "{\""}
    tokens = tokenizer.encode('{"name": "Ada", "n": 42}', add_special_tokens=False)
    ends = [constraint.advance(token) for token in tokens]
    assert ends[:-1] == [None] * (len(tokens) - 1) and ends[-1] == ("stop", None)
    assert constraint.num_consumed == len(tokens)


def test_ignore_eos_clears_eos_until_the_constraint_is_complete(compiler, tokenizer):
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    plain = _constraint(compiler, StructuredOutput(regex="a{1,3}"))
    ignoring = _constraint(compiler, StructuredOutput(regex="a{1,3}"), ignore_eos=True)
    for constraint in (plain, ignoring):
        assert constraint.advance(a) is None and a in allowed_ids(constraint.mask)
    assert 2 in allowed_ids(plain.mask) and 2 not in allowed_ids(ignoring.mask)
    assert ignoring.advance(a) is None and ignoring.advance(a) == ("stop", None)


def test_a_refused_token_ends_the_request_unsatisfiable_with_the_library_reason(compiler,
                                                                                 tokenizer):
    constraint = _constraint(compiler, StructuredOutput(choice=["yes", "no"]))
    bad = tokenizer.encode("maybe", add_special_tokens=False)[0]
    reason, detail = constraint.advance(bad)
    assert reason == "unsatisfiable"
    assert detail.startswith(f"the constraint refused token {bad}: ") and "<state>" not in detail


def test_the_scheduler_ends_a_request_whose_constraint_dies_and_frees_its_pages(compiler,
                                                                                tokenizer):
    from meshserve.batching.knobs import SchedulerConfig
    from meshserve.batching.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(num_pages=8, page_size=4, max_num_seqs=2,
                                          max_num_batched_tokens=16, prefill_chunk=16,
                                          max_model_len=32, eos_token_ids=(2,)))
    structured = StructuredOutput(choice=["yes", "no"])
    request = Request(request_id="r", prompt_token_ids=[5, 6, 7],
                      params=SamplingParams(max_tokens=8, structured=structured))
    request.constraint = _constraint(compiler, structured)
    scheduler.add(request)
    plan = scheduler.schedule()
    assert plan.sampling[0].allowed.shape == (1, 1536)
    np.testing.assert_array_equal(plan.sampling[0].allowed[0], request.constraint.mask)
    bad = tokenizer.encode("maybe", add_special_tokens=False)[0]
    scheduler.update(plan, [np.array([bad], np.int32)])
    assert request.status is RequestStatus.FINISHED_UNSATISFIABLE
    assert request.finish_reason == "unsatisfiable" and "refused token" in request.stop_reason
    assert scheduler.kv_usage().num_used_pages == 0 and not scheduler.has_unfinished()


def test_an_unconstrained_plan_carries_a_one_word_mask(compiler):
    from meshserve.batching.plan import Row, build_plan

    request = Request(request_id="r", prompt_token_ids=[5, 6], params=SamplingParams())
    request.pages = [1]
    plan = build_plan([Row(request, 2, False)], page_size=4)
    assert plan.sampling[0].allowed.tolist() == [[-1]]


@pytest.mark.parametrize("fields,message", [
    ({"regex": "(ab"}, "structured.regex: "),
    ({"json_schema": {"type": "foo"}}, "structured.json_schema: Invalid type: foo"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}},
     "structured.json_schema: Unsatisfiable schema: minimum (5) is greater than maximum (3)"),
    ({"grammar": "start: foo"}, 'structured.grammar: at 1(8): unknown name: "foo"'),
    ({"grammar": "root ::= ("}, "structured.grammar: "),
])
def test_invalid_constraints_are_refused_with_the_library_reason(compiler, fields, message):
    with pytest.raises(ValueError) as error:
        compiler.check(StructuredOutput(**fields))
    assert str(error.value).startswith(message), str(error.value)
    assert "<state>" not in str(error.value)


def test_lark_and_gbnf_grammars_compile(compiler, tokenizer):
    for grammar in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        constraint = _constraint(compiler, StructuredOutput(grammar=grammar))
        assert {"yes", "no"} <= _texts(tokenizer, constraint.mask)


def test_json_numbers_stop_after_eight_fraction_digits(compiler, tokenizer):
    for structured in (StructuredOutput(json_schema={"type": "object", "properties": {
            "x": {"type": "number", "minimum": 0, "maximum": 100}}}),
                       StructuredOutput(json_object=True)):
        for text, is_ok in (('{"x": 12.12345678}', True), ('{"x": 12.123456789}', False)):
            constraint = _constraint(compiler, structured)
            ends = [constraint.advance(t) for t in tokenizer.encode(text, add_special_tokens=False)]
            assert (ends[-1] == ("stop", None)) is is_ok, (structured.kind, text, ends[-1])


def test_masks_of_many_matchers_filled_at_once_are_each_ones_own(compiler, tokenizer):
    """The library's parallel fill gives every matcher the mask it gives alone: one just
    started, one mid-string, one complete (stopped) and one dead."""
    from meshserve.batching.structured import fill_each
    from meshserve.serving.engine.grammar import fill_masks

    matchers = [compiler.matcher(StructuredOutput(json_schema=SCHEMA)) for _ in range(2)]
    matchers += [compiler.matcher(StructuredOutput(choice=["yes", "no"])) for _ in range(2)]
    for token in tokenizer.encode('{"name": "A', add_special_tokens=False):
        assert matchers[1].advance(token)
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert matchers[2].advance(token)
    assert matchers[2].is_stopped()
    assert not matchers[3].advance(tokenizer.encode("maybe", add_special_tokens=False)[0])
    together = np.zeros((len(matchers), mask_words(49152)), np.int32)
    alone = np.zeros_like(together)
    fill_masks(matchers, together)
    fill_each(matchers, alone)
    np.testing.assert_array_equal(together, alone)
    assert len({row.tobytes() for row in together[:2]}) == 2  # the rows are not one mask


def test_a_step_advances_its_constrained_rows_and_fills_their_masks_together(compiler,
                                                                             tokenizer):
    """One `MaskFiller` call a step, holding every constrained row's matcher; the masks it
    fills are the ones each request then carries."""
    from meshserve.batching.knobs import SchedulerConfig
    from meshserve.batching.scheduler import Scheduler
    from meshserve.serving.engine.grammar import fill_masks

    calls = []

    def spy(matchers, out):
        calls.append(len(matchers))
        fill_masks(matchers, out)

    scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4, max_num_seqs=4,
                                          max_num_batched_tokens=16, prefill_chunk=16,
                                          max_model_len=32, eos_token_ids=(2,)), fill_masks=spy)
    requests = []
    for i, structured in enumerate([StructuredOutput(json_schema=SCHEMA),
                                    StructuredOutput(regex="[a-z]+"), None]):
        request = Request(request_id=str(i), prompt_token_ids=[5, 6, 7],
                          params=SamplingParams(max_tokens=8, structured=structured))
        if structured is not None:
            request.constraint = _constraint(compiler, structured)
        scheduler.add(request)
        requests.append(request)
    brace, letter = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("{", "a"))
    plan = scheduler.schedule()
    scheduler.update(plan, [np.array([brace, letter, letter], np.int32)])
    assert calls == [2] and scheduler.num_constraint_batches == 1
    assert scheduler.num_constraint_advances == 2
    for request in requests[:2]:
        alone = np.zeros(mask_words(49152), np.int32)
        request.constraint.matcher.fill_mask(alone)
        np.testing.assert_array_equal(request.constraint.mask, alone)
    texts = _texts(tokenizer, requests[0].constraint.mask)  # after "{": the first key
    assert texts and all(text.startswith('"') for text in texts), texts
