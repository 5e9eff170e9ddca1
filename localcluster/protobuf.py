"""Kubernetes' protobuf encoding, read: the bodies typed kubectl commands send (`kubectl create namespace`,
`create secret`, `create configmap` post `application/vnd.kubernetes.protobuf`), turned into the JSON objects
the rest of the server works with.

The envelope is the 4 bytes "k8s\\0" and a runtime.Unknown message (typeMeta, raw, contentEncoding,
contentType; apimachinery pkg/runtime/serializer/protobuf/protobuf.go); `raw` is the object in the field
numbers of its generated.proto (k8s.io/api/core/v1/generated.proto, k8s.io/apimachinery/pkg/apis/meta/v1/
generated.proto).
Known: Namespace, Secret, ConfigMap, ServiceAccount, Service, Deployment and Job, each with the fields typed
`kubectl create` commands set (and common others); another kind, or a field not known here that holds a value,
gets a clear 415 rather than being dropped silently.
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
SKIP = "skip"  # a field read and dropped (the status of a create: the server sets it)
INT_OR_STRING = "intOrString"
LABEL_SELECTOR = {1: ("matchLabels", ("map", STRING))}
SERVICE_PORT = {
    1: ("name", STRING), 2: ("protocol", STRING), 3: ("port", INT), 4: ("targetPort", INT_OR_STRING),
    5: ("nodePort", INT), 6: ("appProtocol", STRING),
}  # fmt: skip
SERVICE_SPEC = {
    1: ("ports", ("list", SERVICE_PORT)), 2: ("selector", ("map", STRING)), 3: ("clusterIP", STRING),
    4: ("type", STRING), 5: ("externalIPs", STRINGS), 7: ("sessionAffinity", STRING),
    10: ("externalName", STRING), 17: ("ipFamilyPolicy", STRING), 18: ("clusterIPs", STRINGS),
    19: ("ipFamilies", STRINGS),
}  # fmt: skip
RESOURCES = {1: ("limits", ("map", "quantity")), 2: ("requests", ("map", "quantity"))}
CONTAINER_PORT = {
    1: ("name", STRING),
    2: ("hostPort", INT),
    3: ("containerPort", INT),
    4: ("protocol", STRING),
}
ENV_VAR = {1: ("name", STRING), 2: ("value", STRING)}
CONTAINER = {
    1: ("name", STRING), 2: ("image", STRING), 3: ("command", STRINGS), 4: ("args", STRINGS),
    5: ("workingDir", STRING), 6: ("ports", ("list", CONTAINER_PORT)), 7: ("env", ("list", ENV_VAR)),
    8: ("resources", RESOURCES), 13: ("terminationMessagePath", STRING), 14: ("imagePullPolicy", STRING),
}  # fmt: skip
POD_SPEC = {
    2: ("containers", ("list", CONTAINER)), 3: ("restartPolicy", STRING),
    4: ("terminationGracePeriodSeconds", INT), 7: ("nodeSelector", ("map", STRING)),
    8: ("serviceAccountName", STRING),
}  # fmt: skip
POD_TEMPLATE = {1: ("metadata", OBJECT_META), 2: ("spec", POD_SPEC)}
DEPLOYMENT_SPEC = {
    1: ("replicas", INT), 2: ("selector", LABEL_SELECTOR), 3: ("template", POD_TEMPLATE),
    4: ("strategy", {1: ("type", STRING)}), 5: ("minReadySeconds", INT),
    6: ("revisionHistoryLimit", INT), 9: ("progressDeadlineSeconds", INT),
}  # fmt: skip
JOB_SPEC = {
    1: ("parallelism", INT), 2: ("completions", INT), 3: ("activeDeadlineSeconds", INT),
    4: ("selector", LABEL_SELECTOR), 5: ("manualSelector", BOOL), 6: ("template", POD_TEMPLATE),
    7: ("backoffLimit", INT), 8: ("ttlSecondsAfterFinished", INT),
}  # fmt: skip
KINDS: dict[tuple[str, str], dict[int, tuple[str, Any]]] = {
    ("v1", "Namespace"): {
        1: ("metadata", OBJECT_META),
        2: ("spec", {1: ("finalizers", STRINGS)}),
        3: ("status", SKIP),
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
    ("v1", "Service"): {1: ("metadata", OBJECT_META), 2: ("spec", SERVICE_SPEC), 3: ("status", SKIP)},
    ("apps/v1", "Deployment"): {
        1: ("metadata", OBJECT_META), 2: ("spec", DEPLOYMENT_SPEC), 3: ("status", SKIP),
    },
    ("batch/v1", "Job"): {1: ("metadata", OBJECT_META), 2: ("spec", JOB_SPEC), 3: ("status", SKIP)},
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
        return value - (1 << 64) if isinstance(value, int) and value >= 1 << 63 else value
    if reader == INT_OR_STRING:  # type 0: intVal (2), type 1: strVal (3)
        parts = dict(fields(value))
        return parts.get(3, b"").decode() if parts.get(1) == 1 else parts.get(2, 0)
    if reader == "quantity":  # resource.Quantity: its string (1)
        return dict(fields(value)).get(1, b"").decode()
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


def _empty(value: int | bytes) -> bool:
    """Whether a field holds nothing: 0, "", or a message whose own fields all hold nothing."""
    if value in (b"", 0):
        return True
    if isinstance(value, int):
        return False
    try:
        return all(_empty(v) for _, v in fields(value))
    except ValueError:
        return False


def message(data: bytes, schema: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    """A message as JSON, after its schema (unknown fields are dropped)."""
    out: dict[str, Any] = {}
    for number, value in fields(data):
        if number not in schema:
            if _empty(value):
                continue  # an empty field (proto2 sends unset strings as ""): nothing lost
            raise Unreadable(f"field {number} is not one this server reads")
        name, reader = schema[number]
        if reader == SKIP:
            continue
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


class Unreadable(ValueError):
    """A protobuf field this server does not know, with a value: reading on would lose it."""


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object of a protobuf request body; 415 for a kind this server cannot read."""
    if not body.startswith(MAGIC):
        raise ApiError(400, "BadRequest", "a protobuf body must start with the k8s\\0 prefix")
    kind = ""
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
    except Unreadable as e:
        raise ApiError(
            415, "UnsupportedMediaType",
            f"this emulated API server cannot read this {kind} in protobuf ({e}); send it as JSON or YAML "
            "(kubectl apply -f FILE)",
        ) from None  # fmt: skip
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"the protobuf body does not parse: {e}") from None
    return {"apiVersion": api_version, "kind": kind, **obj}
