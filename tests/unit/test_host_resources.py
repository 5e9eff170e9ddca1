"""The CPU and memory each pod requests (operator/host_resources.py), and where pods go: requests from the
instance table (host vCPUs and memory, a pod's share by its Neuron cores) and the model's size, what the spec
sets winning key by key; no pod names a scheduler unless the operator's setting (the chart's
neuron.schedulerName) or the spec does."""

from __future__ import annotations

import pytest
import yaml
from support import ROOT

from neuronfleet.operator import builders, host_kv, host_resources, pod_parts, topology, validation

SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
GIB = 1 << 30


def parsed(obj: dict):
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def sample(name: str, **neuron) -> dict:
    obj = yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())
    obj["spec"]["neuron"].update(neuron)
    return obj


def pods(spec) -> list[tuple[str, dict]]:
    """(role, pod spec) of every pod the model runs: its compile Job's and each serving Deployment's."""
    out = []
    for o in builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec)):
        if o["kind"] in ("Job", "Deployment"):
            out.append((o["metadata"]["labels"]["neuronfleet.dev/role"], o["spec"]["template"]["spec"]))
    return out


def quantity(value: str) -> float:
    units = {"Gi": GIB, "Mi": 1 << 20, "m": 1e-3}
    for unit, factor in units.items():
        if value.endswith(unit):
            return float(value.removesuffix(unit)) * factor
    return float(value)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_pod_of_every_sample_requests_cpu_and_memory_within_its_limits(path):
    spec = parsed(yaml.safe_load(path.read_text()))
    for role, pod in pods(spec):
        for c in pod["containers"] + pod.get("initContainers", []):
            requests, limits = c["resources"]["requests"], c["resources"].get("limits", {})
            assert quantity(requests["cpu"]) > 0 and quantity(requests["memory"]) > 0, (role, c["resources"])
            for key, limit in limits.items():
                assert quantity(requests.get(key, limit)) <= quantity(limit), (role, key)


def test_a_serving_pod_requests_its_cores_share_of_the_node():
    """trn2.48xlarge: 192 vCPUs, 2048 GiB; 64 logical cores at LNC 2. What a model's pod may request of the
    node (topology.pod_allocatable): 190930m and 1937178Mi (2048 GiB less 7.5%, 1355 MiB kube-reserved, the
    100 MiB eviction threshold, 1232 MiB for the DaemonSets). A 64-core pod takes all of it (in MiB: whole
    GiB would pass it), an 8-core one an eighth (23.9 CPUs, 236.5 GiB)."""
    whole = parsed(sample("llama-3.3-70b-vllm-trn2.yaml"))
    allocatable = topology.pod_allocatable(topology.INSTANCES["trn2.48xlarge"])
    assert (allocatable.cpu_millicores, allocatable.memory_bytes >> 20) == (190930, 1937178)
    assert host_resources.serving(whole, "unified") == {"cpu": "190", "memory": "1937178Mi"}
    eighth = parsed(sample("llama-3.3-70b-vllm-trn2.yaml", tensorParallel=8, batchSize=1, sequenceLength=2048,
                           maxInputLength=2047))  # fmt: skip
    assert host_resources.serving(eighth, "unified") == {"cpu": "23", "memory": "237Gi"}


def test_a_serving_pod_requests_at_least_what_loading_its_model_takes():
    """Llama 3.1 70B on 8 of trn1.32xlarge's 32 cores: a quarter of what a pod may request there is 117 GiB,
    but the bfloat16 weights alone are 131 GiB (the engines read the checkpoint into host memory on its way to
    the devices)."""
    spec = parsed(sample("llama-3.1-70b-vllm-trn1.yaml", tensorParallel=8, batchSize=1, sequenceLength=1024,
                         maxInputLength=1023, buckets={}))  # fmt: skip
    weights = host_resources.weight_bytes(spec)
    assert weights == 2 * 70_553_706_496
    share = topology.pod_allocatable(topology.INSTANCES["trn1.32xlarge"]).memory_bytes * 8 / 32
    memory = quantity(host_resources.serving(spec, "unified")["memory"])
    assert memory >= weights + host_resources.LOAD_OVERHEAD_GIB * GIB > share


def test_our_runtime_requests_its_host_kv_store_beside_its_weights():
    """neuron.hostKVCache is counted in the serving pods' memory and reaches their serve options; by default
    the store is as large as the slots' KV cache (SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 x 4 bytes a
    token), 0 turns it off."""

    def smollm2(**neuron):
        obj = sample("smollm2-135m-local-cpu.yaml", **neuron)  # its shape given (a pvc:// file's is unknown)
        obj["spec"]["model"]["shape"] = {"parameters": 134_515_008, "layers": 30, "kvHeads": 3, "headDim": 64}
        return parsed(obj)

    big = {"batchSize": 16, "sequenceLength": 2048}  # a default store past the GiB the request rounds to
    none, given, default = smollm2(hostKVCache="0", **big), smollm2(hostKVCache="2Gi", **big), smollm2(**big)
    n = default.neuron
    assert host_kv.host_kv_bytes(default) == n.batchSize * n.sequenceLength * 30 * 3 * 64 * 2 * 4
    memory = {s: quantity(host_resources.serving(spec, "unified")["memory"])
              for s, spec in (("none", none), ("given", given), ("default", default))}  # fmt: skip
    assert memory["given"] == memory["none"] + 2 * GIB
    assert memory["none"] < memory["default"] <= memory["none"] + host_kv.host_kv_bytes(default) + GIB
    assert quantity(host_resources.serving(given, "router")["memory"]) < GIB  # a router holds no KV
    objects = builders.build_all(OWNER, given, serving_hash=builders.compile_hash(given))
    for deployment in (o for o in objects if o["kind"] == "Deployment"):  # the pods and their front door
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        if deployment["metadata"]["labels"]["neuronfleet.dev/role"] == "router":
            assert "--host-kv-cache-bytes" not in command
        else:
            assert command[command.index("--host-kv-cache-bytes") + 1] == str(2 * GIB)
    # what a router's index counts a pod to hold beside its slots: the store's tokens
    per_token = 30 * 3 * 64 * 2 * 4
    slots = n.batchSize * n.sequenceLength
    assert [host_kv.host_kv_tokens(s) for s in (none, given, default)] == [
        0,
        2 * GIB // per_token,
        slots,
    ]
    (door,) = [d for d in objects if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")]
    command = door["spec"]["template"]["spec"]["containers"][0]["command"]
    assert int(command[command.index("--routing-cache-tokens") + 1]) == slots + 2 * GIB // per_token


def test_what_the_spec_sets_wins_key_by_key():
    obj = sample("llama-3.3-70b-vllm-trn2.yaml")
    obj["spec"]["serving"]["unified"]["resources"] = {"requests": {"cpu": "8"}, "limits": {"memory": "900Gi"}}
    spec = parsed(obj)
    (pod,) = [p for role, p in pods(spec) if role == "unified"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "8"  # the spec's
    assert "memory" not in resources["requests"]  # a limit alone is the request (Kubernetes defaults it)
    assert resources["limits"]["memory"] == "900Gi"


def test_a_compile_on_a_cpu_node_requests_a_slice_of_cpus_and_twice_the_weights():
    spec = parsed(sample("llama-3.3-70b-vllm-trn2.yaml"))
    (job,) = [p for role, p in pods(spec) if role == "compile"]
    requests = job["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == str(host_resources.CPU_COMPILE_CPUS)
    weights = host_resources.weight_bytes(spec)
    assert quantity(requests["memory"]) >= 2 * weights + host_resources.LOAD_OVERHEAD_GIB * GIB


def test_a_model_of_unknown_size_still_requests_memory():
    obj = sample("llama-3.3-70b-vllm-trn2.yaml")
    obj["spec"]["model"] = {"uri": "hf://someone/unknown-model"}
    spec = parsed(obj)
    assert host_resources.weight_bytes(spec) is None
    (job,) = [p for role, p in pods(spec) if role == "compile"]
    memory = quantity(job["containers"][0]["resources"]["requests"]["memory"])
    assert memory == (host_resources.UNKNOWN_MODEL_GIB + host_resources.LOAD_OVERHEAD_GIB) * GIB


# ---- the scheduler ---------------------------------------------------------------------------------------


def test_no_pod_names_a_scheduler_unless_told(monkeypatch):
    """Default (the chart's neuron.schedulerName empty): no pod names one. With the operator's setting, pods
    asking for more than one Neuron core name it (contiguous cores), single-core and CPU pods do not; a
    model's scheduling.schedulerName names its scheduler for every Neuron pod it runs."""
    multi = parsed(sample("llama-3.1-8b-vllm-inf2.yaml"))
    single = parsed(sample("llama-3.1-8b-vllm-inf2.yaml", tensorParallel=1, batchSize=1, sequenceLength=1024,
                           maxInputLength=1023))  # fmt: skip
    cpu = parsed(yaml.safe_load((ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml").read_text()))
    for spec in (multi, single, cpu):
        assert all("schedulerName" not in pod for _, pod in pods(spec))
    monkeypatch.setattr(pod_parts, "NEURON_SCHEDULER", "my-scheduler")
    assert {role: pod.get("schedulerName") for role, pod in pods(multi)} == {
        "compile": "my-scheduler",
        "unified": "my-scheduler",
        "router": None,
    }  # fmt: skip (a CPU pod)
    assert all("schedulerName" not in pod for _, pod in pods(single) + pods(cpu))
    single.scheduling.schedulerName = "neuron-scheduler"
    assert {role: pod.get("schedulerName") for role, pod in pods(single)} == {
        "compile": "neuron-scheduler", "unified": "neuron-scheduler", "router": None}  # fmt: skip


def test_a_compile_on_a_cpu_node_goes_where_the_spec_narrows_it():
    obj = sample("llama-3.3-70b-vllm-trn2.yaml")
    obj["spec"]["compile"]["nodeSelector"] = {"node-pool": "compile"}
    obj["spec"]["compile"]["tolerations"] = [{"key": "compile", "operator": "Exists", "effect": "NoSchedule"}]
    (job,) = [p for role, p in pods(parsed(obj)) if role == "compile"]
    assert job["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                   "node-pool": "compile"}  # fmt: skip
    assert job["tolerations"] == [{"key": "compile", "operator": "Exists", "effect": "NoSchedule"}]
