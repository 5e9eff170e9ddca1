"""Say why a pod will wait, before it waits, in local mode: the real operator (`--read-nodes`) against the
emulated API server, whose one Node is the process kubelet's (`kubelet.node_object`, labelled trn2.48xlarge
as `neuronfleet up --node-label` makes it), and a Trn2 prefill/decode model over EFA. While the node is new
its devices may still be registering (Unknown, NodesStarting: SETTLE seconds here, minutes on a cluster);
then it offers no Neuron device plugin's cores, then no EFA interfaces: the model's Schedulable condition
names each, with a Warning Event, while its compile has not even started a pod; once the node offers both
(its status patched as the device plugins do), the condition clears. Node heartbeats cost no request; every
call the operator made is one the chart grants (RBAC_RULES, and OPT_IN_RULES["readNodes"])."""

from __future__ import annotations

import pytest
import yaml
from support import OPERATOR_USER, ROOT, OperatorCluster

from neuronfleet.localcluster.kubelet import NODE_NAME, node_object
from neuronfleet.localcluster.node_settings import NodeSettings
from neuronfleet.operator import kube, node_offers, watching

TRN2 = "trn2.48xlarge"
SAMPLE = ROOT / "crds" / "samples" / "llama-3.3-70b-vllm-trn2-disaggregated.yaml"
MERGE = "application/merge-patch+json"
SETTLE = (
    10  # seconds a new node's devices may take to register (the operator's NEURONFLEET_NODE_SETTLE_SECONDS)
)


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def schedulable(api: OperatorCluster, name: str) -> dict | None:
    model = api.kubectl.get("neuronmodel", name) or {}
    found = [
        c for c in (model.get("status") or {}).get("conditions") or [] if c["type"] == node_offers.CONDITION
    ]
    return found[0] if found else None


def test_a_model_whose_nodes_lack_a_device_plugin_says_so_and_clears_once_they_offer_it(cluster, tmp_path):
    node, status = node_object(NodeSettings(labels={node_offers.INSTANCE_TYPE: TRN2}))
    cluster.call("POST", "/api/v1/nodes", node)
    cluster.call("PATCH", f"/api/v1/nodes/{NODE_NAME}/status", {"status": status}, MERGE)
    operator = cluster.start_operator("--read-nodes", env={node_offers.SETTLE_ENV: str(SETTLE)})
    model = yaml.safe_load(SAMPLE.read_text())
    model["metadata"]["namespace"] = "default"
    model["spec"]["model"].pop("secretRef")  # (no Hub here)
    model["spec"]["scheduling"] = {"schedulerName": "my-scheduler"}  # the Neuron scheduler extension's
    name = model["metadata"]["name"]
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(model))
    cluster.kubectl("apply", "-f", str(manifest))

    def reason_is(reason: str):
        return lambda: (c := schedulable(cluster, name)) is not None and c["reason"] == reason and c

    first = operator.wait_until(lambda: schedulable(cluster, name), "the Schedulable condition")
    if first["reason"] == node_offers.NODES_STARTING:  # (unless the machine was too slow to see it young)
        assert first["status"] == "Unknown" and "aws.amazon.com/neuroncore yet" in first["message"]
    # nothing changes on the node: once it is SETTLE seconds old, its lack is said
    missing = operator.wait_until(reason_is(node_offers.DEVICE_PLUGIN_MISSING), "DevicePluginMissing")
    assert missing["status"] == "False" and "aws.amazon.com/neuroncore" in missing["message"]
    assert "helm upgrade --install neuron-helm-chart" in missing["message"]
    assert not cluster.kubectl.get("pods")["items"]  # (said before any pod: none exists yet)
    events = lambda: cluster.kubectl.get("events", "--field-selector", f"involvedObject.name={name}")["items"]  # noqa: E731
    operator.wait_until(
        lambda: any(
            e["reason"] == node_offers.DEVICE_PLUGIN_MISSING and e["type"] == "Warning" for e in events()
        ),
        "the Warning Event",
    )

    # the Neuron device plugin registers its cores: now the EFA interfaces are what the pods would wait for
    offered = {"aws.amazon.com/neuroncore": "64", "aws.amazon.com/neuron": "16"}
    cluster.call("PATCH", f"/api/v1/nodes/{NODE_NAME}/status", {"status": {"allocatable": offered}}, MERGE)
    efa = operator.wait_until(reason_is(node_offers.EFA_DEVICE_PLUGIN_MISSING), "EFADevicePluginMissing")
    assert "vpc.amazonaws.com/efa" in efa["message"] and "aws-efa-k8s-device-plugin" in efa["message"]
    # (its Warning Event comes after the status write: counted before the heartbeats, not among their calls)
    operator.wait_until(
        lambda: any(
            e["reason"] == node_offers.EFA_DEVICE_PLUGIN_MISSING and e["type"] == "Warning" for e in events()
        ),
        "the EFA Warning Event",
    )

    # heartbeats (the kubelet's status updates) change nothing the operator reads: no request for them
    calls_before = len(cluster.audit())
    for beat in ("2026-12-06T12:00:10Z", "2026-12-06T12:00:20Z"):
        ready = {**status["conditions"][0], "lastHeartbeatTime": beat}
        cluster.call("PATCH", f"/api/v1/nodes/{NODE_NAME}/status", {"status": {"conditions": [ready]}}, MERGE)
    # the EFA device plugin registers too: the condition clears
    offered = {"vpc.amazonaws.com/efa": "16"}
    cluster.call("PATCH", f"/api/v1/nodes/{NODE_NAME}/status", {"status": {"allocatable": offered}}, MERGE)
    cleared = operator.wait_until(reason_is(node_offers.DEVICES_OFFERED), "the condition to clear")
    assert cleared["status"] == "True" and "16 vpc.amazonaws.com/efa" in cleared["message"]
    calls = cluster.audit()[calls_before:]
    patched = [
        i for i, c in enumerate(calls) if c["user"] != OPERATOR_USER and c["resource"] == "nodes/status"
    ]
    assert len(patched) == 3  # two heartbeats, then the EFA device plugin's
    # (but its Lease, and the leader's periodic check of the watch: a list of the models and their Jobs)
    checks = {("neuronmodels", "list"), ("jobs", "list")}
    assert [c for c in calls[: patched[2]] if c["user"] == OPERATOR_USER and c["resource"] != "leases"
            and (c["resource"], c["verb"]) not in checks] == []  # fmt: skip

    # every call the operator made is one the chart grants; the nodes were listed and watched
    used = {(c["group"], c["resource"], c["verb"]) for c in cluster.audit() if c["user"] == OPERATOR_USER}
    rules = kube.RBAC_RULES | kube.LEASE_RULES | watching.KOPF_RULES | kube.OPT_IN_RULES["readNodes"]
    declared = {(g, r, v) for (g, r), verbs in rules.items() for v in verbs}
    assert used <= declared, sorted(used - declared)
    assert {("", "nodes", "list"), ("", "nodes", "watch")} <= used
