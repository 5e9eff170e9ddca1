"""The autoscaling resource: `spec.autoscaling` and `spec.replicas` (the CRD, its CEL rules as the emulated
API server evaluates them, the operator's refusals with their messages), the scale subresource's mapping to
the serving roles and its status, and the objects the cluster scales with: an autoscaling/v2
HorizontalPodAutoscaler (kubernetes-validate, strict) and a KEDA ScaledObject (KEDA's published CRD schema
for the pinned version, tests/data)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster import semantics
from neuronfleet.operator import builders, crd, kube, pod_metrics, scaling, status, validation

KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]  # oldest and newest this project supports
KEDA_CRD = ROOT / "tests" / "data" / f"keda-{scaling.KEDA_VERSION}-scaledobjects.yaml"
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
PROMETHEUS = "http://prometheus.monitoring.svc:9090"


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())


UNIFIED = load("smollm2-135m-local-cpu.yaml")
DISAGGREGATED = load("smollm2-135m-local-cpu-disaggregated.yaml")


def manifest(base: dict, replicas: int | None = None, **autoscaling) -> dict:
    obj = copy.deepcopy(base)
    obj["metadata"]["name"] = "m"
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    if autoscaling:
        obj["spec"]["autoscaling"] = autoscaling
    return obj


def parsed(obj: dict):
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def crd_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def api_server_refusals(obj: dict) -> list[str]:
    """What the (emulated) API server says of the object under the generated CRD: schema, then CEL rules,
    after its defaults are applied."""
    schema = crd_schema()
    return semantics.schema_errors(semantics.apply_defaults(copy.deepcopy(obj), schema), schema)


# ---- the resource --------------------------------------------------------------------------------------


def test_crd_declares_the_scale_subresource_on_spec_replicas_and_the_status_fields():
    built = crd.build_crd()
    version = built["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.scaleReplicas",
        "labelSelectorPath": ".status.selector",
    }
    props = version["schema"]["openAPIV3Schema"]["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer"
    assert "default" not in props["spec"]["properties"]["replicas"]  # unset: serving.*.replicas rule
    assert props["status"]["properties"]["scaleReplicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"
    assert set(props["status"]["properties"]["replicas"]["additionalProperties"]["properties"]) >= {
        "desired", "ready"
    }  # fmt: skip  # the per-role map stays as it was
    kubernetes_validate.validate(built, KUBERNETES_VERSIONS[-1], strict=True)


def test_a_full_autoscaling_section_is_accepted_and_defaulted_by_the_api_server_and_the_operator():
    obj = manifest(
        DISAGGREGATED, replicas=2, enabled=True, provider="keda", min=0, max=6, scaleToZero=True,
        idleSeconds=600, metric="ttft", ttftSLOMilliseconds=800, prefill={"min": 0, "max": 3},
        prefillDecodeRatio={"min": 0.5, "max": 1.5}, scaleUp={"stabilizationSeconds": 15},
        prometheusAddress=PROMETHEUS,
    )  # fmt: skip
    assert api_server_refusals(obj) == []
    report = validation.check(obj)
    assert report.ok, report.errors
    defaulted = semantics.apply_defaults(copy.deepcopy(obj), crd_schema())["spec"]["autoscaling"]
    assert (defaulted["scaleDown"], defaulted["onManualChange"], defaulted["dryRun"]) == (
        {"stabilizationSeconds": 300}, "adopt", False
    )  # fmt: skip
    a = parsed(obj).autoscaling
    assert (a.scaleUp.stabilizationSeconds, a.scaleDown.stabilizationSeconds, a.target) == (15, 300, None)


# (the autoscaling section, the message both the API server's CEL rule and the operator's twin give)
REFUSED_BY_RULES = [
    ({"min": 5, "max": 2}, "autoscaling.min must not exceed autoscaling.max"),
    ({"scaleToZero": True, "min": 1}, "autoscaling.scaleToZero needs autoscaling.min 0"),
    ({"metric": "ttft"}, "autoscaling.metric ttft needs autoscaling.ttftSLOMilliseconds"),
    (
        {"metric": "ttft", "ttftSLOMilliseconds": 500, "target": 0.5},
        "metric ttft holds autoscaling.ttftSLOMilliseconds instead: remove autoscaling.target",
    ),
    ({"metric": "occupancy", "target": 3}, "autoscaling.target of metric occupancy is a share"),
    (
        {"enabled": True, "provider": "hpa", "min": 0, "scaleToZero": True},
        "autoscaling.provider hpa cannot scale to zero",
    ),
    ({"enabled": True, "provider": "keda"}, "autoscaling.provider keda needs autoscaling.prometheusAddress"),
    ({"provider": "hpa", "dryRun": True}, "autoscaling.dryRun applies to provider builtin"),
]


@pytest.mark.parametrize(("section", "message"), REFUSED_BY_RULES, ids=[m for _, m in REFUSED_BY_RULES])
def test_autoscaling_rules_refuse_in_the_api_server_and_in_the_operator_alike(section, message):
    obj = manifest(UNIFIED, replicas=1, **section)
    assert any(message in e for e in api_server_refusals(obj)), api_server_refusals(obj)
    errors = validation.check(obj).errors
    assert any(message in e for e in errors), errors


def test_per_role_and_ratio_bounds_are_checked_where_they_are_declared():
    bad_prefill = manifest(DISAGGREGATED, prefill={"min": 3, "max": 1})
    assert any("autoscaling.prefill.min must not exceed autoscaling.prefill.max" in e
               for e in api_server_refusals(bad_prefill))  # fmt: skip
    bad_ratio = manifest(DISAGGREGATED, prefillDecodeRatio={"min": 2, "max": 0.5})
    assert any("prefillDecodeRatio.min must not exceed autoscaling.prefillDecodeRatio.max" in e
               for e in validation.check(bad_ratio).errors)  # fmt: skip
    zero_ratio = manifest(DISAGGREGATED, prefillDecodeRatio={"min": 0, "max": 1})
    assert validation.check(zero_ratio).errors == [
        "spec.autoscaling.prefillDecodeRatio.min: Input should be greater than 0"
    ]
    to_zero = manifest(DISAGGREGATED, min=0, scaleToZero=True, prefill={"min": 1, "max": 2})
    assert any("needs autoscaling.prefill.min 0 too" in e for e in validation.check(to_zero).errors)


@pytest.mark.parametrize(
    ("base", "replicas", "section", "message"),
    [
        (
            UNIFIED, None, {"prefillDecodeRatio": {"min": 1, "max": 2}},
            "autoscaling.prefillDecodeRatio applies to serving.mode disaggregated; this model is unified: "
            "remove it",
        ),
        (
            UNIFIED, None, {"prefill": {"min": 1, "max": 2}},
            "autoscaling.prefill applies to serving.mode disaggregated",
        ),
        (
            UNIFIED, None, {"enabled": True, "provider": "hpa", "min": 2, "max": 5},
            "autoscaling.provider hpa scales spec.replicas through the NeuronModel's scale subresource, "
            "and a HorizontalPodAutoscaler does nothing while it reads 0 replicas: set spec.replicas (the "
            "starting count, 2 to 5)",
        ),
        (
            DISAGGREGATED, 1,
            {"enabled": True, "provider": "hpa", "metric": "ttft", "ttftSLOMilliseconds": 900},
            "autoscaling.metric ttft with provider hpa needs serving.mode unified",
        ),
    ],
    ids=["ratio-unified", "prefill-unified", "hpa-without-replicas", "hpa-ttft-disaggregated"],
)  # fmt: skip
def test_cross_section_refusals_say_what_to_change(base, replicas, section, message):
    """Refused at apply by the CRD's rules over the whole spec, and by the operator (Validated=False) for an
    object stored before the CRD had them: both say what to change."""
    obj = manifest(base, replicas=replicas, **section)
    words = message.split(" (the starting count")[0]  # (the API server's message names no values)
    assert [e for e in api_server_refusals(obj) if words in e], api_server_refusals(obj)
    errors = validation.check(obj).errors
    assert any(e.startswith(message) for e in errors), errors


def test_a_spec_that_leaves_replicas_to_autoscaling_validates_with_the_builtin_note_only_for_builtin():
    hpa = manifest(UNIFIED, replicas=2, enabled=True, provider="hpa", min=1, max=3)
    assert validation.check(hpa).ok
    obj = parsed(hpa)
    hpa_obj = scaling.build_autoscaler(obj, builders.metadata(OWNER, "m", "autoscaler"))
    condition = status.autoscaling_condition([], 3, "2026-01-01T00:00:00Z", hpa_obj)
    assert (condition["status"], condition["reason"]) == ("True", "HorizontalPodAutoscaler")
    assert scaling.made_autoscaler([condition]) == "HorizontalPodAutoscaler"
    builtin = status.autoscaling_condition([], 3, "2026-01-01T00:00:00Z", None)
    assert (builtin["status"], builtin["reason"]) == ("True", "Builtin")
    assert scaling.made_autoscaler([builtin]) is None


# ---- the scale subresource's mapping ---------------------------------------------------------------------


def disaggregated(replicas: int | None, pods: tuple[int, int], **autoscaling) -> dict[str, int]:
    """serving_roles of the disaggregated sample with serving.prefill/decode.replicas `pods`."""
    obj = manifest(DISAGGREGATED, replicas=replicas, **autoscaling)
    obj["spec"]["serving"]["prefill"]["replicas"], obj["spec"]["serving"]["decode"]["replicas"] = pods
    return builders.serving_roles(parsed(obj))


def test_spec_replicas_sets_the_unified_pods_and_unset_leaves_serving_replicas():
    # (every unified model's front door: one router pod, whatever the count, docs/front-door.md)
    assert builders.serving_roles(parsed(manifest(UNIFIED))) == {"unified": 1, "router": 1}
    assert builders.serving_roles(parsed(manifest(UNIFIED, replicas=3))) == {"unified": 3, "router": 1}
    assert builders.serving_roles(parsed(manifest(UNIFIED, replicas=0))) == {"unified": 0, "router": 1}
    spec = parsed(manifest(UNIFIED, replicas=3))
    deployment = builders.build_deployment(
        OWNER, spec, "unified", builders.serving_roles(spec)["unified"], "h"
    )
    assert deployment["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    ("replicas", "prefill", "decode", "bounds", "expected"),
    [
        (None, 2, 3, {}, {"prefill": 2, "decode": 3, "router": 1}),  # unset: as serving says
        (4, 1, 2, {}, {"prefill": 2, "decode": 4, "router": 1}),  # the declared 1:2 kept
        (3, 1, 2, {}, {"prefill": 2, "decode": 3, "router": 1}),  # rounded up: never short of prefill
        (5, 1, 4, {}, {"prefill": 2, "decode": 5, "router": 1}),
        (1, 1, 4, {}, {"prefill": 1, "decode": 1, "router": 1}),  # at least one while any decode runs
        (0, 1, 2, {}, {"prefill": 0, "decode": 0, "router": 1}),  # to zero: the router stays
        (4, 1, 4, {"prefillDecodeRatio": {"min": 0.5, "max": 1}}, {"prefill": 2, "decode": 4, "router": 1}),
        (4, 4, 1, {"prefillDecodeRatio": {"min": 0.5, "max": 1}}, {"prefill": 4, "decode": 4, "router": 1}),
        (8, 1, 1, {"prefill": {"min": 1, "max": 3}}, {"prefill": 3, "decode": 8, "router": 1}),
        (1, 1, 4, {"prefill": {"min": 2, "max": 3}}, {"prefill": 2, "decode": 1, "router": 1}),
    ],
)
def test_spec_replicas_sets_decode_and_prefill_follows_the_ratio_within_its_bounds(
    replicas, prefill, decode, bounds, expected
):
    assert disaggregated(replicas, (prefill, decode), **bounds) == expected


def test_scale_status_reports_the_scaled_roles_pods_and_their_selector():
    unified = parsed(manifest(UNIFIED, replicas=3))
    pods = builders.selector(OWNER, scaling.scaled_role(unified))
    assert scaling.scale_status(unified, {"unified": (3, 1)}, pods) == {
        "scaleReplicas": 3,
        "selector": "neuronfleet.dev/model=m,neuronfleet.dev/role=unified",
    }
    pd = parsed(manifest(DISAGGREGATED, replicas=2))
    pods = builders.selector(OWNER, scaling.scaled_role(pd))
    roles = {"prefill": (2, 2), "decode": (2, 0), "router": (1, 1)}
    assert scaling.scale_status(pd, roles, pods) == {
        "scaleReplicas": 2,
        "selector": "neuronfleet.dev/model=m,neuronfleet.dev/role=decode",
    }
    assert scaling.scale_status(pd, {}, pods)["scaleReplicas"] == 0  # compiling: no serving set yet
    # the selector selects exactly the scaled role's pods, as the Deployment labels them
    deployment = builders.build_deployment(OWNER, pd, "decode", 2, "h")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    match = semantics.label_matcher(scaling.scale_status(pd, roles, pods)["selector"])
    assert match(labels)
    prefill = builders.build_deployment(OWNER, pd, "prefill", 2, "h")
    assert not match(prefill["spec"]["template"]["metadata"]["labels"])


# ---- provider hpa -----------------------------------------------------------------------------------------


def built(obj: dict) -> dict[str, dict]:
    spec = parsed(obj)
    return {o["kind"]: o for o in builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec))}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("section", "metric", "value"),
    [
        ({"metric": "occupancy"}, "vllm:kv_cache_usage_perc", "750m"),
        ({"metric": "occupancy", "target": 0.6}, "vllm:kv_cache_usage_perc", "600m"),
        ({"metric": "queue"}, "vllm:num_requests_waiting", "2"),
        ({"metric": "queue", "target": 1.5}, "vllm:num_requests_waiting", "1500m"),
        ({"metric": "ttft", "ttftSLOMilliseconds": 800}, "vllm:time_to_first_token_seconds:p90", "800m"),
    ],
)
def test_provider_hpa_emits_a_valid_autoscaling_v2_hpa_on_the_neuronmodel(version, section, metric, value):
    obj = manifest(
        UNIFIED, replicas=2, enabled=True, provider="hpa", min=1, max=5, **section,
        scaleUp={"stabilizationSeconds": 30}, scaleDown={"stabilizationSeconds": 600},
    )  # fmt: skip
    assert validation.check(obj).ok
    hpa = built(obj)["HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, version, strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["name"] == "m" and hpa["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel",
                                             "name": "m"}  # fmt: skip
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    assert hpa["spec"]["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": metric}, "target": {"type": "AverageValue",
                                                                          "averageValue": value}}}
    ]  # fmt: skip
    assert hpa["spec"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 30},
        "scaleDown": {"stabilizationWindowSeconds": 600},
    }


def test_hpa_metric_names_are_the_ones_the_runtime_exports():
    sources = (ROOT / "runtime" / "engine" / "engine.py").read_text() + (
        ROOT / "runtime" / "serving" / "server.py"
    ).read_text()
    for name in (scaling.QUEUE_METRIC, scaling.OCCUPANCY_METRIC, scaling.TTFT_METRIC):
        assert f'"{name}"' in sources, name
    assert scaling.HELD_METRIC == pod_metrics.HELD  # the front door's gauge, as the builtin loop reads it


def test_no_autoscaler_object_for_builtin_or_disabled_autoscaling():
    for section in ({}, {"enabled": True}, {"enabled": False, "provider": "hpa"}):
        kinds = set(built(manifest(UNIFIED, replicas=1, **section)))
        assert not kinds & set(scaling.AUTOSCALER_KINDS), (section, kinds)


# ---- provider keda ----------------------------------------------------------------------------------------


def keda_schema() -> dict:
    crd_doc = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd_doc["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def keda_valid(obj: dict) -> None:
    """KEDA's published schema (OpenAPI v3.0: JSON Schema draft 4 semantics), and the replica bounds KEDA's
    admission checks (kedacore/keda@v2.20.2 apis/keda/v1alpha1/scaledobject_types.go,
    CheckReplicaCountBoundsAreValid: min <= max, idleReplicaCount below minReplicaCount)."""
    jsonschema.Draft4Validator(keda_schema()).validate(obj)
    s = obj["spec"]
    assert s.get("minReplicaCount", 0) <= s.get("maxReplicaCount", 100)
    if "idleReplicaCount" in s:
        assert s["idleReplicaCount"] < s.get("minReplicaCount", 0)
    assert set(obj["metadata"]) <= {"name", "namespace", "labels", "ownerReferences"}


def test_keda_crd_data_is_the_pinned_release():
    header = KEDA_CRD.read_text().splitlines()[0]
    assert header == ("# Source: https://github.com/kedacore/keda/blob/v2.20.2/config/crd/bases/"
                      "keda.sh_scaledobjects.yaml")  # fmt: skip
    assert yaml.safe_load(KEDA_CRD.read_text())["metadata"]["name"] == "scaledobjects.keda.sh"


def test_provider_keda_scales_to_zero_through_the_idle_replica_count():
    obj = manifest(
        UNIFIED, enabled=True, provider="keda", min=0, max=4, scaleToZero=True, idleSeconds=900,
        metric="queue", target=3, prometheusAddress=PROMETHEUS,
    )  # fmt: skip
    assert validation.check(obj).ok
    so = built(obj)["ScaledObject"]
    keda_valid(so)
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    s = so["spec"]
    assert s["scaleTargetRef"] == {
        "apiVersion": "neuronfleet.dev/v1alpha1",
        "kind": "NeuronModel",
        "name": "m",
    }
    counts = (s["idleReplicaCount"], s["minReplicaCount"], s["maxReplicaCount"], s["cooldownPeriod"])
    assert counts == (0, 1, 4, 900)
    load, held = s["triggers"]
    assert load == {
        "type": "prometheus", "name": "queue", "metricType": "AverageValue",
        "metadata": {"serverAddress": PROMETHEUS, "query": 'sum(vllm:num_requests_waiting{namespace="ns",'
                     'pod=~"m-unified-.*"})', "threshold": "3", "activationThreshold": "0"},
    }  # fmt: skip
    query = 'sum(neuronfleet:router_requests_held{namespace="ns",pod=~"m-router-.*"})'
    assert held["metadata"]["query"] == query
    assert (held["metadata"]["threshold"], held["metadata"]["activationThreshold"]) == ("1", "0")
    assert s["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 300
    }


def test_provider_keda_without_scale_to_zero_and_on_ttft_for_a_disaggregated_model():
    obj = manifest(
        DISAGGREGATED, replicas=1, enabled=True, provider="keda", min=1, max=3, metric="ttft",
        ttftSLOMilliseconds=1200, prometheusAddress=PROMETHEUS,
    )  # fmt: skip
    assert validation.check(obj).ok
    so = built(obj)["ScaledObject"]
    keda_valid(so)
    assert "idleReplicaCount" not in so["spec"] and "cooldownPeriod" not in so["spec"]
    assert so["spec"]["minReplicaCount"] == 1
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metricType"] == "Value"  # a p90 is not a sum over pods
    assert trigger["metadata"]["threshold"] == "1.2"
    assert trigger["metadata"]["query"] == (
        'histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{namespace="ns",'
        'pod=~"m-router-.*"}[2m])))'
    )


def test_keda_schema_check_has_teeth():
    obj = manifest(UNIFIED, enabled=True, provider="keda", prometheusAddress=PROMETHEUS)
    so = built(obj)["ScaledObject"]
    keda_valid(so)
    broken = copy.deepcopy(so)
    del broken["spec"]["scaleTargetRef"]["name"]
    with pytest.raises(jsonschema.ValidationError, match="'name' is a required property"):
        keda_valid(broken)
    broken = copy.deepcopy(so)
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 3  # KEDA's metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        keda_valid(broken)


# ---- RBAC --------------------------------------------------------------------------------------------------


def test_rbac_grows_by_exactly_what_the_autoscaler_objects_need():
    for kind in scaling.AUTOSCALER_KINDS:
        group, _, resource = kube.API_VERSIONS[kind]
        assert kube.RBAC_RULES[(group, resource)] == ("get", "create", "patch", "delete"), kind
    assert kube.API_VERSIONS["HorizontalPodAutoscaler"] == ("autoscaling", "v2", "horizontalpodautoscalers")
    assert kube.API_VERSIONS["ScaledObject"] == ("keda.sh", "v1alpha1", "scaledobjects")


def test_every_sample_still_builds_without_an_autoscaler_object():
    for path in sorted(Path(ROOT / "crds" / "samples").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        if (obj["spec"].get("autoscaling") or {}).get("provider", "builtin") != "builtin":
            continue
        assert not set(built(obj)) & set(scaling.AUTOSCALER_KINDS), path.name


def test_validate_accepts_the_builtin_and_hpa_providers_without_a_note(tmp_path):
    builtin = manifest(UNIFIED, enabled=True, min=1, max=3)
    builtin["metadata"]["name"] = "b"
    hpa = manifest(UNIFIED, replicas=1, enabled=True, provider="hpa", min=1, max=3)
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump_all([builtin, hpa]))
    run = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("ok ") and " b;" in lines[0]
    assert lines[1].startswith("ok ") and " m;" in lines[1] and len(lines) == 2  # builtin is acted on


@pytest.mark.parametrize(
    ("base", "replicas", "autoscaling", "says"),
    [
        (UNIFIED, None, {}, None),  # spec.replicas unset: serving.unified.replicas counts
        (UNIFIED, 1, {}, None),  # the same count both ways: nothing to say
        (UNIFIED, 3, {}, "spec.replicas (3, what kubectl scale sets) decides the unified pods; "
                         "serving.unified.replicas (1) counts only while spec.replicas is unset"),
        (DISAGGREGATED, 2, {}, "decides the decode pods, prefill following serving's prefill:decode ratio"),
        (UNIFIED, 3, {"enabled": True, "min": 1, "max": 4}, None),  # the autoscaler's: its own status says
    ],
)  # fmt: skip
def test_which_replica_count_decides_is_said_when_the_two_differ(base, replicas, autoscaling, says):
    spec = parsed(manifest(base, replicas, **autoscaling))
    notice = scaling.replicas_notice(spec)
    assert (notice is None) == (says is None) and (says is None or says in notice), notice
    if replicas is not None:  # and the pods are as spec.replicas says, whatever serving says
        assert scaling.role_replicas(spec)[scaling.scaled_role(spec)] == replicas
