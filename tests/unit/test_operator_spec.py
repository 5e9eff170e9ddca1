"""The NeuronModel resource: the generated CRD (in sync, structural, valid Kubernetes), the samples, and the
validation beyond the schema (topology, engines, buckets, memory fit) with its messages."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster.semantics import apply_defaults, schema_errors
from neuronfleet.operator import builders, crd, parallelism, spec, validation

SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
KUBERNETES_VERSION = "1.37.0"  # the pinned version manifests are validated against (kubernetes-validate)


def openapi_validate(instance, schema: dict) -> None:
    """JSON Schema draft 4 semantics, which OpenAPI v3.0 schemas (boolean exclusiveMinimum) follow."""
    jsonschema.Draft4Validator(schema).validate(instance)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_crds_folder_holds_exactly_what_the_models_generate():
    on_disk = (ROOT / "crds" / crd.CRD_FILE).read_text()
    assert on_disk == crd.render_crd(), "crds/ is stale: run `neuronfleet crd`"


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(crd.build_crd(), KUBERNETES_VERSION, strict=True)


def test_crd_schema_is_structural():
    """What the API server demands of a structural schema: a type on every node (or the preserve marker),
    no additionalProperties beside properties, defaults that their own node accepts."""

    def walk(node: dict, path: str) -> None:
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title"} & set(node), path
        if "default" in node:
            openapi_validate(node["default"], node)
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[{key}]")

    version = crd.build_crd()["spec"]["versions"][0]
    walk(version["schema"]["openAPIV3Schema"], "")
    assert version["subresources"] == {"status": {}, "scale": crd.SCALE_SUBRESOURCE}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Engine", "Instance", "TP", "Ready", "Progress", "Endpoint", "Age"
    ]  # fmt: skip


def test_crd_carries_each_models_rules_as_cel():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    serving_rules = schema["properties"]["serving"]["x-kubernetes-validations"]
    assert serving_rules[0]["rule"].startswith("self.mode == 'unified'")
    neuron_rules = [r["rule"] for r in schema["properties"]["neuron"]["x-kubernetes-validations"]]
    assert "self.instanceType != 'cpu' || self.tensorParallel == 1" in neuron_rules
    spec_rules = [r["rule"] for r in schema["x-kubernetes-validations"]]  # rules over several sections
    assert any(r.endswith("< self.neuron.sequenceLength") for r in spec_rules)
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert root["x-kubernetes-validations"] == [spec.NAME_RULE.validation()]  # the model's name


def test_generate_command_writes_the_same_file(tmp_path):
    subprocess.run([sys.executable, "-P", "-m", "neuronfleet.cli", "crd", "--out", str(tmp_path)], check=True)
    assert (tmp_path / crd.CRD_FILE).read_text() == (ROOT / "crds" / crd.CRD_FILE).read_text()


def test_samples_cover_engines_instances_and_modes():
    specs = [load(p)["spec"] for p in SAMPLES]
    assert {s["engine"] for s in specs} >= {"embedded", "vllm", "tgi", "sglang"}
    families = {s["neuron"]["instanceType"].split(".")[0] for s in specs}
    assert families >= {"inf2", "trn1", "trn2"}
    assert {s.get("serving", {}).get("mode", "unified") for s in specs} == {"unified", "disaggregated"}


def test_every_sample_names_its_own_model_and_the_local_ones_sample_greedily():
    """Applying one sample never reconfigures another's model (the autoscaled one was `smollm2` too), and
    every local sample answers a request that leaves sampling out greedily, as the docs' examples expect."""
    models = [(load(p)["metadata"].get("namespace", "default"), load(p)["metadata"]["name"]) for p in SAMPLES]
    assert len(set(models)) == len(models), sorted(models)
    local = [load(p) for p in SAMPLES if load(p)["spec"]["neuron"]["instanceType"] == "cpu"]
    assert len(local) >= 3
    assert all(m["spec"]["serving"].get("sampling") == {"temperature": 0} for m in local), [
        m["metadata"]["name"] for m in local
    ]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_are_accepted_by_the_schema_and_the_checks(path):
    obj = load(path)
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    openapi_validate(obj, schema)
    report = validation.check(obj)
    assert report.ok, report.errors
    assert report.fit is not None
    if obj["spec"]["neuron"]["instanceType"] == "cpu":  # local samples: host memory, nothing to fit
        assert not report.fit.checked and "cpu" in report.fit.reason
    else:
        assert report.fit.checked, report.fit


def base() -> dict:
    return load(ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml")


def edited(change) -> dict:
    obj = copy.deepcopy(base())
    change(obj["spec"])
    return obj


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(engine="llamacpp"), "spec.engine: must be one of"),
        (
            lambda s: s["neuron"].update(tensorParallel=0),
            "spec.neuron.tensorParallel: Input should be greater",
        ),
        (lambda s: s["neuron"].update(sequenceLengh=10), "spec.neuron.sequenceLengh: unknown field"),
        (
            lambda s: s["model"].update(uri="ftp://x/y"),
            "spec.model.uri: must be hf://org/name, s3://bucket/path, pvc://claim/path or file:///path",
        ),
        (
            lambda s: s["neuron"].update(maxInputLength=8192),
            "neuron.maxInputLength 8192 must be below neuron.sequenceLength 8192",
        ),
        (  # a refusal caused by a default names the default
            lambda s: (
                s.update(engine="tgi"),
                s["neuron"].pop("maxInputLength", None),
                s["neuron"].update(sequenceLength=2048),
            ),  # (tgi's default prompt limit is 3072; vLLM's and SGLang's sequenceLength - 1)
            "neuron.maxInputLength (default 3072, not set) must be below neuron.sequenceLength 2048 (room is "
            "needed to generate); set neuron.maxInputLength below 2048",
        ),
        (
            lambda s: s["serving"].update(mode="disaggregated"),
            "mode disaggregated needs serving.prefill and serving.decode",
        ),
        (
            lambda s: s["compile"]["cache"].update(claimName="x"),
            "name an existing claimName or a storageClassName",
        ),
        (lambda s: s.update(autoscaling={"min": 7}), "autoscaling.min must not exceed autoscaling.max"),
        (
            lambda s: s["neuron"].update(tensorParallel=3),
            "tensorParallel 3 is not a documented degree on inf2.48xlarge; choose one of 1, 2, 4, 8, 24",
        ),
        (
            lambda s: s["neuron"].update(instanceType="inf2.xlarge"),
            "tensorParallel 8 needs more cores than one inf2.xlarge has (2); choose one of 1, 2",
        ),
        (
            lambda s: s["neuron"].update(batchSize=512, sequenceLength=32768, maxInputLength=16384),
            "the model does not fit: it needs",
        ),
        (
            lambda s: s["neuron"].update(instanceType="cpu"),
            "tensorParallel 8 needs Neuron cores; on cpu use 1",
        ),
        (
            lambda s: s.update(engine="sglang"),
            "engine sglang (SGLang-Neuron 0.1.0) serves LLMs on Trn3 instances (trn3.48xlarge), not "
            "inf2.48xlarge; use one of those, or engine vllm on inf2.48xlarge",
        ),
        (
            lambda s: (s.update(engine="tgi"), s["neuron"].update(instanceType="trn2.48xlarge")),
            "engine tgi (TGI 3.3.5's Neuron backend) runs on Inferentia2 and Trainium1 instances ("
            "inf2.xlarge, inf2.8xlarge, inf2.24xlarge, inf2.48xlarge, trn1.2xlarge, trn1.32xlarge, "
            "trn1n.32xlarge), not trn2.48xlarge; use one of those, or engine vllm on trn2.48xlarge",
        ),
        (
            lambda s: s["neuron"].update(logicalCores=2),
            "neuron.logicalCores applies to Trn2 and Trn3 instances only, not inf2.48xlarge",
        ),
        (
            lambda s: s["neuron"].update(buckets={"context": [1024, 512]}),
            "neuron.buckets.context must be increasing",
        ),
        (
            lambda s: s["neuron"].update(buckets={"generation": [1024, 4096]}),
            "the largest neuron.buckets.generation bucket (4096) must equal neuron.sequenceLength 8192",
        ),
        (
            lambda s: s["serving"].update(mode="disaggregated", prefill={}, decode={}),
            "inf2.48xlarge has no EFA; use kvTransfer.transport tcp",
        ),
        (
            lambda s: s["neuron"].update(quantization="int4"),
            "quantization int4 runs on the embedded engine's CPU kernels only (instanceType cpu); on "
            "Neuron use none, int8 or fp8 (engine vllm)",
        ),
        (
            lambda s: (
                s.update(engine="embedded"),
                s["neuron"].update(instanceType="cpu", quantization="fp8"),
            ),
            "quantization fp8 is not available on cpu; use none, int8 or int4",
        ),
    ],
)
def test_bad_specs_are_refused_naming_what_is_wrong_and_what_would_fit(change, message):
    report = validation.check(edited(change))
    assert any(message in e for e in report.errors), report.errors


def test_neuron_devices_per_replica_follow_cores_per_device():
    """Inf2/Trn1 have 2 cores per device; Trn2 4 logical cores at LNC=2 (its default) and 8 at LNC=1."""
    cases = [("inf2.48xlarge", 8, None, 4), ("trn1.32xlarge", 32, None, 16), ("trn2.48xlarge", 64, None, 16)]
    cases += [("trn2.48xlarge", 8, 1, 1), ("trn1.2xlarge", 1, None, 1)]
    for instance, tp, lnc, devices in cases:
        obj = edited(
            lambda s, i=instance, t=tp, n=lnc: s["neuron"].update(
                instanceType=i, tensorParallel=t, logicalCores=n
            )
        )
        obj["spec"]["neuron"] = {k: v for k, v in obj["spec"]["neuron"].items() if v is not None}
        parsed, errors = validation.parse(obj)
        assert not errors
        assert parallelism.neuron_devices(parsed) == (devices, tp), instance


def test_an_unknown_model_is_not_checked_for_fit_and_says_how_to_check_it():
    report = validation.check(edited(lambda s: s["model"].update(uri="hf://someone/private-model")))
    assert report.ok
    assert not report.fit.checked and "give spec.model.shape" in report.fit.reason


def test_memory_estimate_counts_weights_and_kv_cache_per_core():
    obj = edited(lambda s: s["model"].update(uri="hf://meta-llama/Llama-3.1-8B-Instruct"))
    parsed, _ = validation.parse(obj)
    fit = validation.estimate_fit(parsed)
    # 8.03e9 params x 2 bytes / TP 8; KV: 2 x 32 layers x 1 kv head per core x 128 x 8192 x batch 8 x 2 bytes
    assert fit.weights_bytes_per_core == -(-8_030_261_248 * 2 // 8)
    assert fit.kv_bytes_per_core == 2 * 32 * 1 * 128 * 8192 * 8 * 2
    assert fit.available_bytes_per_core == int(16 * (1 << 30) * validation.USABLE_MEMORY)


def test_validate_command_exits_1_and_prints_every_refusal(tmp_path):
    bad = edited(lambda s: s["neuron"].update(tensorParallel=3, batchSize=0))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([edited(lambda s: s.update(autoscaling={"enabled": True})), bad]))
    run = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert f"ok      {path}#1 llama-3-1-8b" in run.stdout
    assert f"refused {path}#2 llama-3-1-8b" in run.stdout
    assert "spec.neuron.batchSize: Input should be greater than or equal to 1" in run.stdout
    assert "note:" not in run.stdout  # provider builtin is acted on: nothing to note
    ok = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "validate", *map(str, SAMPLES)], capture_output=True
    )
    assert ok.returncode == 0


def test_a_tokenizer_elsewhere_is_the_embedded_engines_and_changes_what_is_compiled():
    cpu = load(ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml")
    obj = copy.deepcopy(cpu)
    obj["spec"]["model"]["tokenizer"] = "pvc://models/tokenizers/llama-3"
    parsed, errors = validation.parse(obj)
    assert not errors and validation.validate(parsed).ok
    assert builders.compile_hash(parsed) != builders.compile_hash(validation.parse(cpu)[0])
    assert builders.compile_config(parsed, "h").model.tokenizer == "pvc://models/tokenizers/llama-3"
    vllm, _ = validation.parse(load(ROOT / "crds" / "samples" / "llama-3.3-70b-vllm-trn2.yaml"))
    vllm = vllm.model_copy(update={"model": vllm.model.model_copy(update={"tokenizer": "file:///tok"})})
    assert (
        "model.tokenizer is applied by the embedded engine's compile" in validation.validate(vllm).errors[0]
    )


def test_spec_defaults_fill_every_section():
    parsed = spec.NeuronModelSpec.model_validate(
        {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "neuron": {"instanceType": "cpu"}}
    )
    assert parsed.engine == "embedded" and parsed.serving.mode == "unified"
    assert parsed.serving.unified.replicas == 1 and parsed.compile.cache.accessModes == ["ReadWriteMany"]
    assert validation.validate(parsed).ok


# ---- what is not built is refused up front -----------------------------------------------------------------

CPU = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
CPU_DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
DISAGGREGATED = {"mode": "disaggregated", "prefill": {}, "decode": {}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (  # the engine the user named, on the sample's inf2.48xlarge (TGI serves there, SGLang-Neuron not)
            lambda s: s.update(engine="embedded"),
            "engine embedded has no Neuron backend for inf2.48xlarge (neuronfleet's runtime serves on cpu, "
            "and on trn2 and trn3 with TorchNeuron, experimental; its compile for inf2.48xlarge would fail); "
            "on inf2.48xlarge use engine vllm or tgi, or instanceType cpu for engine embedded",
        ),
        (  # the default engine says it is the default
            lambda s: s.pop("engine"),
            "engine embedded (the default, not set) has no Neuron backend for inf2.48xlarge",
        ),
        (  # what only our runtime reads (a tokenizer elsewhere, a prompt limit vLLM cannot enforce) does not
            # hide the engines that serve such a model there
            lambda s: (
                s.update(engine="embedded"),
                s["model"].update(tokenizer="pvc://models/tok"),
                s["neuron"].update(maxInputLength=6144),
            ),
            "on inf2.48xlarge use engine vllm or tgi, or instanceType cpu for engine embedded",
        ),
        (  # disaggregated on inf2: TGI has no prefill/decode split, vLLM none at its pin, SGLang not there
            lambda s: s.update(engine="embedded", serving=dict(DISAGGREGATED)),
            "no engine serves serving.mode disaggregated on inf2.48xlarge yet: change serving.mode, or use "
            "instanceType cpu for engine embedded",
        ),
        (  # disaggregated on trn3: the vLLM Neuron plugin and SGLang-Neuron
            lambda s: (
                s.update(engine="embedded", serving=dict(DISAGGREGATED)),
                s["neuron"].update(instanceType="trn3.48xlarge"),
            ),
            "on trn3.48xlarge use engine vllm or sglang, or instanceType cpu for engine embedded",
        ),
        (  # disaggregated on trn2: the vLLM Neuron plugin
            lambda s: (
                s.update(engine="embedded", serving=dict(DISAGGREGATED)),
                s["neuron"].update(instanceType="trn2.48xlarge"),
            ),
            "on trn2.48xlarge use engine vllm, or instanceType cpu for engine embedded",
        ),
        (
            lambda s: (s.update(engine="embedded"), s["neuron"].update(instanceType="trn1.32xlarge")),
            "compile for trn1.32xlarge would fail); on trn1.32xlarge use engine vllm",
        ),
        (  # on trn2: experimental, with the setting it needs named, and the engine that serves there
            lambda s: (s.update(engine="embedded"), s["neuron"].update(instanceType="trn2.48xlarge")),
            "engine embedded on trn2.48xlarge is experimental (TorchNeuron, not yet run on a device) and "
            "serves unified only: set neuron.compiledSteps neuron (the compile Job warms a graph per "
            "bucket); or on trn2.48xlarge use engine vllm",
        ),
    ],
)
def test_the_embedded_engine_on_neuron_is_refused_naming_what_runs_there(change, message):
    report = validation.check(edited(change))
    assert any(message in e for e in report.errors), report.errors


def test_a_local_sample_moved_to_neuron_is_told_the_engines_there_and_the_field_only_embedded_takes():
    """The cpu sample changed to inf2.48xlarge: vLLM and TGI serve a unified model there; what stands in
    their way is serving.sampling (only engine embedded takes it), and for vLLM the prompt limit, each named,
    by the operator and, for the field, by the API server at apply."""
    obj = load(CPU)
    obj["spec"]["neuron"]["instanceType"] = "inf2.48xlarge"
    (error,) = validation.check(obj).errors
    assert "on inf2.48xlarge use engine vllm or tgi, or instanceType cpu for engine embedded" in error
    assert (
        "; with engine vllm, remove serving.sampling (only engine embedded takes it) and remove "
        "neuron.maxInputLength (each engine has its own default); with engine tgi, remove serving.sampling "
        "(only engine embedded takes it)"
    ) in error
    assert "no engine serves" not in error
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (at_apply,) = schema_errors(apply_defaults(copy.deepcopy(obj), schema), schema)
    assert (
        "on inf2.48xlarge use engine vllm or tgi, without serving.sampling (only engine embedded takes it), "
        "or use instanceType cpu"
    ) in at_apply
    for engine in ("vllm", "tgi"):  # what it says works: the change named, and nothing else
        fixed = copy.deepcopy(obj)
        fixed["spec"]["engine"] = engine
        del fixed["spec"]["serving"]["sampling"]
        if engine == "vllm":
            del fixed["spec"]["neuron"]["maxInputLength"]
        assert validation.check(fixed).errors == [], engine
        assert schema_errors(apply_defaults(copy.deepcopy(fixed), schema), schema) == [], engine


def test_the_neuron_engines_the_refusal_names_are_the_engine_matrix():
    from neuronfleet.operator.engines import matrix

    for mode, families in spec.NEURON_ENGINES.items():
        for family, named in families.items():
            works = tuple(
                e
                for e in matrix.ENGINES
                if getattr(matrix.MATRIX[(e, family)], mode).startswith("works") and e != "embedded"
            )
            assert named == works, (mode, family)
    assert set(spec.NEURON_ENGINES["unified"]) == set(matrix.FAMILIES) - {"cpu"}
    assert {spec.instance_family(t) for t in spec.topology.INSTANCES} <= set(matrix.FAMILIES)


@pytest.mark.parametrize(
    ("kv", "image", "message"),
    [
        (  # EFA needs an image with AWS's EFA userspace: ours has NIXL, not EFA's libfabric
            {"transport": "efa"},
            None,
            "kvTransfer.transport efa (NIXL over LIBFABRIC on the pods' EFA devices) needs a runtime image "
            "with AWS's EFA userspace",
        ),
        (
            {"transport": "nixl", "backend": "libfabric"},
            None,
            "kvTransfer.transport nixl with backend libfabric (NIXL over LIBFABRIC on the pods' EFA devices)",
        ),
        (
            {"transport": "tcp", "backend": "ucx"},
            None,
            "serving.kvTransfer.backend ucx: a NIXL backend is chosen for kvTransfer.transport nixl only",
        ),
        (
            {"transport": "nixl", "efaInterfaces": 2},
            None,
            "serving.kvTransfer.efaInterfaces: EFA devices are requested for prefill and decode pods with "
            "kvTransfer.transport efa (or nixl with backend libfabric) only",
        ),
        ({"transport": "nixl"}, None, ""),  # UCX: any network, the runtime-cpu image
        ({"transport": "efa"}, "registry.example/neuronfleet-runtime-efa:1", ""),
    ],
)
def test_the_embedded_engine_moves_kv_over_nixl_and_over_efa_with_an_image_that_has_it(kv, image, message):
    obj = load(CPU_DISAGGREGATED)
    obj["spec"]["serving"]["kvTransfer"] = kv
    if image:
        obj["spec"]["image"] = image
    errors = validation.check(obj).errors
    assert any(message in e for e in errors) if message else errors == [], errors


def test_nixl_is_the_embedded_engines_name_for_its_transport_the_others_use_efa():
    spec = load(ROOT / "crds" / "samples" / "gpt-oss-120b-sglang-trn3-disaggregated.yaml")
    spec["spec"]["serving"]["kvTransfer"] = {"transport": "nixl"}
    wanted = (
        "engine sglang moves KV caches with its own NIXL connector over LIBFABRIC: use kvTransfer.transport"
    )
    assert any(wanted + " efa" in e for e in validation.check(spec).errors)


def test_the_kv_transport_defaults_to_tcp_for_embedded_and_efa_for_the_others():
    """A spec without kvTransfer.transport gets its engine's default, still counted as not set; the CRD has
    no default for it (the API server cannot make one field's default depend on another) and accepts a spec
    without it; a spec that names its engine's default gets the same serving set as one that leaves it out."""
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kv_schema = schema["properties"]["spec"]["properties"]["serving"]["properties"]["kvTransfer"]
    assert "default" not in kv_schema["properties"]["transport"]
    for path, default in (
        (CPU_DISAGGREGATED, "tcp"),
        (ROOT / "crds" / "samples" / "gpt-oss-120b-sglang-trn3-disaggregated.yaml", "efa"),
    ):
        named = load(path)
        left_out = copy.deepcopy(named)
        kv = left_out["spec"]["serving"]["kvTransfer"]
        kv.pop("transport")
        kv.pop("backend", None)  # (the disaggregated local sample names nixl with its backend)
        openapi_validate(left_out, schema)
        parsed, errors = validation.parse(left_out)
        assert not errors and validation.validate(parsed).ok, validation.validate(parsed).errors
        assert parsed.serving.kvTransfer.transport == default
        assert "transport" not in parsed.serving.kvTransfer.model_fields_set
        named["spec"]["serving"]["kvTransfer"] = {**kv, "transport": default}
        explicit = validation.parse(named)[0]
        chash = builders.compile_hash(explicit)
        assert builders.compile_hash(parsed) == chash
        assert builders.serving_set(parsed, chash) == builders.serving_set(explicit, chash)
    # vLLM's default is efa too (its NIXL/LIBFABRIC path), whether or not its disaggregation is accepted
    vllm = edited(lambda s: s.update(serving={"mode": "disaggregated", "prefill": {}, "decode": {}}))
    assert validation.parse(vllm)[0].serving.kvTransfer.transport == "efa"


def test_validate_command_refuses_the_embedded_engine_on_neuron(tmp_path):
    path = tmp_path / "embedded-inf2.yaml"
    path.write_text(yaml.safe_dump(edited(lambda s: s.update(engine="embedded"))))
    run = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "validate", str(path), str(CPU)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert f"refused {path}#1 llama-3-1-8b" in run.stdout and f"ok      {CPU}#1 smollm2" in run.stdout
    assert "on inf2.48xlarge use engine vllm or tgi, or instanceType cpu for engine embedded" in run.stdout


def test_every_sample_the_docs_name_exists():
    """The README and the chart's install notes name samples to apply: each is one of crds/samples/."""
    import re

    docs = [ROOT / "README.md", ROOT / "charts" / "neuronfleet" / "templates" / "NOTES.txt"]
    named = {m for doc in docs for m in re.findall(r"crds/samples/([\w.-]+\.yaml)", doc.read_text())}
    assert named and named <= {p.name for p in SAMPLES}, sorted(named - {p.name for p in SAMPLES})


@pytest.mark.parametrize(
    ("engine", "limit"), [("vllm", 8191), ("sglang", 8191), ("tgi", 3072), ("embedded", 3072)]
)
def test_the_prompt_limit_left_unset_is_the_engines_own_and_stays_unset(engine, limit):
    """vLLM and SGLang bound a prompt by the context length only, so their default is sequenceLength - 1;
    the others' is 3072. The CRD sets no default (an API server would otherwise fill in one that fits no
    engine of the other kind), and the filled-in value is still not the user's (a refusal names it a
    default; a dump re-derives it)."""
    from neuronfleet.operator.spec import NeuronModelSpec

    spec = NeuronModelSpec.model_validate(
        {"model": {"uri": "hf://org/model"}, "engine": engine,
         "neuron": {"instanceType": "cpu", "sequenceLength": 8192}}
    )  # fmt: skip
    assert spec.neuron.maxInputLength == limit
    assert "maxInputLength" not in spec.model_dump(exclude_unset=True)["neuron"]
    schema = yaml.safe_load((ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml").read_text())
    neuron = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "default" not in neuron["neuron"]["properties"]["maxInputLength"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_embedded_engine_on_cpu_takes_int8_and_int4_into_its_compile(kind):
    from neuronfleet.contract import CompileConfig
    from neuronfleet.operator import builders

    obj = load(ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml")
    obj["spec"]["neuron"]["quantization"] = kind
    parsed, errors = validation.parse(obj)
    assert not errors and validation.check(obj).ok, validation.check(obj).errors
    config = CompileConfig.model_validate_json(builders.compile_config(parsed, "h").to_json())
    assert config.quantization == kind


VAR_REF = "must not contain $(: the kubelet expands $(VAR)"
QUALIFIED = "must be a qualified name (an optional DNS-1123 subdomain prefix"
# Hostile NeuronModels: each refused by the operator (and `neuronfleet validate`) with a message naming the
# field, and, where the CRD can say it, by the API server at apply (the field it names there); a map's keys
# and a passed-through object's strings only the operator can check
HOSTILE = [
    (lambda s: s["model"].update(uri="hf://org/$(HF_TOKEN)"), f"spec.model.uri: {VAR_REF}", "spec.model.uri"),
    (lambda s: s["model"].update(revision="main$(HF_TOKEN)"), f"spec.model.revision: {VAR_REF}",
     "spec.model.revision"),
    (lambda s: s["model"].update(revision="main --trust-remote-code"),
     "spec.model.revision: must be one word", "spec.model.revision"),
    (lambda s: s["neuron"].update(overrides={"async_mode": {"path": "/x/$(HF_TOKEN)"}}),
     f"spec.neuron.overrides: neuron.overrides.async_mode.path {VAR_REF}", None),
    (lambda s: s["neuron"].update(overrides={"$(HF_TOKEN)": 1}),
     f"spec.neuron.overrides: neuron.overrides key '$(HF_TOKEN)' {VAR_REF}", None),
    (lambda s: s["model"].update(secretRef={"name": "hf-token", "key": "../token"}),
     "spec.model.secretRef.key: must be a key of a Secret's data", "spec.model.secretRef.key"),
    (lambda s: s["model"].update(secretRef={"name": "hf-token", "key": "k" * 254}),
     "spec.model.secretRef.key: String should have at most 253 characters", "spec.model.secretRef.key"),
    (lambda s: s["model"].update(secretRef={"name": "HF_Token"}),
     "spec.model.secretRef.name: must be a DNS-1123 subdomain", "spec.model.secretRef.name"),
    (lambda s: s.update(scheduling={"priorityClassName": "High Priority"}),
     "spec.scheduling.priorityClassName: must be a DNS-1123 subdomain", "spec.scheduling.priorityClassName"),
    (lambda s: s.update(scheduling={"schedulerName": "my_scheduler"}),
     "spec.scheduling.schedulerName: must be a DNS-1123 subdomain", "spec.scheduling.schedulerName"),
    (lambda s: s.update(scheduling={"nodeSelector": {"bad key!": "x"}}),
     f"spec.scheduling.nodeSelector key 'bad key!': {QUALIFIED}", None),
    (lambda s: s.update(scheduling={"nodeSelector": {"topology.kubernetes.io/zone": "us east"}}),
     "spec.scheduling.nodeSelector.topology.kubernetes.io/zone: must be a label value",
     "spec.scheduling.nodeSelector.topology.kubernetes.io/zone"),
    (lambda s: s["compile"].update(nodeSelector={"a/b/c": "x"}),
     f"spec.compile.nodeSelector key 'a/b/c': {QUALIFIED}", None),
    (lambda s: s["compile"].update(tolerations=[{"key": "gpu", "effect": "Sometimes"}]),
     "spec.compile.tolerations: [0].effect: Input should be 'NoSchedule'",
     "spec.compile.tolerations.0.effect"),
    (lambda s: s.update(scheduling={"tolerations": [{"key": "bad key", "operator": "Exists"}]}),
     f"spec.scheduling.tolerations: [0]: key {QUALIFIED}", "spec.scheduling.tolerations[0]"),
    (lambda s: s.update(scheduling={"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
     "spec.scheduling.tolerations: [0]: value must be empty with operator Exists",
     "spec.scheduling.tolerations[0]"),
    (lambda s: s["serving"]["unified"].update(resources={"requests": {"cpu": "lots"}}),
     "spec.serving.unified.resources.requests.cpu: must be a Kubernetes quantity",
     "spec.serving.unified.resources.requests.cpu"),
    (lambda s: s["serving"]["unified"].update(resources={"limits": {"nvidia gpu": "1"}}),
     f"spec.serving.unified.resources.limits key 'nvidia gpu': {QUALIFIED}", None),
    (lambda s: s["compile"]["cache"].update(storageClassName="Fast SSD"),
     "spec.compile.cache.storageClassName: must be a DNS-1123 subdomain",
     "spec.compile.cache.storageClassName"),
    (lambda s: s["compile"]["cache"].update(claimName="Shared_Claim"),
     "spec.compile.cache.claimName: must be a DNS-1123 label", "spec.compile.cache.claimName"),
    (lambda s: s.update(image="evil image:1"), "spec.image: must be one word, without spaces", "spec.image"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message", "at_apply"), HOSTILE, ids=[h[1][:60] for h in HOSTILE])
def test_hostile_models_are_refused_naming_the_field(change, message, at_apply):
    obj = edited(change)
    errors = validation.check(obj).errors
    assert any(message in e for e in errors), errors
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    # as the API server: its defaults, then the schema and its rules
    refused = schema_errors(apply_defaults(obj, schema), schema)
    if at_apply:
        assert any(e.startswith(f"{at_apply}: Invalid value") for e in refused), refused
    else:  # (the operator refuses it: Validated=False)
        assert not refused, refused


def test_an_image_for_an_engine_whose_pods_run_privileged_needs_the_operators_leave():
    """An image named for vLLM (or its compile) would run as vLLM's pods run, as the image's user with
    SYS_ADMIN and IPC_LOCK: refused unless the operator's administrator allows it (the chart's
    security.allowPrivilegedImageOverride); for our runtime's unprivileged pods no leave is needed."""
    obj = edited(lambda s: (s.update(image="registry.example/vllm:mine"),
                            s["compile"].update(image="registry.example/vllm:compiler")))  # fmt: skip
    refused = validation.check(obj, allow_privileged_image=False).errors
    for name, image in (("image", "registry.example/vllm:mine"),
                        ("compile.image", "registry.example/vllm:compiler")):  # fmt: skip
        assert any(
            e.startswith(f"{name} {image}: engine vllm's pods run their image as the user the image declares")
            and "with SYS_ADMIN and IPC_LOCK" in e
            and "security.allowPrivilegedImageOverride: true" in e
            for e in refused
        ), refused
    assert validation.check(obj, allow_privileged_image=True).ok
    cpu = load(ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml")
    cpu["spec"]["image"] = "registry.example/neuronfleet-runtime:mine"
    assert validation.check(cpu, allow_privileged_image=False).ok
    env = validation.PRIVILEGED_IMAGE_ENV
    assert validation.allows_privileged_image({env: "true"}) and not validation.allows_privileged_image({})
    with pytest.raises(ValueError, match=f"{env}='yes': must be true or false"):
        validation.allows_privileged_image({env: "yes"})
    run = subprocess.run([sys.executable, "-P", "-m", "neuronfleet.cli", "operator"], capture_output=True,
                         text=True, env={**os.environ, env: "yes"})  # fmt: skip
    assert run.returncode != 0 and f"{env}='yes': must be true or false" in run.stderr


def test_switching_back_to_unified_is_the_mode_alone():
    """A disaggregated model patched to mode unified, its prefill, decode and kvTransfer sections left (what
    `kubectl patch --type merge` of the mode alone leaves), is accepted at apply and by the operator, and
    serves exactly as the same model written unified from the start: one unified Deployment, the same
    compile."""
    switched = load(ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml")
    switched["spec"]["serving"]["mode"] = "unified"
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema_errors(apply_defaults(copy.deepcopy(switched), schema), schema) == []
    assert validation.check(switched).errors == []
    fresh = copy.deepcopy(switched)
    for unused in ("prefill", "decode", "kvTransfer"):
        del fresh["spec"]["serving"][unused]
    parsed, written = (validation.parse(o)[0] for o in (switched, fresh))
    assert parsed.serving.prefill is None and parsed.serving.decode is None
    owner = builders.Owner("smollm2", "default", "uid-1")
    chash = builders.compile_hash(parsed)
    assert chash == builders.compile_hash(written)
    objects = builders.build_all(owner, parsed, chash, internal_token="t")
    roles = sorted(
        o["metadata"]["labels"]["neuronfleet.dev/role"] for o in objects if o["kind"] == "Deployment"
    )
    assert "unified" in roles and not {"prefill", "decode"} & set(roles)
    assert objects == builders.build_all(owner, written, chash, internal_token="t")
