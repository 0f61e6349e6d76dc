"""StructuredOutput: one constraint per request, checked for shape on construction; the packed
mask layout. (Compiling and matching: tests/serving/test_grammar.py.)"""

import json

import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import StructuredOutput, allowed_ids, mask_words

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_each_kind_is_one_constraint_with_a_key():
    cases = {"json_schema": SCHEMA, "json_object": True, "regex": "[a-z]+", "choice": ["x", "y"],
             "grammar": 'start: "x"'}
    for kind, value in cases.items():
        structured = StructuredOutput(**{kind: value})
        assert structured.kind == kind and structured.key[0] == kind


def test_a_schema_is_compact_json_in_its_own_key_order():
    from_dict = StructuredOutput(json_schema=SCHEMA)
    from_text = StructuredOutput(json_schema=json.dumps(SCHEMA, indent=2))
    assert from_dict == from_text and from_dict.key == from_text.key
    assert from_dict.json_schema == '{"type":"object","properties":{"b":{"type":"integer"},' \
                                    '"a":{"type":"string"}}}'
    assert hash(SamplingParams(structured=from_dict)) == hash(SamplingParams(structured=from_text))


@pytest.mark.parametrize("fields,message", [
    ({}, "set exactly one of json_schema, json_object, regex, choice, grammar; got none"),
    ({"regex": "a", "choice": ["a"]}, "set exactly one of"),
    ({"json_object": False}, "got none"),
    ({"json_object": 1}, "structured.json_object must be True or False"),
    ({"json_schema": "{not json"}, "structured.json_schema is not valid JSON"),
    ({"json_schema": [1, 2]}, "structured.json_schema must be a JSON object"),
    ({"json_schema": {"x": float("nan")}}, "structured.json_schema cannot be written as JSON"),
    ({"regex": 3}, "structured.regex must be a string, got int"),
    ({"regex": ""}, "structured.regex is empty"),
    ({"grammar": "start: \ud800"}, "structured.grammar holds a lone surrogate"),
    ({"choice": "abc"}, "structured.choice must be a list of strings"),
    ({"choice": []}, "structured.choice is empty"),
    ({"choice": ["a", ""]}, "structured.choice[1] is empty"),
    ({"choice": ["a", 2]}, "structured.choice[1] must be a string"),
])
def test_malformed_constraints_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as error:
        StructuredOutput(**fields)
    assert message in str(error.value)


def test_sampling_params_take_a_dict_of_fields():
    params = SamplingParams(structured={"choice": ["yes", "no"]})
    assert params.structured == StructuredOutput(choice=("yes", "no"))


def test_mask_words_and_allowed_ids_use_the_packed_layout():
    assert [mask_words(v) for v in (1, 32, 33, 49152)] == [1, 1, 2, 1536]
    mask = np.zeros(2, np.int32)
    mask.view(np.uint32)[:] = [(1 << 0) | (1 << 31), 1 << 5]  # bit t % 32 of word t // 32
    assert allowed_ids(mask).tolist() == [0, 31, 37]


@pytest.mark.parametrize("fields,message", [
    ({"json_object": True, "max_string_length": 0}, r"max_string_length must be in \[1, 65536\]"),
    ({"json_object": True, "max_integer_digits": 16}, r"max_integer_digits must be in \[1, 15\]"),
    ({"json_object": True, "max_string_length": True}, "max_string_length must be an int"),
    ({"regex": "a+", "max_integer_digits": 3}, "bounds JSON .* not regex"),
    ({"grammar": 'start: "x"', "max_string_length": 3}, "bounds JSON .* not grammar"),
])
def test_bounds_are_checked_and_for_json_only(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**fields)


def test_bounds_are_part_of_the_key_and_the_engines_fill_only_the_unset_ones():
    plain = StructuredOutput(json_schema=SCHEMA)
    bounded = StructuredOutput(json_schema=SCHEMA, max_string_length=8)
    assert plain.key != bounded.key and bounded.key[2] == (8, None)
    defaults = {"max_string_length": 4, "max_integer_digits": 3}
    assert plain.with_default_bounds(**defaults).bounds == (4, 3)
    assert bounded.with_default_bounds(**defaults).bounds == (8, 3)
    regex = StructuredOutput(regex="a+")
    assert regex.with_default_bounds(**defaults) is regex
    assert SamplingParams(structured={"json_object": True,
                                      "max_integer_digits": 2}).structured.bounds == (None, 2)
