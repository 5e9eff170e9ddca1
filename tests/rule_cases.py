"""NeuronModels that break one rule of the spec each (and some that keep them): the table the CRD's CEL rules
and their Python twins are held to agreeing on (tests/unit/test_cel_rules.py), and that kubectl applies to
the emulated API server (tests/e2e/test_cel_rules_apply.py). Each case: an id, the sample it edits, the edit
(on the whole object), and the words both the API server's refusal and the operator's carry (None: both
accept it)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from support import ROOT

SAMPLES = ROOT / "crds" / "samples"
CPU = "smollm2-135m-local-cpu.yaml"
CPU_PD = "smollm2-135m-local-cpu-disaggregated.yaml"
INF2 = "llama-3.1-8b-vllm-inf2.yaml"
TGI = "llama-3.2-3b-tgi-inf2.yaml"
TRN2 = "llama-3.3-70b-vllm-trn2.yaml"
TRN2_PD = "llama-3.3-70b-vllm-trn2-disaggregated.yaml"
SGLANG_PD = "gpt-oss-120b-sglang-trn3-disaggregated.yaml"
PD = {"mode": "disaggregated", "prefill": {}, "decode": {}}


def sample(name: str) -> dict[str, Any]:
    """The NeuronModel of a sample file (some hold other objects beside it)."""
    docs = yaml.safe_load_all((SAMPLES / name).read_text())
    return next(d for d in docs if d and d.get("kind") == "NeuronModel")


@dataclass(frozen=True)
class Case:
    id: str
    sample: str
    edit: Callable[[dict[str, Any]], Any]
    words: str | None  # in both refusals; None: accepted by both

    def manifest(self) -> dict[str, Any]:
        obj = copy.deepcopy(sample(self.sample))
        self.edit(obj)
        return obj


def spec(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["spec"].update(changes)


def section(name: str, **changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["spec"].setdefault(name, {}).update(changes)


def neuron(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(obj: dict[str, Any]) -> None:
        obj["spec"]["neuron"].update(changes)
        for key in [k for k, v in obj["spec"]["neuron"].items() if v is None]:
            del obj["spec"]["neuron"][key]  # (None: the field left out)

    return edit


def kv(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(obj: dict[str, Any]) -> None:
        transfer = obj["spec"].setdefault("serving", {}).setdefault("kvTransfer", {})
        transfer.update(changes)
        for key in [k for k, v in transfer.items() if v is None]:
            del transfer[key]

    return edit


def both(*edits: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: [e(obj) for e in edits]


def named(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["metadata"].update(name=name)


def tolerations(*items: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
    return section("scheduling", tolerations=list(items))


def model(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["spec"]["model"].update(changes)


def role(name: str, **changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["spec"]["serving"][name].update(changes)


def sampling(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: obj["spec"].setdefault("serving", {}).setdefault("sampling", {}).update(changes)


CASES = [
    # the rules of one section: neuron
    Case("cpu-tensor-parallel", CPU, neuron(tensorParallel=2), "needs Neuron cores"),
    Case("cpu-fp8", CPU, neuron(quantization="fp8"), "quantization fp8 is not available on"),
    Case("cpu-int8", CPU, neuron(quantization="int8"), None),
    Case("neuron-int4", INF2, neuron(quantization="int4"), "quantization int4 runs on the embedded engine's"),
    Case("lnc-inf2", INF2, neuron(logicalCores=2), "neuron.logicalCores applies to Trn2 and Trn3 instances"),
    Case("lnc-cpu", CPU, neuron(logicalCores=1), "neuron.logicalCores applies to Trn2 and Trn3 instances"),
    Case("lnc-trn2", TRN2, neuron(logicalCores=2), None),
    Case("tp-not-a-degree", INF2, neuron(tensorParallel=3), "choose one of 1, 2, 4, 8, 24"),
    Case("tp-past-the-cores", TGI, neuron(tensorParallel=8), "choose one of 1, 2"),
    Case("tp-lnc2-trn2", TRN2, neuron(tensorParallel=128), "choose one of 1, 2, 4, 8, 16, 32, 64"),
    Case("buckets-unsorted", CPU, neuron(buckets={"context": [256, 128]}),
         "neuron.buckets.context must be increasing without repeats"),
    Case("buckets-repeated", CPU, neuron(buckets={"generation": [256, 256, 512]}),
         "neuron.buckets.generation must be increasing without repeats"),
    Case("buckets-generation-past-length", CPU, neuron(buckets={"generation": [256, 1024]}),
         "neuron.buckets.generation must lie between 1 and neuron.sequenceLength"),
    # the rules over several sections
    Case("prompt-limit", INF2, neuron(maxInputLength=8192), "must be below neuron.sequenceLength 8192"),
    Case("prompt-limit-default", TGI, neuron(maxInputLength=None, sequenceLength=2048),
         "must be below neuron.sequenceLength 2048"),
    Case("prompt-limit-default-vllm", INF2, neuron(maxInputLength=None), None),
    Case("context-bucket-past-prompt", CPU, neuron(buckets={"context": [128, 512]}),
         "neuron.buckets.context must lie between 1 and"),
    Case("context-bucket-past-default-prompt", CPU, neuron(maxInputLength=None, sequenceLength=8192,
                                                           buckets={"context": [1024, 4096]}),
         "neuron.buckets.context must lie between 1 and"),
    Case("engine-on-cpu", CPU, spec(engine="vllm"), "needs Neuron devices"),
    Case("embedded-on-neuron", INF2, spec(engine="embedded"), "has no Neuron backend for inf2.48xlarge"),
    Case("embedded-on-trn2-needs-torchneuron", TRN2, spec(engine="embedded"),
         "is experimental (TorchNeuron, not yet run on a device) and serves unified only"),
    Case("role-tp", TRN2_PD, lambda o: o["spec"]["serving"]["prefill"].update(tensorParallel=3),
         "serving.prefill.tensorParallel 3"),
    Case("role-tp-decode", TRN2_PD, lambda o: o["spec"]["serving"]["decode"].update(tensorParallel=128),
         "serving.decode.tensorParallel 128"),
    Case("no-efa", INF2, spec(serving=dict(PD)), "inf2.48xlarge has no EFA"),
    Case("efa-count", TRN2_PD, kv(efaInterfaces=17), "exceeds the 16 EFA interfaces of trn2.48xlarge"),
    Case("efa-image", CPU_PD, kv(transport="efa", backend=None),
         "needs a runtime image with AWS's EFA userspace"),
    Case("efa-image-given", CPU_PD, both(kv(transport="efa", backend=None),
                                         spec(image="registry.example/runtime-efa:1")), None),
    Case("nixl-libfabric-image", CPU_PD, kv(backend="libfabric"), "needs a runtime image with AWS's EFA"),
    Case("nixl-for-sglang", SGLANG_PD, kv(transport="nixl"), "names the embedded engine's NIXL transport"),
    Case("tgi-disaggregated", TGI, spec(serving=dict(PD)), "engine tgi has no prefill/decode disaggregation"),
    Case("efa-devices-disaggregated-tcp", CPU_PD, kv(transport="tcp", backend=None, efaInterfaces=2),
         "EFA devices are requested for prefill and decode"),
    Case("efa-devices-unified", CPU, kv(efaInterfaces=2), None),  # (kept, unused: no KV moves)
    Case("backend-without-nixl", CPU_PD, kv(transport="tcp"),
         "a NIXL backend is chosen for kvTransfer.transport"),
    Case("tokenizer-for-vllm", INF2, lambda o: o["spec"]["model"].update(tokenizer="file:///tok"),
         "model.tokenizer is applied by the embedded engine's compile"),
    Case("prefill-bounds-unified", CPU, section("autoscaling", prefill={"min": 1, "max": 2}),
         "autoscaling.prefill applies to serving.mode disaggregated"),
    Case("ratio-unified", CPU, section("autoscaling", prefillDecodeRatio={"min": 1, "max": 2}),
         "autoscaling.prefillDecodeRatio applies to serving.mode disaggregated"),
    Case("hpa-without-replicas", CPU, section("autoscaling", enabled=True, provider="hpa"),
         "a HorizontalPodAutoscaler does nothing while it reads 0 replicas"),
    Case("hpa-with-replicas", CPU,
         both(spec(replicas=1), section("autoscaling", enabled=True, provider="hpa")), None),
    Case("hpa-ttft-disaggregated", CPU_PD, both(spec(replicas=1), section(
        "autoscaling", enabled=True, provider="hpa", metric="ttft", ttftSLOMilliseconds=900)),
         "autoscaling.metric ttft with provider hpa needs serving.mode unified"),
    # each engine's limits (operator/engines/limits.py): settings only some take, vllm's contract chosen by
    # the instance family (Inf2/Trn1: NxD Inference; Trn2/Trn3: the plugin)
    Case("expert-parallel-embedded", CPU, neuron(expertParallel=1),
         "neuron.expertParallel: engine embedded (neuronfleet's runtime) has no setting for expert "
         "parallelism"),
    Case("kv-cache-dtype-tgi", TGI, neuron(kvCacheDtype="fp8"),
         "neuron.kvCacheDtype: TGI's Neuron export (optimum-neuron) has no setting for a KV cache type"),
    Case("kv-cache-dtype-vllm-inf2", INF2, neuron(kvCacheDtype="fp8"),
         "neuron.kvCacheDtype: engine vllm on Inf2/Trn1 (NxD Inference) has no setting for a KV cache type"),
    Case("kv-cache-dtype-vllm-trn2", TRN2, neuron(kvCacheDtype="fp8", expertParallel=8), None),
    Case("memory-fraction-vllm-trn2", TRN2, neuron(memoryFraction=0.8),
         "neuron.memoryFraction: the vLLM Neuron plugin (engine vllm on Trn2/Trn3) has no setting for a "
         "device memory fraction; remove it, or use engine sglang on Trn3"),
    Case("host-kv-cache-vllm-trn2", TRN2, neuron(hostKVCache="2Gi"),
         "neuron.hostKVCache: the vLLM Neuron plugin (engine vllm on Trn2/Trn3) has no setting for our "
         "runtime's host KV store; remove it, or use engine embedded"),
    Case("host-kv-cache-embedded", CPU, neuron(hostKVCache="512Mi"), None),
    Case("role-tp-sglang", SGLANG_PD, role("prefill", tensorParallel=16),
         "serving.prefill.tensorParallel: SGLang-Neuron runs neuron.tensorParallel in every role"),
    Case("role-tp-embedded", CPU_PD, role("decode", tensorParallel=2),
         "serving.decode.tensorParallel: engine embedded (neuronfleet's runtime) runs neuron.tensorParallel"),
    Case("role-tp-same", SGLANG_PD, role("decode", tensorParallel=8), None),
    Case("sampling-vllm", INF2, sampling(temperature=0.5),
         "serving.sampling: the operator does not yet pass sampling defaults to engine vllm on Inf2/Trn1"),
    Case("connector-sglang", SGLANG_PD, kv(connector="NixlConnector"),
         "serving.kvTransfer.connector names vLLM's KV connector, which SGLang-Neuron has not"),
    Case("connector-vllm-trn2", TRN2_PD, kv(connector="NeuronNixlConnector"), None),
    Case("quantization-tgi", TGI, neuron(quantization="int8"),
         "neuron.quantization int8: TGI's Neuron export (optimum-neuron) has no setting for it; use none"),
    Case("buckets-sglang", SGLANG_PD, neuron(buckets={"context": [1024]}),
         "neuron.buckets: SGLang-Neuron compiles its own length buckets"),
    Case("lnc-sglang", SGLANG_PD, neuron(logicalCores=2),
         "neuron.logicalCores: SGLang-Neuron has no setting"),
    Case("prompt-limit-vllm", INF2, neuron(maxInputLength=4096),
         "neuron.maxInputLength 4096 must be neuron.sequenceLength - 1 (8191) for engine vllm"),
    Case("prompt-limit-sglang", SGLANG_PD, neuron(maxInputLength=4096),
         "neuron.maxInputLength 4096 must be neuron.sequenceLength - 1 (8191) for engine sglang"),
    Case("tgi-on-trn2", TGI, neuron(instanceType="trn2.48xlarge"),
         "engine tgi (TGI 3.3.5's Neuron backend) runs on Inferentia2 and Trainium1 instances"),
    Case("sglang-on-trn2", SGLANG_PD, neuron(instanceType="trn2.48xlarge"),
         "serves LLMs on Trn3 instances (trn3.48xlarge), not trn2.48xlarge"),
    Case("vllm-trn1-disaggregated", INF2, both(neuron(instanceType="trn1.32xlarge"), spec(serving=dict(PD))),
         "serving.mode disaggregated: engine vllm on Inf2 and Trn1"),
    Case("quantization-vllm-trn2", TRN2, neuron(quantization="int8"),
         "neuron.quantization int8 is NxD Inference's (engine vllm on Inf2/Trn1)"),
    Case("quantization-vllm-inf2", INF2, neuron(quantization="fp8"), None),
    Case("generation-buckets-vllm-trn2", TRN2, neuron(buckets={"generation": [1000, 16384]}),
         "each a multiple of 128 below neuron.sequenceLength (16384); [1000, 16384] are not"),
    Case("expert-parallel-vllm", TRN2, neuron(expertParallel=3),
         "neuron.expertParallel 3 must divide neuron.tensorParallel 64 (ep_degree divides the world size)"),
    Case("expert-parallel-sglang", SGLANG_PD, neuron(expertParallel=3),
         "neuron.expertParallel 3 must divide neuron.tensorParallel 8 (SGLang's --ep-size)"),
    Case("expert-parallel-prefill", TRN2_PD, neuron(expertParallel=32),
         "neuron.expertParallel 32 must divide serving.prefill.tensorParallel 16"),
    Case("expert-parallel-decode", TRN2_PD, both(neuron(expertParallel=16), role("decode", tensorParallel=8)),
         "neuron.expertParallel 16 must divide serving.decode.tensorParallel 8"),
    Case("transport-vllm-trn2", TRN2_PD, kv(transport="tcp", efaInterfaces=None),
         "kvTransfer.transport tcp: the vLLM Neuron plugin (engine vllm on Trn2/Trn3) moves the KV cache "
         "with NIXL over LIBFABRIC (EFA)"),
    Case("transport-sglang", SGLANG_PD, kv(transport="tcp", efaInterfaces=None),
         "kvTransfer.transport tcp: SGLang-Neuron moves the KV cache"),
    Case("efa-none-vllm-trn2", TRN2_PD, kv(efaInterfaces=0), "kvTransfer.efaInterfaces 0: NIXL's LIBFABRIC"),
    Case("dtype-tgi", TGI, neuron(dtype="float32"), "neuron.dtype float32: engine tgi casts to bfloat16"),
    Case("dtype-auto-tgi", TGI, neuron(dtype="auto"), None),
    Case("revision-tgi", TGI, model(uri="pvc://models/llama", revision="v1"),
         "model.revision applies to hf:// models only, not pvc://models/llama"),
    Case("model-type-tgi", TGI, model(uri="hf://MistralAI/mistral-7b-v0.1"),
         "model hf://MistralAI/mistral-7b-v0.1 is a mistral model, which optimum-neuron 0.3.0"),
    Case("model-type-tgi-gpt-oss", TGI, model(uri="hf://openai/gpt-oss-120b"), "is a gpt_oss model"),
    Case("model-type-tgi-pvc", TGI, model(uri="pvc://models/mistral-7b-v0.1"), None),
    # what the engines' tables say: the signals their pods export (TGI: no KV cache use, no TTFT), the
    # models an engine runs a compile Job for (SGLang: an s3:// model's fetch only), whether its buckets are
    # the limits (not the vLLM plugin's)
    Case("signal-ttft-tgi", TGI, section("autoscaling", enabled=True, metric="ttft", ttftSLOMilliseconds=500),
         "autoscaling.metric ttft: engine tgi's unified pods export no time-to-first-token histogram for "
         "provider builtin to read; use metric queue or occupancy"),
    Case("signal-occupancy-tgi-keda", TGI, both(spec(replicas=1), section(
        "autoscaling", enabled=True, provider="keda", prometheusAddress="http://prometheus:9090")),
         "autoscaling.metric occupancy: engine tgi's unified pods export no KV-cache-use metric for provider "
         "keda to read; use metric queue"),
    Case("signal-occupancy-tgi-builtin", TGI, section("autoscaling", enabled=True, metric="occupancy"), None),
    Case("signal-queue-tgi-hpa", TGI,
         both(spec(replicas=1), section("autoscaling", enabled=True, provider="hpa", metric="queue")), None),
    Case("signal-ttft-sglang-disaggregated", SGLANG_PD,
         section("autoscaling", enabled=True, metric="ttft", ttftSLOMilliseconds=500), None),
    Case("compile-resources-sglang", SGLANG_PD, section("compile", resources={"requests": {"cpu": "4"}}),
         "compile.resources: engine sglang runs no compile Job for this model (it compiles as each server "
         "starts; a Job only fetches a model from s3://); remove compile.resources"),
    Case("compile-node-selector-sglang", SGLANG_PD, section("compile", nodeSelector={"pool": "cpu"}),
         "compile.nodeSelector: engine sglang runs no compile Job for this model"),
    Case("compile-tolerations-sglang", SGLANG_PD,
         section("compile", tolerations=[{"key": "pool", "operator": "Exists"}]),
         "compile.tolerations: engine sglang runs no compile Job for this model"),
    Case("compile-image-sglang", SGLANG_PD, section("compile", image="registry.example/sglang:1"),
         "compile.image: engine sglang runs no compile Job for this model"),
    Case("compile-backoff-sglang", SGLANG_PD, section("compile", backoffLimit=5),
         "compile.backoffLimit: engine sglang runs no compile Job for this model"),
    Case("compile-deadline-sglang", SGLANG_PD, section("compile", activeDeadlineSeconds=600),
         "compile.activeDeadlineSeconds: engine sglang runs no compile Job for this model"),
    # stored before the deadline was derived, with the CRD's former default: as good as unset
    Case("compile-former-deadline-sglang", SGLANG_PD, section("compile", activeDeadlineSeconds=14400), None),
    Case("compile-timeout-sglang", SGLANG_PD, section("compile", timeoutSeconds=3600),
         "compile.timeoutSeconds: engine sglang runs no compile Job for this model"),
    Case("compile-deadline-below-timeout", TRN2,
         section("compile", timeoutSeconds=3600, activeDeadlineSeconds=1800),
         "compile.activeDeadlineSeconds must be at least compile.timeoutSeconds"),
    Case("compile-deadline-above-timeout", TRN2,
         section("compile", timeoutSeconds=3600, activeDeadlineSeconds=7200),
         None),
    Case("serving-start-timeout", TRN2_PD, section("serving", startTimeoutSeconds=7200), None),
    Case("compile-service-account-sglang", SGLANG_PD, section("compile", serviceAccountName="model-reader"),
         "compile.serviceAccountName: engine sglang runs no compile Job for this model"),
    Case("compile-default-sglang", SGLANG_PD, section("compile", backoffLimit=2, nodeSelector={}), None),
    Case("compile-service-account-sglang-s3", SGLANG_PD,
         both(model(uri="s3://models/gpt-oss-120b"), section("compile", serviceAccountName="model-reader")),
         None),
    Case("largest-context-bucket", CPU, neuron(buckets={"context": [128, 256]}),
         "the largest neuron.buckets.context bucket (256) must equal neuron.maxInputLength 384, or requests "
         "that the spec accepts would fit no bucket: end neuron.buckets.context with 384"),
    Case("largest-context-bucket-default", CPU,
         neuron(maxInputLength=None, sequenceLength=8192, buckets={"context": [1024, 2048]}),
         "must equal neuron.maxInputLength 3072 (the default of engine embedded, not set)"),
    Case("largest-generation-bucket-vllm-inf2", INF2, neuron(buckets={"generation": [1024, 4096]}),
         "the largest neuron.buckets.generation bucket (4096) must equal neuron.sequenceLength 8192"),
    Case("largest-buckets-equal-the-limits", CPU,
         neuron(buckets={"context": [128, 384], "generation": [512]}), None),
    Case("largest-bucket-vllm-trn2", TRN2, neuron(buckets={"context": [2048], "generation": [4096]}), None),
    # tolerations, item by item
    Case("toleration-key", CPU, tolerations({"key": "bad key", "operator": "Exists"}),
         "must be a qualified name"),
    Case("toleration-long-name", CPU, tolerations({"key": "k" * 64, "operator": "Exists"}),
         "must be a qualified name"),
    Case("toleration-prefix", CPU, tolerations({"key": "a_b/c", "operator": "Exists"}),
         "must be a qualified name"),
    Case("toleration-long-prefix", CPU, tolerations({"key": "p" * 254 + "/k", "operator": "Exists"}),
         "must be a qualified name"),
    Case("toleration-ok", CPU,
         tolerations({"key": "example.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                     {"key": "k" * 63, "value": "v", "effect": "NoExecute", "tolerationSeconds": 30}), None),
    Case("toleration-exists-value", CPU, tolerations({"key": "k", "operator": "Exists", "value": "v"}),
         "value must be empty with operator Exists"),
    Case("toleration-no-key", CPU, tolerations({"operator": "Equal", "value": "v"}),
         "a toleration without a key needs operator Exists"),
    Case("toleration-seconds", CPU, tolerations({"key": "k", "tolerationSeconds": 5}),
         "tolerationSeconds applies to effect NoExecute only"),
    # the model's name
    Case("name-not-a-label", CPU, named("9lives"), "must be an RFC 1035 label"),
    Case("name-too-long", CPU, named("m" * 45), "at most 44"),
    Case("name-longest", CPU, named("m" * 44), None),
    # rules that were the CRD's before (parsed sections)
    Case("serving-mode", CPU, spec(serving={"mode": "disaggregated"}),
         "mode disaggregated needs serving.prefill and serving.decode"),
    # switching back to unified is one field: the prefill and decode sections left are unused, not refused
    Case("unified-with-unused-roles", CPU_PD, lambda o: o["spec"]["serving"].update(mode="unified"), None),
    Case("unified-with-unused-kv-backend", CPU_PD, both(lambda o: o["spec"]["serving"].update(mode="unified"),
                                                        kv(transport="tcp")), None),
    Case("unified-with-unused-role-tp", CPU_PD,
         lambda o: (o["spec"]["serving"].update(mode="unified"),
                    o["spec"]["serving"]["prefill"].update(tensorParallel=2)), None),
    Case("cache-both", CPU, section("compile", cache={"claimName": "c", "storageClassName": "gp3"}),
         "name an existing claimName or a storageClassName"),
    Case("autoscaling-bounds", CPU, section("autoscaling", min=5, max=2), "must not exceed autoscaling.max"),
    # spec.replicas above autoscaling.max would not run as written: refused, never clamped
    # engine embedded on a Neuron instance type: the engines that serve there, and the field only it takes
    Case("embedded-on-inf2-with-sampling", CPU, neuron(instanceType="inf2.48xlarge"),
         "use engine vllm or tgi"),
    Case("embedded-on-inf2-names-sampling", CPU, neuron(instanceType="inf2.48xlarge"),
         "serving.sampling (only engine embedded takes it)"),
    Case("embedded-on-inf2-disaggregated", CPU_PD, neuron(instanceType="inf2.48xlarge"),
         "no engine serves serving.mode disaggregated"),
    Case("replicas-above-max", CPU, both(spec(replicas=5), section("autoscaling", enabled=True, max=3)),
         "spec.replicas 5 is above autoscaling.max 3"),
    Case("replicas-at-max", CPU, both(spec(replicas=3), section("autoscaling", enabled=True, max=3)), None),
    Case("unified-replicas-above-max", CPU,
         both(lambda o: o["spec"]["serving"]["unified"].update(replicas=4),
              section("autoscaling", enabled=True, max=3)),
         "serving.unified.replicas 4 is above autoscaling.max 3"),
    Case("decode-replicas-above-max", CPU_PD,
         both(lambda o: o["spec"]["serving"]["decode"].update(replicas=4),
              section("autoscaling", enabled=True, max=3)),
         "serving.decode.replicas 4 is above autoscaling.max 3"),
    Case("replicas-above-max-off", CPU, both(spec(replicas=5), section("autoscaling", enabled=False, max=3)),
         None),
    Case("var-ref", CPU, lambda o: o["spec"]["model"].update(uri="file:///m/$(HF_TOKEN)"),
         "must not contain $("),
]  # fmt: skip
