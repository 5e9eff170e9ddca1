"""The CPU and memory a model's pods request when its spec names none (docs/resources.md). Pure: the instance
table and the model's size in, Kubernetes quantities out.

- A pod on Neuron cores requests the share of what a model's pods may request of its node
  (`topology.pod_allocatable`: the node's allocatable from the EKS AMI's kubelet reservation and eviction
  threshold, less the node's DaemonSets) that its cores are of the node's cores, and never less memory than
  loading the model takes (the engines read the whole checkpoint into host memory on their way to the
  devices: a 70B model in bfloat16 is some 140 GB), nor more than that allocatable.
- A compile that runs on a Neuron node asks for the same share, and at least twice the weights (the compile
  traces the model and writes sharded weights while it holds them).
- A compile that runs on a CPU node (engine vllm on Trn2/Trn3) asks for a fixed slice of CPUs (the compiler
  runs its graphs in parallel) and twice the weights.
- On instanceType cpu (our runtime) a pod asks for a core and what its weights take.
- A serving pod of our runtime also asks for its host KV store (`host_kv.host_kv_bytes`: neuron.hostKVCache,
  by default as much as its slots' KV cache).
- Our router and the fetch step move requests or bytes only: a fixed small slice.

A key the spec sets, in requests or in limits, is the spec's: only keys set in neither are derived (a limit
alone is also the request, as Kubernetes defaults it). `allocatable_refusals` says where a pod's requests, the
spec's or derived, exceed what a node of its instance type can give it (validation refuses the spec).
"""

from __future__ import annotations

import math
from typing import Any

from . import engines, parallelism, topology
from .host_kv import host_kv_bytes
from .spec import NeuronModelSpec
from .spec_base import quantity_value

GIB = 1 << 30
LOAD_OVERHEAD_GIB = 8  # beside the weights while an engine loads them: its imports, buffers, the tokenizer
UNKNOWN_MODEL_GIB = 32  # a model whose size is unknown (no spec.model.shape, not in the table)
CPU_COMPILE_CPUS = 16  # a compile on a CPU node: neuronx-cc compiles the buckets' graphs in parallel
SMALL = {"cpu": "500m", "memory": "512Mi"}  # a router, the fetch step, a shell check
SMALL_LIMITS = {"memory": "1Gi"}


def weight_bytes(spec: NeuronModelSpec) -> int | None:
    """The model's weights in the spec's dtype (quantized ones at their size); None when its size is
    unknown."""
    shape = topology.model_shape(spec.model.uri, spec.model.shape)
    if shape is None:
        return None
    n = spec.neuron
    per = topology.BYTES_PER_QUANTIZED_WEIGHT.get(n.quantization, topology.BYTES_PER_DTYPE.get(n.dtype, 4))
    return math.ceil(shape.parameters * per)


def gib(n_bytes: float) -> str:
    return f"{max(1, math.ceil(n_bytes / GIB))}Gi"


def _cpus(n: float) -> str:
    whole = math.floor(n)
    return str(whole) if whole >= 1 else f"{max(100, math.floor(n * 1000))}m"


def _memory(n_bytes: float, ceiling: float) -> str:
    """`n_bytes` in whole GiB, rounded up, unless that passes `ceiling` (what the node can give): then in
    whole MiB, rounded down."""
    if math.ceil(n_bytes / GIB) * GIB <= ceiling:
        return gib(n_bytes)
    return f"{math.floor(min(n_bytes, ceiling) / topology.MIB)}Mi"


def _pod_allocatable(spec: NeuronModelSpec) -> topology.Allocatable | None:
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    return None if inst is None else topology.pod_allocatable(inst)


def _node_share(spec: NeuronModelSpec, cores: int) -> tuple[float, float] | None:
    """(vCPUs, bytes of memory) of the node share `cores` Neuron cores are; None on instanceType cpu."""
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    if inst is None:
        return None
    share = min(1.0, cores / inst.total_cores(spec.neuron.logicalCores))
    allocatable = topology.pod_allocatable(inst)
    return allocatable.cpu_millicores / 1000 * share, allocatable.memory_bytes * share


def _loading(spec: NeuronModelSpec, factor: float) -> float:
    weights = weight_bytes(spec)
    loaded = UNKNOWN_MODEL_GIB * GIB if weights is None else weights * factor
    return loaded + LOAD_OVERHEAD_GIB * GIB


def _on_node(spec: NeuronModelSpec, cores: int, loading: float) -> dict[str, str]:
    """A pod on a Neuron node: its share of the node, at least `loading` bytes, at most the node's
    allocatable."""
    cpus, memory = _node_share(spec, cores) or (1.0, 0.0)
    ceiling = _pod_allocatable(spec).memory_bytes
    return {"cpu": _cpus(max(1.0, cpus)), "memory": _memory(max(memory, loading), ceiling)}


def serving(spec: NeuronModelSpec, role: str) -> dict[str, str]:
    """A serving pod's requests: its node share, at least the load (Neuron); a core and the weights (cpu)."""
    if role == "router":
        return dict(SMALL)
    host_kv = host_kv_bytes(spec)  # our runtime's host KV store
    if spec.neuron.instanceType not in topology.INSTANCES:  # our runtime on cpu: weights as held, the runtime
        weights = weight_bytes(spec)
        return {"cpu": "1", "memory": gib(1 * GIB + (weights or 1 * GIB) + host_kv)}
    return _on_node(spec, parallelism.role_cores(spec, role), _loading(spec, 1.0) + host_kv)


def compile_job(spec: NeuronModelSpec, needs_neuron: bool, loads_model: bool) -> dict[str, str]:
    """A compile pod's requests: on a Neuron node its serving share and twice the weights; on a CPU node
    CPU_COMPILE_CPUS and twice the weights; a step that loads no model (an s3:// fetch's check): SMALL."""
    if not loads_model:
        return dict(SMALL)
    if needs_neuron:
        return _on_node(spec, parallelism.compile_cores(spec), _loading(spec, 2.0))
    if spec.neuron.instanceType == "cpu":  # our compile: converts and validates by a full load
        weights = weight_bytes(spec)
        return {"cpu": "1", "memory": gib(1 * GIB + 2 * (weights or 1 * GIB))}
    return {"cpu": str(CPU_COMPILE_CPUS), "memory": gib(_loading(spec, 2.0))}


def with_defaults(resources: dict[str, dict[str, str]], defaults: dict[str, str]) -> dict[str, Any]:
    """The spec's resources with the derived requests added for the keys it sets in neither requests nor
    limits."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    for key, value in defaults.items():
        if key not in requests and key not in limits:
            requests[key] = value
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def effective_requests(resources: dict[str, Any]) -> dict[str, str]:
    """What the scheduler counts: each request, and a limit where no request is set (Kubernetes' default)."""
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def _neuron_pods(spec: NeuronModelSpec) -> list[tuple[str, dict[str, Any]]]:
    """(the spec's section, its resources as rendered) of every pod on a node of the spec's instance type:
    the serving roles', and the compile Job's where the engine compiles on the Neuron devices."""
    s = spec.serving
    roles = {"unified": s.unified} if s.mode == "unified" else {"prefill": s.prefill, "decode": s.decode}
    pods = [
        (f"serving.{role}.resources", with_defaults(section.resources.model_dump(), serving(spec, role)))
        for role, section in roles.items()
    ]
    container = engines.compile_container(spec, "")
    if container.needs_neuron:
        derived = compile_job(spec, True, container.loads_model)
        pods.append(("compile.resources", with_defaults(spec.compile.resources.model_dump(), derived)))
    return pods


def allocatable_refusals(spec: NeuronModelSpec) -> list[str]:
    """Where a pod's CPU or memory request (the spec's, or derived) exceeds what a model's pod may request of
    a node of its instance type (`topology.pod_allocatable`): such a pod would never be scheduled."""
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    if inst is None:
        return []
    allocatable = topology.pod_allocatable(inst)
    limits = {"cpu": allocatable.cpu_millicores / 1000, "memory": allocatable.memory_bytes}
    memory_mib = allocatable.memory_bytes // topology.MIB
    words = {"cpu": f"{allocatable.cpu_millicores}m", "memory": f"{memory_mib}Mi"}
    out = []
    for section, resources in _neuron_pods(spec):
        for key, value in effective_requests(resources).items():
            if key in limits and quantity_value(value) > limits[key]:
                out.append(
                    f"{section}: {key} {value} is more than a pod can request on {inst.name}, whose nodes "
                    f"have {words[key]} of {key} allocatable to a model's pods ({allocatable.describe()} in "
                    f"all: {allocatable.explanation}); request at most {words[key]} or use a larger instance "
                    "type"
                )
    return out
