"""Neuron instance topology and well-known model shapes: the one table of each that validation and the
manifest builders read.

Public sources: the AWS Neuron SDK documentation (https://awsdocs-neuron.readthedocs-hosted.com, pages
named below, as of SDK 2.26-2.29):
- Inf2: up to twelve Inferentia2 chips, two NeuronCore-v2 and 32 GiB of device memory per chip
  (general/arch/neuron-hardware/inferentia2.html; chips per size, 1/1/6/12, in inf2-arch.html).
- Trn1/Trn1n: 1 (trn1.2xlarge) or 16 Trainium chips, two NeuronCore-v2 and 32 GiB per chip; EFA
  800 Gbps on trn1.32xlarge, 1600 Gbps on trn1n.32xlarge (general/arch/neuron-hardware/trn1-arch.html,
  trainium.html); 8 EFA devices on trn1.32xlarge, 16 on trn1n.32xlarge
  (frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html).
- Trn2: eight physical NeuronCore-v3 and 96 GiB per Trainium2 chip, 16 chips in trn2.48xlarge and
  trn2u.48xlarge (nki/arch/trainium2_arch.html); logical NeuronCores, LNC=2 by default on Trn2, so a pod
  sees 4 cores per chip (general/arch/neuron-features/logical-neuroncore-config.html).
- Trn3 (SDK 2.32 pages): eight physical NeuronCore-v4 and 144 GiB per Trainium3 chip
  (about-neuron/arch/neuron-hardware/trainium3.rst); a Trn3 Gen1 UltraServer is four servers of 16 Trainium3
  chips each, with 12,800 Gbps of EFA for the four (trn3-arch.rst); LNC is 1 or 2 on Trn2 and Trn3, two
  physical cores per logical core by default (logical-neuroncore-config.rst;
  libraries/nxd-inference/developer_guides/moe-arch-deep-dive.rst: "TRN2 and TRN3 provide two physical cores
  per logical NeuronCore"). The instance type names are the Neuron driver's: trn3.48xlarge (a 16-chip server)
  and trn3p.48xlarge (a server of an UltraServer) in github.com/aws-neuron/aws-neuron-driver@9cc489ec:
  v4/neuron_dhal_v4.c (v4_platform_map; its core map has 16 devices of 8 cores). No published page gives a
  Trn3 server's EFA interface count: 16 is trn2.48xlarge's (below), which has the same 3,200 Gbps of EFA per
  server (trn2-arch.rst; 12,800 / 4 for Trn3); a real cluster must confirm it.
- Devices per pod: the Neuron scheduler extension requires 1, 4, 8 or all 16 devices on trn1.32xlarge
  and trn1n.32xlarge, any contiguous set on Inf2 (containers/tutorials/k8s-neuron-scheduler.html).
- Tensor-parallel degrees (no single published list; these are ours): Trn1's follow from the scheduler
  extension's device counts (one core, or 1/4/8/16 devices = 2/8/16/32 cores); Inf2's, Trn2's and Trn3's are
  powers of two (plus all 24 cores of inf2.48xlarge), each limited at validation to the instance's cores.
- Host vCPUs and memory (what a pod's CPU and memory requests are a share of): the instance tables of
  about-neuron/arch/neuron-hardware/inf2-arch.rst, trn1-arch.rst and trn2-arch.rst at SDK v2.32.0 (inf2
  4/16, 32/128, 96/384, 192/768 GiB; trn1.2xlarge 8/32; trn1.32xlarge and trn1n.32xlarge 128/512;
  trn2.48xlarge and trn2u.48xlarge 192/2048). Trn3 has no per-server table: trn3-arch.rst gives a Gen1
  UltraServer (four 16-chip servers) 768 vCPUs and 8,192 GiB, so 192/2048 per server, the same as Trn2's.
- The compile target family: Inf2 and Trn1 share NeuronCore-v2 (one compiled artifact serves both); Trn2's
  NeuronCore-v3 and Trn3's NeuronCore-v4 each need their own.
- Model families (`model_type` in each model's config.json), which engines that support only some check.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Instance:
    name: str
    devices: int
    physical_cores_per_device: int
    memory_per_device_gib: int
    tensor_parallel: tuple[int, ...]  # documented TP degrees
    device_counts: tuple[int, ...] | None  # devices per pod the scheduler extension accepts; None: any
    efa_interfaces: int
    platform: str  # compile target family: Inf2 and Trn1 share one; Trn2 and Trn3 each differ
    vcpus: int  # the host's
    host_memory_gib: int
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
_TRN3_TP = (1, 2, 4, 8, 16, 32, 64)  # powers of two up to the 64 logical cores of 16 chips at LNC=2

INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("inf2.xlarge", 1, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 4, 16),
        Instance("inf2.8xlarge", 1, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 32, 128),
        Instance("inf2.24xlarge", 6, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 96, 384),
        Instance("inf2.48xlarge", 12, 2, 32, _INF2_TP, None, 0, "inf2-trn1", 192, 768),
        Instance("trn1.2xlarge", 1, 2, 32, _TRN1_TP, None, 0, "inf2-trn1", 8, 32),
        Instance("trn1.32xlarge", 16, 2, 32, _TRN1_TP, (1, 4, 8, 16), 8, "inf2-trn1", 128, 512),
        Instance("trn1n.32xlarge", 16, 2, 32, _TRN1_TP, (1, 4, 8, 16), 16, "inf2-trn1", 128, 512),
        Instance("trn2.48xlarge", 16, 8, 96, _TRN2_TP, None, 16, "trn2", 192, 2048, default_logical_cores=2),
        Instance("trn2u.48xlarge", 16, 8, 96, _TRN2_TP, None, 16, "trn2", 192, 2048, default_logical_cores=2),
        Instance("trn3.48xlarge", 16, 8, 144, _TRN3_TP, None, 16, "trn3", 192, 2048, default_logical_cores=2),
        Instance(
            "trn3p.48xlarge", 16, 8, 144, _TRN3_TP, None, 16, "trn3", 192, 2048, default_logical_cores=2
        ),
    )
}


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
