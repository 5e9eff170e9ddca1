"""The NeuronModel resource (neuronfleet.dev/v1alpha1): pydantic models of its spec and status.

These models are the single source of truth: the CRD's openAPIV3Schema is generated from them (`crd.py`),
and the operator parses objects with them. A rule that needs only the object is declared once, beside its
section, as a `Rule`: its CEL expression goes into the CRD's `x-kubernetes-validations` (the API server
refuses an object that breaks it, at `kubectl apply`) and its Python twin runs when a model is parsed here
(`rules`) or validated (`validated_rules`, with the checks that need more than the object), so that
`neuronfleet validate`, `render` and the operator refuse the same things. Field names are the public
contract: users' manifests and the samples use them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from neuronfleet.contract import SERVE_PORT, TORCHNEURON_FAMILIES, RoutingPolicy, instance_family

from . import names, topology
from .gateway_spec import Gateway
from .spec_base import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    MEANINGS,
    NO_SPACE,
    QUALIFIED_NAME,
    QUALIFIED_NAME_CEL,
    QUANTITY,
    SECRET_KEY,
    VAR_REF,
    LabelKey,
    LabelValue,
    Quantity,
    Rule,
    Spec,
    arg_text,
    qualified_name,
    rules,
    section,
    validated_rules,
    var_refs,
)

GROUP = "neuronfleet.dev"
VERSION = "v1alpha1"
KIND = "NeuronModel"
PLURAL = "neuronmodels"
SINGULAR = "neuronmodel"
SHORT_NAMES = ["nm"]
API_VERSION = f"{GROUP}/{VERSION}"

Engine = Literal["embedded", "vllm", "tgi", "sglang"]
InstanceType = Literal[("cpu", *topology.INSTANCES)]  # the instance table's types (topology.py), and cpu
DType = Literal["auto", "bfloat16", "float16", "float32"]
AUTO_ON_NEURON = "bfloat16"  # what dtype auto is on a Neuron instance type (every engine's dtype there)
SOURCE = r"^(hf://[^/\s]+/[^/\s]+|s3://[^/\s]+/\S*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/\S*|file:///\S*)$"
TOKENIZER = r"^(hf://[^/\s]+/[^/\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/\S*|file:///\S*)$"
# What each pattern of the spec means, in the words a refusal uses (validation.parse)
PATTERN_MEANINGS = {
    **MEANINGS,
    SOURCE: "hf://org/name, s3://bucket/path, pvc://claim/path or file:///path, without spaces",
    TOKENIZER: "a folder: hf://org/name, pvc://claim/path or file:///path, without spaces",
}


class SecretKeyRef(Spec):
    name: str = Field(
        description="Name of a Secret in the NeuronModel's namespace.", pattern=DNS_SUBDOMAIN, max_length=253
    )
    key: str = Field(
        "token", description="Key in the Secret that holds the token.", pattern=SECRET_KEY, max_length=253
    )


class ModelShape(Spec):
    """The model's size and shape, for the memory-fit check; from a table of well-known ids when absent."""

    parameters: int = Field(description="Number of parameters.", ge=1)
    layers: int = Field(description="Transformer layers.", ge=1)
    kvHeads: int = Field(description="Key/value heads (grouped-query attention).", ge=1)
    headDim: int = Field(description="Dimension of one attention head.", ge=1)


class ModelSource(Spec):
    uri: arg_text(SOURCE, 4096) = Field(
        description="Where the weights are: hf://org/name, s3://bucket/path, pvc://claim/path or file:///path."
    )
    revision: arg_text(NO_SPACE, 255) | None = Field(
        None, description="Revision (branch, tag or commit) for hf:// models."
    )
    tokenizer: arg_text(TOKENIZER, 4096) | None = Field(
        None,
        description="Where the tokenizer is when it differs from the model's (a folder: file:///path, "
        "pvc://claim/path or hf://org/name); the compile puts its tokenizer files beside the weights. Engine "
        "embedded only (the API server refuses it for the others).",
    )
    secretRef: SecretKeyRef | None = Field(
        None, description="Secret with the token to download the model (e.g. a Hugging Face token)."
    )
    shape: ModelShape | None = Field(
        None, description="Size and shape for the memory-fit check (default: looked up by well-known id)."
    )


@validated_rules(
    Rule(
        "self.context.isSorted() && self.context.all(b, self.context.exists_one(c, c == b))",
        "neuron.buckets.context must be increasing without repeats (e.g. [512, 1024, 2048])",
        lambda s: s.context == sorted(set(s.context)),
        lambda s: f"neuron.buckets.context must be increasing without repeats, got {s.context}",
    ),
    Rule(
        "self.generation.isSorted() && self.generation.all(b, self.generation.exists_one(c, c == b))",
        "neuron.buckets.generation must be increasing without repeats (e.g. [512, 1024, 2048])",
        lambda s: s.generation == sorted(set(s.generation)),
        lambda s: f"neuron.buckets.generation must be increasing without repeats, got {s.generation}",
    ),
)
class Buckets(Spec):
    context: list[int] = Field(
        default_factory=list,
        description="Prompt length buckets (context encoding), increasing, between 1 and maxInputLength, "
        "the largest maxInputLength (vLLM on Trn2/Trn3: its own prefill buckets); empty: derived from "
        "maxInputLength.",
        max_length=32,
    )
    generation: list[int] = Field(
        default_factory=list,
        description="KV length buckets for token generation, increasing, between 1 and sequenceLength, the "
        "largest sequenceLength (vLLM on Trn2/Trn3: decode context lengths below it); empty: derived from "
        "sequenceLength.",
        max_length=32,
    )


def valued(section: BaseModel, name: str) -> str:
    """`neuron.NAME VALUE`, or `neuron.NAME (default VALUE, not set)` when the user left it to the default:
    a refusal caused by a default must say so."""
    value = getattr(section, name)
    return (
        f"neuron.{name} {value}"
        if name in section.model_fields_set
        else f"neuron.{name} (default {value}, not set)"
    )


def placeable_tensor_parallel(inst: topology.Instance, logical_cores: int | None) -> tuple[int, ...]:
    """The tensor parallelisms one pod can run at on an instance type: a documented degree, within one node's
    cores, on as many devices as the Neuron scheduler extension places."""
    out = []
    for tp in inst.tensor_parallel:
        devices = math.ceil(tp / inst.cores_per_device(logical_cores))
        if tp <= inst.total_cores(logical_cores) and (
            inst.device_counts is None or devices in inst.device_counts
        ):
            out.append(tp)
    return tuple(out)


def _placement_key(instance: str, logical_cores: int | None) -> str:
    return f"{instance}/{'' if logical_cores is None else logical_cores}"


# Per instance type and neuron.logicalCores (unset, 1, 2): what `placeable_tensor_parallel` allows, as the
# Python twins read it and as a CEL map literal the rules index (a table the CRD carries, from topology.py)
PLACEABLE = {
    _placement_key(name, lnc): placeable_tensor_parallel(inst, lnc)
    for name, inst in topology.INSTANCES.items()
    for lnc in (None, 1, 2)
}
PLACEABLE_CEL = "{" + ", ".join(f"'{k}': [{', '.join(map(str, v))}]" for k, v in PLACEABLE.items()) + "}"
LNC_INSTANCES = [name for name, inst in topology.INSTANCES.items() if inst.lnc_configurable]
EFA_CEL = "{" + ", ".join(f"'{k}': {i.efa_interfaces}" for k, i in topology.INSTANCES.items()) + "}"


def placement_key_cel(neuron: str) -> str:
    """The CEL of PLACEABLE's key for the neuron section at `neuron` (`self` or `self.neuron`)."""
    return f"{neuron}.instanceType + '/' + (has({neuron}.logicalCores) ? string({neuron}.logicalCores) : '')"


def placeable_cel(tp: str, neuron: str) -> str:
    """CEL: tensor parallelism `tp` runs on the instance type of the neuron section at `neuron`."""
    return f"{neuron}.instanceType == 'cpu' || {tp} in {PLACEABLE_CEL}[{placement_key_cel(neuron)}]"


def placeable_message_cel(name: str, tp: str, neuron: str) -> str:
    """CEL that words a refusal of `tp` (`name` in the spec) with the degrees that would fit."""
    return (
        f"'{name} ' + string({tp}) + ' does not fit one pod on ' + {neuron}.instanceType + ' (a documented "
        "degree, within its Neuron cores, on as many devices as the Neuron scheduler extension places): "
        f"choose one of ' + {PLACEABLE_CEL}[{placement_key_cel(neuron)}].map(t, string(t)).join(', ')"
    )


PLACEABLE_MESSAGE = (
    "{name} must be a tensor parallelism that fits one pod on the instance type: "
    + "; ".join(
        f"{name} {', '.join(map(str, PLACEABLE[_placement_key(name, None)]))}" for name in topology.INSTANCES
    )
)


def tensor_parallel_refusal(name: str, tp: int, instance: str, logical_cores: int | None) -> str | None:
    """Why tensor parallelism `tp` (`name` in the spec) cannot run on the instance type, in the words of the
    first limit it breaks, with the degrees that would fit; None when it can (or on cpu)."""
    inst = topology.INSTANCES.get(instance)
    if inst is None or tp in PLACEABLE[_placement_key(instance, logical_cores)]:
        return None
    allowed = ", ".join(map(str, PLACEABLE[_placement_key(instance, logical_cores)]))
    if tp not in inst.tensor_parallel:
        return f"{name} {tp} is not a documented degree on {inst.name}; choose one of {allowed}"
    if tp > inst.total_cores(logical_cores):
        return (
            f"{name} {tp} needs more cores than one {inst.name} has ({inst.total_cores(logical_cores)}); "
            f"choose one of {allowed} or a larger instance"
        )
    devices = math.ceil(tp / inst.cores_per_device(logical_cores))
    return (
        f"{name} {tp} needs {devices} Neuron devices per pod, but the Neuron scheduler extension on "
        f"{inst.name} places only {', '.join(map(str, inst.device_counts or ()))} devices; choose {name} "
        f"{allowed}"
    )


@rules(
    Rule(
        "self.buckets.generation.all(b, b >= 1 && b <= self.sequenceLength)",
        "neuron.buckets.generation must lie between 1 and neuron.sequenceLength",
        lambda s: all(1 <= b <= s.sequenceLength for b in s.buckets.generation),
    ),
)
@validated_rules(
    Rule(
        "self.instanceType != 'cpu' || self.tensorParallel == 1",
        "neuron.tensorParallel needs Neuron cores: on instanceType cpu use 1",
        lambda s: s.instanceType != "cpu" or s.tensorParallel == 1,
        lambda s: f"tensorParallel {s.tensorParallel} needs Neuron cores; on cpu use 1",
        "'neuron.tensorParallel ' + string(self.tensorParallel) + ' needs Neuron cores: on instanceType cpu "
        "use 1'",
    ),
    Rule(
        "self.instanceType != 'cpu' || self.quantization in ['none', 'int8', 'int4']",
        "neuron.quantization fp8 is not available on instanceType cpu: use none, int8 or int4",
        lambda s: s.instanceType != "cpu" or s.quantization in ("none", "int8", "int4"),
        lambda s: f"quantization {s.quantization} is not available on cpu; use none, int8 or int4",
    ),
    Rule(
        "self.instanceType == 'cpu' || self.quantization != 'int4'",
        "quantization int4 runs on the embedded engine's CPU kernels only (instanceType cpu); on Neuron use "
        "none, int8 or fp8 (engine vllm)",
        lambda s: s.instanceType == "cpu" or s.quantization != "int4",
    ),
    Rule(
        f"!has(self.logicalCores) || self.instanceType in {LNC_INSTANCES!r}",
        "neuron.logicalCores applies to Trn2 and Trn3 instances only; remove it",
        lambda s: s.logicalCores is None or s.instanceType in LNC_INSTANCES,
        lambda s: (
            "neuron.logicalCores applies to Trn2 and Trn3 instances only"
            + ("" if s.instanceType == "cpu" else f", not {s.instanceType}")
            + "; remove it"
        ),
        "'neuron.logicalCores applies to Trn2 and Trn3 instances only, not ' + self.instanceType + '; remove "
        "it'",
    ),
    Rule(
        placeable_cel("self.tensorParallel", "self"),
        PLACEABLE_MESSAGE.format(name="neuron.tensorParallel"),
        lambda s: (
            tensor_parallel_refusal("tensorParallel", s.tensorParallel, s.instanceType, s.logicalCores)
            is None
        ),
        lambda s: tensor_parallel_refusal("tensorParallel", s.tensorParallel, s.instanceType, s.logicalCores),
        placeable_message_cel("neuron.tensorParallel", "self.tensorParallel", "self"),
    ),
)
class NeuronSettings(Spec):
    instanceType: InstanceType = Field(
        description="EC2 instance type of the serving nodes; `cpu` runs the embedded engine without Neuron "
        "(its only instance type until its Neuron backend is built). The API server refuses engine embedded "
        "on a Neuron instance type, another engine on cpu, and a tensorParallel, logicalCores, quantization "
        "or kvTransfer.efaInterfaces the instance type cannot take (the messages say what would fit)."
    )
    tensorParallel: int = Field(
        1,
        description="Neuron cores (logical cores on Trn2 and Trn3) per replica: a degree that fits one pod "
        "on the instance type (e.g. 1, 2, 4, 8 or 24 on inf2.48xlarge; 1 on cpu), refused at apply "
        "otherwise.",
        ge=1,
        le=128,
    )
    batchSize: int = Field(4, description="Static batch compiled into the model: the slots.", ge=1, le=1024)
    sequenceLength: int = Field(4096, description="Prompt plus generated tokens per slot.", ge=16, le=1048576)
    hostKVCache: Quantity | None = Field(
        None,
        description="Engine embedded: host memory that keeps KV blocks after their slot is overwritten, so "
        "that a conversation whose slot another prompt took between its turns copies its prefix back "
        "instead of prefilling it (a least-recently-used store of 16-token blocks; its blocks count in the "
        "KV events the routers follow). A quantity (e.g. 2Gi); 0 turns it off. Default: as much as the "
        "slots' own KV cache (batchSize x sequenceLength tokens), counted in the pods' memory request. "
        "Refused at apply for the other engines.",
    )
    maxInputLength: int | None = Field(
        None,
        description="Longest prompt in tokens. Default: neuron.sequenceLength - 1 for engines vllm and "
        "sglang (they bound a prompt by the context length only), 3072 for embedded and tgi. Must be below "
        "sequenceLength, default or not (refused at apply).",
        ge=1,
        le=1048576,
    )
    dtype: DType = Field(
        "auto",
        description="Weights and activations. auto: bfloat16 on Neuron; on instanceType cpu, bfloat16 "
        "where the serving CPU computes it natively (AVX512-BF16, AMX or Arm BF16), else float32 (with the "
        "float weights held in float16 on x86: fbgemm's float16-weight GEMM, float32 arithmetic), decided by "
        "each pod.",
    )
    logicalCores: Literal[1, 2] | None = Field(
        None,
        description="Logical NeuronCore configuration (LNC) on Trn2 and Trn3: 2 (default there) or 1; "
        "refused on other instance types. LNC is a node setting with the Neuron device plugin: a value other "
        "than the default needs nodes that run it, found by the chart's neuron.lncNodeLabel (refused "
        "otherwise); with deviceAllocation dra the pods' claims set it.",
    )
    deviceAllocation: Literal["devicePlugin", "dra"] | None = Field(
        None,
        description="How the pods get their Neuron devices and EFA interfaces: devicePlugin (the extended "
        "resources aws.amazon.com/neuroncore and vpc.amazonaws.com/efa) or dra (ResourceClaimTemplates for "
        "the Neuron DRA driver's DeviceClass neuron.aws.com and the EFA DRA driver's efa.networking.k8s.aws; "
        "Kubernetes 1.34+). Default: the chart's neuron.deviceAllocation (devicePlugin unless it says dra).",
    )
    buckets: Buckets = section(Buckets, "Length buckets compiled for prefill and decode.")
    quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        "none",
        description="Weight quantization: int8 (engine vllm on Inf2/Trn1; engine embedded on cpu), int4 "
        "(engine embedded on cpu), fp8 (engine vllm on Inf2/Trn1); refused at apply elsewhere (vLLM's plugin "
        "on Trn2/Trn3 reads pre-quantized checkpoints).",
    )
    compiledSteps: Literal["off", "inductor", "neuron"] = Field(
        "off",
        description="Engine embedded: its passes compiled ahead by the compile Job, a graph per bucket. "
        "inductor (cpu): AOTInductor packages, loaded by the pods without a compiler; a pod on a node whose "
        "CPU differs from the compile's runs op by op and says so; today slower than off on CPU "
        "(docs/benchmarks.md). neuron (trn2, trn3; experimental, not yet run on a device): TorchNeuron "
        "graphs, the compile Job warming every bucket's NEFF on a node of the instance type, the pods "
        "loading them and compiling none; unified serving, a rank per NeuronCore. off: op by op (cpu only). "
        "Needs neuron.buckets.context and neuron.buckets.generation, few enough to make at most 256 graphs "
        "(the count is checked), float weights (quantization none).",
    )
    expertParallel: int | None = Field(
        None,
        description="Expert parallelism of a mixture-of-experts model: experts spread over this many of "
        "the replica's cores (engine vllm on Trn2/Trn3: --enable-expert-parallel with neuron_config "
        "ep_degree; engine sglang: --ep-size; refused at apply for the others). Must divide tensorParallel.",
        ge=1,
        le=128,
    )
    kvCacheDtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="KV cache type: auto (the model's dtype) or fp8 (engine vllm on Trn2/Trn3: "
        "--kv-cache-dtype fp8, which needs calibrated scales in the checkpoint; engine sglang: "
        "--kv-cache-dtype fp8_e4m3; refused at apply for the others).",
    )
    memoryFraction: float | None = Field(
        None,
        description="Engine sglang: the share of device memory for weights and the KV cache pool "
        "(--mem-fraction-static, e.g. 0.8); refused at apply for the other engines.",
        gt=0,
        le=1,
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine-specific compile settings passed through (e.g. NxDI NeuronConfig fields); no "
        "string in them may hold $( (the operator refuses it: they reach the engine's arguments).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @field_validator("overrides")
    @classmethod
    def _overrides_reach_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        if found := list(var_refs(value, "neuron.overrides")):
            raise ValueError(f"{', '.join(found)} {VAR_REF}")
        return value

    @model_validator(mode="after")
    def _auto_on_neuron_is_bfloat16(self):
        """dtype auto means bfloat16 on a Neuron instance type (every engine's dtype there); only the embedded
        engine on cpu keeps `auto`, which each serving pod resolves for its own CPU."""
        if self.dtype == "auto" and self.instanceType != "cpu":
            self.dtype = AUTO_ON_NEURON
        return self


class Resources(Spec):
    requests: dict[LabelKey, Quantity] = Field(
        default_factory=dict, description="Resource requests (cpu, memory).", max_length=32
    )
    limits: dict[LabelKey, Quantity] = Field(
        default_factory=dict, description="Resource limits (cpu, memory).", max_length=32
    )


def _qualified(value: str) -> bool:
    try:
        qualified_name(value)
    except ValueError:
        return False
    return True


@rules(
    Rule(
        f"!has(self.key) || self.key == '' || ({QUALIFIED_NAME_CEL.format('self.key')})",
        f"key must be {QUALIFIED_NAME}",
        lambda t: not t.key or _qualified(t.key),
        lambda t: f"key must be {QUALIFIED_NAME}, got {t.key!r}",
    ),
    Rule(
        "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "value must be empty with operator Exists",
        lambda t: t.operator != "Exists" or not t.value,
    ),
    Rule(
        "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "a toleration without a key needs operator Exists",
        lambda t: bool(t.key) or t.operator == "Exists",
    ),
    Rule(
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds applies to effect NoExecute only",
        lambda t: t.tolerationSeconds is None or t.effect == "NoExecute",
    ),
)
class Toleration(Spec):
    """A Pod's toleration, as Kubernetes checks it (pkg/apis/core/validation validateTolerations, v1.31)."""

    key: str | None = Field(
        None, description="The taint's key (empty with operator Exists: any).", max_length=317
    )
    operator: Literal["Exists", "Equal", ""] | None = Field(None, description="Exists or Equal (default).")
    value: str | None = Field(None, description="The taint's value (operator Equal).", pattern=LABEL_VALUE,
                              max_length=63)  # fmt: skip
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] | None = Field(
        None, description="The taint effect tolerated (empty: all)."
    )
    tolerationSeconds: int | None = Field(None, description="Effect NoExecute: how long the pod stays.")


def _tolerations(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each toleration checked as a `Toleration` (its words naming the index and field), kept as written."""
    for i, item in enumerate(value):
        try:
            Toleration.model_validate(item)
        except ValidationError as e:
            err = e.errors()[0]
            where = "".join(f".{p}" for p in err["loc"])
            raise ValueError(f"[{i}]{where}: {err['msg'].removeprefix('Value error, ')}") from None
    return value


def _toleration_items(schema: dict[str, Any]) -> None:
    """A toleration's schema and rules (the list keeps each item as written, so pydantic leaves them out)."""
    rules = [r.validation() for r in Toleration.__rules__]
    schema["items"] = {**Toleration.model_json_schema(), "x-kubernetes-validations": rules}


Tolerations = Annotated[list[dict[str, Any]], AfterValidator(_tolerations)]
NodeSelector = dict[LabelKey, LabelValue]
# the name of a cluster object the pods name (a PriorityClass, a scheduler, a StorageClass): a DNS subdomain
ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]


@rules(
    Rule(
        "!(has(self.claimName) && has(self.storageClassName))",
        "compile.cache: name an existing claimName or a storageClassName for a new claim, not both",
        lambda s: not (s.claimName and s.storageClassName),
    )
)
class CompileCache(Spec):
    claimName: str | None = Field(
        None,
        description="An existing PersistentVolumeClaim to hold the models' artifacts: each model that names "
        "it has its own folder there, models/<name>/, which is all its pods mount.",
        pattern=DNS_LABEL,
        max_length=63,
    )
    storageClassName: ObjectName | None = Field(
        None, description="Storage class of the claim the operator creates."
    )
    size: str = Field("200Gi", description="Size of the claim the operator creates.", pattern=QUANTITY)
    accessModes: list[Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        description="Access modes of the claim the operator creates (many nodes read the artifacts).",
        min_length=1,
    )


# compile.activeDeadlineSeconds' default before it was derived: objects stored then carry it (engines.limits
# takes it as the default where an engine runs no compile Job)
FORMER_COMPILE_DEADLINE = 14400


@validated_rules(
    Rule(
        "!has(self.timeoutSeconds) || !has(self.activeDeadlineSeconds) || "
        "self.activeDeadlineSeconds >= self.timeoutSeconds",
        "compile.activeDeadlineSeconds must be at least compile.timeoutSeconds (the Job's deadline holds "
        "every graph's compile): raise compile.activeDeadlineSeconds, or leave it out (derived)",
        lambda s: (
            s.timeoutSeconds is None
            or s.activeDeadlineSeconds is None
            or s.activeDeadlineSeconds >= s.timeoutSeconds
        ),
    )
)
class Compile(Spec):
    cache: CompileCache = section(CompileCache, "The shared volume that holds compiled artifacts.")
    resources: Resources = section(
        Resources,
        "CPU and memory of the compile Job's pod; unset keys are derived from the model's size and where "
        "the compile runs (docs/resources.md).",
    )
    nodeSelector: NodeSelector = Field(
        default_factory=dict,
        description="Extra node labels the compile Job's pod matches: a compile that runs on CPU (engine "
        "vllm on Trn2/Trn3) goes to any linux/amd64 node unless this narrows it; one that needs Neuron "
        "devices goes to the serving instance type.",
        max_length=64,
    )
    tolerations: Tolerations = Field(
        default_factory=list,
        description="Tolerations of the compile Job's pod (the Neuron taint is tolerated already where it "
        "runs on a Neuron node).",
        json_schema_extra=_toleration_items,
        max_length=64,
    )
    image: str | None = Field(
        None,
        description="Container image of the compile Job when it runs the engine's own compile (e.g. the "
        "engine's image from a mirror); default: the serving image (spec.image, else the engine's pinned "
        "one). With an engine other than embedded the image runs as its pinned one does, privileged: the "
        "operator takes one only where its chart allows it (docs/security.md).",
        pattern=NO_SPACE,
        max_length=1024,
    )
    backoffLimit: int = Field(2, description="Retries of a failed compile.", ge=0, le=10)
    activeDeadlineSeconds: int | None = Field(
        None,
        description="A compile Job running longer than this fails (its activeDeadlineSeconds). Default: "
        "derived from the model's size, the compile passes and compile.timeoutSeconds, at least "
        f"{FORMER_COMPILE_DEADLINE} (docs/operator.md, Timeouts).",
        ge=60,
        le=604800,
    )
    timeoutSeconds: int | None = Field(
        None,
        description="The longest one compiled graph may take: the engine's own compile timeouts where it has "
        "them (engine vllm on Trn2/Trn3: VLLM_NEURON_COMPILATION_TIMEOUT and the others docs/engine-vllm.md "
        "names), and what the compile Job's deadline is derived from. Default: derived from the model's size "
        "(docs/operator.md, Timeouts).",
        ge=60,
        le=86400,
    )
    serviceAccountName: str | None = Field(
        None,
        description="ServiceAccount the compile Job and source probes run as: its IAM role (IRSA or EKS Pod "
        "Identity) reads an s3:// model. Serving pods do not use it.",
        pattern=DNS_SUBDOMAIN,
        max_length=253,
    )


class RoleSpec(Spec):
    replicas: int = Field(1, description="Pods of this role.", ge=0, le=1000)
    resources: Resources = section(
        Resources,
        "CPU and memory of each pod (Neuron resources are derived); unset keys are derived from the "
        "instance type and the model's size (docs/resources.md).",
    )
    tensorParallel: int | None = Field(
        None,
        description="Mode disaggregated, engine vllm on Trn2/Trn3: this role's tensor parallelism when it "
        "differs from neuron.tensorParallel (e.g. a smaller prefill and a larger decode); refused at apply "
        "for the other engines.",
        ge=1,
        le=128,
    )


class Router(Spec):
    """The routers: a disaggregated model's public endpoint (docs/disaggregation.md), or a unified model's
    front door (every unified model's but one whose serving.gateway pool is its pods: docs/front-door.md)."""

    replicas: int = Field(1, description="Router pods.", ge=1, le=100)


class Sampling(Spec):
    """Sampling defaults: what a request that leaves a field out gets, laid over the model's own generation
    settings (its generation_config.json). A request's own values always win."""

    temperature: float | None = Field(None, description="0 is greedy.", ge=0, le=2)
    topP: float | None = Field(None, description="Nucleus sampling's probability mass.", gt=0, le=1)
    topK: int | None = Field(None, description="The most likely tokens sampled from (0: all).", ge=0)
    repetitionPenalty: float | None = Field(
        None, description="Over 1 discourages repeating tokens already in the text.", gt=0, le=2
    )

    def generation_config(self) -> dict[str, float | int]:
        """The values set, by generation_config.json's names (`--override-generation-config`)."""
        names = {"temperature": "temperature", "topP": "top_p", "topK": "top_k",
                 "repetitionPenalty": "repetition_penalty"}  # fmt: skip
        return {names[k]: v for k, v in self.model_dump().items() if v is not None}


class Routing(Spec):
    """How the routers spread requests over the serving pods (docs/routing.md)."""

    policy: RoutingPolicy = Field(
        "kv-aware",
        description="kv-aware: each request goes to the pod with the lowest expected time to first token: "
        "its wait for a slot plus the prefill of the prompt's prefix it does not hold in its prefix cache "
        "(learnt from what the router sent where, or from the pods' KV-cache events), from the pods' load "
        "and the router's timings of them; until those are measured, the pod expected to hold the longest "
        "prefix unless it carries more than loadMargin requests above the least loaded one; least-loaded: "
        "by load alone. A unified model's front door (router pods) routes, unless serving.gateway's endpoint "
        "picker does.",
    )
    loadMargin: int | None = Field(
        None,
        description="Policy kv-aware, until the routers have timed the pods: requests a pod may carry above "
        "the least loaded pod and still be chosen for the prefix it holds (once timed, the expected wait for "
        "a slot is weighed against the prefill saved instead). Default: a quarter of neuron.batchSize, at "
        "least 2.",
        ge=0,
        le=10000,
    )


PROMPT_TO_CONTEXT_ENGINES = ["vllm", "sglang"]  # a prompt may fill their context but one token
FIXED_MAX_INPUT = 3072


def default_max_input_length(engine: str, sequence_length: int) -> int:
    """The prompt limit of a spec that names none: what vLLM and SGLang enforce (a prompt may fill the
    context but one token: vLLM's --max-model-len, SGLang's --context-length), 3072 for the engines whose
    compile takes a prompt length of its own (embedded, TGI's MAX_INPUT_TOKENS). (`MAX_INPUT_CEL` says the
    same to the API server.)"""
    return sequence_length - 1 if engine in PROMPT_TO_CONTEXT_ENGINES else FIXED_MAX_INPUT


def default_transport(engine: str) -> str:
    """The KV transport of a spec that names none: tcp for the embedded engine (it runs anywhere, no extra
    package), efa for the engines whose NIXL/LIBFABRIC path is configured (vllm, sglang). (`TRANSPORT_CEL`
    says the same to the API server.)"""
    return "tcp" if engine == "embedded" else "efa"


# The spec's values the rules of the whole spec read, in CEL (the API server has no engine-dependent
# defaults: an unset field is derived as `default_max_input_length` and `default_transport` derive it, and
# dtype auto on Neuron as NeuronSettings resolves it)
MAX_INPUT_CEL = (
    "(has(self.neuron.maxInputLength) ? self.neuron.maxInputLength : (self.engine in "
    f"{PROMPT_TO_CONTEXT_ENGINES!r} ? self.neuron.sequenceLength - 1 : {FIXED_MAX_INPUT}))"
)
TRANSPORT_CEL = (
    "(has(self.serving.kvTransfer.transport) ? self.serving.kvTransfer.transport : (self.engine == "
    "'embedded' ? 'tcp' : 'efa'))"
)
OVER_EFA_CEL = (
    f"({TRANSPORT_CEL} == 'efa' || ({TRANSPORT_CEL} == 'nixl' && has(self.serving.kvTransfer.backend) && "
    "self.serving.kvTransfer.backend == 'libfabric'))"
)
DISAGGREGATED_CEL = "(self.serving.mode == 'disaggregated')"
DTYPE_CEL = (
    f"(self.neuron.dtype == 'auto' && self.neuron.instanceType != 'cpu' ? '{AUTO_ON_NEURON}' : "
    "self.neuron.dtype)"
)


DEFAULT_EFA_INTERFACES = 1


class KVTransfer(Spec):
    transport: Literal["efa", "tcp", "nixl"] | None = Field(
        None,
        description="KV cache transport between prefill and decode pods: tcp (engine embedded: its own), "
        "nixl (engine embedded: NIXL with kvTransfer.backend), or efa (NIXL over LIBFABRIC on the pods' EFA "
        "devices). Default: tcp for engine embedded, efa for the other engines.",
    )
    backend: Literal["ucx", "libfabric"] | None = Field(
        None,
        description="Transport nixl: NIXL's backend, ucx (any network; the default) or libfabric (EFA, as "
        "transport efa). Refused with another transport.",
    )
    efaInterfaces: int = Field(
        DEFAULT_EFA_INTERFACES,
        description="EFA devices requested per prefill/decode pod (vpc.amazonaws.com/efa): with an EFA "
        "transport (efa, or nixl with backend libfabric) only, at most the instance type's EFA interfaces.",
        ge=0,
        le=32,
    )
    connector: Literal["NixlConnector", "NeuronNixlConnector"] | None = Field(
        None,
        description="Engine vllm on Trn2/Trn3 (refused at apply for the others): vLLM's KV connector. "
        "Default: NeuronNixlConnector for the sliding-window models the table knows (GPT-OSS), NixlConnector "
        "otherwise; name NeuronNixlConnector for any other model whose attention slides.",
    )

    @property
    def over_efa(self) -> bool:
        """Whether the pods move KV caches over their EFA devices (efa, or nixl with LIBFABRIC)."""
        return self.transport == "efa" or (self.transport == "nixl" and self.backend == "libfabric")


# Switching a model's mode is one field either way: mode disaggregated needs prefill and decode sections, and
# mode unified leaves any it still has unused (as mode disaggregated leaves serving.unified), so that
# `kubectl patch --type merge -p '{"spec":{"serving":{"mode":"unified"}}}'` switches back (docs/operator.md)
@rules(
    Rule(
        "self.mode == 'unified' || (has(self.prefill) && has(self.decode))",
        "serving: mode disaggregated needs serving.prefill and serving.decode (each may be {})",
        lambda s: s.mode == "unified" or (s.prefill is not None and s.decode is not None),
    )
)
class Serving(Spec):
    mode: Literal["unified", "disaggregated"] = Field(
        "unified", description="One pod type, or prefill and decode pods joined by a router."
    )
    unified: RoleSpec = section(
        RoleSpec, "Pods that prefill and decode (mode unified; kept, unused, under mode disaggregated)."
    )
    prefill: RoleSpec | None = Field(
        None, description="Prefill pods (mode disaggregated; kept, unused, under mode unified)."
    )
    decode: RoleSpec | None = Field(
        None, description="Decode pods (mode disaggregated; kept, unused, under mode unified)."
    )

    @model_validator(mode="before")
    @classmethod
    def _unused_roles_dropped(cls, data: Any) -> Any:
        """Under mode unified, the prefill and decode sections an earlier mode left mean nothing: parsed as
        absent, so no rule, hash or object reads them (they stay in the stored object until removed)."""
        if isinstance(data, dict) and data.get("mode", "unified") == "unified":
            return {k: v for k, v in data.items() if k not in ("prefill", "decode")}
        return data

    router: Router = section(
        Router, "The public endpoint of a disaggregated model, or a unified model's front door."
    )
    routing: Routing = section(Routing, "How the routers choose each request's pod (docs/routing.md).")
    sampling: Sampling = section(
        Sampling,
        "Sampling defaults for requests that leave a field out (engine embedded; refused at apply for the "
        "others), over the model's generation_config.json; `/info` shows what they are.",
    )
    kvTransfer: KVTransfer = section(KVTransfer, "How KV caches travel from prefill to decode pods.")
    port: int = Field(
        SERVE_PORT, description="HTTP port of the serving pods and the Service.", ge=1, le=65535
    )
    startTimeoutSeconds: int | None = Field(
        None,
        description="The longest a serving pod (unified, prefill, decode) may take to start: the engine's "
        "own start timeout where it has one (engine vllm on Trn2/Trn3: VLLM_ENGINE_READY_TIMEOUT_S) and the "
        "startup probe's budget. Default: derived from the model's size and the engine (docs/operator.md, "
        "Timeouts).",
        ge=60,
        le=86400,
    )
    networkPolicy: bool = Field(
        True,
        description="NetworkPolicies: this model's own pods reach every port of its pods (KV, KV events, "
        "internal endpoints); clients reach only the public pods' serving port; the operator and the "
        "chart's networkPolicy.metricsFrom only the serving port (/metrics). false: none (docs/security.md).",
    )
    gateway: Gateway | None = Field(
        None,
        description="Behind an inference gateway: an InferencePool (Gateway API Inference Extension) of the "
        "pods the model's Service selects, for an endpoint picker, and optionally an HTTPRoute to it "
        "(docs/gateway.md).",
    )


class ScaleUp(Spec):
    stabilizationSeconds: int = Field(
        0, description="Scale up to the highest wish of this window (0: at once).", ge=0, le=3600
    )


class ScaleDown(Spec):
    stabilizationSeconds: int = Field(
        300, description="Scale down only to the highest wish of this window (seconds).", ge=0, le=3600
    )


@rules(Rule("self.min <= self.max", "autoscaling.prefill.min must not exceed autoscaling.prefill.max",
            lambda s: s.min <= s.max))  # fmt: skip
class RoleBounds(Spec):
    min: int = Field(1, description="Fewest pods of the role.", ge=0, le=1000)
    max: int = Field(4, description="Most pods of the role.", ge=1, le=1000)


@rules(
    Rule(
        "self.min <= self.max",
        "autoscaling.prefillDecodeRatio.min must not exceed autoscaling.prefillDecodeRatio.max",
        lambda s: s.min <= s.max,
    )
)
class RatioBounds(Spec):
    min: float = Field(
        description="Fewest prefill pods per decode pod (e.g. 0.25: one per four).", gt=0, le=100
    )
    max: float = Field(description="Most prefill pods per decode pod.", gt=0, le=100)


AUTOSCALING_METRICS = ("queue", "occupancy", "ttft")
DEFAULT_TARGETS = {"queue": 2.0, "occupancy": 0.75}  # per replica, when autoscaling.target is not set


@rules(
    Rule(
        "self.min <= self.max",
        "autoscaling.min must not exceed autoscaling.max",
        lambda s: s.min <= s.max,
    ),
    Rule(
        "!self.scaleToZero || self.min == 0",
        "autoscaling.scaleToZero needs autoscaling.min 0",
        lambda s: not s.scaleToZero or s.min == 0,
    ),
    Rule(
        "!self.scaleToZero || !has(self.prefill) || self.prefill.min == 0",
        "autoscaling.scaleToZero needs autoscaling.prefill.min 0 too (or no autoscaling.prefill)",
        lambda s: not s.scaleToZero or s.prefill is None or s.prefill.min == 0,
    ),
    Rule(
        "self.metric != 'ttft' || has(self.ttftSLOMilliseconds)",
        "autoscaling.metric ttft needs autoscaling.ttftSLOMilliseconds: the TTFT p90 to hold, in ms",
        lambda s: s.metric != "ttft" or s.ttftSLOMilliseconds is not None,
    ),
    Rule(
        "self.metric != 'ttft' || !has(self.target)",
        "autoscaling.target is per replica for metrics queue and occupancy; metric ttft holds "
        "autoscaling.ttftSLOMilliseconds instead: remove autoscaling.target",
        lambda s: s.metric != "ttft" or s.target is None,
    ),
    Rule(
        "self.metric != 'occupancy' || !has(self.target) || self.target <= 1.0",
        "autoscaling.target of metric occupancy is a share of a replica's slots and KV cache: above 0, at "
        "most 1 (e.g. 0.75)",
        lambda s: s.metric != "occupancy" or s.target is None or s.target <= 1.0,
    ),
    Rule(
        # https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/horizontal-pod-autoscaler-v2/
        # (v1.32): minReplicas "is allowed to be 0 if the alpha feature gate HPAScaleToZero is enabled"
        "self.provider != 'hpa' || (!self.scaleToZero && self.min >= 1)",
        "autoscaling.provider hpa cannot scale to zero (a HorizontalPodAutoscaler's minReplicas is at least "
        "1 unless the alpha feature gate HPAScaleToZero is on): set autoscaling.min 1 or more and no "
        "scaleToZero, or use provider keda or builtin",
        lambda s: s.provider != "hpa" or (not s.scaleToZero and s.min >= 1),
    ),
    Rule(
        "self.provider != 'keda' || has(self.prometheusAddress)",
        "autoscaling.provider keda needs autoscaling.prometheusAddress: the Prometheus that KEDA's "
        "prometheus trigger queries for the pods' metrics (e.g. http://prometheus.monitoring.svc:9090)",
        lambda s: s.provider != "keda" or s.prometheusAddress is not None,
    ),
    Rule(
        "!self.dryRun || self.provider == 'builtin'",
        "autoscaling.dryRun applies to provider builtin: a HorizontalPodAutoscaler or a KEDA ScaledObject "
        "acts as soon as it exists",
        lambda s: not s.dryRun or s.provider == "builtin",
    ),
)
class Autoscaling(Spec):
    """Who scales the serving replicas, between which bounds, on which signal: the builtin provider is the
    operator itself (autoscale_loop.py, from the pods' /metrics); hpa and keda are acted on by the cluster
    once the operator has made their HorizontalPodAutoscaler or ScaledObject."""

    enabled: bool = Field(False, description="Scale the serving replicas between min and max.")
    provider: Literal["builtin", "hpa", "keda"] = Field(
        "builtin",
        description="Who scales: builtin (the operator, from the pods' /metrics), hpa (an autoscaling/v2 "
        "HorizontalPodAutoscaler on the scale subresource, custom metrics from an adapter) or keda (a KEDA "
        "ScaledObject with prometheus triggers).",
    )
    min: int = Field(
        1,
        description="Fewest replicas of the scaled role (unified, or decode when disaggregated).",
        ge=0,
        le=1000,
    )
    max: int = Field(
        4,
        description="Most replicas of the scaled role (unified, or decode when disaggregated).",
        ge=1,
        le=1000,
    )
    prefill: RoleBounds | None = Field(
        None,
        description="Mode disaggregated: bounds of the prefill pods (default: as the ratio to decode makes "
        "them).",
    )
    prefillDecodeRatio: RatioBounds | None = Field(
        None,
        description="Mode disaggregated: bounds of prefill pods per decode pod; prefill follows decode "
        "within them.",
    )
    metric: Literal["queue", "occupancy", "ttft"] = Field(
        "occupancy",
        description="Signal: queue (requests waiting for a slot, vllm:num_requests_waiting), occupancy (KV "
        "cache and slot use, vllm:kv_cache_usage_perc) or ttft (time to first token p90, "
        "vllm:time_to_first_token_seconds, against ttftSLOMilliseconds). A signal the engine's pods do not "
        "export for the provider is refused at apply (engine tgi: no KV cache use for hpa or keda, no ttft).",
    )
    target: float | None = Field(
        None,
        description="Target value of the metric per replica: waiting requests (queue, default 2) or a share "
        "0-1 (occupancy, default 0.75); not with ttft.",
        gt=0,
        le=10000,
    )
    ttftSLOMilliseconds: int | None = Field(
        None, description="The TTFT p90 to hold, in milliseconds (metric ttft needs it).", ge=1, le=600000
    )
    scaleUp: ScaleUp = section(ScaleUp, "Scale-up stabilisation.")
    scaleDown: ScaleDown = section(ScaleDown, "Scale-down stabilisation.")
    scaleToZero: bool = Field(False, description="Allow zero replicas when idle (needs min 0).")
    idleSeconds: int = Field(
        300,
        description="scaleToZero: seconds without requests before the last replica goes.",
        ge=30,
        le=86400,
    )
    onManualChange: Literal["adopt", "refuse"] = Field(
        "adopt",
        description="Provider builtin: a change of spec.replicas by anyone else (kubectl scale neuronmodel, "
        "a GitOps apply) is adopted (the autoscaler's new desired replicas, within min/max; an Event "
        "ManualScaleAdopted) or refused (put back, with a Warning Event ManualScaleRefused).",
    )
    dryRun: bool = Field(False, description="Provider builtin: record decisions in the status, act on none.")
    prometheusAddress: str | None = Field(
        None,
        description="Provider keda: URL of the Prometheus that scrapes the serving and router pods.",
        pattern=r"^https?://\S+$",
        max_length=2048,
    )


class Scheduling(Spec):
    nodeSelector: NodeSelector = Field(
        default_factory=dict, description="Extra node labels to match.", max_length=64
    )
    tolerations: Tolerations = Field(
        default_factory=list,
        description="Extra tolerations (the Neuron taint is tolerated already).",
        json_schema_extra=_toleration_items,
        max_length=64,
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod affinity rules, as in a Pod spec.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    schedulerName: ObjectName | None = Field(
        None,
        description="Scheduler of the model's serving pods and of a compile Job on Neuron nodes, e.g. "
        "my-scheduler of the Neuron scheduler extension. Unset: the operator's setting neuron.schedulerName "
        "(its chart value, for pods asking for more than one Neuron core), else the cluster's default "
        "scheduler.",
    )
    priorityClassName: ObjectName | None = Field(None, description="Priority class of the serving pods.")


def _role_tp_rule(role: str) -> Rule:
    tp = f"self.serving.{role}.tensorParallel"
    return Rule(
        f"!{DISAGGREGATED_CEL} || !has(self.serving.{role}) || !has({tp}) || "
        f"{placeable_cel(tp, 'self.neuron')}",
        PLACEABLE_MESSAGE.format(name=f"serving.{role}.tensorParallel"),
        lambda s: (
            s.serving.mode != "disaggregated"
            or getattr(s.serving, role) is None
            or _role_tp_refusal(s, role) is None
        ),
        lambda s: _role_tp_refusal(s, role) or "",
        placeable_message_cel(f"serving.{role}.tensorParallel", tp, "self.neuron"),
    )


def _role_tp_refusal(s: NeuronModelSpec, role: str) -> str | None:
    tp = getattr(s.serving, role).tensorParallel
    n = s.neuron
    name = f"serving.{role}.tensorParallel"
    return None if tp is None else tensor_parallel_refusal(name, tp, n.instanceType, n.logicalCores)


def _efa_interfaces(s: NeuronModelSpec) -> int:
    inst = topology.INSTANCES.get(s.neuron.instanceType)
    return inst.efa_interfaces if inst is not None else 0


def _over_efa(s: NeuronModelSpec) -> bool:
    return s.serving.mode == "disaggregated" and s.serving.kvTransfer.over_efa


def _transport_named(s: NeuronModelSpec) -> str:
    kv = s.serving.kvTransfer
    return f"{kv.transport} with backend libfabric" if kv.transport == "nixl" else str(kv.transport)


# The engines that serve each serving mode on each Neuron instance family (the engine matrix's "works" cells,
# engines/matrix.py, which tests/unit/test_operator_spec.py holds this to): what the refusal of engine
# embedded on a Neuron instance type names at apply
NEURON_ENGINES: dict[str, dict[str, tuple[str, ...]]] = {
    "unified": {
        "inf2": ("vllm", "tgi"),
        "trn1": ("vllm", "tgi"),
        "trn2": ("vllm",),
        "trn3": ("vllm", "sglang"),
    },
    "disaggregated": {"inf2": (), "trn1": (), "trn2": ("vllm",), "trn3": ("vllm", "sglang")},
}
# serving.sampling set (only engine embedded takes it: engines/limits.py refuses it for the others)
SAMPLING_SET_CEL = (
    "(" + " || ".join(f"has(self.serving.sampling.{name})" for name in Sampling.model_fields) + ")"
)


# The instance types where engine embedded runs TorchNeuron (experimental): the contract's families
TORCHNEURON_CEL = "(self.neuron.instanceType in [{}])".format(
    ", ".join(f"'{t}'" for t in topology.INSTANCES if instance_family(t) in TORCHNEURON_FAMILIES)
)


def _torchneuron(s: NeuronModelSpec) -> bool:
    return instance_family(s.neuron.instanceType) in TORCHNEURON_FAMILIES


def _engines_there_cel(mode: str) -> str:
    """CEL: a map of each Neuron instance type to the engines that serve `mode` there, in words."""
    words = {
        name: (
            f"use engine {' or '.join(engines)}"
            if (engines := NEURON_ENGINES[mode][instance_family(name)])
            else f"no engine serves serving.mode {mode} there yet"
        )
        for name in topology.INSTANCES
    }
    return "{" + ", ".join(f"'{k}': '{v}'" for k, v in words.items()) + "}"


def _scaled_role_replicas(s: NeuronModelSpec) -> tuple[str, int]:
    """The scaled role (unified, or decode when disaggregated) and its serving.*.replicas."""
    if s.serving.mode == "disaggregated" and s.serving.decode is not None:
        return "decode", s.serving.decode.replicas
    return "unified", s.serving.unified.replicas


# The rules that read more than one section (checked by validation.validate, with the rest of its checks;
# the rules of one section are declared beside it)
@validated_rules(
    Rule(
        f"{MAX_INPUT_CEL} < self.neuron.sequenceLength",
        "neuron.maxInputLength must be below neuron.sequenceLength (room is needed to generate); unset it is "
        f"{FIXED_MAX_INPUT} for engines embedded and tgi, neuron.sequenceLength - 1 for vllm and sglang: set "
        "neuron.maxInputLength below neuron.sequenceLength",
        lambda s: s.neuron.maxInputLength < s.neuron.sequenceLength,
        lambda s: (
            f"{valued(s.neuron, 'maxInputLength')} must be below {valued(s.neuron, 'sequenceLength')} (room "
            f"is needed to generate); set neuron.maxInputLength below {s.neuron.sequenceLength}"
        ),
        f"'neuron.maxInputLength ' + string({MAX_INPUT_CEL}) + (has(self.neuron.maxInputLength) ? '' : ' "
        "(the default of engine ' + self.engine + ', not set)') + ' must be below neuron.sequenceLength ' + "
        "string(self.neuron.sequenceLength) + ' (room is needed to generate); set neuron.maxInputLength "
        "below ' + string(self.neuron.sequenceLength)",
    ),
    Rule(
        f"self.neuron.buckets.context.all(b, b >= 1 && b <= {MAX_INPUT_CEL})",
        "neuron.buckets.context must lie between 1 and neuron.maxInputLength (unset: "
        f"{FIXED_MAX_INPUT} for engines embedded and tgi, neuron.sequenceLength - 1 for vllm and sglang)",
        lambda s: all(1 <= b <= s.neuron.maxInputLength for b in s.neuron.buckets.context),
        lambda s: (
            f"neuron.buckets.context must lie between 1 and {valued(s.neuron, 'maxInputLength')}, got "
            f"{s.neuron.buckets.context}"
        ),
    ),
    Rule(
        "self.neuron.instanceType != 'cpu' || self.engine == 'embedded'",
        "engine vllm, tgi and sglang need Neuron devices: instanceType cpu runs engine embedded only",
        lambda s: s.neuron.instanceType != "cpu" or s.engine == "embedded",
        lambda s: f"engine {s.engine} needs Neuron devices; instanceType cpu runs engine embedded only",
        "'engine ' + self.engine + ' needs Neuron devices: instanceType cpu runs engine embedded only'",
    ),
    EMBEDDED_ON_NEURON := Rule(
        f"self.neuron.instanceType == 'cpu' || self.engine != 'embedded' || {TORCHNEURON_CEL}",
        "engine embedded (set, or the default) has no Neuron backend for this instance type: neuronfleet's "
        "runtime serves on instanceType cpu, and on trn2 and trn3 with TorchNeuron (experimental); on Inf2 "
        "and Trn1 use engine vllm or tgi, or use instanceType cpu",
        lambda s: s.neuron.instanceType == "cpu" or s.engine != "embedded" or _torchneuron(s),
        # (validation words the Python refusal: it names the engines that serve such a spec there, and what
        # they need changed)
        message_expression="'engine embedded (set, or the default) has no Neuron backend for ' + "
        "self.neuron.instanceType + ' (neuronfleet\\'s runtime serves on instanceType cpu, and on trn2 and "
        "trn3 with TorchNeuron, experimental); on ' + self.neuron.instanceType + ' ' + "
        f"({DISAGGREGATED_CEL} ? {_engines_there_cel('disaggregated')} : {_engines_there_cel('unified')})"
        f"[self.neuron.instanceType] + ({SAMPLING_SET_CEL} ? ', without serving.sampling (only engine "
        "embedded takes it)' : '') + (has(self.model.tokenizer) ? ', without model.tokenizer (only engine "
        "embedded applies it)' : '') + "
        "', or use instanceType cpu'",
    ),
    EMBEDDED_TORCHNEURON := Rule(
        f"self.engine != 'embedded' || !{TORCHNEURON_CEL} || (self.neuron.compiledSteps == 'neuron' && "
        f"!{DISAGGREGATED_CEL})",
        "engine embedded (set, or the default) on trn2 and trn3 is experimental (TorchNeuron, not yet run on "
        "a device) and serves unified only: set neuron.compiledSteps neuron and serving.mode unified, or use "
        "engine vllm",
        lambda s: (
            s.engine != "embedded"
            or not _torchneuron(s)
            or (s.neuron.compiledSteps == "neuron" and s.serving.mode != "disaggregated")
        ),
        # (validation words the Python refusal, naming the engines that serve such a spec there)
        message_expression="'engine embedded (set, or the default) on ' + self.neuron.instanceType + ' is "
        "experimental (TorchNeuron, not yet run on a device) and serves unified only: ' + "
        f"({DISAGGREGATED_CEL} ? 'serving.mode disaggregated moves KV caches from host memory, not yet the "
        "device\\'s; use serving.mode unified' : 'set neuron.compiledSteps neuron') + ', or ' + "
        f"({DISAGGREGATED_CEL} ? {_engines_there_cel('disaggregated')} : {_engines_there_cel('unified')})"
        "[self.neuron.instanceType]",
    ),
    _role_tp_rule("prefill"),
    _role_tp_rule("decode"),
    Rule(
        f"!({DISAGGREGATED_CEL} && {OVER_EFA_CEL}) || self.neuron.instanceType == 'cpu' || {EFA_CEL}"
        "[self.neuron.instanceType] > 0",
        "serving.kvTransfer over EFA (transport efa, the default of engines vllm and sglang, or nixl with "
        "backend libfabric) needs an instance type with EFA ("
        + ", ".join(k for k, i in topology.INSTANCES.items() if i.efa_interfaces)
        + "): use kvTransfer.transport tcp (or nixl with backend ucx) or an EFA instance",
        lambda s: not _over_efa(s) or s.neuron.instanceType == "cpu" or _efa_interfaces(s) > 0,
        lambda s: (
            f"{s.neuron.instanceType} has no EFA; use kvTransfer.transport tcp (or nixl with backend ucx) or "
            "an EFA instance"
        ),
        "self.neuron.instanceType + ' has no EFA: use kvTransfer.transport tcp (or nixl with backend ucx) or "
        "an EFA instance'",
    ),
    Rule(
        f"!({DISAGGREGATED_CEL} && {OVER_EFA_CEL}) || self.neuron.instanceType == 'cpu' || "
        f"self.serving.kvTransfer.efaInterfaces <= {EFA_CEL}[self.neuron.instanceType] || {EFA_CEL}"
        "[self.neuron.instanceType] == 0",
        "serving.kvTransfer.efaInterfaces must not exceed the instance type's EFA interfaces ("
        + ", ".join(f"{k} {i.efa_interfaces}" for k, i in topology.INSTANCES.items() if i.efa_interfaces)
        + ")",
        lambda s: (
            not _over_efa(s)
            or _efa_interfaces(s) == 0
            or s.serving.kvTransfer.efaInterfaces <= _efa_interfaces(s)
        ),
        lambda s: (
            f"kvTransfer.efaInterfaces {s.serving.kvTransfer.efaInterfaces} exceeds the {_efa_interfaces(s)} "
            f"EFA interfaces of {s.neuron.instanceType}"
        ),
        "'kvTransfer.efaInterfaces ' + string(self.serving.kvTransfer.efaInterfaces) + ' exceeds the ' + "
        f"string({EFA_CEL}[self.neuron.instanceType]) + ' EFA interfaces of ' + self.neuron.instanceType",
    ),
    Rule(
        f"!({DISAGGREGATED_CEL} && self.engine == 'embedded' && {OVER_EFA_CEL} && !has(self.image))",
        "serving.kvTransfer over EFA (transport efa, or nixl with backend libfabric: NIXL over LIBFABRIC on "
        "the pods' EFA devices) needs a runtime image with AWS's EFA userspace (EFA installer 1.51.0 or "
        "later; docs/disaggregation.md): neuronfleet's runtime-cpu image has NIXL but not EFA's libfabric. "
        "Set spec.image to such an image, or use kvTransfer.transport nixl (backend ucx) or tcp",
        lambda s: not (_over_efa(s) and s.engine == "embedded" and s.image is None),
        lambda s: (
            f"kvTransfer.transport {_transport_named(s)} (NIXL over LIBFABRIC on the pods' EFA devices) "
            "needs a "
            "runtime image with AWS's EFA userspace (EFA installer 1.51.0 or later: NIXL 1.5.1's LIBFABRIC "
            "plugin needs a libfabric newer than 2.6.0, and the libraries docs/disaggregation.md lists); "
            "neuronfleet's runtime-cpu image has NIXL but not EFA's libfabric: set spec.image to such an "
            "image, or use kvTransfer.transport nixl (backend ucx) or tcp"
        ),
    ),
    Rule(
        f"!({DISAGGREGATED_CEL} && {TRANSPORT_CEL} == 'nixl' && self.engine != 'embedded')",
        "kvTransfer.transport nixl names the embedded engine's NIXL transport; engines vllm and sglang move "
        "KV caches with their own NIXL connector over LIBFABRIC: use kvTransfer.transport efa",
        lambda s: (
            not (
                s.serving.mode == "disaggregated"
                and s.serving.kvTransfer.transport == "nixl"
                and s.engine != "embedded"
            )
        ),
        lambda s: (
            "kvTransfer.transport nixl names the embedded engine's NIXL transport; engine "
            f"{s.engine} moves KV caches with its own NIXL connector over LIBFABRIC: use "
            "kvTransfer.transport efa"
        ),
    ),
    Rule(
        f"!({DISAGGREGATED_CEL} && self.engine == 'tgi')",
        "engine tgi has no prefill/decode disaggregation; use serving.mode unified",
        lambda s: not (s.serving.mode == "disaggregated" and s.engine == "tgi"),
    ),
    Rule(
        f"!{DISAGGREGATED_CEL} || self.serving.kvTransfer.efaInterfaces == {DEFAULT_EFA_INTERFACES} || "
        f"{OVER_EFA_CEL}",
        "serving.kvTransfer.efaInterfaces: EFA devices are requested for prefill and decode pods with "
        "kvTransfer.transport efa (or nixl with backend libfabric) only; remove it, or use transport efa",
        lambda s: (  # (mode unified moves no KV cache: its kvTransfer is kept, unused)
            s.serving.mode != "disaggregated"
            or s.serving.kvTransfer.efaInterfaces == DEFAULT_EFA_INTERFACES
            or _over_efa(s)
        ),
    ),
    Rule(
        f"!{DISAGGREGATED_CEL} || !has(self.serving.kvTransfer.backend) || {TRANSPORT_CEL} == 'nixl'",
        "serving.kvTransfer.backend: a NIXL backend is chosen for kvTransfer.transport nixl only (efa is "
        "NIXL over LIBFABRIC already); remove it, or use transport nixl",
        lambda s: (
            s.serving.mode != "disaggregated"
            or s.serving.kvTransfer.backend is None
            or s.serving.kvTransfer.transport == "nixl"
        ),
        lambda s: (
            f"serving.kvTransfer.backend {s.serving.kvTransfer.backend}: a NIXL backend is chosen for "
            "kvTransfer.transport nixl only (efa is NIXL over LIBFABRIC already); remove it, or use "
            "transport nixl"
        ),
    ),
    Rule(
        "!has(self.model.tokenizer) || self.engine == 'embedded'",
        "model.tokenizer is applied by the embedded engine's compile, not engines vllm, tgi or sglang: "
        "remove it, or put the tokenizer files beside the model's weights",
        lambda s: s.model.tokenizer is None or s.engine == "embedded",
        lambda s: (
            f"model.tokenizer is applied by the embedded engine's compile, not engine {s.engine}; remove it, "
            "or put the tokenizer files beside the model's weights"
        ),
    ),
    *(
        Rule(
            f"{DISAGGREGATED_CEL} || !has(self.autoscaling.{name})",
            f"autoscaling.{name} applies to serving.mode disaggregated; this model is unified: remove it",
            lambda s, name=name: s.serving.mode == "disaggregated" or getattr(s.autoscaling, name) is None,
        )
        for name in ("prefill", "prefillDecodeRatio")
    ),
    # Above autoscaling.max, spec.replicas would not run as written (every provider stays within it):
    # refused, through the scale subresource too (`kubectl scale`): the API server validates the object the
    # new replicas make against the CRD's schema and rules (apiextensions-apiserver
    # pkg/registry/customresource/etcd.go, ScaleREST.Update: the store's Update with the resource's strategy)
    Rule(
        "!self.autoscaling.enabled || !has(self.replicas) || self.replicas <= self.autoscaling.max",
        "spec.replicas must not exceed autoscaling.max: the autoscaler runs at most autoscaling.max pods of "
        "the scaled role; raise autoscaling.max, or set spec.replicas within autoscaling.min and max",
        lambda s: not s.autoscaling.enabled or s.replicas is None or s.replicas <= s.autoscaling.max,
        lambda s: (
            f"spec.replicas {s.replicas} is above autoscaling.max {s.autoscaling.max}"
            f"{'' if 'max' in s.autoscaling.model_fields_set else ' (the default, not set)'}: the "
            f"autoscaler runs at most {s.autoscaling.max} pods of the scaled role; raise autoscaling.max, or "
            f"set spec.replicas within autoscaling.min {s.autoscaling.min} and max {s.autoscaling.max}"
        ),
        "'spec.replicas ' + string(self.replicas) + ' is above autoscaling.max ' + "
        "string(self.autoscaling.max) + ': the autoscaler runs at most ' + string(self.autoscaling.max) + "
        "' pods of the scaled role; raise autoscaling.max, or set spec.replicas within autoscaling.min ' + "
        "string(self.autoscaling.min) + ' and max ' + string(self.autoscaling.max)",
    ),
    Rule(  # (likewise the scaled role's own count, where spec.replicas is unset: the autoscaler starts there)
        f"!self.autoscaling.enabled || has(self.replicas) || ({DISAGGREGATED_CEL} ? "
        "(!has(self.serving.decode) || self.serving.decode.replicas <= self.autoscaling.max) : "
        "self.serving.unified.replicas <= self.autoscaling.max)",
        "serving.unified.replicas (serving.decode.replicas when disaggregated) must not exceed "
        "autoscaling.max: the autoscaler runs at most autoscaling.max pods of the scaled role; raise "
        "autoscaling.max, or lower the replicas",
        lambda s: (
            not s.autoscaling.enabled
            or s.replicas is not None
            or _scaled_role_replicas(s)[1] <= s.autoscaling.max
        ),
        lambda s: (
            f"serving.{_scaled_role_replicas(s)[0]}.replicas {_scaled_role_replicas(s)[1]} is above "
            f"autoscaling.max {s.autoscaling.max}: the autoscaler runs at most {s.autoscaling.max} pods of "
            "the scaled role; raise autoscaling.max, or lower the replicas"
        ),
        f"'serving.' + ({DISAGGREGATED_CEL} ? 'decode' : 'unified') + '.replicas ' + string("
        f"{DISAGGREGATED_CEL} ? self.serving.decode.replicas : self.serving.unified.replicas) + ' is above "
        "autoscaling.max ' + string(self.autoscaling.max) + ': the autoscaler runs at most ' + "
        "string(self.autoscaling.max) + ' pods of the scaled role; raise autoscaling.max, or lower the "
        "replicas'",
    ),
    Rule(
        "!self.autoscaling.enabled || self.autoscaling.provider != 'hpa' || has(self.replicas)",
        "autoscaling.provider hpa scales spec.replicas through the NeuronModel's scale subresource, and a "
        "HorizontalPodAutoscaler does nothing while it reads 0 replicas: set spec.replicas (the starting "
        "count, between autoscaling.min and autoscaling.max)",
        lambda s: not s.autoscaling.enabled or s.autoscaling.provider != "hpa" or s.replicas is not None,
        lambda s: (
            "autoscaling.provider hpa scales spec.replicas through the NeuronModel's scale subresource, "
            "and a HorizontalPodAutoscaler does nothing while it reads 0 replicas: set spec.replicas (the "
            f"starting count, {s.autoscaling.min} to {s.autoscaling.max})"
        ),
    ),
    Rule(
        "!self.autoscaling.enabled || self.autoscaling.provider != 'hpa' || self.autoscaling.metric != "
        f"'ttft' || !{DISAGGREGATED_CEL}",
        "autoscaling.metric ttft with provider hpa needs serving.mode unified: a disaggregated model's TTFT "
        "is "
        "measured by its router, not by the decode pods a HorizontalPodAutoscaler averages over; use metric "
        "occupancy or queue, or provider keda or builtin",
        lambda s: (
            not (
                s.autoscaling.enabled
                and s.autoscaling.provider == "hpa"
                and s.autoscaling.metric == "ttft"
                and s.serving.mode == "disaggregated"
            )
        ),
    ),
)
class NeuronModelSpec(Spec):
    model: ModelSource = Field(description="The model to serve.")
    engine: Engine = Field(
        "embedded",
        description="embedded (neuronfleet's runtime: instanceType cpu, and trn2/trn3 over TorchNeuron, "
        "experimental, with neuron.compiledSteps neuron), "
        "or the vLLM, TGI or SGLang Neuron servers. Each engine's limits (the instance families it serves, "
        "the settings it has no flag for, its prompt limit and KV transport) are refused at apply, saying "
        "what would be right.",
    )
    image: str | None = Field(
        None,
        description="Container image override for the engine. Engine embedded: our runtime's unprivileged "
        "pods run it; another engine's pods run it as they run the pinned one (its own user, with the "
        "capabilities the engine's documentation adds), which the operator takes only where its chart "
        "allows it: security.allowPrivilegedImageOverride (docs/security.md).",
        pattern=NO_SPACE,
        max_length=1024,
    )
    replicas: int | None = Field(
        None,
        description="Replicas of the scaled role, the NeuronModel's scale subresource (kubectl scale, HPA, "
        "KEDA): unified pods, or decode pods with prefill following their ratio. Unset: serving.*.replicas. "
        "autoscaling.provider hpa needs it (refused at apply without it).",
        ge=0,
        le=1000,
    )
    neuron: NeuronSettings = Field(description="Target hardware and the shapes compiled for it.")
    compile: Compile = section(
        Compile,
        "The compile Job and its artifact cache. Engine sglang runs a Job only to fetch an s3:// model: for "
        "other models its Job's settings (all but cache) are refused at apply.",
    )
    serving: Serving = section(Serving, "Serving pods: unified or disaggregated, replicas per role.")
    autoscaling: Autoscaling = section(Autoscaling, "Replica autoscaling.")
    scheduling: Scheduling = section(Scheduling, "Placement of the serving pods.")

    @model_validator(mode="after")
    def _engine_defaults(self):
        """Defaults that depend on the engine (the CRD cannot say them: its defaults are per field): the KV
        transport and the prompt limit. Filled in, but still not set by the user (`model_fields_set`), so a
        refusal caused by one says it is a default, and `model_dump(exclude_unset=True)` re-derives it for
        another engine (the rules that read them are validated rules: validation.validate checks them)."""
        kv = self.serving.kvTransfer
        if kv.transport is None:
            kv.transport = default_transport(self.engine)
            kv.model_fields_set.discard("transport")
        n = self.neuron
        if n.maxInputLength is None:
            n.maxInputLength = default_max_input_length(self.engine, n.sequenceLength)
            n.model_fields_set.discard("maxInputLength")
        return self


# The model's own name: its children are named after it (names.py); the CRD's rule at the object's root, where
# Kubernetes' CEL sees metadata.name (and generateName) only; the Python twin is names.name_errors
MAX_MODEL_NAME = names.max_model_name()
NAME_RULE = Rule(
    f"self.metadata.name.matches('{names.RFC1035.pattern}') && size(self.metadata.name) <= {MAX_MODEL_NAME}",
    "metadata.name must be an RFC 1035 label (lower-case letters, digits and '-', starting with a letter, "
    f"ending with a letter or digit) of at most {MAX_MODEL_NAME} characters: it names the model's Service, "
    "and the longest name of its children (a disaggregated set's Deployments) must fit Kubernetes' 63",
    lambda name: not names.name_errors(name),
    lambda name: names.name_errors(name)[0],
    f"'metadata.name ' + self.metadata.name + (size(self.metadata.name) > {MAX_MODEL_NAME} ? ' has ' + "
    f"string(size(self.metadata.name)) + ' characters; at most {MAX_MODEL_NAME} fit: the longest name of its "
    "children (the Deployments of a disaggregated set) must fit the 63 characters Kubernetes allows' : ' "
    "must "
    "be an RFC 1035 label (lower-case letters, digits and -, starting with a letter, ending with a letter or "
    "digit): it names the Service of the model')",
)


# ---- status ----------------------------------------------------------------------------------------------

Phase = Literal["Pending", "Compiling", "Deploying", "Rolling", "Ready", "Degraded", "Failed"]
ConditionType = Literal[
    "Validated", "Compiled", "Ready", "Progressing", "Degraded", "AutoscalingActive", "Conflict"
]


class Condition(BaseModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase reason.")
    message: str = ""
    lastTransitionTime: str = Field(description="RFC 3339 time of the last status change.")
    observedGeneration: int | None = None


class Artifacts(BaseModel):
    path: str | None = Field(
        None, description="artifacts/<hash>/ in the model's own folder of the compile cache, models/NAME/."
    )
    bytes: int | None = None
    compiledAt: str | None = None
    cacheHit: bool | None = Field(None, description="True when the artifacts existed already.")


class RoleReplicas(BaseModel):
    desired: int = 0
    ready: int = 0
    reached: int = Field(
        0,
        description="Most pods ready at once since this role's set went live (at most desired): Degraded "
        "while fewer are ready.",
    )


class LastScale(BaseModel):
    from_: dict[str, int] = Field(alias="from", description="Replicas per role before the decision.")
    to: dict[str, int] = Field(description="Replicas per role the decision set.")
    reason: str = Field(description="Why, per role.")
    at: str = Field(description="When (RFC 3339).")
    signals: dict[str, Any] = Field(
        default_factory=dict,
        description="Per role, the signal values the decision used (load, per replica, target, pods).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class AutoscalingStatus(BaseModel):
    """Provider builtin: what the operator's autoscaler decided (it is the only writer of these)."""

    desired: dict[str, int] | None = Field(None, description="Replicas per role the autoscaler set.")
    lastScale: LastScale | None = Field(None, description="The last decision that changed the replicas.")
    lastDecision: LastScale | None = Field(None, description="Dry run: the last change it would have made.")
    stuck: dict[str, int] | None = Field(None, description="Per role, pods Pending past the deadline.")
    coldStartSeconds: float | None = Field(
        None,
        description="The last measured cold start: seconds from a scale-up decision to the first new pod "
        "ready (how early a rising load scales up).",
    )
    coldStartAt: str | None = Field(None, description="When that pod became ready (RFC 3339).")
    specReplicas: int | None = Field(
        None,
        description="spec.replicas as the operator last saw them (unset: 0): a change by someone else is "
        "adopted or refused as autoscaling.onManualChange says.",
    )


class CompileProgressStatus(BaseModel):
    """A running compile's progress, as its pod's log last said (contract.CompileProgress)."""

    phase: str = Field(description="download, convert, compile or validate.")
    bytesDone: int | None = Field(None, description="Bytes the phase has done.")
    bytesTotal: int | None = Field(None, description="Bytes the phase does in all, where known.")
    filesDone: int | None = Field(None, description="Files the phase has done.")
    filesTotal: int | None = Field(None, description="Files the phase does in all, where known.")
    startedAt: str | None = Field(None, description="When the compile pod's container started (RFC 3339).")
    elapsed: float | None = Field(None, description="Seconds since the compile started, when last read.")
    text: str = Field(description="For people, e.g. download 35% 1.2/3.4GB 42s (the Progress column).")
    updatedAt: str = Field(description="When the operator last wrote it (RFC 3339): at most every 15 s.")


class NeuronModelStatus(BaseModel):
    phase: Phase | None = None
    observedGeneration: int | None = None
    compileHash: str | None = None
    artifacts: Artifacts | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: dict[str, RoleReplicas] = Field(default_factory=dict, description="Per role: desired, ready.")
    readyReplicas: str | None = Field(
        None,
        description="Ready/desired pods that serve the model (routers not counted), e.g. 2/2 (for kubectl).",
    )
    endpoint: str | None = Field(None, description="In-cluster URL of the model's OpenAI/TGI endpoint.")
    drainUntil: str | None = Field(
        None,
        description="Until when the pods of a set the Service left finish their requests (RFC 3339); "
        "its other objects are deleted after.",
    )
    compileRetryAt: str | None = Field(
        None,
        description="When a compile that failed because its model source could not be read is tried again "
        "(RFC 3339): 30 s after the failure, doubling each time in a row, at most 10 minutes.",
    )
    scaleReplicas: int | None = Field(
        None,
        description="Pods the scaled role (unified, or decode) runs: the scale subresource's "
        "status.replicas.",
    )
    selector: str | None = Field(
        None, description="Label selector of the scaled role's pods: the scale subresource's status.selector."
    )
    sourceFingerprint: str | None = Field(
        None,
        description="What the model source of a failed compile was when last checked (a changed one "
        "compiles again).",
    )
    sourceCheckAt: str | None = Field(
        None, description="When the model source of a failed compile is checked again (RFC 3339)."
    )
    servingSpec: dict[str, Any] | None = Field(
        None,
        description="The model, engine, image and neuron sections of the spec compiled as compileHash: the "
        "serving pods are built from them until the next compile has finished, so a change that needs a "
        "compile rolls once, after it.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    autoscaling: AutoscalingStatus | None = Field(None, description="Provider builtin: its decisions.")
    compileProgress: CompileProgressStatus | None = Field(
        None, description="While the compile Job runs: its progress, read from its pod's log (then cleared)."
    )


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
    {"name": "Instance", "type": "string", "jsonPath": ".spec.neuron.instanceType"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.neuron.tensorParallel"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.readyReplicas"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.compileProgress.text"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
