"""TGI's Neuron backend: `text-generation-launcher --model-id <export>`, configured by HF_NUM_CORES,
HF_AUTO_CAST_TYPE and the MAX_* variables, which must match the compiled model; the compile is
optimum-neuron's export (`optimum-cli export neuron`), the format the backend loads.

Pinned: TGI 3.3.6, Neuron backend: backends/neuron/server/text_generation_server/tgi_env.py at tag v3.3.6 of
github.com/huggingface/text-generation-inference (HF_NUM_CORES, HF_AUTO_CAST_TYPE and the MAX_* variables;
`--model-id`). Its launcher has no served-model-name option.
"""

from __future__ import annotations

import shlex

from neuronfleet.contract import CONFIG_MOUNT

from ..spec import NeuronModelSpec
from .common import Container, artifacts_dir, compile_script, model_reference, refusals_of_nxdi_fields

IMAGE = "ghcr.io/huggingface/text-generation-inference:3.3.6-neuron"
AUTO_CAST_TYPES = {"bfloat16": "bf16", "float16": "fp16"}


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    n = spec.neuron
    env = {
        "HF_NUM_CORES": str(n.tensorParallel),
        "HF_AUTO_CAST_TYPE": AUTO_CAST_TYPES[n.dtype],
        "MAX_BATCH_SIZE": str(n.batchSize),
        "MAX_TOTAL_TOKENS": str(n.sequenceLength),
        "MAX_INPUT_TOKENS": str(n.maxInputLength),
        "MAX_BATCH_PREFILL_TOKENS": str(n.batchSize * n.maxInputLength),
        "PORT": str(port),
    }
    command = ["text-generation-launcher", "--model-id", f"{artifacts_dir(compile_hash)}/model"]
    return Container(IMAGE, command, env, read_only_root=False)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    n = spec.neuron
    step = (
        f"optimum-cli export neuron --model {shlex.quote(model_reference(spec))} "
        f"--batch_size {n.batchSize} --sequence_length {n.sequenceLength} --num_cores {n.tensorParallel} "
        f'--auto_cast_type {AUTO_CAST_TYPES[n.dtype]} "$OUT/model"'
    )
    return {"compile.sh": compile_script(spec, compile_hash, step)}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    return Container(IMAGE, ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], read_only_root=False)


def unsupported(spec: NeuronModelSpec) -> list[str]:
    use = "engine embedded or vllm"
    out = refusals_of_nxdi_fields(spec, "TGI's Neuron export (optimum-neuron)", use)
    if spec.model.revision:
        out.append(
            f"model.revision: neuronfleet passes no revision to TGI's Neuron export; remove it or use {use}"
        )
    return out
