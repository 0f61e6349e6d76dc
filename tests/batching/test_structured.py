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
