"""SamplingParams: vLLM's defaults, validation of every field, normalisation."""

import dataclasses

import numpy as np
import pytest

from meshserve.batching.sampling import MAX_LOGPROBS, SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (
        16, 0, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), False)
    assert (p.seed, p.logprobs, p.prompt_logprobs) == (None, None, None)
    assert not p.is_greedy


def test_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0
    with pytest.raises(TypeError):
        SamplingParams(16)


INVALID = [
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("max_tokens", 1.5, "max_tokens must be an int"),
    ("max_tokens", True, "max_tokens must be an int"),
    ("max_tokens", "16", "max_tokens must be an int"),
    ("min_tokens", -1, "min_tokens must be in [0, max_tokens (16)], got -1"),
    ("min_tokens", 17, "min_tokens must be in [0, max_tokens (16)], got 17"),
    ("min_tokens", None, "min_tokens must be an int"),
    ("temperature", -1, "temperature must be >= 0, got -1"),
    ("temperature", float("nan"), "temperature must be finite"),
    ("temperature", float("inf"), "temperature must be finite"),
    ("temperature", 1e300, "temperature must be finite and at most 3.403e+38 in size"),  # inf
    ("repetition_penalty", 3.5e38, "repetition_penalty must be finite and at most"),  # in f32
    ("temperature", "0.5", "temperature must be a number"),
    ("temperature", False, "temperature must be a number"),
    ("top_k", -2, "top_k must be >= 1, or 0 or -1 for off, got -2"),
    ("top_k", 2.0, "top_k must be an int"),
    ("top_k", True, "top_k must be an int"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.01, "top_p must be in (0, 1]"),
    ("top_p", "1", "top_p must be a number"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("presence_penalty", -2.5, "presence_penalty must be in [-2, 2], got -2.5"),
    ("presence_penalty", 2.01, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", 3, "frequency_penalty must be in [-2, 2], got 3"),
    ("frequency_penalty", None, "frequency_penalty must be a number"),
    ("stop", "", "stop strings must be non-empty"),
    ("stop", ["ok", ""], "stop strings must be non-empty"),
    ("stop", ["ok", 3], "stop strings must be non-empty strings, got 3"),
    ("stop", 3, "stop must be a string or a list of strings"),
    ("stop_token_ids", [1, -1], "stop_token_ids must hold non-negative ints, got -1"),
    ("stop_token_ids", [True], "stop_token_ids must hold non-negative ints, got True"),
    ("stop_token_ids", ["2"], "stop_token_ids must hold non-negative ints"),
    ("stop_token_ids", 2, "stop_token_ids must be a list of ints"),
    ("ignore_eos", 1, "ignore_eos must be True or False, got 1"),
    ("ignore_eos", "yes", "ignore_eos must be True or False"),
    ("speculate", 0, "speculate must be True or False, got 0"),
    ("seed", -1, "seed must be in [0, 4294967295], got -1"),
    ("seed", 2**32, "seed must be in [0, 4294967295]"),
    ("seed", 1.0, "seed must be an int"),
    ("seed", "7", "seed must be an int"),
    ("logprobs", -1, f"logprobs must be in [0, {MAX_LOGPROBS}], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
    ("logprobs", True, "logprobs must be an int"),
    ("prompt_logprobs", 21, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got 21"),
    ("prompt_logprobs", "1", "prompt_logprobs must be an int"),
    ("structured", "json", "structured must be a StructuredOutput, a dict of its fields, or None"),
    ("structured", {"schema": {}}, "structured: unknown fields ['schema']"),
    ("structured", {}, "structured output: set exactly one of"),
]


@pytest.mark.parametrize("field,value,message", INVALID,
                         ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_values_raise_a_message_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert message in str(error.value)


def test_every_field_is_validated():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {field for field, _, _ in INVALID} == fields


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 1), ("min_tokens", 16), ("temperature", 0), ("top_k", 1), ("top_p", 1),
    ("top_p", 1e-6), ("min_p", 1), ("repetition_penalty", 1e-3), ("presence_penalty", -2),
    ("frequency_penalty", 2), ("seed", 0), ("seed", 2**32 - 1), ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS), ("prompt_logprobs", 0), ("max_tokens", np.int64(4)),
])
def test_bounds_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_min_tokens_is_checked_against_the_given_max_tokens():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens \(4\)\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[2, np.int32(3)]).stop_token_ids == (2, 3)
    assert type(SamplingParams(stop_token_ids=[np.int32(3)]).stop_token_ids[0]) is int
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1, repetition_penalty=2)
    for name in ("temperature", "top_p", "presence_penalty", "repetition_penalty", "min_p"):
        assert type(getattr(p, name)) is float, name


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_params_are_hashable_and_compare_by_value():
    assert SamplingParams(stop=["x"]) == SamplingParams(stop="x")
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))
