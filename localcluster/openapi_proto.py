"""A swagger 2.0 document (as JSON) encoded as gnostic's `openapi.v2.Document` protobuf: the form kubectl asks
/openapi/v2 for (`Accept: application/com.github.proto-openapi.spec.v2@v1.0+protobuf`, client-go discovery
OpenAPISchema) and parses with kube-openapi pkg/util/proto NewOpenAPIData for its client-side validation.

Field numbers: openapiv2/OpenAPIv2.proto of google/gnostic-models v0.6.8 (commit 577692584cdf, the version
kubectl v1.32 vendors), the same messages as google/gnostic's at 96635ff3a800e184f8b2f7bf9b3b765d0fa071cd.
Wire format: https://protobuf.dev/programming-guides/encoding/ (proto3: a zero scalar is left out; a message
present in the JSON is sent even when empty, so that `properties: {}` stays a kind with no fields, which
kube-openapi tells from an absent one). A JSON map is a repeated Named* message (name = 1, value = 2), in the
document's order; an `x-` key is a NamedAny vendor extension; an Any (default, enum, example, extension value)
carries its value as YAML in `yaml` (= 2): the value's JSON text, which YAML reads as the same value.

A key that is not part of swagger 2.0 where it stands raises ValueError naming it and where it is: the
document served must say all it means. Pure.
"""

from __future__ import annotations

import json
import struct
from typing import Any

# A message: JSON key -> (field number, codec); "x-" -> the field of its vendor extensions. A codec is one of
# the scalar names below, a message (a dict), ("repeated", codec), ("named", codec) (a JSON map as repeated
# Named* entries), or a function (JSON value, where) -> bytes for a oneof.
STRING, STRINGS, BOOL, INT, DOUBLE, ANY, ANYS = "string", "strings", "bool", "int", "double", "any", "anys"
Spec = dict[str, tuple[int, Any]]

EXTERNAL_DOCS: Spec = {"description": (1, STRING), "url": (2, STRING), "x-": (3, None)}
# The validation keywords shared, in this order, by PrimitivesItems and the non-body parameters.
_PRIMITIVE_KEYS = [
    ("type", STRING), ("format", STRING), ("items", None), ("collectionFormat", STRING), ("default", ANY),
    ("maximum", DOUBLE), ("exclusiveMaximum", BOOL), ("minimum", DOUBLE), ("exclusiveMinimum", BOOL),
    ("maxLength", INT), ("minLength", INT), ("pattern", STRING), ("maxItems", INT), ("minItems", INT),
    ("uniqueItems", BOOL), ("enum", ANYS), ("multipleOf", DOUBLE),
]  # fmt: skip


def _primitives(head: list[tuple[str, Any]], items: Spec | None) -> Spec:
    """A message made of head's fields (from 1), then the primitive keywords, then the vendor extensions."""
    keys = [*head, *((k, items if k == "items" else c) for k, c in _PRIMITIVE_KEYS)]
    spec: Spec = {key: (n, codec) for n, (key, codec) in enumerate(keys, 1)}
    spec["x-"] = (len(keys) + 1, None)
    return spec


PRIMITIVES_ITEMS: Spec = {}
PRIMITIVES_ITEMS.update(_primitives([], PRIMITIVES_ITEMS))  # items nest
_PARAMETER_HEAD = [("required", BOOL), ("in", STRING), ("description", STRING), ("name", STRING)]
HEADER_OR_PATH_PARAMETER = _primitives(_PARAMETER_HEAD, PRIMITIVES_ITEMS)
QUERY_OR_FORM_PARAMETER = _primitives([*_PARAMETER_HEAD, ("allowEmptyValue", BOOL)], PRIMITIVES_ITEMS)

SCHEMA: Spec = {}
SCHEMA.update({
    "$ref": (1, STRING), "format": (2, STRING), "title": (3, STRING), "description": (4, STRING),
    "default": (5, ANY), "multipleOf": (6, DOUBLE), "maximum": (7, DOUBLE), "exclusiveMaximum": (8, BOOL),
    "minimum": (9, DOUBLE), "exclusiveMinimum": (10, BOOL), "maxLength": (11, INT), "minLength": (12, INT),
    "pattern": (13, STRING), "maxItems": (14, INT), "minItems": (15, INT), "uniqueItems": (16, BOOL),
    "maxProperties": (17, INT), "minProperties": (18, INT), "required": (19, STRINGS), "enum": (20, ANYS),
    "additionalProperties": (21, lambda v, where: _additional_properties(v, where)),
    "type": (22, lambda v, where: _message({"value": [v] if isinstance(v, str) else v}, TYPE_ITEM, where)),
    "items": (23, lambda v, where: _message({"schema": v if isinstance(v, list) else [v]}, ITEMS, where)),
    "allOf": (24, ("repeated", SCHEMA)), "properties": (25, {"": (1, ("named", SCHEMA))}),
    "discriminator": (26, STRING), "readOnly": (27, BOOL), "externalDocs": (29, EXTERNAL_DOCS),
    "example": (30, ANY), "x-": (31, None),
})  # fmt: skip
TYPE_ITEM: Spec = {"value": (1, STRINGS)}
ITEMS: Spec = {"schema": (1, ("repeated", SCHEMA))}
BODY_PARAMETER: Spec = {
    "description": (1, STRING), "name": (2, STRING), "in": (3, STRING), "required": (4, BOOL),
    "schema": (5, SCHEMA), "x-": (6, None),
}  # fmt: skip
JSON_REFERENCE: Spec = {"$ref": (1, STRING), "description": (2, STRING)}
NON_BODY = {"header": (1, HEADER_OR_PATH_PARAMETER), "formData": (2, QUERY_OR_FORM_PARAMETER),
            "query": (3, QUERY_OR_FORM_PARAMETER), "path": (4, HEADER_OR_PATH_PARAMETER)}  # fmt: skip
RESPONSE: Spec = {
    "description": (1, STRING),
    "schema": (2, lambda v, where: _tag(1, _message(v, SCHEMA, where))),  # SchemaItem: schema = 1
    "examples": (4, {"": (1, ("named", ANY))}), "x-": (5, None),
}  # fmt: skip
RESPONSES: Spec = {"": (1, ("named", lambda v, where: _response_value(v, where))), "x-": (2, None)}
OPERATION: Spec = {
    "tags": (1, STRINGS), "summary": (2, STRING), "description": (3, STRING),
    "externalDocs": (4, EXTERNAL_DOCS), "operationId": (5, STRING), "produces": (6, STRINGS),
    "consumes": (7, STRINGS),
    "parameters": (8, ("repeated", lambda v, where: _parameters_item(v, where))), "responses": (9, RESPONSES),
    "schemes": (10, STRINGS), "deprecated": (11, BOOL), "x-": (13, None),
}  # fmt: skip
PATH_ITEM: Spec = {
    "$ref": (1, STRING), "get": (2, OPERATION), "put": (3, OPERATION), "post": (4, OPERATION),
    "delete": (5, OPERATION), "options": (6, OPERATION), "head": (7, OPERATION), "patch": (8, OPERATION),
    "parameters": (9, ("repeated", lambda v, where: _parameters_item(v, where))), "x-": (10, None),
}  # fmt: skip
CONTACT: Spec = {"name": (1, STRING), "url": (2, STRING), "email": (3, STRING), "x-": (4, None)}
LICENSE: Spec = {"name": (1, STRING), "url": (2, STRING), "x-": (3, None)}
INFO: Spec = {
    "title": (1, STRING), "version": (2, STRING), "description": (3, STRING), "termsOfService": (4, STRING),
    "contact": (5, CONTACT), "license": (6, LICENSE), "x-": (7, None),
}  # fmt: skip
TAG: Spec = {
    "name": (1, STRING),
    "description": (2, STRING),
    "externalDocs": (3, EXTERNAL_DOCS),
    "x-": (4, None),
}
DOCUMENT: Spec = {
    "swagger": (1, STRING), "info": (2, INFO), "host": (3, STRING), "basePath": (4, STRING),
    "schemes": (5, STRINGS), "consumes": (6, STRINGS), "produces": (7, STRINGS),
    "paths": (8, {"": (2, ("named", PATH_ITEM)), "x-": (1, None)}),
    "definitions": (9, {"": (1, ("named", SCHEMA))}),
    "tags": (14, ("repeated", TAG)), "externalDocs": (15, EXTERNAL_DOCS), "x-": (16, None),
}  # fmt: skip
# A spec with the key "" is a JSON map: each of its keys (but x- ones) is an entry of that field.


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # an int64 below zero: its two's complement, ten bytes
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tag(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any(value: Any) -> bytes:
    return _tag(2, json.dumps(value, ensure_ascii=False).encode())


def _scalar(number: int, codec: str, value: Any, where: str) -> bytes:
    if codec == STRING:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, not {value!r}")
        return _tag(number, value.encode()) if value else b""
    if codec == STRINGS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings, not {value!r}")
        return b"".join(_tag(number, v.encode()) for v in value)
    if codec == BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, not {value!r}")
        return _varint(number << 3) + b"\x01" if value else b""
    if codec == INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, not {value!r}")
        return _varint(number << 3) + _varint(value) if value else b""
    if codec == DOUBLE:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number, not {value!r}")
        return _varint(number << 3 | 1) + struct.pack("<d", value) if value else b""
    if codec == ANY:
        return _tag(number, _any(value))
    if codec == ANYS:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, not {value!r}")
        return b"".join(_tag(number, _any(v)) for v in value)
    raise AssertionError(f"unknown codec {codec!r}")


def _field(number: int, codec: Any, value: Any, where: str) -> bytes:
    if isinstance(codec, str):
        return _scalar(number, codec, value, where)
    if isinstance(codec, dict):
        return _tag(number, _message(value, codec, where))
    if callable(codec):
        return _tag(number, codec(value, where))
    kind, inner = codec
    if kind == "repeated":
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, not {value!r}")
        return b"".join(_field(number, inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    # "named": one entry of a map, name = 1, value = 2
    name, item = value
    entry = _tag(1, name.encode()) + _field(2, inner, item, f"{where}.{name}")
    return _tag(number, entry)


def _message(value: Any, spec: Spec, where: str) -> bytes:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, not {value!r}")
    out = bytearray()
    for key, item in value.items():
        if key.startswith("x-") and "x-" in spec:  # a vendor extension: NamedAny
            out += _tag(spec["x-"][0], _tag(1, key.encode()) + _tag(2, _any(item)))
        elif "" in spec:  # an entry of a JSON map
            number, codec = spec[""]
            out += _field(number, codec, (key, item), where)
        elif key in spec and key != "x-":
            number, codec = spec[key]
            out += _field(number, codec, item, f"{where}.{key}")
        else:
            known = ", ".join(k for k in spec if k not in ("", "x-"))
            raise ValueError(f"{where}: {key!r} is not a swagger 2.0 field here (known: {known}, x-...)")
    return bytes(out)


def _additional_properties(value: Any, where: str) -> bytes:
    """AdditionalPropertiesItem: oneof schema = 1, boolean = 2 (a oneof member is sent even when false)."""
    if isinstance(value, bool):
        return _varint(2 << 3) + _varint(int(value))
    return _tag(1, _message(value, SCHEMA, where))


def _parameters_item(value: Any, where: str) -> bytes:
    """ParametersItem: oneof parameter = 1 (Parameter: body = 1 | NonBodyParameter = 2, by `in`), or
    json_reference = 2."""
    if isinstance(value, dict) and "$ref" in value:
        return _tag(2, _message(value, JSON_REFERENCE, where))
    where_in = value.get("in") if isinstance(value, dict) else None
    if where_in == "body":
        return _tag(1, _tag(1, _message(value, BODY_PARAMETER, where)))
    if where_in not in NON_BODY:
        raise ValueError(f"{where}.in must be one of body, {', '.join(NON_BODY)}, not {where_in!r}")
    number, spec = NON_BODY[where_in]
    return _tag(1, _tag(2, _tag(number, _message(value, spec, where))))


def _response_value(value: Any, where: str) -> bytes:
    """ResponseValue: oneof response = 1, json_reference = 2."""
    if isinstance(value, dict) and "$ref" in value:
        return _tag(2, _message(value, JSON_REFERENCE, where))
    return _tag(1, _message(value, RESPONSE, where))


def encode(document: dict[str, Any]) -> bytes:
    """The protobuf bytes of a swagger 2.0 document (ValueError for anything swagger 2.0 has no field for)."""
    return _message(document, DOCUMENT, "swagger")
