"""xspec.json_schema: where closing a schema could leave nothing to write, it stays as given
(the closed-and-bounded compilation itself: tests/test_grammar.py, through a compiler)."""

from __future__ import annotations

from xspec.json_schema import SAFE_INTEGER, compact_schema


def test_schemas_whose_closing_could_empty_them_stay_as_given() -> None:
    part = {"type": "object", "properties": {"a": {"type": "string"}}}
    both = {"allOf": [part, {"properties": {"b": {"type": "string"}}}]}
    assert compact_schema(both) == both
    shared = {"$ref": "#/$defs/p", "properties": {"b": {"type": "string"}}, "$defs": {"p": part}}
    assert compact_schema(shared)["$defs"] == {"p": part}
    assert "additionalProperties" not in compact_schema(shared)  # its own $ref beside
    # a bound given on one side only: the other is added unless it would contradict it
    assert compact_schema({"type": "integer", "minimum": 2**60}) == {
        "type": "integer", "minimum": 2**60
    }  # fmt: skip
    assert compact_schema({"type": ["integer", "null"], "multipleOf": 5})["maximum"] == SAFE_INTEGER
    assert compact_schema(True) is True
    other = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}
    assert compact_schema(other) == other  # closed, "b" could not be written
