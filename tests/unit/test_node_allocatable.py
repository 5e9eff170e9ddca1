"""Every sample starts on its instance type: the instance table (operator/topology.py) holds the types the
Neuron helm chart runs its device plugin on, with the figures recorded from their sources
(tests/data/neuron-instances-sources.json); each type's node allocatable follows the EKS AMI's kubelet
reservation and eviction threshold; every pod every sample renders (each role, the compile Job) requests no
more than a node of its instance type can give a model's pod; and validation refuses a spec that asks for
more, naming what the node has."""

from __future__ import annotations

import json
import typing

import pytest
import yaml
from engine_renders import OWNER
from support import ROOT

from neuronfleet.operator import builders, crd, host_resources, spec, topology, validation

RECORD = json.loads((ROOT / "tests" / "data" / "neuron-instances-sources.json").read_text())
CHART = RECORD["neuron-helm-chart"]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
INSTANCE_LABEL = "node.kubernetes.io/instance-type"


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())


def neuron_pods(obj: dict) -> list[tuple[str, str, dict]]:
    """(object name, instance type, pod spec) of every pod the model renders onto a Neuron node."""
    parsed, errors = validation.parse(obj)
    assert not errors, errors
    objects = builders.build_all(OWNER, parsed, serving_hash=builders.compile_hash(parsed))
    out = []
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            pod = o["spec"]["template"]["spec"]
            instance = pod.get("nodeSelector", {}).get(INSTANCE_LABEL)
            if instance is not None:
                out.append((o["metadata"]["name"], instance, pod))
    return out


def pod_requests(pod: dict) -> dict[str, float]:
    """What the scheduler counts for a pod: the larger of its containers' summed requests and any one init
    container's (a limit alone being the request)."""

    def of(container: dict) -> dict[str, float]:
        requests = host_resources.effective_requests(container.get("resources") or {})
        return {k: host_resources.quantity_value(requests[k]) for k in ("cpu", "memory") if k in requests}

    total = {"cpu": 0.0, "memory": 0.0}
    for c in pod["containers"]:
        for k, v in of(c).items():
            total[k] += v
    for c in pod.get("initContainers", []):
        for k, v in of(c).items():
            total[k] = max(total[k], v)
    return total


# ---- the table against its sources ----------------------------------------------------------------------


def test_every_table_type_is_one_the_neuron_chart_runs_its_device_plugin_on():
    """A type the chart does not list gets no device plugin (no Neuron resource): not in the table. Every type
    the chart lists is in the table or recorded as left out, with why."""
    listed = set(CHART["neuronInstances"])
    assert set(topology.INSTANCES) <= listed, set(topology.INSTANCES) - listed
    assert "trn3p.48xlarge" not in topology.INSTANCES
    assert listed == set(topology.INSTANCES) | set(CHART["left out of the table"])


def test_the_table_holds_each_types_recorded_figures():
    for name, fig in RECORD["instances"].items():
        inst = topology.INSTANCES[name]
        table = (inst.devices, inst.total_cores(None), inst.vcpus, inst.host_memory_gib, inst.efa_interfaces)
        assert table == (fig["devices"], fig["cores"], fig["vcpus"], fig["host_memory_gib"], fig["efa"]), name
        pods = 110 if fig["enis"] is None else fig["enis"] * (fig["ipv4_per_eni"] - 1) + 2
        assert inst.max_pods == pods, name
    assert set(RECORD["instances"]) == set(topology.INSTANCES)


def test_the_spec_and_the_crd_accept_exactly_the_table_types():
    assert typing.get_args(spec.InstanceType) == ("cpu", *topology.INSTANCES)
    schema = yaml.safe_load(crd.render_crd())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enum = schema["properties"]["spec"]["properties"]["neuron"]["properties"]["instanceType"]["enum"]
    assert enum == ["cpu", *topology.INSTANCES]


# ---- node allocatable -----------------------------------------------------------------------------------


def test_the_kubelet_reservation_follows_the_eks_ami():
    """nodeadm: kubeReserved cpu 6% of the first core, 1% of the second, 0.5% of the next two, 0.25% above;
    memory 11 MiB a pod plus 255 MiB; evictionHard memory.available 100Mi."""
    assert topology.kube_reserved_cpu_millicores(1) == 60
    assert topology.kube_reserved_cpu_millicores(2) == 70
    assert topology.kube_reserved_cpu_millicores(4) == 80
    assert topology.kube_reserved_cpu_millicores(8) == 90
    for name, example in RECORD["eks-ami-kubelet"]["examples"].items():
        inst = topology.INSTANCES[name]
        assert inst.max_pods == example["maxPods"]
        assert f"{topology.kube_reserved_cpu_millicores(inst.vcpus)}m" == example["kubeReserved cpu"]
        assert f"{topology.kube_reserved_memory_mib(inst.max_pods)}Mi" == example["kubeReserved memory"]
    assert topology.EVICTION_HARD_MEMORY_MIB == 100
    assert RECORD["capacity"]["vm memory overhead"] == topology.VM_MEMORY_OVERHEAD


def test_an_inf2_xlarge_node_gives_a_model_pod_well_under_its_nominal_16_gib():
    """16 GiB less 7.5% (15155 MiB reported), 893 MiB kube-reserved, 100 MiB eviction: 14162 MiB allocatable;
    less the DaemonSets' 1232 MiB: 12930 MiB for a model's pods. 4 vCPUs less 80m, less 520m: 3400m."""
    inst = topology.INSTANCES["inf2.xlarge"]
    assert topology.capacity_memory_bytes(inst) == 15155 * topology.MIB
    node = topology.node_allocatable(inst)
    assert (node.cpu_millicores, node.memory_bytes) == (3920, 14162 * topology.MIB)
    pod = topology.pod_allocatable(inst)
    assert (pod.cpu_millicores, pod.memory_bytes) == (3400, 12930 * topology.MIB)
    daemonsets = sum(d.memory_mib for d in topology.NODE_DAEMONSETS)
    assert node.memory_bytes - pod.memory_bytes == daemonsets * topology.MIB


def test_a_model_pod_may_ask_less_than_every_node_reports():
    """For every type: less than the node's nominal memory and vCPUs, and less than what a node of the type
    reports (capacity) less the kubelet's reserve."""
    for inst in topology.INSTANCES.values():
        pod = topology.pod_allocatable(inst)
        node, capacity = topology.node_allocatable(inst), topology.capacity_memory_bytes(inst)
        assert pod.memory_bytes < node.memory_bytes < capacity < inst.host_memory_gib * topology.GIB
        assert 0 < pod.cpu_millicores < inst.vcpus * 1000


# ---- every sample fits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_pod_of_every_sample_fits_its_instance_types_allocatable(path):
    """Each role's pods and the compile Job, wherever they go onto a Neuron node (the DRA sample's too)."""
    obj = yaml.safe_load(path.read_text())
    report = validation.check(obj)
    assert report.ok, report.errors
    pods = neuron_pods(obj)
    on_neuron = obj["spec"]["neuron"]["instanceType"] in topology.INSTANCES
    assert bool(pods) == on_neuron, path.name  # a Neuron sample is checked, a cpu one has none to check
    for name, instance, pod in pods:
        allocatable = topology.pod_allocatable(topology.INSTANCES[instance])
        requests = pod_requests(pod)
        assert requests["cpu"] <= allocatable.cpu_millicores / 1000, (name, requests, allocatable)
        assert requests["memory"] <= allocatable.memory_bytes, (name, requests, allocatable)


def test_the_tgi_sample_asks_what_an_inf2_xlarge_gives_not_15gi():
    pods = neuron_pods(load("llama-3.2-3b-tgi-inf2.yaml"))
    assert {instance for _, instance, _ in pods} == {"inf2.xlarge"}
    for _, _, pod in pods:
        assert pod_requests(pod)["memory"] == 12930 * topology.MIB


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_no_sample_names_an_object_nothing_creates(path):
    """No PriorityClass (none is created by the chart or the samples; Kubernetes' own are system-*), no
    existing claim: the operator makes each sample's cache claim."""
    s = yaml.safe_load(path.read_text())["spec"]
    assert "priorityClassName" not in s.get("scheduling", {}), path.name
    assert "claimName" not in s.get("compile", {}).get("cache", {}), path.name


def test_the_samples_ask_for_at_most_the_efa_devices_of_their_type():
    for path in SAMPLES:
        s = yaml.safe_load(path.read_text())["spec"]
        wanted = s.get("serving", {}).get("kvTransfer", {}).get("efaInterfaces")
        if wanted is not None and s["neuron"]["instanceType"] in topology.INSTANCES:
            assert wanted <= topology.INSTANCES[s["neuron"]["instanceType"]].efa_interfaces, path.name


# ---- validation -----------------------------------------------------------------------------------------


def test_a_request_beyond_the_allocatable_is_refused_naming_it():
    obj = load("llama-3.1-70b-vllm-trn1.yaml")
    obj["spec"]["compile"]["resources"] = {"requests": {"cpu": "32", "memory": "480Gi"}}
    obj["spec"]["serving"]["unified"]["resources"] = {"limits": {"cpu": "200"}}  # a limit alone: the request
    errors = validation.check(obj).errors
    because = (
        "(127.09 CPUs and 469.4 GiB in all: 512 GiB less 7.5% the node does not report, 2972 MiB "
        "kube-reserved and the 100 MiB eviction threshold, less 1232 MiB for the node's DaemonSets)"
    )
    where = "is more than a pod can request on trn1.32xlarge, whose nodes have"
    assert errors == [
        f"serving.unified.resources: cpu 200 {where} 127090m of cpu allocatable to a model's pods {because}; "
        "request at most 127090m or use a larger instance type",
        f"compile.resources: memory 480Gi {where} 480662Mi of memory allocatable to a model's pods "
        f"{because}; request at most 480662Mi or use a larger instance type",
    ]


def test_a_compile_on_a_cpu_node_is_not_held_to_the_neuron_nodes_allocatable():
    """vLLM on Trn2 compiles on a CPU node: its requests are not a trn2.48xlarge's to bound."""
    obj = load("llama-3.3-70b-vllm-trn2.yaml")
    obj["spec"]["compile"]["resources"] = {"requests": {"memory": "4Ti"}}
    assert validation.check(obj).ok


def test_quantities_read_as_kubernetes_writes_them():
    q = host_resources.quantity_value
    assert (q("500m"), q("2"), q("1.5"), q("2Gi"), q("12930Mi"), q("1e3"), q("1k"), q("1Ki")) == (
        0.5, 2.0, 1.5, 2 * topology.GIB, 12930 * topology.MIB, 1000.0, 1000.0, 1024.0)  # fmt: skip
