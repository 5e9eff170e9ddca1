"""Engine `vllm`: two pinned contracts, chosen by the instance family (docs/engine-vllm.md):

- Trn2 and Trn3: the vLLM Neuron plugin's own model code (`vllm_plugin`): compiled ahead into the cache,
  unified or prefill/decode with vLLM's NIXL connector over EFA;
- Inf2 and Trn1: the last image that serves them, the plugin over NxD Inference (`vllm_nxdi`), unified only.

Each function below hands the spec to the contract of its instance family; `contract` says which.
"""

from __future__ import annotations

from types import ModuleType

from .. import topology
from ..pod_metrics import Names
from ..spec import NeuronModelSpec
from . import vllm_nxdi, vllm_plugin
from .common import Container, Pinned

CONTRACTS: tuple[ModuleType, ...] = (vllm_plugin, vllm_nxdi)
# vLLM's names for the autoscaler's signals, both contracts': vllm/v1/metrics/loggers.py, read in the vllm
# 0.16.0 wheel (PyPI); the same four are the plugin image's vLLM 0.24.0's (its loggers were not read there)
METRICS = Names(
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    kv_usage="vllm:kv_cache_usage_perc",
    ttft="vllm:time_to_first_token_seconds",
)


def contract(spec: NeuronModelSpec) -> ModuleType:
    """The contract of the spec's instance family (instanceType cpu, which validation refuses for vllm, and
    every other family map to the one whose platform it is; cpu to the plugin's)."""
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    platform = inst.platform if inst else ""
    return next((c for c in CONTRACTS if platform in c.PLATFORMS), vllm_plugin)


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


def bucket_limits(spec: NeuronModelSpec) -> bool:
    return getattr(contract(spec), "bucket_limits", lambda _: True)(spec)


def unsupported(spec: NeuronModelSpec) -> list[str]:
    return contract(spec).unsupported(spec)
