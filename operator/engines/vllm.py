"""Engine `vllm`: two pinned contracts, chosen by the instance family (docs/engine-vllm.md):

- Trn2 and Trn3: the vLLM Neuron plugin's own model code (`vllm_plugin`): compiled ahead into the cache,
  unified or prefill/decode with vLLM's NIXL connector over EFA;
- Inf2 and Trn1: the last image that serves them, the plugin over NxD Inference (`vllm_nxdi`), unified only.

Each function below hands the spec to the contract of its instance family; `contract` says which.
"""

from __future__ import annotations

from types import ModuleType
from typing import get_args

from .. import topology
from ..pod_metrics import Names
from ..spec import InstanceType, NeuronModelSpec
from . import vllm_nxdi, vllm_plugin
from .common import Container, Pinned

CONTRACTS: dict[str, ModuleType] = {"vllm_plugin": vllm_plugin, "vllm_nxdi": vllm_nxdi}


def _contract_of(instance: str) -> str:
    inst = topology.INSTANCES.get(instance)
    platform = inst.platform if inst else ""
    return next((name for name, c in CONTRACTS.items() if platform in c.PLATFORMS), "vllm_plugin")


# The contract of each instance type, from its family's platform (cpu, which a rule refuses for vllm, the
# plugin's): the one table `contract` reads and the CRD's rules read as a CEL map literal (`CONTRACT_CEL`)
CONTRACT_OF: dict[str, str] = {name: _contract_of(name) for name in get_args(InstanceType)}
CONTRACT_CEL = "{" + ", ".join(f"'{k}': '{v}'" for k, v in CONTRACT_OF.items()) + "}"
# vLLM's names for the autoscaler's signals, both contracts': vllm/v1/metrics/loggers.py, read in the vllm
# 0.16.0 wheel (PyPI); the same four are the plugin image's vLLM 0.24.0's (its loggers were not read there)
METRICS = Names(
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    kv_usage="vllm:kv_cache_usage_perc",
    ttft="vllm:time_to_first_token_seconds",
)


def contract(spec: NeuronModelSpec) -> ModuleType:
    """The contract of the spec's instance family (`CONTRACT_OF`)."""
    return CONTRACTS[CONTRACT_OF[spec.neuron.instanceType]]


def pinned(spec: NeuronModelSpec) -> Pinned:
    return contract(spec).PINNED


def image(spec: NeuronModelSpec) -> str:
    return contract(spec).image(spec)


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    return contract(spec).serve(spec, role, compile_hash, port, served_name)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    return contract(spec).compile_files(spec, compile_hash)


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    return contract(spec).compile_container(spec, compile_hash)


def reads_hub_when_serving(spec: NeuronModelSpec) -> bool:
    return contract(spec).reads_hub_when_serving(spec)
