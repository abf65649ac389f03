"""JSON Schemas as xspec compiles them: closed and bounded (:func:`compact_schema`).

A grammar engine enforces a schema as written; a weak model under a schema that admits
any further key, or any number of digits, can keep writing until ``max_tokens`` and
return JSON that does not parse. :func:`compact_schema` closes and bounds a schema
without admitting anything the schema itself refuses (docs/structured_output.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NUMBER_STEP", "SAFE_INTEGER", "compact_schema"]

# A JSON Schema is compiled closed and bounded (:func:`compact_schema`): numbers within
# JSON's interoperable integer range (RFC 8259, section 6), at most 9 decimal places.
SAFE_INTEGER = 2**53 - 1
NUMBER_STEP = 1e-9


def compact_schema(schema: Any) -> Any:
    """``schema`` as xspec compiles it: closed and bounded, so that every value a model
    writes under it ends (a small model at T > 0 otherwise writes digits, or keys, until
    ``max_tokens``). Every document the result admits is valid under ``schema``:

    - an object schema with ``properties`` (that ``required`` names no other) and no
      ``additionalProperties`` / ``patternProperties`` admits only its listed properties (as xgrammar's strict mode,
      vLLM's default); set ``additionalProperties`` to admit others;
    - an ``integer`` or ``number`` without a bound gets JSON's interoperable one,
      +-(2**53 - 1), and a ``number`` without ``multipleOf`` at most 9 decimal places
      (``multipleOf: 1e-9``); no exponent is written under a bound.

    Left as given: subschemas under ``allOf``, ``not``, ``if`` / ``then`` / ``else``, a node
    whose ``anyOf`` / ``oneOf`` / ``$ref`` is intersected with its own object keywords
    (closing either side could leave nothing), and ``$defs`` when any ``$ref`` has
    sibling keywords."""
    if not isinstance(schema, dict):
        return schema
    shared_defs = _refs_with_siblings(schema)
    return _compact(schema, close_defs=not shared_defs)


_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "minProperties")
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "not", "if", "then", "else")
_ANNOTATIONS = {"$ref", "title", "description", "default", "examples", "$comment"}


def _refs_with_siblings(schema: Any) -> bool:
    """Whether any ``$ref`` in ``schema`` is intersected with other keywords, or any
    ``allOf`` exists: then a definition cannot be closed safely."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "allOf" in node or ("$ref" in node and set(node) - _ANNOTATIONS):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _compact(node: Any, close_defs: bool, depth: int = 0) -> Any:
    if not isinstance(node, dict) or depth > 256:  # deeper: llguidance refuses the schema
        return node
    out = dict(node)

    def sub(value: Any) -> Any:
        return _compact(value, close_defs, depth + 1)

    shaped = any(k in node for k in _OBJECT_KEYS)
    if isinstance(props := node.get("properties"), dict):
        out["properties"] = {k: sub(v) for k, v in props.items()}
        required = node.get("required", [])
        if (
            not any(k in node for k in _OPEN_KEYS + _APPLICATORS)
            and isinstance(required, list)
            and set(required) <= set(props)  # else closing would leave nothing
        ):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = sub(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        out["items"] = sub(node["items"])
    for key in ("prefixItems",) + (() if shaped else ("anyOf", "oneOf")):
        if isinstance(node.get(key), list):
            out[key] = [sub(v) for v in node[key]]
    for key in ("$defs", "definitions"):
        if close_defs and isinstance(node.get(key), dict):
            out[key] = {k: sub(v) for k, v in node[key].items()}
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if types & {"integer", "number"}:
        _bound(out, "number" in types)
    return out


def _bound(node: dict[str, Any], fractional: bool) -> None:
    """Give a numeric schema the bounds it lacks (never one that contradicts its own)."""
    low = [node[k] for k in ("minimum", "exclusiveMinimum") if _number(node.get(k))]
    high = [node[k] for k in ("maximum", "exclusiveMaximum") if _number(node.get(k))]
    if not low and all(h >= -SAFE_INTEGER for h in high):
        node["minimum"] = -SAFE_INTEGER
    if not high and all(lo <= SAFE_INTEGER for lo in low):
        node["maximum"] = SAFE_INTEGER
    if fractional and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
