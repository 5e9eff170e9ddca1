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
    Case("embedded-on-neuron", INF2, spec(engine="embedded"), "has no Neuron backend yet"),
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
    Case("efa-devices-unified", CPU, kv(efaInterfaces=2), "EFA devices are requested for prefill and decode"),
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
    Case("cache-both", CPU, section("compile", cache={"claimName": "c", "storageClassName": "gp3"}),
         "name an existing claimName or a storageClassName"),
    Case("autoscaling-bounds", CPU, section("autoscaling", min=5, max=2), "must not exceed autoscaling.max"),
    Case("var-ref", CPU, lambda o: o["spec"]["model"].update(uri="file:///m/$(HF_TOKEN)"),
         "must not contain $("),
]  # fmt: skip
