"""The Neuron cores and devices each of a model's pods asks for: the tensor parallelism each role runs (the
model's, or a prefill's or decode's own), and what a compile on devices holds. Pure (the instance table)."""

from __future__ import annotations

import math

from . import topology
from .spec import NeuronModelSpec


def role_tensor_parallel(spec: NeuronModelSpec, role: str | None = None) -> int:
    """A role's tensor parallelism: serving.prefill/decode.tensorParallel where set, else the model's."""
    s = spec.serving
    own = {"prefill": s.prefill, "decode": s.decode}.get(role or "")
    return own.tensorParallel if own is not None and own.tensorParallel else spec.neuron.tensorParallel


def tensor_parallel_degrees(spec: NeuronModelSpec) -> list[int]:
    """Every tensor parallelism the model's Neuron pods run at (one, or prefill's and decode's), ascending."""
    roles = ("prefill", "decode") if spec.serving.mode == "disaggregated" else ("unified",)
    return sorted({role_tensor_parallel(spec, r) for r in roles})


def neuron_devices(spec: NeuronModelSpec, role: str | None = None) -> tuple[int, int]:
    """(devices, cores) a replica of `role` (default: the model's tensor parallelism) asks the device plugin
    for; (0, 0) on cpu."""
    n = spec.neuron
    inst = topology.INSTANCES.get(n.instanceType)
    if inst is None:
        return 0, 0
    tp = role_tensor_parallel(spec, role)
    return math.ceil(tp / inst.cores_per_device(n.logicalCores)), tp


def role_cores(spec: NeuronModelSpec, role: str) -> int:
    """Neuron cores a pod of `role` asks for (none for a router, none on cpu)."""
    return 0 if role == "router" else neuron_devices(spec, role)[1]


def compile_cores(spec: NeuronModelSpec) -> int:
    """Neuron cores a compile that runs on devices holds: the largest tensor parallelism it compiles."""
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    return max(tensor_parallel_degrees(spec)) if inst is not None else 0
