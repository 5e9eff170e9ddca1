"""neuron.compiledSteps through the operator: refused where it cannot work, each refusal saying what would be
right; accepted with a small table, its graph count checked against the contract's one table; it reaches the
compile Job's compile.json and every pod of our runtime that loads the model (not the front door), and is
part of the compile hash only when set."""

from __future__ import annotations

import pytest

from neuronfleet.contract import MAX_COMPILED_GRAPHS, CompileConfig
from neuronfleet.operator import builders, engines
from neuronfleet.operator.spec import NeuronModelSpec
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
