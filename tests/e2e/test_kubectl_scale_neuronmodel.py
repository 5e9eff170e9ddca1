"""The NeuronModel's scale subresource through the real kubectl against the emulated API server: discovery,
`kubectl scale neuronmodel` (spec.replicas), the autoscaling/v1 Scale read and written with GET, PATCH and
PUT, its status from status.scaleReplicas and status.selector, refusals; then with the operator running, a
scale moves the serving Deployments (decode, and prefill with it by the declared ratio) and the status the
operator writes feeds the Scale an HPA reads; provider keda's ScaledObject made and deleted."""

from __future__ import annotations

import json

import pytest
import yaml
from support import OPERATOR_USER, ROOT, OperatorCluster, finish_compile

from neuronfleet.operator.kube import LEASE_RULES, RBAC_RULES
from neuronfleet.operator.watching import KOPF_RULES

UNIFIED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
KEDA_CRD = ROOT / "tests" / "data" / "keda-v2.20.2-scaledobjects.yaml"  # KEDA's published CRD
SCALE = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels/{}/scale"


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def sample(path, name: str, **spec) -> str:
    obj = yaml.safe_load(path.read_text())
    obj["metadata"] = {"name": name, "namespace": "default"}
    obj["spec"].update(spec)
    return json.dumps(obj)


def scale_of(kubectl, name: str) -> dict:
    """The NeuronModel's autoscaling/v1 Scale, as GET .../scale answers."""
    return json.loads(kubectl("get", "--raw", SCALE.format(name)).stdout)


def test_kubectl_scale_reads_and_writes_spec_replicas_through_the_scale_subresource(cluster, tmp_path):
    kubectl = cluster.kubectl
    resources = json.loads(kubectl("get", "--raw", "/apis/neuronfleet.dev/v1alpha1").stdout)["resources"]
    scale = next(r for r in resources if r["name"] == "neuronmodels/scale")
    assert (scale["group"], scale["version"], scale["kind"]) == ("autoscaling", "v1", "Scale")
    assert set(scale["verbs"]) >= {"get", "patch", "update"}

    kubectl("apply", "-f", "-", stdin=sample(UNIFIED, "m"))
    first = scale_of(kubectl, "m")
    # spec.replicas unset reads as 0, as a real API server reads a missing specReplicasPath; no status yet
    assert (first["kind"], first["apiVersion"], first["spec"], first["status"]) == (
        "Scale", "autoscaling/v1", {"replicas": 0}, {"replicas": 0}
    )  # fmt: skip

    out = kubectl("scale", "neuronmodel", "m", "--replicas=3").stdout
    assert out == "neuronmodel.neuronfleet.dev/m scaled\n"
    assert kubectl("get", "nm", "m", "-o", "jsonpath={.spec.replicas}").stdout == "3"
    generation = int(kubectl("get", "nm", "m", "-o", "jsonpath={.metadata.generation}").stdout)
    assert generation == 2  # a spec change, as any other: the operator's update handler runs

    # the status the operator writes is what the Scale reports (what an HPA reads as current and selects)
    selector = "neuronfleet.dev/model=m,neuronfleet.dev/role=unified"
    status = json.dumps({"status": {"scaleReplicas": 2, "selector": selector}})
    kubectl("patch", "nm", "m", "--subresource", "status", "--type", "merge", "-p", status)
    assert scale_of(kubectl, "m")["status"] == {"replicas": 2, "selector": selector}
    assert scale_of(kubectl, "m")["spec"] == {"replicas": 3}

    run = kubectl("scale", "nm", "m", "--current-replicas=2", "--replicas=5", check=False)
    assert run.returncode != 0 and "Expected replicas to be 2, was 3" in run.stderr, run.stderr
    out = kubectl("scale", "nm", "m", "--current-replicas=3", "--replicas=1").stdout
    assert out == "neuronmodel.neuronfleet.dev/m scaled\n"

    # PATCH of /scale answers with the Scale; a negative count is refused in the Scale's words
    patch = json.dumps({"spec": {"replicas": 4}})
    answered = json.loads(
        kubectl(
            "patch", "nm", "m", "--subresource", "scale", "--type", "merge", "-p", patch, "-o", "json"
        ).stdout
    )
    assert (answered["kind"], answered["spec"]) == ("Scale", {"replicas": 4})
    run = kubectl("patch", "nm", "m", "--subresource", "scale", "--type", "merge", "-p",
                  json.dumps({"spec": {"replicas": -1}}), check=False)  # fmt: skip
    assert run.returncode != 0 and "spec.replicas: Invalid value: -1" in run.stderr, run.stderr
    # past the schema's maximum: refused as a write of the object would be
    run = kubectl("scale", "nm", "m", "--replicas=100000", check=False)
    assert run.returncode != 0 and "spec.replicas" in run.stderr and "1000" in run.stderr, run.stderr
    assert kubectl("get", "nm", "m", "-o", "jsonpath={.spec.replicas}").stdout == "4"

    # PUT: the Scale read back, changed and replaced (what an HPA's scale client does)
    current = scale_of(kubectl, "m")
    current["spec"]["replicas"] = 6
    put = tmp_path / "scale.json"
    put.write_text(json.dumps(current))
    out = kubectl("replace", "--raw", SCALE.format("m"), "-f", str(put)).stdout
    assert json.loads(out)["spec"] == {"replicas": 6}
    assert kubectl("get", "nm", "m", "-o", "jsonpath={.spec.replicas}").stdout == "6"
    # the status is the operator's alone: a scale write leaves it as it was
    assert scale_of(kubectl, "m")["status"] == {"replicas": 2, "selector": selector}

    # an autoscaled model: a scale above autoscaling.max is refused by the CRD's rule, never clamped
    kubectl("apply", "-f", "-", stdin=sample(UNIFIED, "auto", replicas=2,
                                             autoscaling={"enabled": True, "min": 1, "max": 3}))  # fmt: skip
    run = kubectl("scale", "nm", "auto", "--replicas=5", check=False)
    assert run.returncode != 0 and "spec.replicas 5 is above autoscaling.max 3" in run.stderr, run.stderr
    assert kubectl("get", "nm", "auto", "-o", "jsonpath={.spec.replicas}").stdout == "2"
    assert kubectl("scale", "nm", "auto", "--replicas=3").returncode == 0


def test_the_operator_maps_a_scale_to_decode_and_prefill_and_reports_the_scale_status(cluster):
    kubectl = cluster.kubectl
    operator = cluster.start_operator()
    obj = json.loads(sample(DISAGGREGATED, "pd", replicas=2))
    obj["spec"]["serving"]["prefill"]["replicas"] = 1  # the declared ratio, 1 prefill : 2 decode
    obj["spec"]["serving"]["decode"]["replicas"] = 2
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    jobs = operator.wait_until(lambda: (kubectl.get("jobs") or {}).get("items"), "the compile Job")
    selector = "neuronfleet.dev/model=pd,neuronfleet.dev/role=decode"
    # compiling: no serving pods yet, and the Scale says so (an HPA reads 0 current replicas)
    operator.wait_until(
        lambda: scale_of(kubectl, "pd")["status"] == {"replicas": 0, "selector": selector}, "the scale status"
    )
    finish_compile(kubectl, jobs[0]["metadata"]["name"])

    def replicas() -> dict[str, int]:
        found = kubectl.get("deployments", "-l", "neuronfleet.dev/model=pd")["items"]
        return {d["metadata"]["labels"]["neuronfleet.dev/role"]: d["spec"]["replicas"] for d in found}

    operator.wait_until(lambda: replicas() == {"prefill": 1, "decode": 2, "router": 1}, "the serving set")
    operator.wait_until(lambda: scale_of(kubectl, "pd")["status"]["replicas"] == 2, "status.scaleReplicas 2")
    assert kubectl("scale", "nm", "pd", "--replicas=4").stdout == "neuronmodel.neuronfleet.dev/pd scaled\n"
    operator.wait_until(lambda: replicas() == {"prefill": 2, "decode": 4, "router": 1}, "decode 4, prefill 2")
    operator.wait_until(lambda: scale_of(kubectl, "pd")["status"]["replicas"] == 4, "status.scaleReplicas 4")
    assert scale_of(kubectl, "pd")["status"]["selector"] == selector
    # the selector selects the decode Deployment only
    names = kubectl("get", "deployments", "-l", selector, "-o", "jsonpath={.items[*].metadata.name}").stdout
    assert len(names.split()) == 1 and names.startswith("pd-decode-"), names
    model = kubectl.get("nm", "pd")
    assert model["status"]["replicas"]["decode"]["desired"] == 4  # the per-role map is kept as it was
    assert model["status"]["replicas"]["prefill"]["desired"] == 2
    # one replica count: kubectl describe says that spec.replicas, not the serving block's 2, decides
    said = "spec.replicas (4, what kubectl scale sets) decides the decode pods"
    validated = next(c for c in model["status"]["conditions"] if c["type"] == "Validated")
    assert validated["reason"] == "ReplicasFromScale" and said in validated["message"], validated
    operator.wait_until(lambda: said in kubectl("describe", "nm", "pd").stdout, "the ReplicasFromScale Event")


def test_provider_keda_makes_a_scaled_object_the_cluster_accepts_and_deletes_it_when_no_longer_asked(cluster):
    """KEDA's own CRD (tests/data, v2.20.2) installed in the emulated API server, which checks the operator's
    ScaledObject against its schema; a change of provider deletes it; every call within RBAC_RULES."""
    kubectl = cluster.kubectl
    kubectl("apply", "-f", str(KEDA_CRD))
    operator = cluster.start_operator()
    obj = json.loads(sample(UNIFIED, "k"))
    obj["spec"]["autoscaling"] = {
        "enabled": True, "provider": "keda", "min": 0, "max": 3, "scaleToZero": True, "metric": "queue",
        "prometheusAddress": "http://prometheus.monitoring.svc:9090",
    }  # fmt: skip
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    scaled = operator.wait_until(lambda: kubectl.get("scaledobject", "k"), "the ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "k"}
    assert (scaled["spec"]["idleReplicaCount"], scaled["spec"]["minReplicaCount"]) == (0, 1)
    assert scaled["metadata"]["ownerReferences"][0]["kind"] == "NeuronModel"

    def active() -> dict | None:
        model = kubectl.get("nm", "k")
        conds = {c["type"]: c for c in (model or {}).get("status", {}).get("conditions", [])}
        return conds.get("AutoscalingActive")

    condition = operator.wait_until(active, "AutoscalingActive")
    assert (condition["status"], condition["reason"]) == ("True", "ScaledObject")
    obj["spec"]["autoscaling"] = {"enabled": True, "provider": "builtin", "min": 1, "max": 3}
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    operator.wait_until(lambda: kubectl.get("scaledobject", "k") is None, "the ScaledObject deleted")
    operator.wait_until(lambda: (active() or {}).get("reason") == "Builtin", "builtin: the operator scales")
    calls = [json.loads(line) for line in (cluster.state / "audit.jsonl").read_text().splitlines()]
    used = {(c["group"], c["resource"], c["verb"]) for c in calls if c["user"] == OPERATOR_USER}
    declared = {(g, r, v) for (g, r), verbs in (RBAC_RULES | LEASE_RULES | KOPF_RULES).items() for v in verbs}
    assert ("keda.sh", "scaledobjects", "delete") in used and used <= declared, sorted(used - declared)
