"""The spec's rules, declared once (`spec_base.Rule`): the CRD's CEL (what the API server refuses at apply,
as the emulated one evaluates it) and the Python twins (what the operator and `neuronfleet validate`
refuse) agree on a table of good and bad NeuronModels (tests/rule_cases.py), rule by rule; every rule is
one a real kube-apiserver takes (only functions Kubernetes' CEL offers, no transition rule, a bounded cost)
and one the emulated API server evaluates, or its CRD is refused."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from rule_cases import CASES, SAMPLES, Case

from neuronfleet.localcluster import semantics
from neuronfleet.localcluster.semantics import ApiError
from neuronfleet.operator import crd, names, spec, validation
from neuronfleet.operator.engines import limits

SCHEMA = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def as_stored(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server validates it: the schema's defaults applied."""
    return semantics.apply_defaults(copy.deepcopy(obj), SCHEMA)


def api_server_refusals(obj: dict[str, Any]) -> list[str]:
    return semantics.schema_errors(as_stored(obj), SCHEMA)


def every_rule(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path, schema node, rule) of every x-kubernetes-validations entry of a schema."""
    out = [(path, node, rule) for rule in node.get("x-kubernetes-validations", [])]
    for name, sub in node.get("properties", {}).items():
        out += every_rule(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += every_rule(node[key], f"{path}[{key}]")
    return out


def sample_manifests() -> list[dict[str, Any]]:
    return [d for p in sorted(SAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d and d.get("kind") == "NeuronModel"]  # fmt: skip


# ---- the table: the API server and the operator refuse the same objects, saying what is wrong -------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_api_server_and_the_operator_refuse_the_same_objects(case: Case):
    obj = case.manifest()
    at_apply = api_server_refusals(obj)
    operator = validation.check(obj, allow_privileged_image=True).errors
    if case.words is None:
        assert at_apply == [] and operator == [], (at_apply, operator)
        return
    assert any(case.words in e for e in at_apply), at_apply
    assert any(case.words in e for e in operator), operator


def sections_with_nodes(
    model: BaseModel, node: Any, schema: dict[str, Any]
) -> list[tuple[BaseModel, Any, dict[str, Any]]]:
    """Each parsed section of a spec with its node in the object as stored, and its schema."""
    out = [(model, node, schema)]
    for name in type(model).model_fields:
        value, sub = getattr(model, name), node.get(name) if isinstance(node, dict) else None
        if isinstance(value, BaseModel) and isinstance(sub, dict):
            out += sections_with_nodes(value, sub, schema["properties"][name])
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_rules_cel_and_python_twin_agree_on_every_case(case: Case):
    """Rule by rule, wherever the spec parses: the CEL on the object as stored (engine-dependent fields unset)
    and the Python twin on the parsed spec (those fields filled in) say the same."""
    obj = case.manifest()
    parsed, _ = validation.parse(obj)
    if parsed is None:  # a rule checked at parse refused it: the test above compares the refusals
        return
    stored = as_stored(obj)
    checked = 0
    for section, node, schema in sections_with_nodes(parsed, stored["spec"], SCHEMA["properties"]["spec"]):
        declared = crd.rules_of(type(section))  # (the spec's: the engines' limits too)
        assert [r.validation() for r in declared] == schema.get("x-kubernetes-validations", [])
        for rule in declared:
            cel = semantics.evaluate_rule(rule.cel, node, schema)
            assert cel is rule.check(section), (type(section).__name__, rule.cel, cel)
            checked += 1
    assert checked >= 60
    name = obj["metadata"]["name"]
    assert semantics.evaluate_rule(spec.NAME_RULE.cel, {"metadata": {"name": name}}) is (
        not names.name_errors(name)
    )


def failing_rules(value: Any, node: dict[str, Any]) -> set[str]:
    """The rules (CEL text) an object as stored breaks, wherever they sit; the messageExpression of each
    evaluates to its message (not an error, which would leave the static message)."""
    out = set()
    for rule in node.get("x-kubernetes-validations", []):
        if semantics.evaluate_rule(rule["rule"], value, node) is not True:
            out.add(rule["rule"])
            if "messageExpression" in rule:
                message = semantics.evaluate_rule(rule["messageExpression"], value, node)
                assert isinstance(message, str) and message and "\n" not in message, rule
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name in value:
                out |= failing_rules(value[name], sub)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            out |= failing_rules(item, node["items"])
    return out


def test_the_table_breaks_every_rule_it_is_for():
    """Each rule the table is for (those checked with validation, the engines' limits, the neuron section's,
    the tolerations' and the name's) is broken by some case, so each has a kubectl test too
    (tests/e2e/test_cel_rules_apply.py)."""
    declared = [spec.NAME_RULE, *spec.Toleration.__rules__, *spec.NeuronSettings.__rules__, *limits.RULES]
    for model in crd._models_by_name(spec.NeuronModelSpec).values():
        declared += getattr(model, "__validated_rules__", [])
    broken = set()
    for case in CASES:
        if case.words:
            obj = as_stored(case.manifest())
            broken |= failing_rules(obj, SCHEMA)
    assert not [r.cel for r in declared if r.cel not in broken]


@pytest.mark.parametrize("obj", sample_manifests(), ids=lambda o: o["metadata"]["name"])
def test_every_rule_evaluates_on_every_sample_without_an_error(obj):
    """An error is a refusal at the API server: every rule evaluates, to true, on each sample as stored, at
    the node it sits on."""
    stored = as_stored(obj)

    def walk(value: Any, node: dict[str, Any]) -> int:
        count = 0
        for rule in node.get("x-kubernetes-validations", []):
            assert semantics.evaluate_rule(rule["rule"], value, node) is True, rule["rule"]
            count += 1
        if isinstance(value, dict):
            for name, sub in node.get("properties", {}).items():
                if name in value:
                    count += walk(value[name], sub)
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            count += sum(walk(item, node["items"]) for item in value)
        return count

    assert walk({**stored, "metadata": {"name": obj["metadata"]["name"]}}, SCHEMA) >= 20


# ---- what a real kube-apiserver takes ---------------------------------------------------------------------


def test_every_rule_calls_only_what_kubernetes_cel_offers_and_the_evaluator_evaluates():
    """No rule or messageExpression the emulated API server would refuse (`crd_rule_problems`: unknown
    functions, a parse error, oldSelf); the Kubernetes library functions used are the ones it implements."""
    assert semantics.crd_rule_problems(crd.build_crd()) == []
    used = set()
    for _, _, rule in every_rule(SCHEMA):
        for key in ("rule", "messageExpression"):
            if key in rule:
                used |= set(semantics._cel_program(rule[key]).functions())
    assert used - semantics.CEL_STANDARD == {"isSorted", "join"}


def test_a_crd_whose_rule_the_evaluator_cannot_evaluate_is_refused_loudly():
    """A rule calling a function this evaluator lacks (cel-go's `distinct`, which Kubernetes 1.30 does not
    offer either), one that does not parse, and a transition rule: the CRD is refused, naming each."""
    bad = copy.deepcopy(crd.build_crd())
    node = bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    node["x-kubernetes-validations"] = [
        {"rule": "size(self.neuron.buckets.context.distinct()) == 1", "message": "m"},
        {"rule": "self.engine ==", "message": "m"},
        {"rule": "self.engine == oldSelf.engine", "message": "m"},
    ]
    with pytest.raises(ApiError) as refused:
        semantics.established(bad)
    assert (refused.value.code, refused.value.reason) == (422, "Invalid")
    text = refused.value.message
    assert "x-kubernetes-validations[0].rule: Invalid value: compilation failed" in text
    assert "undeclared reference to distinct" in text
    assert "compilation failed" in text and "transition rules (oldSelf)" in text
    assert semantics.established(crd.build_crd())["status"]["conditions"]


ITERATES = re.compile(
    r"(self(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\.(all|exists|exists_one|map|filter|isSorted|join|matches|contains|"
    r"startsWith|endsWith)\("
)


def resolve(node: dict[str, Any], path: str) -> dict[str, Any]:
    for name in path.split(".")[1:]:
        node = node["properties"][name]
    return node


def test_every_list_or_string_a_rule_iterates_has_a_bound():
    """The API server refuses a CRD whose rules' estimated cost exceeds its budget (apiextensions-apiserver
    StaticEstimatedCostLimit; https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
    custom-resource-definitions/#resource-use-by-validation-functions): a list or string a rule iterates
    carries maxItems or maxLength, and so does a list whose items carry rules."""
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def walk(node: dict[str, Any], path: str, unbounded_list: bool) -> int:
        count = 0
        for rule in node.get("x-kubernetes-validations", []):
            assert not unbounded_list, (path, rule["rule"])
            for expression in (rule["rule"], rule.get("messageExpression", "")):
                for target, verb in ITERATES.findall(expression):
                    field = resolve(node, target)
                    bound = {"array": "maxItems", "string": "maxLength", "object": "maxProperties"}[
                        field["type"]
                    ]
                    assert bound in field, (path, target, verb)
                    count += 1
        for name, sub in node.get("properties", {}).items():
            count += walk(sub, f"{path}.{name}", unbounded_list)
        if isinstance(node.get("items"), dict):
            count += walk(node["items"], f"{path}[]", unbounded_list or "maxItems" not in node)
        return count

    assert walk(root, "", False) >= 8


def test_the_crd_with_every_rule_fits_what_kubectl_apply_writes():
    """Client-side `kubectl apply` keeps the whole object in its annotation kubectl.kubernetes.io/
    last-applied-configuration, and the API server refuses an object whose annotations exceed 256 KiB
    (k8s.io/apimachinery pkg/api/validation/objectmeta.go, TotalAnnotationSizeLimitB): the CRD, every rule's
    CEL and messages included, stays well below it."""
    size = len(json.dumps(crd.build_crd(), separators=(",", ":")).encode())
    assert size < 0.6 * 256 * 1024, size


def test_the_evaluators_kubernetes_functions_as_kubernetes_documents_them():
    """isSorted (k8s.io/apiserver/pkg/cel/library/lists.go examples) and join (cel-go ext strings)."""
    for expression, expected in [
        ("[1, 2, 3].isSorted()", True), ("['a', 'b', 'b', 'c'].isSorted()", True),
        ("[2.0, 1.0].isSorted()", False), ("[1].isSorted()", True), ("[].isSorted()", True),
        ("['a', 'b'].join()", "ab"),
        ("['a', 'b'].join(', ')", "a, b"), ("[].join('-')", ""),
    ]:  # fmt: skip
        assert semantics.evaluate_rule(expression, {}) == expected, expression
    with pytest.raises(Exception, match="join"):
        semantics.evaluate_rule("[1, 2].join(',')", {})


def test_a_number_field_is_a_double_to_cel_and_a_failing_message_expression_falls_back():
    schema = {"type": "object", "properties": {"t": {"type": "number"}}, "x-kubernetes-validations": [
        {"rule": "self.t < 1.0", "message": "t below 1", "messageExpression": "'t is ' + self.missing"},
        {"rule": "self.t < 1.0", "message": "static", "messageExpression": "'t is ' + string(self.t)"},
    ]}  # fmt: skip
    assert semantics.evaluate_rule("self.t", {"t": 2}, schema) == 2.0
    assert semantics.cel_violations({"t": 2}, schema, "x") == ["x: Invalid value: t below 1",
                                                              "x: Invalid value: t is 2"]  # fmt: skip


@pytest.mark.parametrize(
    "path",
    [
        "gateway-api-v1.6.1-httproutes.yaml",
        "gie-v1.6.0-inferencepools.yaml",
        "keda-v2.20.2-scaledobjects.yaml",
    ],
)
def test_the_pinned_crds_of_other_projects_are_taken_with_their_rules(path):
    """Their rules (duration() among them) are ones this evaluator evaluates, as a real API server takes "
    "them."""
    from support import ROOT

    crds = [d for d in yaml.safe_load_all((ROOT / "tests" / "data" / path).read_text()) if d]
    for definition in crds:
        assert semantics.crd_rule_problems(definition) == []
        assert semantics.established(definition)["status"]["conditions"]
