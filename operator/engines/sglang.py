"""SGLang-Neuron: `SGLANG_PLATFORM=neuron python -m sglang.launch_server`, P/D with `--disaggregation-mode`
over NIXL; compiled graphs cached in NEURON_COMPILE_CACHE_URL.

Pinned: SGLang at sglang-neuron 0.1.0's pinned commit: https://docs.sglang.io/advanced_features/server_arguments.html
(--tp-size, --max-running-requests, --context-length, --dtype, --served-model-name, --revision,
--disaggregation-mode, --disaggregation-transfer-backend).
"""

from __future__ import annotations

from neuronfleet.contract import CONFIG_MOUNT

from ..spec import NeuronModelSpec
from .common import Container, artifacts_dir, compile_script, model_reference, refusals_of_nxdi_fields

# The prefill server's bootstrap port, where decode servers and the router meet it (SGLang's
# --disaggregation-bootstrap-port; its default, to be confirmed against the pinned version's server_args.py)
BOOTSTRAP_PORT = 8998
IMAGE = "public.ecr.aws/neuron/pytorch-inference-sglang-neuron:0.1.0-neuronx-py312-sdk2.33.0-ubuntu24.04"


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    n = spec.neuron
    command = ["python", "-m", "sglang.launch_server", "--model-path", model_reference(spec)]
    command += ["--host", "0.0.0.0", "--port", str(port), "--tp-size", str(n.tensorParallel)]
    command += ["--max-running-requests", str(n.batchSize), "--context-length", str(n.sequenceLength)]
    command += ["--dtype", n.dtype]
    if served_name:
        command += ["--served-model-name", served_name]
    if spec.model.revision:
        command += ["--revision", spec.model.revision]
    if role in ("prefill", "decode"):
        command += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl"]
    cache = f"{artifacts_dir(compile_hash)}/neuron-cache"
    env = {"SGLANG_PLATFORM": "neuron", "NEURON_COMPILE_CACHE_URL": cache}
    return Container(IMAGE, command, env, read_only_root=False)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """SGLang compiles its graphs on start; serving pods share this compile cache folder."""
    return {"compile.sh": compile_script(spec, compile_hash, 'mkdir -p "$OUT/neuron-cache"')}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    return Container(IMAGE, ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], read_only_root=False)


def unsupported(spec: NeuronModelSpec) -> list[str]:
    n, use = spec.neuron, "engine embedded or vllm"
    out = refusals_of_nxdi_fields(spec, "SGLang-Neuron", use)
    if "maxInputLength" in n.model_fields_set:
        out.append(
            "neuron.maxInputLength: SGLang bounds prompts by the context length only (--context-length, "
            f"neuron.sequenceLength {n.sequenceLength}); remove maxInputLength or use {use}"
        )
    return out
