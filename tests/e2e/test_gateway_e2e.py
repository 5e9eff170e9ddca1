"""serving.gateway on the emulated API server with the pinned Gateway API Inference Extension and Gateway API
CRDs installed (tests/data), which checks the operator's InferencePool and HTTPRoute against their schemas and
CEL rules as a real API server does: `kubectl get inferencepools` shows the model's pool once it serves, the
pool selects what the model's Service selects, the HTTPRoute sends to it; a pool changed by hand is put back
(and never patched for what the API server defaulted); a spec change that drops the route, then the gateway,
deletes them; every call the operator made is within RBAC_RULES."""

from __future__ import annotations

import json

import pytest
import yaml
from support import OPERATOR_USER, ROOT, OperatorCluster, finish_compile

from neuronfleet.operator.kube import LEASE_RULES, RBAC_RULES
from neuronfleet.operator.watching import KOPF_RULES

UNIFIED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
POOL_CRD = ROOT / "tests" / "data" / "gie-v1.6.0-inferencepools.yaml"
ROUTE_CRD = ROOT / "tests" / "data" / "gateway-api-v1.6.1-httproutes.yaml"
GATEWAY = {
    "endpointPicker": {"name": "g-epp"},
    "httpRoute": {"parentRefs": [{"name": "inference-gateway"}], "hostnames": ["llm.example.com"]},
}


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def test_the_model_behind_an_inference_gateway_gets_a_pool_and_route_the_cluster_accepts(cluster):
    kubectl = cluster.kubectl
    kubectl("apply", "-f", str(POOL_CRD))
    kubectl("apply", "-f", str(ROUTE_CRD))
    operator = cluster.start_operator()
    obj = yaml.safe_load(UNIFIED.read_text())
    obj["metadata"] = {"name": "g", "namespace": "default"}
    obj["spec"]["serving"] = {**obj["spec"].get("serving", {}), "gateway": GATEWAY}
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    jobs = operator.wait_until(lambda: (kubectl.get("jobs") or {}).get("items"), "the compile Job")
    assert kubectl("get", "inferencepools", "-o", "name").stdout == ""  # nothing to pool before it serves
    finish_compile(kubectl, jobs[0]["metadata"]["name"])
    operator.wait_until(lambda: kubectl.get("inferencepool", "g"), "the InferencePool")
    table = kubectl("get", "inferencepools").stdout.splitlines()
    assert table[0].split()[0] == "NAME" and [line.split()[0] for line in table[1:]] == ["g"], table
    pool = kubectl.get("inferencepool", "g")
    service = kubectl.get("service", "g")
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": service["spec"]["ports"][0]["port"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "g-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }  # group: the CRD's default, set by the API server
    assert pool["spec"]["appProtocol"] == "http"  # the CRD's default too: the schema was applied
    assert pool["metadata"]["ownerReferences"][0]["name"] == "g"
    (deployment,) = kubectl.get("deployments", "-l", "neuronfleet.dev/model=g")["items"]
    assert deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == "prefill-decode"
    route = operator.wait_until(lambda: kubectl.get("httproute", "g"), "the HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool" and rule["backendRefs"][0]["name"] == "g"
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    # a pool changed by hand is put back at the next reconcile (here: the spec change below)
    by_hand = json.dumps({"spec": {"targetPorts": [{"number": 9999}]}})
    kubectl("patch", "inferencepool", "g", "--type", "merge", "-p", by_hand)
    # the route dropped, then the gateway: the operator deletes what it no longer makes
    obj["spec"]["serving"]["gateway"] = {"endpointPicker": {"name": "g-epp"}}
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    operator.wait_until(lambda: kubectl.get("httproute", "g") is None, "the HTTPRoute deleted")
    assert kubectl.get("inferencepool", "g")["spec"]["targetPorts"] == pool["spec"]["targetPorts"]
    del obj["spec"]["serving"]["gateway"]
    kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    operator.wait_until(lambda: kubectl.get("inferencepool", "g") is None, "the InferencePool deleted")
    calls = [json.loads(line) for line in (cluster.state / "audit.jsonl").read_text().splitlines()]
    used = {(c["group"], c["resource"], c["verb"]) for c in calls if c["user"] == OPERATOR_USER}
    declared = {(g, r, v) for (g, r), verbs in (RBAC_RULES | LEASE_RULES | KOPF_RULES).items() for v in verbs}
    assert used <= declared, sorted(used - declared)
    for resource in ("inferencepools", "httproutes"):
        group = "inference.networking.k8s.io" if resource == "inferencepools" else "gateway.networking.k8s.io"
        assert {(group, resource, "create"), (group, resource, "delete")} <= used
    # what the API server defaulted is not drift: the pool was patched for the hand-made change only
    patches = [c for c in calls if c["user"] == OPERATOR_USER and c["verb"] == "patch"]
    gateway_patches = [c["resource"] for c in patches if c["resource"] in ("inferencepools", "httproutes")]
    assert gateway_patches == ["inferencepools"]
