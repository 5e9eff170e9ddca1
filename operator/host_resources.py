"""The CPU and memory a model's pods request when its spec names none (docs/resources.md). Pure: the instance
table and the model's size in, Kubernetes quantities out.

- A pod on Neuron cores requests the share of its node's vCPUs and memory that its cores are of the node's
  cores, less what the node keeps for itself, and never less memory than loading the model takes (the
  engines read the whole checkpoint into host memory on their way to the devices: a 70B model in bfloat16 is
  some 140 GB).
- A compile that runs on a Neuron node asks for the same share, and at least twice the weights (the compile
  traces the model and writes sharded weights while it holds them).
- A compile that runs on a CPU node (engine vllm on Trn2/Trn3) asks for a fixed slice of CPUs (the compiler
  runs its graphs in parallel) and twice the weights.
- On instanceType cpu (our runtime) a pod asks for a core and what its weights take.
- Our router and the fetch step move requests or bytes only: a fixed small slice.

A key the spec sets, in requests or in limits, is the spec's: only keys set in neither are derived (a limit
alone is also the request, as Kubernetes defaults it).
"""

from __future__ import annotations

import math
from typing import Any

from . import parallelism, topology, validation
from .spec import NeuronModelSpec

GIB = 1 << 30
NODE_RESERVE = 0.1  # of a node's vCPUs and memory: the kubelet, the system daemons, the device plugins
LOAD_OVERHEAD_GIB = 8  # beside the weights while an engine loads them: its imports, buffers, the tokenizer
UNKNOWN_MODEL_GIB = 32  # a model whose size is unknown (no spec.model.shape, not in the table)
CPU_COMPILE_CPUS = 16  # a compile on a CPU node: neuronx-cc compiles the buckets' graphs in parallel
SMALL = {"cpu": "500m", "memory": "512Mi"}  # a router, the fetch step, a shell check
SMALL_LIMITS = {"memory": "1Gi"}


def weight_bytes(spec: NeuronModelSpec) -> int | None:
    """The model's weights in the spec's dtype (quantized ones at their size); None when its size is
    unknown."""
    shape = validation.model_shape(spec)
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


def _node_share(spec: NeuronModelSpec, cores: int) -> tuple[float, float] | None:
    """(vCPUs, bytes of memory) of the node share `cores` Neuron cores are; None on instanceType cpu."""
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    if inst is None:
        return None
    share = min(1.0, cores / inst.total_cores(spec.neuron.logicalCores))
    usable = 1 - NODE_RESERVE
    return inst.vcpus * share * usable, inst.host_memory_gib * GIB * share * usable


def _node_memory(spec: NeuronModelSpec) -> float:
    inst = topology.INSTANCES[spec.neuron.instanceType]
    return inst.host_memory_gib * GIB * (1 - NODE_RESERVE)


def _loading(spec: NeuronModelSpec, factor: float) -> float:
    weights = weight_bytes(spec)
    loaded = UNKNOWN_MODEL_GIB * GIB if weights is None else weights * factor
    return loaded + LOAD_OVERHEAD_GIB * GIB


def serving(spec: NeuronModelSpec, role: str) -> dict[str, str]:
    """A serving pod's requests: its node share, at least the load (Neuron); a core and the weights (cpu)."""
    if role == "router":
        return dict(SMALL)
    share = _node_share(spec, parallelism.role_cores(spec, role))
    if share is None:  # our runtime on cpu: weights as held (float32 at most) and the runtime
        weights = weight_bytes(spec)
        return {"cpu": "1", "memory": gib(1 * GIB + (weights or 1 * GIB))}
    cpus, memory = share
    memory = min(max(memory, _loading(spec, 1.0)), _node_memory(spec))
    return {"cpu": _cpus(max(1.0, cpus)), "memory": gib(memory)}


def compile_job(spec: NeuronModelSpec, needs_neuron: bool, loads_model: bool) -> dict[str, str]:
    """A compile pod's requests: on a Neuron node its serving share and twice the weights; on a CPU node
    CPU_COMPILE_CPUS and twice the weights; a step that loads no model (an s3:// fetch's check): SMALL."""
    if not loads_model:
        return dict(SMALL)
    if needs_neuron:
        cpus, memory = _node_share(spec, parallelism.compile_cores(spec)) or (1.0, 0.0)
        memory = min(max(memory, _loading(spec, 2.0)), _node_memory(spec))
        return {"cpu": _cpus(max(1.0, cpus)), "memory": gib(memory)}
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
