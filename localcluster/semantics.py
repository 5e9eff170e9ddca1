"""Kubernetes API semantics without I/O: the kinds the emulated API server knows, error bodies (Status),
patches (JSON, merge, strategic merge, apply), label and field selectors, a custom resource's schema
(defaults, pruning, validation with CEL rules), a CRD's resources, the scale view and timestamps. Names,
labels and the defaults of built-in kinds are `admission`'s.

Everything here is a function of its arguments; the store and the HTTP server build on it.
"""

from __future__ import annotations

import copy
import datetime
import functools
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import jsonschema


@dataclass
class Resource:
    """One served kind: where it lives in the API and what its objects look like."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # openAPIV3Schema of a custom resource
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    categories: tuple[str, ...] = ()
    scale: dict[str, Any] | None = None  # a CRD version's scale subresource (specReplicasPath...)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# the kinds a real API server puts in the `all` category (`kubectl get all`) that this one serves; a
# NeuronModel is not among them: `kubectl delete all --all` would delete the models, which own everything
# else (`kubectl get neuronmodels,all` lists both)
ALL = ("all",)

BUILTIN = [
    Resource("", "v1", "namespaces", "Namespace", False, ("status",), ("ns",)),
    Resource("", "v1", "nodes", "Node", False, ("status",), ("no",)),  # the process kubelet's one node
    Resource("", "v1", "pods", "Pod", True, ("status", "log"), ("po",), categories=ALL),
    Resource("", "v1", "services", "Service", True, ("status",), ("svc",), categories=ALL),
    Resource("", "v1", "endpoints", "Endpoints", True, (), ("ep",)),
    Resource("", "v1", "configmaps", "ConfigMap", True, (), ("cm",)),
    Resource("", "v1", "secrets", "Secret", True),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("status",), ("pvc",)),
    Resource("", "v1", "events", "Event", True, (), ("ev",)),
    Resource(
        "apps", "v1", "deployments", "Deployment", True, ("status", "scale"), ("deploy",), categories=ALL
    ),
    Resource("apps", "v1", "replicasets", "ReplicaSet", True, ("status", "scale"), ("rs",), categories=ALL),
    Resource("batch", "v1", "jobs", "Job", True, ("status",), categories=ALL),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, (), ("netpol",)),
    Resource("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),  # DRA
    Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("events.k8s.io", "v1", "events", "Event", True, (), ("ev",)),
    Resource(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd", "crds"),
    ),
]
PRECREATED_NAMESPACES = ("default", "kube-system", "kube-public")

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


# ---- errors and times ------------------------------------------------------------------------------------


class ApiError(Exception):
    """A refusal as the API server words it: HTTP code, reason, message and details of a Status object."""

    def __init__(self, code: int, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        """The Status object the API server answers with."""
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def not_found(kind: Resource, name: str | None) -> ApiError:
    group = kind.group or ""
    return ApiError(
        404, "NotFound", f'{kind.plural}{"." + group if group else ""} "{name}" not found',
        name=name, group=group, kind=kind.plural,
    )  # fmt: skip


def now() -> str:
    """The current time as Kubernetes writes timestamps (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- patches ---------------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A merge patch in which lists of objects that carry a `name` (containers, env, ports, volumes...)
    merge item by item on that name, as Kubernetes' strategic merge does for those fields."""
    if isinstance(patch, dict) and isinstance(target, dict):
        out = dict(target)
        for key, value in patch.items():
            if key.startswith("$"):  # directives ($patch, $retainKeys...): not modelled
                continue
            out[key] = None if value is None else strategic_merge_patch(target.get(key), value)
            if value is None:
                out.pop(key)
        return out
    named = (
        isinstance(patch, list)
        and isinstance(target, list)
        and all(isinstance(i, dict) and "name" in i for i in [*patch, *target])
    )
    if named:
        by_name = {i["name"]: i for i in target}
        order = [i["name"] for i in target]
        for item in patch:
            if item.get("$patch") == "delete":
                by_name.pop(item["name"], None)
                continue
            if item["name"] not in by_name:
                order.append(item["name"])
            by_name[item["name"]] = strategic_merge_patch(by_name.get(item["name"], {}), item)
        return [by_name[n] for n in order if n in by_name]
    return copy.deepcopy(patch)


def apply_patch(kind: Resource, old: dict[str, Any], body: Any, content_type: str) -> tuple[Any, str | None]:
    """The object after a patch of this content type, and the resourceVersion the patch expects (if any);
    apply patches are merges (no field managers)."""
    if content_type == JSON_PATCH:
        try:
            return jsonpatch.apply_patch(old, body), None
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            raise ApiError(422, "Invalid", f"the JSON patch does not apply: {e}") from None
    expected_rv = (
        ((body or {}).get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
    )
    if content_type in (MERGE_PATCH, APPLY_PATCH):
        return merge_patch(old, body), expected_rv
    if content_type == STRATEGIC_MERGE_PATCH:
        if kind.schema is not None:
            raise ApiError(
                415, "UnsupportedMediaType", "strategic merge patch is not supported for custom resources"
            )
        return strategic_merge_patch(old, body), expected_rv
    raise ApiError(415, "UnsupportedMediaType", f"the patch type {content_type} is not supported")


def spec_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether anything but metadata and status differs (what bumps metadata.generation)."""
    strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
    return strip(old) != strip(new)


# ---- selectors -------------------------------------------------------------------------------------------

_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        terms.append(current)
    return terms


def label_matcher(selector: str | None):
    """A predicate for a label selector (=, ==, !=, in, notin, key, !key); 400 when it does not parse."""
    checks = []
    for term in _split_terms(selector or ""):
        m = _SELECTOR_TERM.match(term)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term.strip()!r}")
        key, neg = m["key"], bool(m["neg"])
        if m["op"]:
            value, equal = m["value"], m["op"] != "!="
            checks.append(lambda labels, k=key, v=value, e=equal: (labels.get(k) == v) == e)
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            inside = m["setop"] == "in"
            checks.append(lambda labels, k=key, vs=values, i=inside: (k in labels and labels[k] in vs) == i)
        else:
            checks.append(lambda labels, k=key, n=neg: (k in labels) != n)
    return lambda labels: all(c(labels) for c in checks)


def field_matcher(selector: str | None):
    """A predicate for a field selector on dotted paths (metadata.name=x, status.phase!=Running)."""
    checks = []
    for term in _split_terms(selector or ""):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse field selector: {term.strip()!r}")
        path, op, value = m.groups()
        checks.append(lambda obj, p=path, v=value, e=op != "!=": (str(dig(obj, p.split("."))) == v) == e)
    return lambda obj: all(c(obj) for c in checks)


def object_matcher(params: dict[str, str]):
    """A predicate for the request's labelSelector and fieldSelector together."""
    labels, fields = label_matcher(params.get("labelSelector")), field_matcher(params.get("fieldSelector"))
    return lambda obj: labels(obj["metadata"].get("labels") or {}) and fields(obj)


def dig(obj: Any, path: list[str]) -> Any:
    """The value at a path of keys; "" where the path ends early or the value is null."""
    for part in path:
        if not isinstance(obj, dict):
            return ""
        obj = obj.get(part, "")
    return "" if obj is None else obj


def json_path(obj: dict[str, Any], path: str) -> Any:
    """A printer column's simple JSONPath (.status.phase); None when absent."""
    value = dig(obj, [p for p in path.strip(".").split(".") if p])
    return None if value == "" else value


# ---- schemas ---------------------------------------------------------------------------------------------


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Fill in the schema's defaults where fields are absent (recursively, defaults included)."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(obj[name], sub)
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name in obj:
            obj[name] = apply_defaults(obj[name], schema["additionalProperties"])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in obj]
    return obj


def prune(obj: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> Any:
    """Drop fields the schema does not declare (recording their paths), unless it preserves them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return obj
    if isinstance(obj, dict) and "properties" in schema:
        out = {}
        for name, value in obj.items():
            if name in schema["properties"]:
                out[name] = prune(value, schema["properties"][name], f"{path}.{name}", unknown)
            else:
                unknown.append(f"{path}.{name}")
        return out
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: prune(v, schema["additionalProperties"], f"{path}.{k}", unknown) for k, v in obj.items()}
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"], f"{path}[{i}]", unknown) for i, v in enumerate(obj)]
    return obj


# ---- CEL: a CRD's x-kubernetes-validations ----------------------------------------------------------------
# Kubernetes' CEL (https://kubernetes.io/docs/reference/using-api/cel/, v1.30; the rules' form:
# https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
# #validation-rules): the standard definitions and macros, which the `cel` package (cel-rust) evaluates, and
# Kubernetes' libraries, whose functions a rule here may call only where this table evaluates them, each
# with Kubernetes' semantics. A rule calling anything else makes its CRD refused (`cel_rule_problems`), as the
# real API server refuses a rule that does not compile, rather than evaluated wrong.


def _is_sorted(items: Any) -> bool:
    """k8s.io/apiserver/pkg/cel/library/lists.go: `<list<T>>.isSorted()`, T comparable: whether each element
    is no greater than the next (an empty list is sorted)."""
    if not isinstance(items, list):
        raise TypeError(f"no such overload: isSorted on {type(items).__name__}")
    return all(a <= b for a, b in itertools.pairwise(items))


def _join(items: Any, separator: str = "") -> str:
    """cel-go ext/strings.go (ext.Strings, in Kubernetes' environment at every version):
    `<list<string>>.join()` and `.join(<string>)`, the strings joined with the separator between them."""
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise TypeError("no such overload: join takes a list of strings")
    return separator.join(items)


KUBERNETES_CEL_LIBRARY = {"isSorted": _is_sorted, "join": _join}
# The standard definitions' functions and operators (cel-spec langdef.md "List of Standard Definitions"), as
# the cel package names them: what a rule may call besides KUBERNETES_CEL_LIBRARY (the macros, has() among
# them, are expanded before)
CEL_STANDARD = frozenset({
    "!_", "-_", "_&&_", "_||_", "_?_:_", "@not_strictly_false", "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_",
    "_+_", "_-_", "_*_", "_/_", "_%_", "_[_]", "@in", "size", "contains", "startsWith", "endsWith", "matches",
    "int", "uint", "double", "string", "bytes", "dyn", "type", "duration", "timestamp",
    "getFullYear", "getMonth", "getDayOfYear", "getDayOfMonth", "getDate", "getDayOfWeek", "getHours",
    "getMinutes", "getSeconds", "getMilliseconds",
})  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _cel_program(expression: str):
    import cel

    return cel.compile(expression)


def cel_rule_problems(expression: str) -> list[str]:
    """Why this evaluator cannot take a rule (or messageExpression) as Kubernetes would: it does not
    compile, calls a function neither CEL's standard nor KUBERNETES_CEL_LIBRARY holds, or is a transition
    rule (oldSelf, which this server does not evaluate); empty when it can."""
    try:
        program = _cel_program(expression)
    except Exception as e:  # the cel package's parse error
        return [f"compilation failed: {e}"]
    problems = []
    unknown = set(program.functions()) - CEL_STANDARD - set(KUBERNETES_CEL_LIBRARY)
    if unknown:
        problems.append(f"compilation failed: undeclared reference to {', '.join(sorted(unknown))}")
    if "oldSelf" in program.variables():
        problems.append("transition rules (oldSelf) are not evaluated by this emulated API server")
    return problems


def crd_rule_problems(crd: dict[str, Any]) -> list[str]:
    """Every rule (and messageExpression) of a CRD's versions that `cel_rule_problems` refuses, by path."""
    out = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        for i, rule in enumerate(node.get("x-kubernetes-validations", [])):
            for key in ("rule", "messageExpression"):
                if key in rule:
                    where = f"{path}.x-kubernetes-validations[{i}].{key}"
                    out.extend(f"{where}: Invalid value: {p}" for p in cel_rule_problems(rule[key]))
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.properties[{name}]")
        for key in ("items", "additionalProperties"):
            walk(node.get(key), f"{path}.{key}")

    for i, version in enumerate((crd.get("spec") or {}).get("versions", [])):
        walk(
            (version.get("schema") or {}).get("openAPIV3Schema"), f"spec.versions[{i}].schema.openAPIV3Schema"
        )
    return out


def _cel_value(obj: Any, schema: dict[str, Any]) -> Any:
    """The object as Kubernetes' CEL sees it: a number field's integers as doubles."""
    if schema.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    if isinstance(obj, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {
            k: _cel_value(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
            for k, v in obj.items()
        }
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [_cel_value(v, schema["items"]) for v in obj]
    return obj


def evaluate_rule(expression: str, obj: Any, schema: dict[str, Any] | None = None) -> Any:
    """A rule (or messageExpression) of a CRD on a node, `self` bound to the node as Kubernetes' CEL sees it
    under its schema; raises what the evaluation raises (a missing field, a wrong type)."""
    return _cel_evaluate(expression, _cel_value(obj, schema or {}))


def _cel_evaluate(expression: str, node: Any) -> Any:
    import cel

    context = cel.Context(variables={"self": node}, functions=KUBERNETES_CEL_LIBRARY)
    return _cel_program(expression).execute(context)


def _cel_message(rule: dict[str, Any], node: Any) -> str:
    """A failed rule's message: its messageExpression's string where that evaluates to one without line
    breaks, else its message, else the rule (as the API server words it)."""
    if "messageExpression" in rule:
        try:
            message = _cel_evaluate(rule["messageExpression"], node)
        except Exception:  # the API server logs it and falls back on the message
            message = None
        if isinstance(message, str) and message.strip() and "\n" not in message:
            return message
    return rule.get("message") or f"failed rule: {rule['rule']}"


def cel_violations(obj: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Evaluate x-kubernetes-validations (CEL, with `self` bound to the node) throughout the object."""
    out = []
    node = _cel_value(obj, schema) if schema.get("x-kubernetes-validations") else None
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            ok = _cel_evaluate(rule["rule"], node)
        except Exception as e:  # a rule that cannot evaluate refuses, as the API server does
            ok, rule = False, {"rule": rule["rule"], "message": f"{_cel_message(rule, node)} ({e})"}
        if ok is not True:
            out.append(f"{path or '<root>'}: Invalid value: {_cel_message(rule, node)}")
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                out += cel_violations(obj[name], sub, f"{path}.{name}" if path else name)
        if isinstance(schema.get("additionalProperties"), dict):
            for name, value in obj.items():
                out += cel_violations(value, schema["additionalProperties"], f"{path}.{name}")
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_violations(item, schema["items"], f"{path}[{i}]")
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """The schema's complaints ("path: Invalid value: why"), then, when it has none, its CEL rules'. Of the
    object's metadata only name and generateName are checked (what a CRD's schema and rules may see)."""
    meta = obj.get("metadata") or {}
    obj = {**obj, "metadata": {k: v for k, v in meta.items() if k in ("name", "generateName")}}
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI v3.0 bounds (boolean exclusiveMinimum)
    errors = []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in e.absolute_path) or "<root>"
        errors.append(f"{where}: Invalid value: {e.message}")
    return errors or cel_violations(obj, schema, "")


def admit(kind: Resource, obj: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
    """Schema enforcement for custom resources: defaults, pruning (or Strict refusal), validation."""
    if kind.schema is None:
        return obj
    meta = obj.get("metadata")
    unknown: list[str] = []
    body = {k: v for k, v in obj.items() if k != "metadata"}  # (metadata is ObjectMeta, never pruned)
    pruned = prune(apply_defaults(body, kind.schema), kind.schema, "", unknown)
    obj = {k: meta if k == "metadata" else pruned[k] for k in obj if k == "metadata" or k in pruned}
    obj.update({k: v for k, v in pruned.items() if k not in obj})
    obj.setdefault("metadata", meta)
    obj.setdefault("apiVersion", kind.api_version)
    obj.setdefault("kind", kind.kind)
    name = (meta or {}).get("name")
    if unknown and params.get("fieldValidation") == "Strict":  # a decoding error, as the real server words it
        # (apiextensions-apiserver's strict decoding: 400 BadRequest, "strict decoding error: unknown field")
        fields = ", ".join(f'unknown field "{u.lstrip(".")}"' for u in unknown)
        decoding = f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}'
        raise ApiError(400, "BadRequest", f"{decoding}: strict decoding error: {fields}")
    errors = schema_errors(obj, kind.schema)
    if errors:
        causes = []
        for e in errors:
            where, _, message = e.partition(": ")
            causes.append({"reason": "FieldValueInvalid", "field": where, "message": message})
        raise ApiError(
            422, "Invalid", f'{kind.kind}.{kind.group} "{name}" is invalid: ' + "; ".join(errors),
            name=name, group=kind.group, kind=kind.kind, causes=causes,
        )  # fmt: skip
    return obj


# ---- custom resource definitions -------------------------------------------------------------------------


def crd_resources(crd: dict[str, Any]) -> list[Resource]:
    """The kinds a CustomResourceDefinition serves (one per served version)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec.get("versions", []):
        if not version.get("served", True):
            continue
        out.append(
            Resource(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=tuple(version.get("subresources", {})),
                short_names=tuple(names.get("shortNames", [])),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=version.get("additionalPrinterColumns", []),
                categories=tuple(names.get("categories", [])),
                scale=(version.get("subresources") or {}).get("scale"),
            )
        )
    return out


def established(crd: dict[str, Any]) -> dict[str, Any]:
    """A well-formed CRD with the status the API server gives it (names accepted, established); 422 if its
    name is not `<plural>.<group>`."""
    spec = crd.get("spec") or {}
    try:
        expected = f"{spec['names']['plural']}.{spec['group']}"
    except (KeyError, TypeError):
        raise ApiError(
            422, "Invalid", "CustomResourceDefinition is invalid: spec.names and spec.group are required"
        ) from None
    if crd["metadata"]["name"] != expected:
        raise ApiError(
            422, "Invalid", f"CustomResourceDefinition is invalid: metadata.name must be {expected}"
        )
    if problems := crd_rule_problems(crd):  # a rule the API server could not compile is refused with its CRD
        raise ApiError(
            422, "Invalid",
            f'CustomResourceDefinition.apiextensions.k8s.io "{expected}" is invalid: ' + "; ".join(problems),
        )  # fmt: skip
    crd["status"] = {
        "acceptedNames": spec["names"],
        "storedVersions": [v["name"] for v in spec.get("versions", []) if v.get("storage")],
        "conditions": [
            {"type": t, "status": "True", "reason": "Emulated", "lastTransitionTime": now()}
            for t in ("NamesAccepted", "Established")
        ],
    }
    return crd


# ---- views: scale -----------------------------------------------------------------------------------------


def scale_view(obj: dict[str, Any], kind: Resource | None = None) -> dict[str, Any]:
    """The autoscaling/v1 Scale of an object: spec.replicas and status.replicas, or the paths a CRD's scale
    subresource declares (specReplicasPath, statusReplicasPath), and the selector when one is declared."""
    spec_path, status_path, selector_path = scale_paths(kind)
    status: dict[str, Any] = {"replicas": json_path(obj, status_path) or 0}
    selector = json_path(obj, selector_path) if selector_path else dig(obj, ["spec", "selector"])
    if isinstance(selector, dict):
        selector = ",".join(f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items()))
    if selector:
        status["selector"] = selector
    meta = obj["metadata"]
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if k in meta},
        "spec": {"replicas": json_path(obj, spec_path) or 0},
        "status": status,
    }  # fmt: skip


def scale_paths(kind: Resource | None) -> tuple[str, str, str | None]:
    """Where an object keeps its desired and current replicas (and label selector) for /scale."""
    if kind is not None and kind.scale:
        return (
            kind.scale.get("specReplicasPath", ".spec.replicas"),
            kind.scale.get("statusReplicasPath", ".status.replicas"),
            kind.scale.get("labelSelectorPath"),
        )
    return ".spec.replicas", ".status.replicas", None


def with_replicas(obj: dict[str, Any], replicas: Any, kind: Resource | None = None) -> dict[str, Any]:
    """A copy of the object with its desired replicas set (a write through /scale)."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ApiError(
            422, "Invalid",
            f'Scale.autoscaling "{obj["metadata"]["name"]}" is invalid: spec.replicas: Invalid value: '
            f"{json.dumps(replicas)}: must be greater than or equal to 0",
        )  # fmt: skip
    out = copy.deepcopy(obj)
    node = out
    parts = [p for p in scale_paths(kind)[0].strip(".").split(".") if p]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = replicas
    return out
