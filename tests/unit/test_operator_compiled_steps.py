"""neuron.compiledSteps through the operator: refused where it cannot work, each refusal saying what would be
right; accepted with a small table, its graph count checked against the contract's one table; it reaches the
compile Job's compile.json and every pod of our runtime that loads the model (not the front door), and is
part of the compile hash only when set. neuron (engine embedded on trn2 and trn3 over TorchNeuron) is
accepted as experimental, said so, and renders the runtime-neuron image on Neuron nodes."""

from __future__ import annotations

import pytest
import yaml
from support import ROOT, run_neuronfleet

from neuronfleet.contract import MAX_COMPILED_GRAPHS, NEURON_TARGET_ENV, CompileConfig
from neuronfleet.operator import builders, engines
from neuronfleet.operator.builders import Owner
from neuronfleet.operator.spec import NeuronModelSpec
from neuronfleet.operator.status import compute_status, transitions
from neuronfleet.operator.validation import validate

SMALL = {"context": [128, 1024], "generation": [512, 2048]}
# 8 batch sizes x (5 decode lengths + 29 prompt and context pairs)
MANY = {"context": [16, 32, 64, 128, 256, 512, 1024], "generation": [128, 256, 512, 1024, 2048]}


def spec_of(**neuron) -> NeuronModelSpec:
    settings = {"instanceType": "cpu", "compiledSteps": "inductor", "batchSize": 4, "sequenceLength": 2048,
                "maxInputLength": 1024, "buckets": SMALL, **neuron}  # fmt: skip
    return NeuronModelSpec.model_validate(
        {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "neuron": settings}
    )


def test_a_small_table_on_cpu_is_accepted():
    assert validate(spec_of()).errors == []


@pytest.mark.parametrize(
    ("neuron", "says"),
    [
        ({"quantization": "int8"}, "takes float weights; quantization int8 runs on torch's CPU kernels only"),
        ({"buckets": {}}, "give neuron.buckets.context and neuron.buckets.generation"),
        ({"buckets": {"context": [128], "generation": [512]}}, "must end at neuron.sequenceLength (2048)"),
        (
            {"batchSize": 128, "buckets": MANY},
            f"make 272 graphs, more than {MAX_COMPILED_GRAPHS}: give fewer",
        ),
    ],
)
def test_settings_it_cannot_compile_are_refused_saying_what_to_change(neuron, says):
    errors = validate(spec_of(**neuron)).errors
    assert any(says in e for e in errors), errors


def test_another_engine_or_a_neuron_instance_type_is_refused():
    spec = NeuronModelSpec.model_validate({
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "engine": "vllm",
        "neuron": {"instanceType": "trn2.48xlarge", "compiledSteps": "inductor"},
    })  # fmt: skip
    errors = validate(spec).errors
    assert any(
        "takes engine embedded on instanceType cpu, not engine vllm on trn2.48xlarge" in e for e in errors
    )


def test_it_reaches_compile_json_and_the_pods_and_the_hash_only_when_set():
    on, off = spec_of(), spec_of(compiledSteps="off")
    chash = builders.compile_hash(on)
    assert chash != builders.compile_hash(off)
    assert (
        CompileConfig.model_validate_json(builders.compile_config(on, chash).to_json()).compiledSteps
        == "inductor"
    )
    assert builders.compile_config(off, "h").compiledSteps == "off"
    unified = engines.serve_config(on, "unified", chash, model="m", namespace="ns")
    assert (
        "--compiled-steps" in (args := unified.to_args())
        and args[args.index("--compiled-steps") + 1] == "inductor"
    )
    door = engines.serve_config(on, "router", chash, model="m", namespace="ns")
    assert "--compiled-steps" not in door.to_args()
    assert (
        "--compiled-steps"
        not in engines.serve_config(off, "unified", chash, model="m", namespace="ns").to_args()
    )
    # a spec that never names it keeps its hash (compiledSteps off is the default)
    plain = NeuronModelSpec.model_validate({"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
                                            "neuron": {"instanceType": "cpu", "batchSize": 4,
                                                       "sequenceLength": 2048, "maxInputLength": 1024,
                                                       "buckets": SMALL}})  # fmt: skip
    assert builders.compile_hash(plain) == builders.compile_hash(off)


# ---- neuron: engine embedded on trn2 and trn3 over TorchNeuron (experimental) ------------------------------

TRN2 = ROOT / "crds" / "samples" / "smollm2-1.7b-embedded-trn2.yaml"


def trn2_spec(**neuron) -> NeuronModelSpec:
    obj = yaml.safe_load(TRN2.read_text())
    obj["spec"]["neuron"].update(neuron)
    return NeuronModelSpec.model_validate(obj["spec"])


def test_torchneuron_on_trn2_is_accepted_as_experimental_said_in_validated_and_by_validate():
    """The sample validates; the Validated condition's reason is Experimental (with a Normal Event once),
    and `neuronfleet validate` says so and how many graphs its compile Job warms."""
    spec = trn2_spec()
    report = validate(spec)
    assert report.errors == []
    reason, message = engines.notice(spec)
    assert reason == "Experimental" and "has not run on a device" in message
    assert any("compiles 18 graphs on a node of the instance type" in n for n in report.notes)
    status = compute_status(
        old={}, generation=1, errors=[], compile_hash="h", serving_hash=None, job=("running", ""),
        roles={"unified": (1, 0)}, notice=(reason, message), endpoint=None, at="2026-12-07T00:00:00Z",
    )  # fmt: skip
    validated = next(c for c in status["conditions"] if c["type"] == "Validated")
    assert (validated["status"], validated["reason"], validated["message"]) == ("True", reason, message)
    assert ("Normal", "Experimental", message) in transitions({}, status)
    run = run_neuronfleet("validate", "--offline", str(TRN2))
    assert run.returncode == 0 and "note: Experimental: engine embedded on trn2.48xlarge" in run.stdout


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (  # the TorchNeuron path on another family, and Inductor's on trn2
            {"instanceType": "inf2.48xlarge"},
            "engine embedded has no Neuron backend for inf2.48xlarge",
        ),
        (
            {"compiledSteps": "inductor"},
            "takes engine embedded on instanceType cpu, not engine embedded on trn2",
        ),
        ({"compiledSteps": "off"}, "serves unified only: set neuron.compiledSteps neuron"),
        ({"quantization": "int8"}, "takes float weights; quantization int8"),
        ({"buckets": {}}, "give neuron.buckets.context and neuron.buckets.generation"),
    ],
)
def test_torchneuron_settings_it_cannot_serve_are_refused_saying_what_to_change(change, says):
    errors = validate(trn2_spec(**change)).errors
    assert any(says in e for e in errors), errors


def test_torchneuron_at_tensor_parallel_4_runs_a_rank_per_core_in_the_pods_and_the_compile_job():
    """tensorParallel 4 is accepted as experimental, said so; the pods ask for 4 NeuronCores and serve with
    `--tensor-parallel 4` (a rank on each), and the compile Job, which warms with as many ranks, holds 4."""
    spec = trn2_spec(tensorParallel=4)
    assert validate(spec).errors == []
    reason, message = engines.notice(spec)
    assert reason == "Experimental" and "a rank per NeuronCore at tensorParallel 4" in message
    objs = builders.build_all(Owner("m", "inference", "uid"), spec, serving_hash=builders.compile_hash(spec))
    job = next(o for o in objs if o["kind"] == "Job" and "compile" in o["metadata"]["name"])
    (compile_c,) = job["spec"]["template"]["spec"]["containers"]
    assert compile_c["resources"]["limits"]["aws.amazon.com/neuroncore"] == "4"
    (dep,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"][
        "neuronfleet.dev/role"] == "unified"]  # fmt: skip
    serve_c = dep["spec"]["template"]["spec"]["containers"][0]
    assert serve_c["resources"]["limits"]["aws.amazon.com/neuroncore"] == "4"
    args = serve_c["command"]
    assert args[args.index("--tensor-parallel") + 1] == "4"
    assert args[args.index("--compiled-steps") + 1] == "neuron"


def test_torchneuron_on_cpu_or_with_another_engine_is_refused():
    assert any("set it to inductor or off" in e for e in validate(spec_of(compiledSteps="neuron")).errors)
    spec = NeuronModelSpec.model_validate({
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "engine": "vllm",
        "neuron": {"instanceType": "trn2.48xlarge", "compiledSteps": "neuron"},
    })  # fmt: skip
    errors = validate(spec).errors
    assert any("takes engine embedded on trn2 or trn3, not engine vllm on trn2.48xlarge" in e for e in errors)


def test_torchneuron_renders_the_neuron_image_a_compile_job_on_the_device_and_pods_told_their_family():
    """The compile Job runs the runtime-neuron image on a trn2 node with the core it serves on (TorchNeuron
    documents no compile-only mode) and writes compile.json with compiledSteps neuron; the serving pods run
    the same image on a core each, with `--compiled-steps neuron`; both are told the instance family (part
    of the NEFFs' key). kubernetes-validate checks these objects for every sample
    (test_operator_builders.py)."""
    spec = trn2_spec()
    chash = builders.compile_hash(spec)
    objs = builders.build_all(Owner("smollm2-1-7b-trn2", "inference", "uid"), spec, serving_hash=chash)
    job = next(o for o in objs if o["kind"] == "Job" and "compile" in o["metadata"]["name"])
    pod = job["spec"]["template"]["spec"]
    (compile_c,) = pod["containers"]
    assert compile_c["image"] == engines.OWN_IMAGES["neuron"]
    assert {"name": NEURON_TARGET_ENV, "value": "trn2"} in compile_c["env"]
    assert compile_c["resources"]["limits"]["aws.amazon.com/neuroncore"] == "1"
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn2.48xlarge"
    compiled = CompileConfig.model_validate_json(builders.compile_config(spec, chash).to_json())
    assert (compiled.compiledSteps, compiled.instanceType, compiled.dtype) == ("neuron", "trn2.48xlarge",
                                                                              "bfloat16")  # fmt: skip
    (dep,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"][
        "neuronfleet.dev/role"] == "unified"]  # fmt: skip
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == engines.OWN_IMAGES["neuron"]
    assert c["command"][c["command"].index("--compiled-steps") + 1] == "neuron"
    assert {"name": NEURON_TARGET_ENV, "value": "trn2"} in c["env"]
    assert c["resources"]["limits"]["aws.amazon.com/neuroncore"] == "1"
    assert c["securityContext"]["runAsNonRoot"] is True  # our image: unprivileged, as on cpu
