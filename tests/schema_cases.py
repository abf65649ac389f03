"""JSON Schemas that structured-output tests run end to end (the Python API and the
server), each output checked with ``jsonschema``: nested objects, arrays of objects,
enums, patterns, ``anyOf`` of objects and of scalars, numeric bounds, optional
properties, ``$ref`` / ``$defs`` (a Pydantic model's shape), and schemas that leave
numbers and objects open (xspec compiles them closed and bounded). Strings and arrays
are bounded by ``maxLength`` / ``maxItems``: an unbounded one is unbounded for the model
too (docs/structured_output.md, "Limits")."""

from __future__ import annotations

import json
from typing import Any

import jsonschema


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: every property required unless ``required`` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,9}$"}
SCHEMAS: dict[str, Any] = {
    "nested": _obj(
        {
            "user": _obj(
                {
                    "name": {"type": "string", "maxLength": 12},
                    "address": _obj(
                        {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                    ),
                }
            ),
            "active": {"type": "boolean"},
        }
    ),
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": _obj({"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": NAME}),
            }
        }
    ),
    "enums": _obj(
        {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "enum": [1, 2, 3]},
            "mixed": {"enum": ["auto", 0, None, True]},
        }
    ),
    "patterns": _obj(
        {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "ident": NAME,
            "version": {"type": "string", "pattern": r"^v[0-9]+\.[0-9]+$", "maxLength": 10},
        }
    ),
    "any_of_objects": _obj(
        {
            "shape": {
                "anyOf": [
                    _obj({"kind": {"const": "circle"}, "r": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}),
                    _obj({"kind": {"const": "rect"}, "w": {"type": "integer", "minimum": 1}, "h": {"type": "integer", "minimum": 1}}),
                ]
            }
        }
    ),
    "any_of_scalars": {
        "type": "array",
        "minItems": 2,
        "maxItems": 4,
        "items": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "string", "maxLength": 6}, {"type": "boolean"}, {"type": "null"}]},
    },
    "numeric_bounds": _obj(
        {
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "offset": {"type": "integer", "exclusiveMaximum": 0},
            "score": {"type": "number"},
        }
    ),
    "optional_properties": _obj(
        {"name": NAME, "nick": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        required=["name"],
    ),
    "refs": {
        # a Pydantic model's shape: $defs, $ref, titles, no additionalProperties
        "$defs": {
            "Item": {
                "title": "Item",
                "type": "object",
                "properties": {"name": {"title": "Name", "type": "string"}, "price": {"title": "Price", "type": "number"}},
                "required": ["name", "price"],
            }
        },
        "title": "Order",
        "type": "object",
        "properties": {
            "items": {"title": "Items", "type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 3},
            "total": {"title": "Total", "type": "number"},
        },
        "required": ["items", "total"],
    },
    "unclosed_object": {
        # no additionalProperties: xspec writes only the listed properties
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
        "required": ["name", "tags"],
    },
}  # fmt: skip


def response_format(name: str) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``SCHEMAS[name]``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def check(name: str, text: str) -> Any:
    """The parsed output; fails the test unless it parses and validates."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{name}: output is not JSON ({e}): {text!r}") from None
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{name}: output does not validate ({e.message}): {text!r}") from None
    return value


# a small reference schema as a response_format (the server tests that need one)
REF_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,10}$"},
        "kind": {"enum": ["function", "class"]},
        "line": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "kind", "line"],
    "additionalProperties": False,
}
REF_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "ref", "schema": REF_SCHEMA, "strict": True},
}
