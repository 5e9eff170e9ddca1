"""The process kubelet's node (localcluster/kubelet.py): the Node it registers, with the labels and extended
resources its settings name (`neuronfleet up --node-label/--node-resource`, what the operator's Schedulable
condition reads), registered again after a restart without losing what a device plugin set; and the settings
Kubernetes would refuse, refused with what would be right."""

from __future__ import annotations

import asyncio

import pytest

from neuronfleet.localcluster.kubelet import NODE_NAME, ProcessKubelet
from neuronfleet.localcluster.node_settings import node_settings
from neuronfleet.localcluster.store import ClusterClient, Store

TRN2 = {"node.kubernetes.io/instance-type": "trn2.48xlarge"}


def test_the_node_carries_the_settings_labels_and_extended_resources_beside_the_machines_own(tmp_path):
    async def scenario() -> None:
        cluster = ClusterClient(Store())
        settings = node_settings(["node.kubernetes.io/instance-type=trn2.48xlarge"],
                                 ["aws.amazon.com/neuroncore=64"])  # fmt: skip
        await ProcessKubelet(cluster, tmp_path, settings).register()
        node = cluster.get("", "v1", "nodes", None, NODE_NAME)
        labels, allocatable = node["metadata"]["labels"], node["status"]["allocatable"]
        assert (
            labels.items()
            >= {**TRN2, "kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}.items()
        )
        assert allocatable["aws.amazon.com/neuroncore"] == "64" and int(allocatable["cpu"]) >= 1
        assert allocatable["memory"].endswith("Ki") and node["status"]["capacity"] == allocatable
        assert [c["type"] for c in node["status"]["conditions"]] == ["Ready"]
        # a device plugin registers EFA interfaces; the kubelet starts again (the API server kept the Node)
        await cluster.patch_status(
            "", "v1", "nodes", None, NODE_NAME, {"allocatable": {"vpc.amazonaws.com/efa": "16"}}
        )
        await ProcessKubelet(cluster, tmp_path, settings).register()
        allocatable = cluster.get("", "v1", "nodes", None, NODE_NAME)["status"]["allocatable"]
        assert (
            allocatable["vpc.amazonaws.com/efa"] == "16" and allocatable["aws.amazon.com/neuroncore"] == "64"
        )

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "labels, resources, said",
    [
        (["instance-type"], [], "KEY=VALUE"),
        (["bad key!=x"], [], "not a valid label key"),
        ([], ["aws.amazon.com/neuroncore"], "NAME=COUNT"),
        ([], ["cpu=64"], "the machine's"),
        ([], ["neuroncore=4"], "DOMAIN/NAME"),
        ([], ["aws.amazon.com/neuroncore=2.5"], "whole number"),
    ],
)
def test_a_setting_kubernetes_would_refuse_is_refused_saying_what_is_right(labels, resources, said):
    with pytest.raises(ValueError, match=said):
        node_settings(labels, resources)
