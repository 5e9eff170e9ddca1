"""The NeuronModel CustomResourceDefinition, generated from the pydantic models in `spec.py`.

Pydantic's JSON Schema is turned into a structural openAPIV3Schema: references inlined, optional fields
without `null` unions, titles dropped, defaults, enums, bounds and descriptions kept, each section's rules
(`spec_base.Rule`: those checked at parse and those checked with validation; on the spec, the engines' limits
too, `engines.limits.RULES`) added as `x-kubernetes-validations` (`rules_of`), and the model name's rule at
the object's root. `neuronfleet crd` writes the
result into `crds/`; a test fails when the file there differs from what this module generates.

What the API server takes (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
custom-resource-definitions/#validation-rules, v1.30): a rule is CEL with `self` the node it sits on, after
the schema's defaults; `message` is static, `messageExpression` a CEL string expression worded with the
object's values (its `message` is used when it fails); Kubernetes' CEL is the standard definitions plus its
libraries (https://kubernetes.io/docs/reference/using-api/cel/); at the root `self.metadata` holds only name
and generateName, and the root schema may restrict only those two (a maxLength on metadata.name bounds the
cost of the name's rule). The API server refuses a CRD whose rules' estimated cost exceeds its budget, so a
list or string a rule iterates carries maxItems or maxLength (tests/unit/test_cel_rules.py checks both).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from . import spec
from .engines import limits
from .spec_base import Rule

CRD_FILE = f"{spec.GROUP}_{spec.PLURAL}.yaml"
# `kubectl scale`, HPA and KEDA act on spec.replicas (builders map it to the serving roles);
# status.scaleReplicas and status.selector are what the operator observed
# (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
# #scale-subresource, v1.32: labelSelectorPath must name a string field, the serialized selector).
SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.scaleReplicas",
    "labelSelectorPath": ".status.selector",
}
# The root's metadata: what the API server checks of every name already (a DNS subdomain of at most 253
# characters), declared so that the name's rule has a bounded cost; generateName too, or the API server's
# CEL would not take this declaration (apiextensions-apiserver schema/cel/model WithTypeAndObjectMeta)
METADATA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 253}, "generateName": {"type": "string"}},
}
# Keywords a structural schema may carry (others, like title or $schema, are dropped).
KEPT = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "pattern",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "maxProperties",
    "items",
    "properties",
    "required",
    "additionalProperties",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
}


def _models_by_name(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from root, by the name pydantic gives its $defs entry."""
    found: dict[str, type[BaseModel]] = {}

    def visit(cls: type[BaseModel]) -> None:
        if cls.__name__ in found:
            return
        found[cls.__name__] = cls
        for field in cls.model_fields.values():
            for arg in _type_args(field.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    visit(arg)

    visit(root)
    return found


def _type_args(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [a for arg in args for a in _type_args(arg)]


def _structural(node: Any, defs: dict[str, Any], models: dict[str, type[BaseModel]]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs, models) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:  # inline the definition; sibling keys (description, default) win
        name = node.pop("$ref").rsplit("/", 1)[-1]
        target = _structural(defs[name], defs, models)
        node = {**target, **{k: v for k, v in node.items()}}
        node = _with_model_extras(node, models[name])
    if "anyOf" in node:  # X | None: the field is optional, which `required` already says
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {options} in a structural schema")
        if node.get("default", ...) is None:
            node.pop("default")
        node = {**_structural(options[0], defs, models), **node}
    out = {}
    for key, value in node.items():
        if key not in KEPT:
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs, models) for name, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs, models)
        else:
            out[key] = copy.deepcopy(value)  # a model used twice must not share lists (YAML anchors)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), int | float) and not isinstance(out[bound], bool):  # OpenAPI v3.0 form
            out[limit], out[bound] = out[bound], True
    if out.get("additionalProperties") is False:  # structural schemas refuse it; the API server prunes
        out.pop("additionalProperties")
    if out.get("x-kubernetes-preserve-unknown-fields") and out.get("additionalProperties") is True:
        out.pop("additionalProperties")
    if out.get("additionalProperties") is True:  # dict[str, Any] without the marker: keep anything
        out.pop("additionalProperties")
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "integer" if all(isinstance(v, int) for v in out["enum"]) else "string"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    order = ["type", "description", *sorted(KEPT - {"type", "description"})]
    return {k: out[k] for k in order if k in out}


def rules_of(model: type[BaseModel]) -> list[Rule]:
    """The rules the CRD carries on a section's node: those declared beside it and, on the spec's, the
    engines' limits (they read the whole spec)."""
    declared = [*getattr(model, "__rules__", []), *getattr(model, "__validated_rules__", [])]
    return declared + (list(limits.RULES) if model is spec.NeuronModelSpec else [])


def _with_model_extras(schema: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """Add what pydantic's schema leaves out: defaults of fields made by a factory ({} for a nested section,
    so the API server fills in its own defaults) and the model's rules."""
    schema = dict(schema)
    props = dict(schema.get("properties", {}))
    for name, field in model.model_fields.items():
        if field.default_factory is None or name not in props or "default" in props[name]:
            continue
        value = field.default_factory()
        props[name] = {**props[name], "default": {} if isinstance(value, BaseModel) else value}
    if props:
        schema["properties"] = props
    rules = rules_of(model)
    if rules:
        schema["x-kubernetes-validations"] = [r.validation() for r in rules]
    return schema


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A pydantic model's structural openAPIV3Schema, with its rules as x-kubernetes-validations."""
    raw = model.model_json_schema(mode="validation")
    defs = raw.pop("$defs", {})
    models = _models_by_name(model)
    return _structural(_with_model_extras(raw, model), defs, models)


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1) for NeuronModel."""
    spec_schema = openapi_schema(spec.NeuronModelSpec)
    spec_schema["description"] = "What to serve, on which Neuron hardware, and how."
    status_schema = openapi_schema(spec.NeuronModelStatus)
    status_schema["description"] = "Observed state, written by the operator."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/name": "neuronfleet", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": spec.SHORT_NAMES,
                "categories": ["neuronfleet"],
            },
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": spec.PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM served on AWS Neuron: compiled once, deployed per role. "
                            "Its name is an RFC 1035 label of at most "
                            f"{spec.MAX_MODEL_NAME} characters (its children are named after it). What needs "
                            "only the object, each engine's limits included, is checked at apply "
                            "(x-kubernetes-validations); what needs the cluster, the Hugging Face Hub or the "
                            "operator's settings, by the operator (condition Validated).",
                            "required": ["spec"],
                            "x-kubernetes-validations": [spec.NAME_RULE.validation()],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": METADATA,
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `neuronfleet crd` from operator/spec.py and operator/engines/limits.py; do not "
    header += "edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=110)


def write_crd(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CRD_FILE
    path.write_text(render_crd())
    return path
