"""/openapi/v2: one swagger 2.0 document of every kind the store serves, with the definitions as the
kube-apiserver v1.32 publishes them there. kubectl reads it (in protobuf: `openapi_proto`) for client-side
validation, which it still does for a `kind: List` (kubectl pkg/validation: each item is walked against the
definition whose x-kubernetes-group-version-kind names its kind; kube-openapi pkg/util/proto/validation
refuses a field a definition with properties does not list, and a missing required one).

Where v2 differs from the v3 documents (`openapi`), after the real server:
- a described reference is `{$ref, description}` (swagger 2.0 has no allOf for that: `openapi._field`);
- a built-in type whose fields `openapi` lists only in part (`openapi.PARTIAL`) is an open object
  (`type: object`, no properties), so that kubectl never refuses a field a real server accepts;
- a kind without a detailed schema is `type: object` with its group-version-kind, and nothing else, as
  apiextensions-apiserver v0.32 pkg/controller/openapi/builder/builder.go buildKubeNative publishes a schema
  that keeps unknown fields ("we cannot add more properties here ... because kubectl will complain");
- a CRD's schema goes through the rules of apiextensions-apiserver v0.32 pkg/controller/openapi/v2/
  conversion.go ToStructuralOpenAPIV2 (allOf, anyOf, oneOf and not dropped; a nullable field untyped, without
  items or properties, and not required; x-kubernetes-preserve-unknown-fields: no items or properties, untyped
  if an object; an array left without items untyped), with defaults pruned (pkg/controller/openapi/
  controller.go: handler.PruneDefaults) and embedded resources given apiVersion, kind and metadata (builder.go
  addEmbeddedProperties).

Pure functions of the kinds the store serves.
"""

from __future__ import annotations

from typing import Any

from . import openapi
from .semantics import Resource

JUNCTORS = ("allOf", "anyOf", "oneOf", "not")


def _crd_v2(schema: dict[str, Any]) -> dict[str, Any]:
    """One node of a CRD's openAPIV3Schema as OpenAPI v2 publishes it (see the module docstring)."""
    out = {k: v for k, v in schema.items() if k not in (*JUNCTORS, "default", "nullable")}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _crd_v2(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _crd_v2(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _crd_v2(out["additionalProperties"])
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    if schema.get("nullable") is True:
        for key in ("type", "items", "properties"):
            out.pop(key, None)
    if preserve:
        out.pop("items", None)
        out.pop("properties", None)
    if out.get("type") == "array" and "items" not in out:
        out.pop("type")
    if preserve and out.get("type") == "object":
        out.pop("type")
    # the properties left (none once dropped above) that are nullable are not required
    kept = schema.get("properties", {}) if "properties" in out else {}
    nullable = {k for k, v in kept.items() if v.get("nullable") is True}
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict) and additional.get("nullable") is True:
        out.pop("required", None)
    elif nullable and "required" in out:
        out["required"] = [r for r in out["required"] if r not in nullable]
        if not out["required"]:
            del out["required"]
    if schema.get("x-kubernetes-embedded-resource") is True and not preserve:
        out.setdefault("properties", {}).update(_type_meta())
    return out


def _type_meta() -> dict[str, Any]:
    return {
        "apiVersion": {"type": "string", "description": openapi.API_VERSION},
        "kind": {"type": "string", "description": openapi.KIND},
        "metadata": openapi.field(openapi.META + "ObjectMeta", openapi.METADATA, openapi.V2_PREFIX),
    }


def _gvk(r: Resource) -> list[dict[str, str]]:
    return [{"group": r.group, "kind": r.kind, "version": r.version}]


def _kind(r: Resource) -> dict[str, Any]:
    """The definition of a custom resource, or of a built-in kind without a detailed schema here."""
    schema = r.schema
    if schema is None or schema.get("x-kubernetes-preserve-unknown-fields") is True:
        out: dict[str, Any] = {"type": "object"}
        if schema is None:
            out["description"] = f"{r.kind} ({r.api_version})."
    else:
        out = _crd_v2(schema)
        out.setdefault("properties", {}).update(_type_meta())
        out["properties"] = dict(sorted(out["properties"].items()))
    out["x-kubernetes-group-version-kind"] = _gvk(r)
    return out


def definitions(kinds: list[Resource]) -> dict[str, Any]:
    """Every kind's definition and the definitions they refer to."""
    out = openapi.schemas(kinds, openapi.V2_PREFIX)
    for r in kinds:
        name = openapi.schema_name(r)
        if r.schema is not None or name not in openapi.TYPES:
            out[name] = _kind(r)
    for name in openapi.PARTIAL & set(out):
        out[name] = {"description": out[name]["description"], "type": "object"}
    return out


def document(kinds: list[Resource], server_version: str) -> dict[str, Any]:
    """/openapi/v2: every kind's paths and definitions in one swagger 2.0 document."""
    paths: dict[str, Any] = {}
    for r in kinds:
        prefix = f"apis/{r.group}/{r.version}" if r.group else f"api/{r.version}"
        paths.update(openapi.kind_paths([r], prefix, v2=True))
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": server_version},
        "paths": paths,
        "definitions": definitions(kinds),
    }


JSON = "application/json"
PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"  # what the real server answers
# What /openapi/v2 serves, by the media types a client may name (kube-openapi pkg/handler/handler.go at the
# version kube-apiserver v1.32 vendors, 32ad38e42d3f: JSON first, then both spellings of the protobuf type;
# client-go asks for the older one, with "@").
MEDIA_TYPES = [
    ("application", "json", JSON),
    ("application", "com.github.proto-openapi.spec.v2@v1.0+protobuf", PROTOBUF),
    ("application", "com.github.proto-openapi.spec.v2.v1.0+protobuf", PROTOBUF),
]


def media_type(accept: str) -> str | None:
    """The content type /openapi/v2 answers this Accept header with, or None (406 Not Acceptable): the first
    clause, by quality then specificity (goautoneg, as the real handler), that a served type matches."""
    clauses = []
    for clause in (accept or "*/*").split(","):
        kind, *params = (p.strip() for p in clause.split(";"))
        main, _, sub = kind.partition("/")
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if main and quality > 0:
            clauses.append((-quality, main == "*", sub in ("*", ""), main, sub or "*"))
    for *_, main, sub in sorted(clauses, key=lambda c: c[:3]):
        for served_main, served_sub, content_type in MEDIA_TYPES:
            if main in (served_main, "*") and sub in (served_sub, "*"):
                return content_type
    return None
