"""Neuron instance topology, each instance type's node allocatable, and well-known model shapes: the one table
of each that validation, the resource requests and the manifest builders read.

Public sources, each read at the version named:
- Instance types: those the Neuron helm chart's DaemonSets (device plugin, DRA driver) run on, its
  `neuronInstances` value at chart 1.10.0 (public.ecr.aws/neuron/neuron-helm-chart:1.10.0, `helm show values`:
  trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.3xlarge, trn2.48xlarge, trn2u.48xlarge, trn3.48xlarge,
  trn3n.48xlarge, trn3en.24xlarge, trn3s-es.48xlarge, inf1.*, inf2.*, and SageMaker's ml.* names; chart 1.9.0,
  github.com/aws-neuron/neuron-helm-charts@b77a6f90 charts/neuron-helm-chart/values.yaml, had trn3.48xlarge
  and trn3e.24xlarge for Trn3). A type the chart does not list gets no device plugin, so no Neuron resource:
  it is not in the table (trn3p.48xlarge, which the table had from the Neuron driver's platform names, is
  gone: no chart version lists it). Of the chart's types the table leaves out: inf1 (NeuronCore-v1, which no
  engine here runs), the ml.* names (SageMaker HyperPod's, not EC2 node labels), and trn3n.48xlarge,
  trn3en.24xlarge and trn3s-es.48xlarge, whose devices, vCPUs, memory and EFA no published page gives (a row
  would be a guess that sizes pods).
- Inf2: up to twelve Inferentia2 chips, two NeuronCore-v2 and 32 GiB of device memory per chip
  (about-neuron/arch/neuron-hardware/inferentia2.rst; chips, vCPUs and host memory per size in inf2-arch.rst
  at SDK v2.32.0: 1/4/16, 1/32/128, 6/96/384, 12/192/768 GiB).
- Trn1/Trn1n: 1 (trn1.2xlarge) or 16 Trainium chips, two NeuronCore-v2 and 32 GiB per chip; 8/32 and 128/512
  vCPUs/GiB (trn1-arch.rst at v2.32.0); 8 EFA devices on trn1.32xlarge, 16 on trn1n.32xlarge
  (frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.rst); none on trn1.2xlarge.
- Trn2: eight physical NeuronCore-v3 and 96 GiB per Trainium2 chip (trainium2.rst); trn2.48xlarge and
  trn2u.48xlarge: 16 chips, 192 vCPUs, 2,048 GiB, 3,200 Gbps of EFAv3 (trn2-arch.rst at v2.32.0);
  trn2.3xlarge: one chip, 12 vCPUs, 128 GiB, "does not use NeuronLink interconnect or EFA networking"
  (trn2-arch.rst after v2.32.0, the page that adds it; the v2.32.0 DRA driver manifest
  deploy/files/manifests/daemonset.yaml already lists trn2.3xlarge). Logical NeuronCores: LNC=2 by default on
  Trn2 and Trn3, so a pod sees 4 cores per chip, or 8 at LNC=1 (logical-neuroncore-config.rst).
- Trn3 (SDK v2.32.0): eight physical NeuronCore-v4 and 144 GiB per Trainium3 chip (trainium3.rst); a Gen1
  UltraServer is four servers of 16 chips with 768 vCPUs, 8,192 GiB and 12,800 Gbps of EFA in all
  (trn3-arch.rst), so 192 vCPUs, 2,048 GiB and 3,200 Gbps a server. trn3.48xlarge is such a server
  (aws-neuron-driver@9cc489ec v4/neuron_dhal_v4.c: v4_platform_map names it a PDS server of 16 devices; the
  UltraServer operator, deploy/eks/ultraserver-operator.rst, runs on these "Trn3pds" types).
- EFA devices (`vpc.amazonaws.com/efa`, what a pod can request): one per network card that carries an EFA
  interface. trn2.48xlarge has 16 network cards (3,200 Gbps; the Neuron EKS node template
  aws-neuron/aws-neuron-eks-samples dp_bert_hf_pretrain/cfn/eks_trn2_ng_stack_al2023.yaml attaches an `efa`
  interface on each of cards 0-15), and so do the layouts the EKS user guide documents ("EFA devices",
  awsdocs/amazon-eks-user-guide@43d79bdb latest/ug/ml/device-management-efa.adoc: card 0 an ENA interface plus
  an EFA-only one at device index 1, each other card EFA-only; eksctl's efaEnabled and Karpenter's default for
  EFA pods make every interface EFA). A node whose card 0 carries only an ENA interface advertises one fewer
  (15): `efa_interfaces` is the documented layouts' count (docs/resources.md says so).
  No page gives a Trn3 server's count: 16, trn2.48xlarge's, for the same 3,200 Gbps (UNVERIFIED).
- Node allocatable (what pods may request of a node), computed in `node_allocatable`: the EKS-optimized AL2023
  AMI's kubelet settings (github.com/awslabs/amazon-eks-ami@v20260724 nodeadm/internal/kubelet/config.go:
  kubeReserved memory = 11 MiB x maxPods + 255 MiB, kubeReserved cpu = 6% of the first core, 1% of the second,
  0.5% of the third and fourth, 0.25% of the rest; evictionHard memory.available 100Mi; no systemReserved),
  maxPods = ENIs x (IPv4 addresses per ENI - 1) + 2 from the AMI's instance-info.jsonl
  (nodeadm/internal/kubelet/eni_max_pods.go; a type it does not list, trn2u and Trn3, is looked up with EC2 at
  boot: 110, kubelet's default and nodeadm's fallback, is assumed), and the memory the node reports as its
  capacity: the nominal memory less the share the hypervisor, firmware and kernel keep, 7.5% as Karpenter
  estimates it before a node of the type has registered (aws/karpenter-provider-aws, settings
  VM_MEMORY_OVERHEAD_PERCENT, default 0.075; a trn1.2xlarge reports 32332152Ki of its 32 GiB, 3.6% less).
- What a model's pod may request (`pod_allocatable`): the node's allocatable less the DaemonSets a Neuron node
  runs (`NODE_DAEMONSETS`): the Neuron chart 1.10.0's (device plugin: no requests; node problem detector,
  enabled by default: 10m and 80Mi; the DRA driver instead of the device plugin: 10m and 128Mi), and EKS's own
  (VPC CNI, kube-proxy, the EFA device plugin or DRA driver, CSI node drivers, the pod identity agent: their
  requests vary with each add-on's version, so 500m and 1 GiB are held for them all, an assumption).
- Devices per pod: the Neuron scheduler extension requires 1, 4, 8 or all 16 devices on trn1.32xlarge and
  trn1n.32xlarge, any contiguous set on Inf2 (containers/tutorials/k8s-neuron-scheduler.html).
- Tensor-parallel degrees (no single published list; these are ours): Trn1's follow from the scheduler
  extension's device counts (one core, or 1/4/8/16 devices = 2/8/16/32 cores); Inf2's, Trn2's and Trn3's are
  powers of two (plus all 24 cores of inf2.48xlarge), each limited at validation to the instance's cores.
- The compile target family: Inf2 and Trn1 share NeuronCore-v2 (one compiled artifact serves both); Trn2's
  NeuronCore-v3 and Trn3's NeuronCore-v4 each need their own.
- Model families (`model_type` in each model's config.json), which engines that support only some check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Instance:
    name: str
    devices: int
    physical_cores_per_device: int
    memory_per_device_gib: int
    tensor_parallel: tuple[int, ...]  # documented TP degrees
    device_counts: tuple[int, ...] | None  # devices per pod the scheduler extension accepts; None: any
    efa_interfaces: int  # EFA devices a pod can request on a node of the documented layouts (docstring)
    platform: str  # compile target family: Inf2 and Trn1 share one; Trn2 and Trn3 each differ
    vcpus: int  # the host's
    host_memory_gib: int  # the host's, nominal (EC2's figure; the node reports less: `node_allocatable`)
    max_pods: int  # the EKS AMI's maxPods for the type, which sizes the kubelet's memory reserve
    default_logical_cores: int = 1  # LNC

    @property
    def lnc_configurable(self) -> bool:
        """Whether neuron.logicalCores (LNC 1 or 2) applies: Trn2 and Trn3."""
        return self.default_logical_cores > 1

    def cores_per_device(self, logical_cores: int | None) -> int:
        """Cores a pod sees per device: physical cores / LNC (Trn2 defaults to LNC=2)."""
        return self.physical_cores_per_device // (logical_cores or self.default_logical_cores)

    def total_cores(self, logical_cores: int | None) -> int:
        return self.devices * self.cores_per_device(logical_cores)

    def memory_per_core(self, logical_cores: int | None) -> int:
        return self.memory_per_device_gib * GIB // self.cores_per_device(logical_cores)


_INF2_TP = (1, 2, 4, 8, 24)
_TRN1_TP = (1, 2, 8, 16, 32)
_TRN2_TP = (1, 2, 4, 8, 16, 32, 64)
_TRN1_DEVICES = (1, 4, 8, 16)
_TRN3_TP = (1, 2, 4, 8, 16, 32, 64)  # powers of two up to the 64 logical cores of 16 chips at LNC=2


def _max_pods(enis: int, ipv4_per_eni: int) -> int:
    """The EKS AMI's maxPods: ENIs x (IPv4 addresses per ENI - 1) + 2 (nodeadm's calculateStandardMaxPods)."""
    return enis * (ipv4_per_eni - 1) + 2


_TRN1_PODS = _max_pods(5, 50)  # trn1.32xlarge and trn1n.32xlarge
UNLISTED_MAX_PODS = 110  # a type instance-info.jsonl does not list: kubelet's default, nodeadm's fallback

# ENIs and IPv4 addresses per ENI: amazon-eks-ami@v20260724 nodeadm/internal/kubelet/instance-info.jsonl
INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("inf2.xlarge", 1, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 4, 16, _max_pods(4, 15)),
        Instance("inf2.8xlarge", 1, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 32, 128, _max_pods(8, 30)),
        Instance("inf2.24xlarge", 6, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 96, 384, _max_pods(15, 50)),
        Instance("inf2.48xlarge", 12, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 192, 768, _max_pods(15, 50)),
        Instance("trn1.2xlarge", 1, 2, 32, _TRN1_TP, None, 0, "inf2-trn1", 8, 32, _max_pods(4, 15)),
        Instance("trn1.32xlarge", 16, 2, 32, _TRN1_TP, _TRN1_DEVICES, 8, "inf2-trn1", 128, 512, _TRN1_PODS),
        Instance("trn1n.32xlarge", 16, 2, 32, _TRN1_TP, _TRN1_DEVICES, 16, "inf2-trn1", 128, 512, _TRN1_PODS),
        Instance("trn2.3xlarge", 1, 8, 96, _TRN2_TP, None, 0, "trn2", 12, 128, _max_pods(2, 15), 2),
        Instance("trn2.48xlarge", 16, 8, 96, _TRN2_TP, None, 16, "trn2", 192, 2048, _max_pods(2, 50), 2),
        Instance("trn2u.48xlarge", 16, 8, 96, _TRN2_TP, None, 16, "trn2", 192, 2048, UNLISTED_MAX_PODS, 2),
        Instance("trn3.48xlarge", 16, 8, 144, _TRN3_TP, None, 16, "trn3", 192, 2048, UNLISTED_MAX_PODS, 2),
    )
}


# Node allocatable: the EKS AMI's kubelet settings (module docstring)
VM_MEMORY_OVERHEAD = 0.075  # of the nominal memory, not in the node's capacity (Karpenter's default estimate)
EVICTION_HARD_MEMORY_MIB = 100  # evictionHard memory.available
KUBE_RESERVED_MIB_PER_POD = 11
KUBE_RESERVED_MIB_BASE = 255
# (up to this many millicores, the share of them kube-reserved takes)
KUBE_RESERVED_CPU_STEPS = ((1000, 0.06), (2000, 0.01), (4000, 0.005), (math.inf, 0.0025))


@dataclass(frozen=True)
class DaemonSet:
    name: str
    cpu_millicores: int
    memory_mib: int
    source: str


# What every Neuron node runs beside a model's pods, by their requests
NODE_DAEMONSETS = (
    DaemonSet("neuron-device-plugin or neuron-dra-driver", 10, 128,
              "Neuron chart 1.10.0: devicePlugin.resources {}; draDriver.resources.requests 10m, 128Mi"),
    DaemonSet("node-problem-detector", 10, 80, "Neuron chart 1.10.0: npd.enabled, requests 10m, 80Mi"),
    DaemonSet("EKS node DaemonSets", 500, 1024,
              "VPC CNI, kube-proxy, EFA device plugin or DRA driver, CSI node drivers, pod identity agent: "
              "an allowance (their requests vary with each add-on's version)"),
)  # fmt: skip


@dataclass(frozen=True)
class Allocatable:
    cpu_millicores: int
    memory_bytes: int
    # how the memory was arrived at, in words a refusal quotes
    explanation: str = ""

    def describe(self) -> str:
        return f"{self.cpu_millicores / 1000:g} CPUs and {self.memory_bytes / GIB:.1f} GiB"


def kube_reserved_cpu_millicores(vcpus: int) -> int:
    """The EKS AMI's kubeReserved cpu: 6% of the first core, 1% of the second, 0.5% of the next two, 0.25% of
    the rest (nodeadm getCPUMillicoresToReserve)."""
    total, reserved, start = vcpus * 1000, 0, 0
    for end, share in KUBE_RESERVED_CPU_STEPS:
        if total > start:
            reserved += int((min(total, end) - start) * share)
        start = end
    return reserved


def kube_reserved_memory_mib(max_pods: int) -> int:
    """The EKS AMI's kubeReserved memory: 11 MiB a pod plus 255 MiB (nodeadm getMemoryMebibytesToReserve)."""
    return KUBE_RESERVED_MIB_PER_POD * max_pods + KUBE_RESERVED_MIB_BASE


def capacity_memory_bytes(inst: Instance) -> int:
    """The memory the node reports (its capacity): the nominal memory less VM_MEMORY_OVERHEAD, whole MiB."""
    return math.floor(inst.host_memory_gib * GIB * (1 - VM_MEMORY_OVERHEAD) / MIB) * MIB


def node_allocatable(inst: Instance) -> Allocatable:
    """The node's allocatable: capacity less kubeReserved and, for memory, the hard eviction threshold."""
    reserved_mib = kube_reserved_memory_mib(inst.max_pods)
    memory = capacity_memory_bytes(inst) - (reserved_mib + EVICTION_HARD_MEMORY_MIB) * MIB
    cpu = inst.vcpus * 1000 - kube_reserved_cpu_millicores(inst.vcpus)
    return Allocatable(
        cpu,
        memory,
        f"{inst.host_memory_gib} GiB less {VM_MEMORY_OVERHEAD:.1%} the node does not report, "
        f"{reserved_mib} MiB kube-reserved and the {EVICTION_HARD_MEMORY_MIB} MiB eviction threshold",
    )


def pod_allocatable(inst: Instance) -> Allocatable:
    """What a model's pods may request of a node of `inst`: its allocatable less NODE_DAEMONSETS'."""
    node = node_allocatable(inst)
    cpu = sum(d.cpu_millicores for d in NODE_DAEMONSETS)
    memory = sum(d.memory_mib for d in NODE_DAEMONSETS)
    return Allocatable(
        node.cpu_millicores - cpu,
        node.memory_bytes - memory * MIB,
        f"{node.explanation}, less {memory} MiB for the node's DaemonSets",
    )


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    model_type: str | None = None  # config.json's model_type; None: not known (a shape given in the spec)


# Hugging Face ids -> size and shape (from each model's config.json: num_hidden_layers, num_key_value_heads,
# hidden_size / num_attention_heads or head_dim, model_type; parameter counts as published).
KNOWN_MODELS: dict[str, ModelShape] = {
    "meta-llama/Llama-3.2-1B": ModelShape(1_235_814_400, 16, 8, 64, "llama"),
    "meta-llama/Llama-3.2-1B-Instruct": ModelShape(1_235_814_400, 16, 8, 64, "llama"),
    "meta-llama/Llama-3.2-3B": ModelShape(3_212_749_824, 28, 8, 128, "llama"),
    "meta-llama/Llama-3.2-3B-Instruct": ModelShape(3_212_749_824, 28, 8, 128, "llama"),
    "meta-llama/Llama-3.1-8B": ModelShape(8_030_261_248, 32, 8, 128, "llama"),
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape(8_030_261_248, 32, 8, 128, "llama"),
    "meta-llama/Meta-Llama-3-8B-Instruct": ModelShape(8_030_261_248, 32, 8, 128, "llama"),
    "meta-llama/Llama-3.1-70B-Instruct": ModelShape(70_553_706_496, 80, 8, 128, "llama"),
    "meta-llama/Llama-3.3-70B-Instruct": ModelShape(70_553_706_496, 80, 8, 128, "llama"),
    "meta-llama/Llama-3.1-405B-Instruct": ModelShape(405_853_388_800, 126, 8, 128, "llama"),
    "mistralai/Mistral-7B-Instruct-v0.3": ModelShape(7_248_023_552, 32, 8, 128, "mistral"),
    "mistralai/Mistral-7B-v0.1": ModelShape(7_241_732_096, 32, 8, 128, "mistral"),
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(494_032_768, 24, 2, 64, "qwen2"),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(1_543_714_304, 28, 2, 128, "qwen2"),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(7_615_616_512, 28, 4, 128, "qwen2"),
    "Qwen/Qwen2.5-14B-Instruct": ModelShape(14_770_033_664, 48, 8, 128, "qwen2"),
    "Qwen/Qwen2.5-32B-Instruct": ModelShape(32_763_876_352, 64, 8, 128, "qwen2"),
    "Qwen/Qwen2.5-72B-Instruct": ModelShape(72_706_203_648, 80, 8, 128, "qwen2"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ModelShape(134_515_008, 30, 3, 64, "llama"),
    "HuggingFaceTB/SmolLM2-360M-Instruct": ModelShape(361_821_120, 32, 5, 64, "llama"),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": ModelShape(1_711_376_384, 24, 32, 64, "llama"),
    # 116.83B parameters (gpt-oss model card); its MoE experts ship in MXFP4, so the bfloat16 estimate is high
    "openai/gpt-oss-120b": ModelShape(116_830_000_000, 36, 8, 64, "gpt_oss"),
}

BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}
BYTES_PER_QUANTIZED_WEIGHT = {"int8": 1, "int4": 0.5, "fp8": 1}


def known_model(uri: str) -> ModelShape | None:
    """The shape of an hf://org/name model in the table (case-insensitive), else None."""
    if not uri.startswith("hf://"):
        return None
    wanted = uri.removeprefix("hf://").lower()
    return next((shape for name, shape in KNOWN_MODELS.items() if name.lower() == wanted), None)


def model_shape(uri: str, given: Any = None) -> ModelShape | None:
    """A model's shape: `given` (the spec's model.shape: parameters, layers, kvHeads, headDim) where set, else
    the table's for an hf:// id; None when neither knows it."""
    if given is not None:
        return ModelShape(given.parameters, given.layers, given.kvHeads, given.headDim)
    return known_model(uri)
