"""The JSON schema a JSON constraint compiles: the user's, rewritten so it admits no endless
number or string where the engine is told to bound them.

A JSON number has at most `MAX_FRACTION_DIGITS` digits after the point, always
(`bounded_numbers`: a `multipleOf` added to every number the schema leaves open, which only
narrows what is valid): SmolLM2 writes digits one token at a time and, unbounded, can repeat
them until max_tokens. The library writes a number with a `multipleOf` without an exponent.

A constraint's bounds (`StructuredOutput.max_string_length`, `max_integer_digits`) are written
into the schema the same way (`bounded_schema`), each only narrowing what is valid (the grammar
library has no option of its own for either): a string gets `maxLength` (the smaller of its own
and the bound), a number or integer `exclusiveMaximum: 10**digits` and
`exclusiveMinimum: -10**digits` (beside its own limits: the library keeps the tighter), a value
an `enum` or `const` lists is left as it is, an object (`"type": "object"`) that takes keys
beyond its `properties` takes only keys of at most the bound's length (`patternProperties`,
spelled to leave the named keys out, `other_keys_pattern`; where the object has
`patternProperties` of its own, its keys stay as they are), and a value the schema leaves free
(`{}`, `true`, an array without `items`) is any JSON whose strings and numbers are bounded
alike. A bound that no output can meet (`minLength` above it, a `minimum` beyond its digits) is
refused with a ValueError naming both.

Plain Python: the grammar module (`meshserve.serving.engine.grammar`) compiles what this gives.
"""

from __future__ import annotations

import dataclasses
import json

MAX_FRACTION_DIGITS = 8
_ANY_VALUE = {"anyOf": [{"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
                        {"type": "array", "items": {"$ref": "#/$defs/value"}},
                        {"type": "string"}, {"type": "number"}, {"type": "boolean"},
                        {"type": "null"}]}
ANY_OBJECT_SCHEMA = {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"},
                     "$defs": {"value": _ANY_VALUE}}
_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not schemas


def bounded_numbers(schema):
    """`schema` with `multipleOf: 10**-MAX_FRACTION_DIGITS` on every number type that has no
    `multipleOf` (see the module docstring); everything else as it is."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else bounded_numbers(value)
           for key, value in schema.items()}
    types = schema.get("type")
    is_number = types == "number" or (isinstance(types, list) and "number" in types)
    if is_number and "multipleOf" not in schema:
        out["multipleOf"] = 10.0 ** -MAX_FRACTION_DIGITS
    return out


def bounded_schema(schema, *, max_string_length: int | None = None,
                   max_integer_digits: int | None = None):
    """`schema` with its numbers' fraction digits bounded (`bounded_numbers`) and, where given,
    every string and every number's integer digits (see the module docstring). Raises
    ValueError where a bound leaves nothing the schema allows."""
    schema = bounded_numbers(schema)
    if max_string_length is None and max_integer_digits is None:
        return schema
    bounds = _Bounds(max_string_length, max_integer_digits)
    bounded = bounds.schema(schema)
    if not bounds.uses_any:
        return bounded
    if not isinstance(bounded, dict):
        bounded = {"$ref": _ANY_REF}
    return bounded | {"$defs": {**bounded.get("$defs", {}), _ANY_NAME: bounds.any_value()}}


_ANY_NAME = "meshserve_bounded_value"
_ANY_REF = f"#/$defs/{_ANY_NAME}"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
               "contains", "unevaluatedItems", "unevaluatedProperties")
_ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "deprecated",
                "readOnly", "writeOnly", "$id", "$schema", "x-guidance"}


@dataclasses.dataclass
class _Bounds:
    """One schema's walk for `bounded_schema`: the bounds, and whether a free value was
    replaced by the bounded any-value (then the schema needs its definition)."""

    max_string_length: int | None
    max_integer_digits: int | None
    uses_any: bool = False

    def schema(self, node):
        """`node` (a schema) bounded, its subschemas too."""
        if node is True or (isinstance(node, dict) and set(node) <= _ANNOTATIONS):
            self.uses_any = True
            return {"$ref": _ANY_REF}
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: self.schema(sub) for name, sub in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.schema(sub) for sub in value]
            elif key in _SCHEMA_ONE:
                out[key] = ([self.schema(sub) for sub in value] if isinstance(value, list)
                            else self.schema(value))
        types = node.get("type")
        types = set(types) if isinstance(types, list) else {types}
        is_listed = "enum" in node or "const" in node  # its few values are its own bound
        if "string" in types and not is_listed:
            self._string(out)
        if types & {"number", "integer"} and not is_listed:
            self._number(out)
        if "object" in types:
            self._object(out)
        if "array" in types and "items" not in node and "prefixItems" not in node:
            self.uses_any = True
            out["items"] = {"$ref": _ANY_REF}
        return out

    def any_value(self) -> dict:
        """Any JSON value, its strings and numbers bounded (JSON object mode's, bounded)."""
        value = json.loads(json.dumps(_ANY_VALUE).replace("#/$defs/value", _ANY_REF))
        return self.schema(bounded_numbers(value))

    def _string(self, out: dict) -> None:
        limit = self.max_string_length
        if limit is None:
            return
        least = _number_in(out, "minLength", 0)
        if least > limit:
            raise ValueError(f"minLength ({least}) is above max_string_length ({limit}): no "
                             "string meets both")
        out["maxLength"] = min(_number_in(out, "maxLength", limit), limit)

    def _number(self, out: dict) -> None:
        digits = self.max_integer_digits
        if digits is None:
            return
        top = 10 ** digits
        for name, sign in (("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1),
                           ("exclusiveMaximum", -1)):
            if sign * _number_in(out, name, 0) >= top:
                raise ValueError(f"{name} ({out[name]}) needs more than max_integer_digits "
                                 f"({digits}) digits before the point: no number meets both")
        out["exclusiveMaximum"] = min(_number_in(out, "exclusiveMaximum", top), top)
        out["exclusiveMinimum"] = max(_number_in(out, "exclusiveMinimum", -top), -top)

    def _object(self, out: dict) -> None:
        """Keys beyond `properties`, when the object takes any, of at most the bound's length
        (its own `patternProperties`, if any, stay as they are)."""
        limit = self.max_string_length
        extra = out.get("additionalProperties", True)
        if limit is None or extra is False or "patternProperties" in out:
            return
        if extra is True:
            self.uses_any = True
            extra = {"$ref": _ANY_REF}
        out["patternProperties"] = {other_keys_pattern(out.get("properties", {}), limit): extra}
        out["additionalProperties"] = False


def _number_in(schema: dict, name: str, default: float) -> float:
    """`schema[name]`, a number, or `default` when absent; ValueError for any other value (a
    draft-4 boolean `exclusiveMaximum`, a string), which a bound cannot be set beside."""
    value = schema.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number to bound it, got {value!r}")
    return value


def other_keys_pattern(names, limit: int) -> str:
    """A regex of the keys of at most `limit` characters other than `names`. A key that a
    pattern property matches must meet that schema too, on top of its own property's, so the
    named keys are left out; the library's regexes have no look-ahead, so this one spells the
    rest out, along a trie of the names."""
    trie: dict = {}
    for name in names:
        if len(name) <= limit:
            node = trie
            for char in name:
                node = node.setdefault(char, {})
            node[_NAME_END] = {}
    pattern = _keys_not_in(trie, limit)
    assert pattern is not None, "a key of one character outside the trie is always left"
    return "^" + pattern + "$"


_NAME_END = object()  # in a trie of names: one ends here


def _keys_not_in(node: dict, left: int) -> str | None:
    """A regex of the strings of at most `left` characters that, after `node`'s path, spell no
    name; None if there is none."""
    chars = [char for char in node if char is not _NAME_END]
    parts = []
    if left > 0:
        others = "[^" + "".join(_escaped(char) for char in chars) + "\\n]" if chars else "."
        parts.append(others + (f".{{0,{left - 1}}}" if left > 1 else ""))
        for char in chars:
            rest = _keys_not_in(node[char], left - 1)
            if rest is not None:
                parts.append(_escaped(char) + rest)
    if not parts:
        return None if _NAME_END in node else ""
    group = "(?:" + "|".join(parts) + ")"
    return group if _NAME_END in node else group + "?"


def _escaped(char: str) -> str:
    """`char` as a regex (or character class) reads it: ASCII punctuation escaped."""
    return "\\" + char if char.isascii() and not char.isalnum() and char != " " else char
