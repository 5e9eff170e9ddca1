"""Kubernetes' protobuf encoding, read: the bodies typed kubectl commands send (`kubectl create namespace`,
`create secret`, `create configmap` post `application/vnd.kubernetes.protobuf`), turned into the JSON objects
the rest of the server works with.

The envelope is the 4 bytes "k8s\\0" and a runtime.Unknown message (typeMeta, raw, contentEncoding,
contentType; apimachinery pkg/runtime/serializer/protobuf/protobuf.go); `raw` is the object in the field
numbers of its generated.proto (k8s.io/api/core/v1/generated.proto, k8s.io/apimachinery/pkg/apis/meta/v1/
generated.proto).
Only the kinds kubectl creates with typed clients are known; any other kind gets a clear 415.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from .semantics import ApiError

MAGIC = b"k8s\x00"

# A message: field number -> (JSON name, how to read it). Readers: "string", "bytes" (base64 in JSON), "int",
# "bool", "time", "strings" (repeated), a nested message (a dict), ("map", value reader), ("list", message).
STRING, BYTES, INT, BOOL, TIME, STRINGS = "string", "bytes", "int", "bool", "time", "strings"

OWNER_REFERENCE = {
    1: ("kind", STRING), 3: ("name", STRING), 4: ("uid", STRING), 5: ("apiVersion", STRING),
    6: ("controller", BOOL), 7: ("blockOwnerDeletion", BOOL),
}  # fmt: skip
OBJECT_META = {
    1: ("name", STRING), 2: ("generateName", STRING), 3: ("namespace", STRING), 5: ("uid", STRING),
    6: ("resourceVersion", STRING), 7: ("generation", INT), 8: ("creationTimestamp", TIME),
    11: ("labels", ("map", STRING)), 12: ("annotations", ("map", STRING)),
    13: ("ownerReferences", ("list", OWNER_REFERENCE)), 14: ("finalizers", STRINGS),
}  # fmt: skip
KINDS: dict[tuple[str, str], dict[int, tuple[str, Any]]] = {
    ("v1", "Namespace"): {
        1: ("metadata", OBJECT_META),
        2: ("spec", {1: ("finalizers", STRINGS)}),
    },
    ("v1", "Secret"): {
        1: ("metadata", OBJECT_META), 2: ("data", ("map", BYTES)), 3: ("type", STRING),
        4: ("stringData", ("map", STRING)), 5: ("immutable", BOOL),
    },
    ("v1", "ConfigMap"): {
        1: ("metadata", OBJECT_META), 2: ("data", ("map", STRING)), 3: ("binaryData", ("map", BYTES)),
        4: ("immutable", BOOL),
    },
    ("v1", "ServiceAccount"): {1: ("metadata", OBJECT_META)},
}  # fmt: skip
UNKNOWN = {1: ("typeMeta", {1: ("apiVersion", STRING), 2: ("kind", STRING)}), 2: ("raw", "raw")}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a protobuf message: ints for varints, bytes for length-delimited
    fields (fixed-width fields are skipped: none of the known kinds has them)."""
    out, i = [], 0
    while i < len(data):
        tag, i = _varint(data, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _varint(data, i)
            out.append((number, value))
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            out.append((number, data[i : i + size]))
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _read(reader: Any, value: int | bytes) -> Any:
    if reader == STRING:
        return value.decode() if isinstance(value, bytes) else str(value)
    if reader in (BYTES, "raw"):
        return base64.b64encode(value).decode() if reader == BYTES else value
    if reader == INT:
        return value
    if reader == BOOL:
        return bool(value)
    if reader == TIME:
        seconds = dict(fields(value)).get(1, 0)
        if not seconds:
            return ""  # the zero time: absent
        return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(reader, dict):
        return message(value, reader)
    raise ValueError(f"unknown reader {reader!r}")


def message(data: bytes, schema: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    """A message as JSON, after its schema (unknown fields are dropped)."""
    out: dict[str, Any] = {}
    for number, value in fields(data):
        if number not in schema:
            continue
        name, reader = schema[number]
        if reader == STRINGS:
            out.setdefault(name, []).append(_read(STRING, value))
        elif isinstance(reader, tuple) and reader[0] == "map":
            entry = dict(fields(value))  # a map entry: key = 1, value = 2
            out.setdefault(name, {})[_read(STRING, entry.get(1, b""))] = _read(reader[1], entry.get(2, b""))
        elif isinstance(reader, tuple) and reader[0] == "list":
            out.setdefault(name, []).append(message(value, reader[1]))
        else:
            value = _read(reader, value)
            if value not in ("", 0, False):  # Go's omitempty: a zero scalar is an absent field in JSON
                out[name] = value
    return out


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object of a protobuf request body; 415 for a kind this server cannot read."""
    if not body.startswith(MAGIC):
        raise ApiError(400, "BadRequest", "a protobuf body must start with the k8s\\0 prefix")
    try:
        envelope = message(body[len(MAGIC) :], UNKNOWN)
        type_meta = envelope.get("typeMeta") or {}
        api_version, kind = type_meta.get("apiVersion", ""), type_meta.get("kind", "")
        schema = KINDS.get((api_version, kind))
        if schema is None:
            known = ", ".join(k for _, k in KINDS)
            raise ApiError(
                415, "UnsupportedMediaType",
                f"this emulated API server reads protobuf bodies of {known} only, not {kind or 'this kind'}; "
                "send the object as JSON or YAML (kubectl apply -f FILE)",
            )  # fmt: skip
        obj = message(envelope.get("raw", b""), schema)
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"the protobuf body does not parse: {e}") from None
    return {"apiVersion": api_version, "kind": kind, **obj}
