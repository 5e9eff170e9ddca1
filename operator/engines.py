"""Engines: a pure mapping from a NeuronModel spec to each serving engine's image, command, arguments and
environment, following that engine's documented contract, including where it finds the compiled artifacts.

- embedded: neuronfleet's own runtime (`neuronfleet serve`; on Neuron its NxDI backend), artifacts = the
  folder `neuronfleet compile` wrote.
- vllm: the vLLM Neuron plugin; `--additional-config '{"neuron_config": {...}}'`, artifacts through
  NEURON_COMPILED_ARTIFACTS.
- tgi: TGI's Neuron backend, configured by HF_NUM_CORES, HF_AUTO_CAST_TYPE, MAX_BATCH_SIZE, MAX_TOTAL_TOKENS,
  MAX_INPUT_TOKENS, MAX_BATCH_PREFILL_TOKENS, which must match the compiled model; `--model-id` the export.
- sglang: SGLang-Neuron (`SGLANG_PLATFORM=neuron python -m sglang.launch_server`), P/D with
  `--disaggregation-mode` over NIXL; compiled graphs cached in NEURON_COMPILE_CACHE_URL.

Every spec field meant for the runtime reaches each role's command, environment or compile config
(tests/unit/test_spec_reaches_process.py checks it for every sample); a field an engine has no setting for is
refused by `unsupported` (called by validation), never dropped. The flags are those of the pinned images:
- vLLM 0.11.0 (the vllm-neuron plugin's): https://docs.vllm.ai/en/v0.11.0/configuration/engine_args.html
  (--tensor-parallel-size, --max-num-seqs, --max-model-len, --dtype, --served-model-name, --revision, --port,
  --additional-config, --kv-transfer-config).
- TGI 3.3.6, Neuron backend: backends/neuron/server/text_generation_server/tgi_env.py at tag v3.3.6 of
  github.com/huggingface/text-generation-inference (HF_NUM_CORES, HF_AUTO_CAST_TYPE and the MAX_* variables,
  which must equal the export's shapes; `--model-id`). Its launcher has no served-model-name option.
- SGLang at sglang-neuron 0.1.0's pinned commit: https://docs.sglang.io/advanced_features/server_arguments.html
  (--tp-size, --max-running-requests, --context-length, --dtype, --served-model-name, --revision,
  --disaggregation-mode, --disaggregation-transfer-backend).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field

from neuronfleet import __version__
from neuronfleet.contract import (
    CACHE_MOUNT,
    COMPILE_CONFIG_FILE,
    CONFIG_MOUNT,
    MODEL_MOUNT,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    ServeConfig,
)

from .spec import NeuronModelSpec

# Default images, pinned (a spec's `image` overrides). Our own are built from the repository's Dockerfile.
IMAGES = {
    ("embedded", "cpu"): f"ghcr.io/neuronfleet/runtime-cpu:{__version__}",
    ("embedded", "neuron"): f"ghcr.io/neuronfleet/runtime-neuron:{__version__}",
    (
        "vllm",
        "neuron",
    ): "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:0.11.0-neuronx-py312-sdk2.27.1-ubuntu24.04",
    ("tgi", "neuron"): "ghcr.io/huggingface/text-generation-inference:3.3.6-neuron",
    (
        "sglang",
        "neuron",
    ): "public.ecr.aws/neuron/pytorch-inference-sglang-neuron:0.1.0-neuronx-py312-sdk2.33.0-ubuntu24.04",
}

# The chart's runtimeImages: the operator's deployment may name other images for our own runtime.
for _target in ("cpu", "neuron"):
    if os.environ.get(f"NEURONFLEET_RUNTIME_IMAGE_{_target.upper()}"):
        IMAGES[("embedded", _target)] = os.environ[f"NEURONFLEET_RUNTIME_IMAGE_{_target.upper()}"]


@dataclass
class Container:
    """What a container of one role runs: image, command + args, environment (name -> value)."""

    image: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def artifacts_dir(compile_hash: str) -> str:
    return f"{CACHE_MOUNT}/artifacts/{compile_hash}"


def image_for(spec: NeuronModelSpec) -> str:
    if spec.image:
        return spec.image
    target = "cpu" if spec.neuron.instanceType == "cpu" else "neuron"
    return IMAGES[(spec.engine, target)]


def model_reference(spec: NeuronModelSpec) -> str:
    """How an engine names the model: a Hub id for hf://, a mounted path for pvc:// and file://."""
    uri = spec.model.uri
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://")
    if uri.startswith("pvc://"):
        return f"{MODEL_MOUNT}/{uri.removeprefix('pvc://').split('/', 1)[1]}".rstrip("/")
    if uri.startswith("file://"):
        return uri.removeprefix("file://")
    return uri  # s3:// is fetched by the compile step into the artifacts


def _buckets(values: list[int]) -> str:
    return ",".join(map(str, values))


def unsupported(spec: NeuronModelSpec) -> list[str]:
    """Spec fields the engine has no setting for (empty: every field reaches the engine). The embedded engine
    and vLLM take every field (NxDI's NeuronConfig holds the shapes, buckets, quantization and overrides)."""
    n, engine, out = spec.neuron, spec.engine, []
    if engine not in ("tgi", "sglang"):
        return out
    where = {"tgi": "TGI's Neuron export (optimum-neuron)", "sglang": "SGLang-Neuron"}[engine]
    use = "engine embedded or vllm"
    if n.quantization != "none":
        out.append(f"neuron.quantization {n.quantization}: {where} has no setting for it; use none or {use}")
    if n.buckets.context or n.buckets.generation:
        out.append(f"neuron.buckets: {where} compiles its own length buckets; remove them or use {use}")
    if n.overrides:
        out.append(f"neuron.overrides are NxDI NeuronConfig fields, which {where} does not read; remove them "
                   f"or use {use}")  # fmt: skip
    if n.logicalCores is not None:
        out.append(f"neuron.logicalCores: {where} has no setting for it; remove it or use {use}")
    if engine == "tgi" and spec.model.revision:
        out.append(f"model.revision: neuronfleet passes no revision to {where}; remove it or use {use}")
    if engine == "sglang" and "maxInputLength" in n.model_fields_set:
        out.append(
            "neuron.maxInputLength: SGLang bounds prompts by the context length only (--context-length, "
            f"neuron.sequenceLength {n.sequenceLength}); remove maxInputLength or use {use}"
        )
    return out


def nxdi_neuron_config(spec: NeuronModelSpec) -> dict:
    """NxDI NeuronConfig fields for the spec's shapes (vLLM's `neuron_config`), overrides last."""
    n = spec.neuron
    config = {
        "tp_degree": n.tensorParallel,
        "batch_size": n.batchSize,
        "seq_len": n.sequenceLength,
        "max_context_length": n.maxInputLength,
        "torch_dtype": n.dtype,
        "is_continuous_batching": True,
        "enable_bucketing": True,
    }
    if n.buckets.context:
        config["context_encoding_buckets"] = n.buckets.context
    if n.buckets.generation:
        config["token_generation_buckets"] = n.buckets.generation
    if n.logicalCores is not None:
        config["logical_nc_config"] = n.logicalCores
    if n.quantization != "none":
        config["quantized"] = True
        config["quantization_dtype"] = n.quantization
    return {**config, **n.overrides}


def serve_config(spec: NeuronModelSpec, role: str, compile_hash: str, port: int) -> ServeConfig:
    """Our runtime's serve options for a role that follow from the spec alone (the pod's own are added by
    the caller): the compiled model, the port, and the compiled shapes (slots, lengths, buckets, dtype), for
    every role: the router checks requests against the same limits and reports them (`/info`)."""
    n = spec.neuron
    shapes: dict = {"slots": n.batchSize, "max_seq_len": n.sequenceLength, "max_input_len": n.maxInputLength}
    if n.buckets.context:
        shapes["prefill_buckets"] = list(n.buckets.context)
    if n.buckets.generation:
        shapes["decode_buckets"] = list(n.buckets.generation)
    model = f"{artifacts_dir(compile_hash)}/model"
    return ServeConfig(model=model, role=role, host="0.0.0.0", port=port, dtype=n.dtype, **shapes)  # type: ignore[arg-type]


def serve_container(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, config: ServeConfig | None = None,
    served_name: str | None = None,
) -> Container:  # fmt: skip
    """The serving container of a role (unified, prefill, decode or router). For our runtime (the embedded
    engine, and every engine's router) `config` is the role's serve options (default: `serve_config`); the
    other engines name the model `served_name` in their APIs (default: their own choice)."""
    n, artifacts = spec.neuron, artifacts_dir(compile_hash)
    image = image_for(spec)
    if spec.engine == "embedded" or role == "router":
        config = config or serve_config(spec, role, compile_hash, port)
        if spec.engine != "embedded":  # the router is ours whatever the engine
            image = image_for(spec.model_copy(update={"engine": "embedded", "image": None}))
        return Container(image, ["neuronfleet", "serve", *config.to_args()])
    if spec.engine == "vllm":
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
        return Container(image, command, {"NEURON_COMPILED_ARTIFACTS": f"{artifacts}/model"})
    if spec.engine == "tgi":
        dtype = {"bfloat16": "bf16", "float16": "fp16"}[n.dtype]
        env = {
            "HF_NUM_CORES": str(n.tensorParallel),
            "HF_AUTO_CAST_TYPE": dtype,
            "MAX_BATCH_SIZE": str(n.batchSize),
            "MAX_TOTAL_TOKENS": str(n.sequenceLength),
            "MAX_INPUT_TOKENS": str(n.maxInputLength),
            "MAX_BATCH_PREFILL_TOKENS": str(n.batchSize * n.maxInputLength),
            "PORT": str(port),
        }
        return Container(image, ["text-generation-launcher", "--model-id", f"{artifacts}/model"], env)
    # sglang
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
    env = {"SGLANG_PLATFORM": "neuron", "NEURON_COMPILE_CACHE_URL": f"{artifacts}/neuron-cache"}
    return Container(image, command, env)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """Scripts the compile Job runs from the runtime ConfigMap (file name -> content), for the engines that
    are not ours: the engine's ahead-of-time compile into artifacts/<hash>/, manifest.json (the completion
    marker) written last, and an immediate exit when the manifest exists already (a cache hit)."""
    if spec.engine == "embedded":
        return {}
    out, n = artifacts_dir(compile_hash), spec.neuron
    files = {}
    if spec.engine == "tgi":  # optimum-neuron's export: the format TGI's Neuron backend loads
        dtype = {"bfloat16": "bf16", "float16": "fp16"}[n.dtype]
        step = (
            f"optimum-cli export neuron --model {shlex.quote(model_reference(spec))} "
            f"--batch_size {n.batchSize} --sequence_length {n.sequenceLength} --num_cores {n.tensorParallel} "
            f'--auto_cast_type {dtype} "$OUT/model"'
        )
    elif spec.engine == "vllm":  # vLLM compiles into NEURON_COMPILED_ARTIFACTS when it loads the model
        files["compile_vllm.py"] = (
            "from vllm import LLM\n\n"
            f"LLM(\n    model={model_reference(spec)!r},\n    tensor_parallel_size={n.tensorParallel},\n"
            f"    max_num_seqs={n.batchSize},\n    max_model_len={n.sequenceLength},\n"
            f"    dtype={n.dtype!r},\n    revision={spec.model.revision!r},\n    device='neuron',\n"
            f"    additional_config={ {'neuron_config': nxdi_neuron_config(spec)}!r},\n)\n"
        )
        step = f'NEURON_COMPILED_ARTIFACTS="$OUT/model" python {CONFIG_MOUNT}/compile_vllm.py'
    else:  # sglang compiles its graphs on start; serving pods share this compile cache folder
        step = 'mkdir -p "$OUT/neuron-cache"'
    manifest = json.dumps({"engine": spec.engine, "compileHash": compile_hash})
    files["compile.sh"] = (
        "#!/bin/sh\nset -eu\n"
        f"OUT={out}\n"
        f'LOG="${{{TERMINATION_LOG_ENV}:-{TERMINATION_LOG}}}"  # the termination message the operator reads\n'
        'if [ -f "$OUT/manifest.json" ]; then echo "cache hit: $OUT"; '
        'sed \'s/}$/, "cacheHit": true}/\' "$OUT/manifest.json" > "$LOG" || true; exit 0; fi\n'
        'mkdir -p "$OUT"\n'
        f"{step}\n"
        f'echo {shlex.quote(manifest)} > "$OUT/manifest.json.tmp"\n'
        'mv "$OUT/manifest.json.tmp" "$OUT/manifest.json"\n'
        'sed \'s/}$/, "cacheHit": false}/\' "$OUT/manifest.json" > "$LOG" || true\n'
    )
    return files


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """What the compile Job runs: `neuronfleet compile` for our engine, else the engine's own compile."""
    if spec.engine == "embedded":
        out = artifacts_dir(compile_hash)
        config = f"{CONFIG_MOUNT}/{COMPILE_CONFIG_FILE}"
        command = ["neuronfleet", "compile", "--config", config, "--out", out]
        if spec.model.uri.startswith("pvc://"):
            command += ["--model-mount", MODEL_MOUNT]
        return Container(image_for(spec), command)
    return Container(image_for(spec), ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"])
