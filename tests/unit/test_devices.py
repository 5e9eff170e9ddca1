"""How Neuron pods get their devices (operator/devices.py), both ways: every Neuron sample and DRA and LNC
variants rendered by the builders as the operator applies them, validated strictly for Kubernetes 1.34+
(resource.k8s.io/v1 included), every DRA name checked against the record of its sources
(tests/data/neuron-dra-sdk2.32.0-names.json: the Neuron SDK at v2.32.0 and the EKS user guide), and what each
pod asks for read back from the objects: the device plugins' extended resources, or a claim template's
requests, counts, connected-set constraint, LNC and EFA pairing. A non-default LNC with the device plugin
selects the nodes the chart's label names, or is refused saying how to get such nodes; a claim template no
pod kind names any more is deleted as stale."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
from engine_renders import OWNER, manifest, of_kind, rendered
from support import ROOT

from neuronfleet.operator import builders, devices, planner, validation

RECORDED = json.loads((ROOT / "tests" / "data" / "neuron-dra-sdk2.32.0-names.json").read_text())
RECORD, FACTS = RECORDED["names"], RECORDED["facts"]
NEURON_SAMPLES = sorted(
    p.name
    for p in (ROOT / "crds" / "samples").glob("*.yaml")
    if re.search(r"instanceType: (inf2|trn)", p.read_text())
)
TRN2, TRN2_PD = "llama-3.3-70b-vllm-trn2.yaml", "llama-3.3-70b-vllm-trn2-disaggregated.yaml"
TRN3_PD, INF2 = "gpt-oss-120b-sglang-trn3-disaggregated.yaml", "llama-3.1-8b-vllm-inf2.yaml"
DRA = {"deviceAllocation": "dra"}
SMALL = {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}  # one that fits a few cores
PLUGIN = {"deviceAllocation": "devicePlugin"}
VARIANTS = {
    "trn2 dra LNC 1": (TRN2, {"neuron": {**DRA, "logicalCores": 1, "tensorParallel": 64, "batchSize": 8}}),
    "trn2 dra tensorParallel 8 (2 devices: a set of 4)": (
        TRN2, {"neuron": {**DRA, "tensorParallel": 8}, "model": SMALL},
    ),
    "trn2 dra tensorParallel 1": (
        TRN2, {"neuron": {**DRA, "tensorParallel": 1}, "model": {"uri": "hf://meta-llama/Llama-3.2-1B-Instruct"}},
    ),
    "trn2 disaggregated dra, EFA": (TRN2_PD, {"neuron": DRA}),
    "trn2 disaggregated dra, more EFA than a prefill pod's group": (
        TRN2_PD, {"neuron": DRA, "serving": {"kvTransfer": {"transport": "efa", "efaInterfaces": 8}}},
    ),
    "trn3 disaggregated dra (sglang)": (TRN3_PD, {"neuron": DRA}),
    "inf2 dra": (INF2, {"neuron": DRA}),
}  # fmt: skip


def cases() -> list[tuple[str, dict]]:
    """Every Neuron sample both ways, then the variants."""
    out = []
    for name in NEURON_SAMPLES:
        out += [
            (f"{name} devicePlugin", manifest(name, {"neuron": PLUGIN})),
            (f"{name} dra", manifest(name, {"neuron": DRA})),
        ]
    return out + [(label, manifest(base, change)) for label, (base, change) in VARIANTS.items()]


def neuron_pods(objects: list[dict]) -> dict[str, dict]:
    """role (or `compile`) -> pod spec, of the pods placed on Neuron nodes."""
    out = {}
    for o in of_kind(objects, "Deployment") + of_kind(objects, "Job"):
        pod = o["spec"]["template"]["spec"]
        if any(t.get("key") == "aws.amazon.com/neuron" for t in pod.get("tolerations", [])):
            out[o["metadata"]["labels"]["neuronfleet.dev/role"]] = pod
    return out


def templates(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in of_kind(objects, "ResourceClaimTemplate")}


def dra_names(template: dict) -> set[str]:
    """Every name a claim template gives the drivers (not the Kubernetes API's own field names)."""
    names = {template["apiVersion"], template["kind"]}
    devices_ = template["spec"]["spec"]["devices"]
    for request in devices_["requests"]:
        exactly = request["exactly"]
        names |= {exactly["deviceClassName"], exactly["allocationMode"]}
        for selector in exactly.get("selectors", []):
            names.add(re.sub(r"\s*==.*", "", selector["cel"]["expression"]))
    names |= {c["matchAttribute"] for c in devices_.get("constraints", [])}
    for config in devices_.get("config", []):
        opaque = config["opaque"]
        params = opaque["parameters"]
        names |= {opaque["driver"], params["apiVersion"], params["kind"]} | (
            set(params) - {"apiVersion", "kind"}
        )
    return names


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_every_neuron_sample_and_variant_renders_objects_that_validate_strictly(label, obj):
    _, objects = rendered(obj)
    for o in objects:
        for version in ("1.34.0", "1.37.0"):  # DRA's resource.k8s.io/v1 is GA from 1.34
            kubernetes_validate.validate(o, version, strict=True)


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_each_pod_asks_for_its_devices_one_way_only(label, obj):
    """devicePlugin: extended resources, no claims; dra: a claim naming a template of the model, no extended
    resources, no Neuron scheduler extension."""
    spec, objects = rendered(obj)
    made = templates(objects)
    pods = neuron_pods(objects)
    assert pods, "no pod on Neuron nodes"
    for role, pod in pods.items():
        (container,) = pod["containers"]
        resources = container["resources"]
        extended = {k for k in resources.get("limits", {}) if "/" in k}
        if spec.neuron.deviceAllocation == "dra":
            assert not extended and "schedulerName" not in pod, role
            (claim,) = pod["resourceClaims"]
            assert resources["claims"] == [{"name": claim["name"]}]
            template = made[claim["resourceClaimTemplateName"]]
            assert template["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
        else:
            assert "resourceClaims" not in pod and "claims" not in resources, role
            assert extended <= {devices.NEURONCORE, devices.EFA} and devices.NEURONCORE in extended
            assert resources["requests"][devices.NEURONCORE] == resources["limits"][devices.NEURONCORE]
    if spec.neuron.deviceAllocation != "dra":
        assert not made


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_every_dra_name_is_recorded_with_a_versioned_source(label, obj):
    _, objects = rendered(obj)
    for template in templates(objects).values():
        missing = sorted(n for n in dra_names(template) if not RECORD.get(n))
        assert not missing, f"emitted but not found in the drivers' documentation: {missing}"


def test_every_recorded_name_is_emitted_somewhere_and_names_a_versioned_source():
    seen: set[str] = set()
    for _, obj in cases():
        _, objects = rendered(obj)
        for template in templates(objects).values():
            seen |= dra_names(template)
    # devicegroup1_id: a pod of one device on an EFA-enabled instance (tensorParallel 1 above)
    assert set(RECORD) - {"NEURON_LOGICAL_NC_CONFIG"} <= seen, sorted(set(RECORD) - seen)
    versioned = re.compile(r"@(v\d+\.\d+\.\d+|[0-9a-f]{8,40}):")
    for name, sources in [*RECORD.items(), *((n, f["sources"]) for n, f in FACTS.items())]:
        assert sources and all(versioned.search(s) for s in sources), name


def claim_of(objects: list[dict], role: str) -> dict:
    pod = neuron_pods(objects)[role]
    (claim,) = pod["resourceClaims"]
    return templates(objects)[claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]


def requests(devices_: dict) -> dict[str, dict]:
    return {r["name"]: r["exactly"] for r in devices_["requests"]}


@pytest.mark.parametrize(
    ("change", "count", "group", "lnc"),
    [
        ({"tensorParallel": 64}, 16, 16, 2),  # 64 logical cores at LNC=2: all 16 devices
        ({"tensorParallel": 64, "logicalCores": 1, "batchSize": 8}, 8, 8, 1),  # 8 cores a device at LNC=1
        ({"tensorParallel": 8}, 4, 4, 2),  # 2 devices, held as a connected set of 4
        ({"tensorParallel": 4}, 1, 1, 2),
    ],
)
def test_a_trn2_claim_holds_exactly_its_connected_devices_at_its_lnc(change, count, group, lnc):
    model = SMALL if change["tensorParallel"] < 64 else {}
    _, objects = rendered(manifest(TRN2, {"neuron": {**DRA, **change}, "model": model}))
    claim = claim_of(objects, "unified")
    neurons = requests(claim)["neurons"]
    assert (neurons["deviceClassName"], neurons["allocationMode"], neurons["count"]) == (
        "neuron.aws.com", "ExactCount", count,
    )  # fmt: skip
    assert count in FACTS["connected device sets"]["values"]
    assert neurons["selectors"] == [
        {"cel": {"expression": "device.attributes['neuron.aws.com'].instanceType == 'trn2.48xlarge'"}}
    ]
    assert claim["constraints"] == [
        {"requests": ["neurons"], "matchAttribute": f"resource.aws.com/devicegroup{group}_id"}
    ]
    (config,) = claim["config"]
    assert config == {"requests": ["neurons"], "opaque": {"driver": "neuron.aws.com", "parameters": {
        "apiVersion": "neuron.aws.com/v1", "kind": "NeuronConfig", "logicalNeuronCore": lnc}}}  # fmt: skip


def test_disaggregated_pods_get_efa_interfaces_paired_with_their_neuron_devices():
    _, objects = rendered(manifest(TRN2_PD, {"neuron": DRA}))
    for role, devices_count in (("prefill", 4), ("decode", 8)):  # tensorParallel 16 and 32 at LNC=2
        claim = claim_of(objects, role)
        wanted = requests(claim)
        assert wanted["neurons"]["count"] == devices_count
        assert wanted["efas"] == {"deviceClassName": "efa.networking.k8s.aws", "allocationMode": "ExactCount",
                                  "count": 4}  # fmt: skip
        assert claim["constraints"] == [
            {
                "requests": ["neurons", "efas"],
                "matchAttribute": f"resource.aws.com/devicegroup{devices_count}_id",
            }
        ]
    (router,) = [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"]["neuronfleet.dev/role"] == "router"
    ]
    assert "resourceClaims" not in router["spec"]["template"]["spec"]  # no devices


def test_more_efa_interfaces_than_a_group_holds_are_asked_for_unpaired():
    change = {"neuron": DRA, "serving": {"kvTransfer": {"transport": "efa", "efaInterfaces": 8}}}
    _, objects = rendered(manifest(TRN2_PD, change))
    prefill = claim_of(objects, "prefill")  # 4 devices: a group of 4 pairs with at most 4 interfaces
    assert requests(prefill)["efas"]["count"] == 8
    assert prefill["constraints"] == [
        {"requests": ["neurons"], "matchAttribute": "resource.aws.com/devicegroup4_id"}
    ]
    decode = claim_of(objects, "decode")
    assert decode["constraints"][0]["requests"] == ["neurons", "efas"]


def test_an_instance_without_efa_gets_no_connected_set_and_no_lnc():
    """inf2 publishes no devicegroup attributes (SDK dra.rst 566: EFA-enabled instances only), has no LNC."""
    _, objects = rendered(manifest(INF2, {"neuron": DRA}))
    claim = claim_of(objects, "unified")
    assert "constraints" not in claim and "config" not in claim
    assert requests(claim)["neurons"]["count"] == 4  # tensorParallel 8, two cores a device


def test_the_compile_job_on_devices_gets_its_own_claim():
    """vLLM's NxD Inference compile on Inf2 runs on the devices it compiles for; with DRA it names a claim of
    its own (the largest tensor parallelism it compiles), not cores, made before the Job."""
    _, objects = rendered(manifest(INF2, {"neuron": DRA}))
    compile_pod = neuron_pods(objects)["compile"]
    claim = claim_of(objects, "compile")
    assert requests(claim)["neurons"]["count"] == 4  # tensorParallel 8, two cores a device
    resources = compile_pod["containers"][0]["resources"]
    assert resources["claims"] == [{"name": devices.POD_CLAIM}]
    assert devices.NEURONCORE not in resources.get("limits", {})
    names = [o["metadata"]["name"] for o in objects]
    (job,) = of_kind(objects, "Job")
    template = compile_pod["resourceClaims"][0]["resourceClaimTemplateName"]
    assert template.startswith("m-compile-devices-")
    assert names.index(template) < names.index(job["metadata"]["name"])  # the template before its pod


def test_the_cluster_setting_decides_unless_the_model_says():
    spec, _ = validation.parse(manifest(TRN2))
    assert devices.allocation(spec, devices.Settings("dra")) == "dra"
    assert devices.allocation(spec, devices.Settings()) == "devicePlugin"
    own, _ = validation.parse(manifest(TRN2, {"neuron": PLUGIN}))
    assert devices.allocation(own, devices.Settings("dra")) == "devicePlugin"
    assert devices.claim_spec(own, "unified", devices.Settings("dra")) is None
    assert devices.claim_spec(spec, "unified", devices.Settings("dra")) is not None
    assert devices.extended_resources(spec, "unified", devices.Settings("dra")) == {}


def test_a_claim_template_is_named_by_its_content():
    one, _ = validation.parse(manifest(TRN2, {"neuron": DRA}))
    two, _ = validation.parse(manifest(TRN2, {"neuron": {**DRA, "logicalCores": 1, "tensorParallel": 32}}))
    names = {builders.build_claim_template(OWNER, s, "unified")["metadata"]["name"] for s in (one, two, one)}
    assert len(names) == 2 and all(n.startswith("m-unified-devices-") for n in names)


# ---- LNC with the device plugin --------------------------------------------------------------------------


def test_a_non_default_lnc_without_a_node_label_is_refused_saying_how_to_get_such_nodes():
    obj = manifest(TRN2, {"neuron": {**PLUGIN, "logicalCores": 1, "tensorParallel": 64, "batchSize": 8}})
    report = validation.check(obj)
    (error,) = [e for e in report.errors if "logicalCores" in e]
    for words in ("launch template", "NEURON_LOGICAL_NC_CONFIG=1", "neuron.lncNodeLabel", "dra"):
        assert words in error, words


def test_a_non_default_lnc_selects_the_nodes_the_charts_label_names(monkeypatch):
    monkeypatch.setattr(devices, "LNC_NODE_LABEL", "example.com/neuron-lnc")
    _, objects = rendered(
        manifest(TRN2, {"neuron": {**PLUGIN, "logicalCores": 1, "tensorParallel": 64, "batchSize": 8}})
    )
    pod = neuron_pods(objects)["unified"]
    assert pod["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "trn2.48xlarge",
        "example.com/neuron-lnc": "1",
    }
    for o in objects:
        kubernetes_validate.validate(o, "1.34.0", strict=True)


@pytest.mark.parametrize("lnc", [None, 2])
def test_the_default_lnc_needs_no_label(lnc, monkeypatch):
    monkeypatch.setattr(devices, "LNC_NODE_LABEL", "example.com/neuron-lnc")
    change = {"neuron": {**PLUGIN, "logicalCores": lnc}}
    _, objects = rendered(manifest(TRN2, change))
    assert neuron_pods(objects)["unified"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "trn2.48xlarge"
    }


def test_dra_sets_a_non_default_lnc_in_the_claim_needing_no_label():
    obj = manifest(TRN2, {"neuron": {**DRA, "logicalCores": 1, "tensorParallel": 64, "batchSize": 8}})
    assert validation.check(obj).ok
    _, objects = rendered(obj)
    assert "example.com/neuron-lnc" not in neuron_pods(objects)["unified"]["nodeSelector"]
    assert claim_of(objects, "unified")["config"][0]["opaque"]["parameters"]["logicalNeuronCore"] == 1


def test_a_bad_cluster_setting_is_refused_at_start():
    import subprocess
    import sys

    env = {"NEURONFLEET_NEURON_DEVICE_ALLOCATION": "claims", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", "import neuronfleet.operator.devices"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode != 0 and "neuron.deviceAllocation must be one of devicePlugin, dra" in out.stderr


# ---- the claim templates a spec no longer names are deleted as stale -------------------------------------


def test_a_claim_template_no_pod_kind_names_is_deleted_once_the_new_set_serves():
    spec, _ = validation.parse(manifest(TRN2, {"neuron": DRA}))
    old = builders.build_claim_template(OWNER, spec, "unified")
    other, _ = validation.parse(manifest(TRN2, {"neuron": {**DRA, "tensorParallel": 32}}))
    wanted = builders.build_all(OWNER, other, serving_hash=builders.compile_hash(other), compile_job=False)
    kept = builders.build_claim_template(OWNER, other, "unified")
    foreign = {**old, "metadata": {**old["metadata"], "name": "someone-elses", "ownerReferences": []}}
    observed = planner.Observed(claim_templates=[old, kept, foreign])
    writes, _ = planner.stale_deletions(OWNER, wanted, [], observed, None, None, "2026-12-06T12:00:00Z")
    assert planner.Delete("ResourceClaimTemplate", old["metadata"]["name"]) in writes
    deleted = {w.name for w in writes if isinstance(w, planner.Delete)}
    assert kept["metadata"]["name"] not in deleted and "someone-elses" not in deleted
