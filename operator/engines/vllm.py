"""vLLM with the Neuron plugin: `vllm serve` with the shapes in `--additional-config`, artifacts through
NEURON_COMPILED_ARTIFACTS, prefill/decode through `--kv-transfer-config` (NixlConnector).

Pinned: vLLM 0.11.0 in the image below; flags from https://docs.vllm.ai/en/v0.11.0/configuration/engine_args.html
(--tensor-parallel-size, --max-num-seqs, --max-model-len, --dtype, --served-model-name, --revision, --port,
--additional-config, --kv-transfer-config).
"""

from __future__ import annotations

import json

from neuronfleet.contract import CONFIG_MOUNT

from ..spec import NeuronModelSpec
from .common import Container, artifacts_dir, compile_script, model_reference, nxdi_neuron_config

IMAGE = "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:0.11.0-neuronx-py312-sdk2.27.1-ubuntu24.04"


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    n = spec.neuron
    command = ["vllm", "serve", model_reference(spec), "--host", "0.0.0.0", "--port", str(port)]
    command += ["--tensor-parallel-size", str(n.tensorParallel), "--max-num-seqs", str(n.batchSize)]
    command += ["--max-model-len", str(n.sequenceLength), "--dtype", n.dtype, "--device", "neuron"]
    if served_name:
        command += ["--served-model-name", served_name]
    command += ["--additional-config", json.dumps({"neuron_config": nxdi_neuron_config(spec)})]
    if spec.model.revision:
        command += ["--revision", spec.model.revision]
    if role in ("prefill", "decode"):
        producer = "kv_producer" if role == "prefill" else "kv_consumer"
        transfer = {"kv_connector": "NixlConnector", "kv_role": producer}
        command += ["--kv-transfer-config", json.dumps(transfer)]
    env = {"NEURON_COMPILED_ARTIFACTS": f"{artifacts_dir(compile_hash)}/model"}
    return Container(IMAGE, command, env, read_only_root=False)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """vLLM compiles into NEURON_COMPILED_ARTIFACTS when it loads the model."""
    n = spec.neuron
    script = (
        "from vllm import LLM\n\n"
        f"LLM(\n    model={model_reference(spec)!r},\n    tensor_parallel_size={n.tensorParallel},\n"
        f"    max_num_seqs={n.batchSize},\n    max_model_len={n.sequenceLength},\n"
        f"    dtype={n.dtype!r},\n    revision={spec.model.revision!r},\n    device='neuron',\n"
        f"    additional_config={ {'neuron_config': nxdi_neuron_config(spec)}!r},\n)\n"
    )
    step = f'NEURON_COMPILED_ARTIFACTS="$OUT/model" python {CONFIG_MOUNT}/compile_vllm.py'
    return {"compile_vllm.py": script, "compile.sh": compile_script(spec, compile_hash, step)}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    return Container(IMAGE, ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], read_only_root=False)


def unsupported(spec: NeuronModelSpec) -> list[str]:
    return []  # NxDI's NeuronConfig holds the shapes, buckets, quantization and overrides
