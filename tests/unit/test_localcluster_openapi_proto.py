"""/openapi/v2 in protobuf: the encoding read back by a decoder written here from gnostic-models v0.6.8
openapiv2/OpenAPIv2.proto's field numbers (not from the encoder's tables), the definitions as the
kube-apiserver publishes them in v2, the rules kube-openapi's NewOpenAPIData applies when kubectl parses
them, and the Accept negotiation of the real handler."""

from __future__ import annotations

import struct

import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster import openapi, openapi_proto, openapi_v2
from neuronfleet.localcluster.semantics import BUILTIN, crd_resources

CRD = yaml.safe_load((ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml").read_text())
KINDS = [*BUILTIN, *crd_resources(CRD)]
NEURONMODEL = "dev.neuronfleet.v1alpha1.NeuronModel"


# ---- a protobuf reader and the messages of OpenAPIv2.proto this test needs --------------------------------


def wire(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: an int for a varint, bytes for a length-delimited or 64-bit field."""
    out, i = [], 0
    while i < len(data):
        key, i = varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = varint(data, i)
        elif kind == 2:
            size, i = varint(data, i)
            value, i = data[i : i + size], i + size
            assert len(value) == size, "truncated"
        elif kind == 1:
            value, i = data[i : i + 8], i + 8
        else:
            raise AssertionError(f"wire type {kind} is not used by OpenAPIv2.proto's messages")
        out.append((number, value))
    return out


def varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        value, shift, i = value | (byte & 0x7F) << shift, shift + 7, i + 1
        if byte < 0x80:
            return value, i


def signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def any_value(data: bytes):
    """openapi.v2.Any: yaml = 2 (value = 1, a google.protobuf.Any, is not used)."""
    fields = dict(wire(data))
    assert set(fields) == {2}
    return yaml.safe_load(fields[2].decode())


def named(data: bytes, read):
    """A Named* entry: name = 1, value = 2."""
    fields = dict(wire(data))
    return fields[1].decode(), read(fields[2])


STRINGS = {1: "$ref", 2: "format", 3: "title", 4: "description", 13: "pattern", 26: "discriminator"}
INTS = {
    11: "maxLength",
    12: "minLength",
    14: "maxItems",
    15: "minItems",
    17: "maxProperties",
    18: "minProperties",
}
DOUBLES = {6: "multipleOf", 7: "maximum", 9: "minimum"}
BOOLS = {8: "exclusiveMaximum", 10: "exclusiveMinimum", 16: "uniqueItems", 27: "readOnly"}


def schema(data: bytes) -> dict:
    """openapi.v2.Schema as JSON."""
    out: dict = {}
    for number, value in wire(data):
        if number in STRINGS:
            out[STRINGS[number]] = value.decode()
        elif number in INTS:
            out[INTS[number]] = signed(value)
        elif number in DOUBLES:
            out[DOUBLES[number]] = struct.unpack("<d", value)[0]
        elif number in BOOLS:
            out[BOOLS[number]] = bool(value)
        elif number == 19:
            out.setdefault("required", []).append(value.decode())
        elif number == 20:
            out.setdefault("enum", []).append(any_value(value))
        elif number == 21:  # AdditionalPropertiesItem: schema = 1 | boolean = 2
            (which, inner), *_ = wire(value)
            out["additionalProperties"] = schema(inner) if which == 1 else bool(inner)
        elif number == 22:  # TypeItem: repeated string value = 1
            types = [v.decode() for _, v in wire(value)]
            out["type"] = types[0] if len(types) == 1 else types
        elif number == 23:  # ItemsItem: repeated Schema schema = 1
            items = [schema(v) for _, v in wire(value)]
            out["items"] = items[0] if len(items) == 1 else items
        elif number == 24:
            out.setdefault("allOf", []).append(schema(value))
        elif number == 25:  # Properties: repeated NamedSchema additional_properties = 1
            out["properties"] = dict(named(v, schema) for _, v in wire(value))
        elif number == 31:  # repeated NamedAny vendor_extension
            name, extension = named(value, any_value)
            out[name] = extension
        else:
            raise AssertionError(f"Schema field {number} is not expected here")
    return out


def operation(data: bytes) -> dict:
    """openapi.v2.Operation, the parts the local cluster's paths use."""
    out: dict = {}
    for number, value in wire(data):
        if number == 8:  # ParametersItem: parameter = 1 -> Parameter: non_body_parameter = 2 -> query = 3
            ((p, parameter),) = wire(value)
            ((b, non_body),) = wire(parameter)
            ((q, query),) = wire(non_body)
            assert (p, b, q) == (1, 2, 3), "a query parameter"
            names = {1: "required", 2: "in", 3: "description", 4: "name", 6: "type", 20: "uniqueItems"}
            param = {names[n]: (v.decode() if isinstance(v, bytes) else bool(v)) for n, v in wire(query)}
            out.setdefault("parameters", []).append(param)
        elif number == 9:  # Responses: response_code = 1
            out["responses"] = dict(wire(value))
        elif number == 13:
            name, extension = named(value, any_value)
            out[name] = extension
        else:
            raise AssertionError(f"Operation field {number} is not expected here")
    return out


VERBS = {2: "get", 3: "put", 4: "post", 5: "delete", 8: "patch"}  # PathItem's operations


def document(data: bytes) -> dict:
    """openapi.v2.Document: swagger = 1, info = 2, paths = 8 (path = 2), definitions = 9."""
    out: dict = {}
    for number, value in wire(data):
        if number == 1:
            out["swagger"] = value.decode()
        elif number == 2:
            out["info"] = {{1: "title", 2: "version"}[n]: v.decode() for n, v in wire(value)}
        elif number == 8:
            out["paths"] = {}
            for n, entry in wire(value):
                assert n == 2
                name, item = named(entry, lambda b: {VERBS[k]: operation(v) for k, v in wire(b)})
                out["paths"][name] = item
        elif number == 9:
            out["definitions"] = dict(named(v, schema) for _, v in wire(value))
        else:
            raise AssertionError(f"Document field {number} is not expected here")
    return out


SCALARS = {*STRINGS.values(), *INTS.values(), *DOUBLES.values(), *BOOLS.values()}


def proto3(node: dict) -> dict:
    """What proto3 can carry of a JSON schema: a scalar keyword that is 0, "" or false is absent (values
    carried as YAML, such as extensions and enums, keep theirs)."""
    out = {k: v for k, v in node.items() if k not in SCALARS or v not in (0, "", False)}
    if "properties" in out:
        out["properties"] = {k: proto3(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = proto3(out[key])
    if "allOf" in out:
        out["allOf"] = [proto3(v) for v in out["allOf"]]
    return out


# ---- tests ------------------------------------------------------------------------------------------------


def test_the_document_reads_back_as_the_json_one():
    doc = openapi_v2.document(KINDS, "v1.32.0")
    decoded = document(openapi_proto.encode(doc))
    assert decoded["swagger"] == "2.0" and decoded["info"] == {"title": "Kubernetes", "version": "v1.32.0"}
    assert list(decoded["definitions"]) == list(doc["definitions"])  # every definition, in order
    for name in (openapi.CORE + "Pod", openapi.CORE + "ConfigMap", openapi.META + "ObjectMeta", NEURONMODEL):
        assert decoded["definitions"][name] == proto3(doc["definitions"][name]), name
    assert decoded["definitions"] == {k: proto3(v) for k, v in doc["definitions"].items()}
    patch = decoded["paths"]["/api/v1/namespaces/{namespace}/configmaps/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "", "kind": "ConfigMap", "version": "v1"}
    assert patch["x-kubernetes-action"] == "patch" and patch["responses"] == {}
    assert [(p["name"], p["in"], p["type"], p["uniqueItems"]) for p in patch["parameters"]] == [
        ("fieldValidation", "query", "string", True)
    ]
    assert decoded["paths"].keys() == doc["paths"].keys()


def test_the_wire_details_kube_openapi_relies_on():
    encoded = openapi_proto.encode({"definitions": {"a": {"type": "object", "properties": {}}}})
    assert document(encoded)["definitions"]["a"] == {"type": "object", "properties": {}}  # a kind, no fields
    encoded = openapi_proto.encode({"definitions": {"a": {"type": "object", "additionalProperties": False}}})
    assert document(encoded)["definitions"]["a"]["additionalProperties"] is False  # a oneof member, sent
    encoded = openapi_proto.encode(
        {"definitions": {"a": {"minimum": -1.5, "maxLength": -2, "enum": ["x", 2]}}}
    )
    assert document(encoded)["definitions"]["a"] == {"minimum": -1.5, "maxLength": -2, "enum": ["x", 2]}
    gvk = [{"group": "", "kind": "Pod", "version": "v1"}]
    encoded = openapi_proto.encode({"definitions": {"p": {"x-kubernetes-group-version-kind": gvk}}})
    assert document(encoded)["definitions"]["p"]["x-kubernetes-group-version-kind"] == gvk


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"definitions": {"a": {"nullable": True}}},
            "swagger.definitions.a: 'nullable' is not a swagger 2.0 field",
        ),
        ({"definitions": {"a": {"type": 3}}}, "swagger.definitions.a.type.value must be a list of strings"),
        ({"info": {"title": 1}}, "swagger.info.title must be a string, not 1"),
        ({"paths": {"/x": {"get": {"parameters": [{"in": "cookie"}]}}}}, "in must be one of body, header"),
    ],
)
def test_what_swagger_2_has_no_field_for_is_refused_by_name(doc, message):
    with pytest.raises(ValueError) as e:
        openapi_proto.encode(doc)
    assert message in str(e.value)


def kube_openapi_parse(definitions: dict) -> None:
    """The checks of kube-openapi pkg/util/proto/document.go ParseSchema (kubectl v1.32's vendored version):
    a $ref names a definition and has neither type nor properties; an array has exactly one item schema; a
    single type is object, array or a primitive; no definition has two types."""

    def walk(node: dict, path: str) -> None:
        if "$ref" in node:
            assert node["$ref"].removeprefix("#/definitions/") in definitions, path
            assert "type" not in node and not node.get("properties"), path
            return
        kind = node.get("type")
        assert not isinstance(kind, list), f"{path}: definitions with multiple types aren't supported"
        if kind == "array":
            assert isinstance(node.get("items"), dict), f"{path}: array should have exactly one sub-item"
            walk(node["items"], path + "[]")
        elif kind in (None, "object"):
            for name, sub in (node.get("properties") or {}).items():
                walk(sub, f"{path}.{name}")
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], path + ".*")
        else:
            assert kind in ("string", "number", "integer", "boolean"), (
                f"{path}: Unknown primitive type {kind}"
            )

    for name, node in definitions.items():
        walk(node, name)


def test_the_v2_definitions_are_what_kubectl_parses_and_validates_as_a_real_cluster():
    definitions = document(openapi_proto.encode(openapi_v2.document(KINDS, "v1.32.0")))["definitions"]
    kube_openapi_parse(definitions)
    pod = definitions[openapi.CORE + "Pod"]
    assert pod["properties"]["metadata"] == {  # a described reference, as swagger 2.0 has it
        "description": openapi.METADATA, "$ref": "#/definitions/" + openapi.META + "ObjectMeta"
    }  # fmt: skip
    assert pod["x-kubernetes-group-version-kind"] == [{"group": "", "kind": "Pod", "version": "v1"}]
    # a type listed here in part is open (kubectl never refuses a field a real server takes); others are not
    assert definitions[openapi.CORE + "PodSpec"].keys() == {"description", "type"}
    assert {"managedFields", "selfLink", "labels"} <= set(
        definitions[openapi.META + "ObjectMeta"]["properties"]
    )
    assert set(definitions[openapi.CORE + "ConfigMap"]["properties"]) == {
        "apiVersion", "binaryData", "data", "immutable", "kind", "metadata",
    }  # fmt: skip
    # a kind without a detailed schema: an open object found by its group-version-kind
    lease = definitions["io.k8s.api.coordination.v1.Lease"]
    assert "properties" not in lease and lease["type"] == "object"
    assert lease["x-kubernetes-group-version-kind"][0]["kind"] == "Lease"
    # the CRD as apiextensions-apiserver publishes it in v2: no defaults, unknown-field-preserving nodes open
    model = definitions[NEURONMODEL]
    spec = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert model["required"] == spec["required"] and model["description"] == spec["description"]
    assert set(model["properties"]) == set(spec["properties"]) | {"apiVersion", "kind", "metadata"}
    overrides = model["properties"]["spec"]["properties"]["neuron"]["properties"]["overrides"]
    assert overrides["x-kubernetes-preserve-unknown-fields"] and overrides.keys() <= {
        "description",
        "x-kubernetes-preserve-unknown-fields",
    }  # no type: kube-openapi reads it as any value, so kubectl lets its fields through
    assert not any("default" in node for node in nodes(model))


def nodes(schema: dict):
    yield schema
    for sub in (schema.get("properties") or {}).values():
        yield from nodes(sub)
    if isinstance(schema.get("items"), dict):
        yield from nodes(schema["items"])


def test_crd_schemas_follow_the_v2_conversion_rules():
    schema = {
        "type": "object", "required": ["a", "n"], "default": {},
        "properties": {
            "a": {"type": "string", "allOf": [{"minLength": 1}], "oneOf": [{}], "anyOf": [{}], "not": {}},
            "n": {"type": "object", "nullable": True, "properties": {"x": {"type": "string"}}},
            "keep": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                     "properties": {"y": {"type": "string"}}},
            "list": {"type": "array", "x-kubernetes-preserve-unknown-fields": True,
                     "items": {"type": "string"}},
            "embedded": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {}},
        },
    }  # fmt: skip
    out = openapi_v2._crd_v2(schema)
    assert out["required"] == ["a"]  # a nullable field is not required in v2
    assert out["properties"]["a"] == {"type": "string"}
    assert out["properties"]["n"] == {}
    assert out["properties"]["keep"] == {"x-kubernetes-preserve-unknown-fields": True}
    assert out["properties"]["list"] == {"x-kubernetes-preserve-unknown-fields": True}
    assert set(out["properties"]["embedded"]["properties"]) == {"apiVersion", "kind", "metadata"}
    assert "default" not in out


@pytest.mark.parametrize(
    ("accept", "served"),
    [
        ("application/com.github.proto-openapi.spec.v2@v1.0+protobuf", openapi_v2.PROTOBUF),  # client-go's
        ("application/com.github.proto-openapi.spec.v2.v1.0+protobuf", openapi_v2.PROTOBUF),
        ("application/json", openapi_v2.JSON),
        ("", openapi_v2.JSON),
        ("*/*", openapi_v2.JSON),
        (
            "application/json;q=0.5, application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
            openapi_v2.PROTOBUF,
        ),
        ("text/html, */*;q=0.1", openapi_v2.JSON),
        ("text/html", None),
        ("application/json;q=0", None),
    ],
)
def test_accept_negotiation_is_the_real_handlers(accept, served):
    assert openapi_v2.media_type(accept) == served
