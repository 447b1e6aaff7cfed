"""The JSON schema a grammar decodes under: the declared schema with closed objects and bounds.

One function serves every schema a grammar holds — a ``@tool``'s (from pydantic), a raw
OpenAI-format tool's (``tool(dict)``, the server's ``tools``) and a structured answer's — so a
small model can neither invent keys nor ramble until ``max_new_tokens``::

    bounded_schema({"type": "object", "properties": {"city": {"type": "string"}}})
    # {"type": "object", "properties": {"city": {"type": "string", "maxLength": 200}},
    #  "additionalProperties": False}

The rules, for the schema and each subschema (walked through schema keywords only, never
``enum``/``const``/``default`` data):

- an object that declares ``properties`` and says nothing about other keys is closed
  (``additionalProperties: false``): only the declared keys, each at most once (an object
  built with ``allOf`` is left open: its members declare the keys between them);
- an object that allows other keys (``additionalProperties: true`` or a schema, or a bare
  ``{"type": "object"}`` map) keeps allowing them, bounded: their values follow the bounded
  value schema, a map without declared keys gets keys of at most ``MAX_KEY_LENGTH`` characters,
  and the number of keys is capped (``maxProperties``) where llguidance can express it (every
  declared key required: llguidance 1.9 refuses ``maxProperties`` beside optional ones);
- every string gets a ``maxLength``, every array a ``maxItems``, every integer (and a number's
  integer part) the range of ``MAX_SAFE_INTEGER`` (a small model otherwise writes digits until
  ``max_new_tokens``; llguidance cannot bound a number's decimals);
- a schema that allows any value (``{}``, ``true``, a bare description) allows any bounded
  scalar (string, number, boolean, null).
"""

from __future__ import annotations

import copy
from typing import Any

MAX_SAFE_INTEGER = 2**53 - 1
"""Integers without ``minimum``/``maximum`` stay within ±this (JSON's interoperable range, RFC 8259)."""
MAX_KEY_LENGTH = 64
"""Keys of a free-form map (an object without declared ``properties``) have at most this many
characters."""

# Schema keywords whose value is one subschema, a {name: subschema} map, or a list of subschemas
# of values the model writes (``not``, ``if`` and ``propertyNames`` are conditions: a bound there
# would change what they say, so they are not walked).
_ONE_SCHEMA = (
    "items", "additionalProperties", "additionalItems", "contains", "then", "else",
    "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_VALUE_KEYWORDS = frozenset({
    "type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties", "items",
    "prefixItems", "additionalProperties", "patternProperties", "required",
})  # fmt: skip
"""Keywords that say something about a value's type; a schema with none of them allows any value."""
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def bounded_schema(
    schema: dict[str, Any], *, max_string_length: int = 200, max_items: int = 16
) -> dict[str, Any]:
    """A copy of ``schema`` with closed objects and bounded strings, arrays and maps (module
    docstring). Existing bounds are kept; ``max_items`` also caps the keys a map may add.

    ``bounded_schema({"type": "string"})`` → ``{"type": "string", "maxLength": 200}``
    """
    if max_string_length < 1 or max_items < 1:
        raise ValueError("max_string_length and max_items must be at least 1")
    bounded = copy.deepcopy(schema)
    _Bounder(max_string_length, max_items).bound(bounded)
    return bounded


class _Bounder:
    """Adds the bounds in place, walking schema keywords."""

    def __init__(self, max_string_length: int, max_items: int) -> None:
        self.max_string_length = max_string_length
        self.max_items = max_items

    def any_value(self) -> dict[str, Any]:
        """Any scalar, strings bounded: what a schema that allows anything becomes."""
        return {"anyOf": [{"type": "string", "maxLength": self.max_string_length}, {"type": "number"},
                          {"type": "boolean"}, {"type": "null"}]}

    def bound(self, schema: Any, *, close: bool = True) -> None:
        """Bound ``schema`` in place; ``close=False`` leaves its own keys as they are (an
        ``allOf`` member: closing each member would refuse the keys the others declare)."""
        if not isinstance(schema, dict):
            return
        if not _VALUE_KEYWORDS & schema.keys():
            schema.update(self.any_value())
        types = _types(schema)
        if "string" in types and not {"maxLength", "enum", "const"} & schema.keys():
            schema["maxLength"] = self.max_string_length
        if "array" in types:
            self._bound_array(schema)
        if types & {"integer", "number"}:
            _bound_number(schema)
        if close and "allOf" not in schema and ("object" in types or "properties" in schema):
            self._bound_object(schema)
        self._walk(schema)

    def _bound_array(self, schema: dict[str, Any]) -> None:
        if "maxItems" not in schema:
            schema["maxItems"] = max(self.max_items, schema.get("minItems", 0))
        if schema.get("items", True) is True and "prefixItems" not in schema:
            schema["items"] = self.any_value()

    def _bound_object(self, schema: dict[str, Any]) -> None:
        """Close an object with declared properties; bound the other keys one that allows them."""
        declared = schema.get("properties")
        if isinstance(declared, dict) and not any(key in schema for key in _OTHER_KEYS):
            schema["additionalProperties"] = False
            return
        extra = schema.get("additionalProperties", True)
        if extra is False or "unevaluatedProperties" in schema:
            return
        value = extra if isinstance(extra, dict) else self.any_value()
        if not declared and "patternProperties" not in schema:
            # NOTE: a pattern bounds the keys' length; with declared keys it would also apply to
            # them (JSON Schema intersects), so it is used on free-form maps only.
            schema["patternProperties"] = {f"^.{{1,{MAX_KEY_LENGTH}}}$": value}
            schema["additionalProperties"] = False
        else:
            schema["additionalProperties"] = value
        required = set(schema.get("required", []))
        if "maxProperties" not in schema and set(declared or {}) <= required:
            schema["maxProperties"] = len(declared or {}) + self.max_items

    def _walk(self, schema: dict[str, Any]) -> None:
        for key in _ONE_SCHEMA:
            self.bound(schema.get(key))
        for key in _SCHEMA_MAPS:
            if isinstance(schema.get(key), dict):
                for subschema in schema[key].values():
                    self.bound(subschema)
        for key in _SCHEMA_LISTS:
            if isinstance(schema.get(key), list):
                for subschema in schema[key]:
                    self.bound(subschema, close=key != "allOf")


def _bound_number(schema: dict[str, Any]) -> None:
    """Add whichever side of ±``MAX_SAFE_INTEGER`` the schema leaves open (enums are bounded)."""
    if {"enum", "const"} & schema.keys():
        return
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -MAX_SAFE_INTEGER
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = MAX_SAFE_INTEGER


def _types(schema: dict[str, Any]) -> set[str]:
    """The JSON types ``schema["type"]`` names (empty when it names none)."""
    types = schema.get("type")
    return {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
