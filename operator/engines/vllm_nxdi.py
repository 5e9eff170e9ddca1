"""vLLM with the Neuron plugin over NxD Inference on Inf2 and Trn1 (the last image that serves them), pinned
in `PINNED`: `vllm serve` with the shapes in vLLM's own flags and NxDI's NeuronConfig in `--additional-config
{"override_neuron_config": ...}`; the compile Job runs the same engine arguments once through `vllm.LLM` on a
node of the serving instance type (the plugin compiles into NEURON_COMPILED_ARTIFACTS when it loads the model,
on Neuron devices); serving pods start only when the compiled artifacts are complete (`start_guard`), because
the plugin would compile again instead. Disaggregated serving is refused: the plugin documents it only on its
legacy vLLM fork (Known Issues), and NIXL P/D is the Trn2/Trn3 plugin's (`vllm_plugin`). Trn2 and Trn3 are
served by `vllm_plugin`: from Neuron 2.34 NxD Inference is unsupported there.
"""

from __future__ import annotations

import json

from neuronfleet.contract import CONFIG_MOUNT

from ..spec import NeuronModelSpec
from .common import (
    HF_HUB,
    Container,
    Fact,
    Pinned,
    artifacts_dir,
    compile_script,
    hub_download_failure,
    missing_files,
    model_reference,
)
from .common import start_guard as common_start_guard

# ---- the pinned version and its sources --------------------------------------------------------------------

DLC = (
    "aws-neuron/deep-learning-containers@2.32.0:README.md (vllm-inference-neuronx: VLLM 0.16.0, Neuron "
    "2.31.1, the last row for trn1 and inf2) and @2.31.1:vllm/inference/0.16.0/Dockerfile.neuronx "
    "(GITHUB_REPO_BRANCH=release-0.5.3, NxDI 0.10.18399+ed62453e, neuronx-cc 2.26.6360.0, torch-neuronx "
    "2.9.0.2.15.32035; no USER line: root; WORKDIR /workspace/vllm)"
)
VLLM_ARGS = "vllm 0.16.0 wheel (PyPI): vllm/engine/arg_utils.py"
VLLM_SERVE = "vllm 0.16.0 wheel (PyPI): vllm/entrypoints/openai/cli_args.py"
VLLM_PROMPT = (
    "vllm 0.16.0 wheel (PyPI): vllm/v1/engine/input_processor.py (a prompt plus at least one output token "
    "must fit max_model_len) and vllm/renderers/params.py"
)
# The image installs the plugin's release-0.5.3 branch; the code read was its release-0.5.0 (commit 3afb0a9,
# "Release 0.5.0", the same vLLM 0.16.0 line; docs/engine-vllm.md)
PLUGIN = "vllm-project/vllm-neuron@release-0.5.0"
PLUGIN_LOADER = f"{PLUGIN}:vllm_neuron/worker/neuronx_distributed_model_loader.py"
PLUGIN_PLATFORM = f"{PLUGIN}:vllm_neuron/platform.py"
PLUGIN_README = f"{PLUGIN}:README.md (Known Issues)"
USER_GUIDE = (
    "aws-neuron/aws-neuron-sdk@v2.31.1:libraries/nxd-inference/developer_guides/vllm-user-guide-v1.rst "
    "(plugin 0.5.x, vLLM 0.16.0)"
)
NXDI_API = "aws-neuron/aws-neuron-sdk@v2.31.1:libraries/nxd-inference/api-guides/api-guide.rst (NeuronConfig)"
NXDI_CONFIG = (
    "aws-neuron/neuronx-distributed-inference@c63afe0 (Release 2.29, the public tag nearest 0.10.18399):"
    "src/neuronx_distributed_inference/models/config.py"
)
NXDI_APP = (
    "aws-neuron/neuronx-distributed-inference@c63afe0:src/neuronx_distributed_inference/models/"
    "application_base.py"
)
QUICKSTART = (
    "aws-neuron/aws-neuron-sdk@v2.32.0:deploy/environments/quickstart-deploy-dlc.rst (Step 2: docker run "
    "--cap-add SYS_ADMIN --cap-add IPC_LOCK, for Trainium and Inferentia)"
)

IMAGE = "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04"
PLATFORMS = ("inf2-trn1",)
CAPABILITIES = ("SYS_ADMIN", "IPC_LOCK")  # QUICKSTART (why, and what it means: vllm_plugin.CAPABILITIES)
OVERRIDE = "override_neuron_config"  # the key of --additional-config the plugin reads (PLUGIN_LOADER)
QUANTIZATION_DTYPES = {"int8": "int8", "fp8": "f8e4m3"}  # spec -> NxDI quantization_dtype (NXDI_API)


def _arg(name: str, meaning: str, value: str, source: str = VLLM_ARGS) -> Fact:
    return Fact(name, "arg", meaning, source, value)


def _config(name: str, meaning: str, value: str, source: str) -> Fact:
    return Fact(f"{OVERRIDE}.{name}", "config", meaning, source, value)


def _env(name: str, meaning: str, value: str, source: str) -> Fact:
    return Fact(name, "env", meaning, source, value)


PINNED = Pinned(
    image=IMAGE,
    versions={
        "vllm": "0.16.0",
        "vllm-neuron": "0.5.3",
        "neuronx-distributed-inference": "0.10.18399+ed62453e",
        "neuron-sdk": "2.31.1",
        "torch-neuronx": "2.9.0.2.15.32035",
        "neuronx-cc": "2.26.6360.0",
    },
    source=f"{DLC}; {USER_GUIDE}",
    facts=(
        _arg("model_tag", "positional: the model, a Hugging Face id or a local folder", "str", VLLM_SERVE),
        _arg("--host", "address the OpenAI server listens on", "str", VLLM_SERVE),
        _arg("--port", "port of the OpenAI server", "int", VLLM_SERVE),
        _arg("--served-model-name", "the model's name in the API", "str"),
        _arg("--revision", "the Hub revision of the model's config and tokenizer", "str"),
        _arg(
            "--tensor-parallel-size",
            "tensor parallelism; the plugin makes it NeuronConfig.tp_degree (PLUGIN_LOADER "
            "_get_default_neuron_config)",
            "int",
        ),
        _arg(
            "--max-num-seqs",
            "requests decoded together; the plugin makes it NeuronConfig.batch_size",
            "int",
        ),
        _arg(
            "--max-model-len",
            "prompt plus generated tokens; the plugin makes it NeuronConfig.seq_len and max_context_length; "
            f"vLLM's only bound on a prompt, which must leave a token to generate ({VLLM_PROMPT})",
            "int",
        ),
        _arg(
            "--dtype",
            "weights and activations; the plugin makes it NeuronConfig.torch_dtype",
            "auto|half|float16|bfloat16|float|float32",
        ),
        _arg(
            "--no-enable-prefix-caching",
            "vLLM's V1 engine enables prefix caching unless told not to; without it the plugin uses "
            "NxDI's contiguous KV cache, one block of --max-model-len per sequence (PLUGIN_PLATFORM "
            "check_and_update_config sets block_size = max_model_len), so no --block-size is passed",
            "flag",
        ),
        _arg(
            "--num-gpu-blocks-override",
            "KV blocks: with neither chunked prefill nor prefix caching the plugin sets block_size to "
            "max_model_len and asks for exactly --max-num-seqs blocks "
            f"({PLUGIN_README}; {USER_GUIDE} Known Issues)",
            "int",
        ),
        _arg(
            "--additional-config",
            f"a JSON object; the plugin reads its '{OVERRIDE}' key as NxDI NeuronConfig fields, over the "
            "defaults it derives from vLLM's flags (the user guide's CLI example spells the key with "
            "hyphens; the plugin's code reads the underscore spelling)",
            "json",
        ),
        Fact(
            OVERRIDE, "config", "NxDI NeuronConfig fields over the plugin's defaults", PLUGIN_LOADER, "json"
        ),
        _config(
            "save_sharded_checkpoint",
            "the compile writes the sharded weights into the artifacts (weights/tp<rank>_sharded_checkpoint"
            ".safetensors), so serving pods load the artifacts alone; NxDI's default is false in code",
            "bool",
            f"{NXDI_APP} (load_weights, shard_weights); {NXDI_CONFIG}",
        ),
        _config(
            "context_encoding_buckets",
            "prompt length buckets; the largest is the longest prompt vLLM admits, --max-model-len - 1 (NxDI "
            "fails a prompt above its largest bucket)",
            "int-list",
            f"{NXDI_API}; {NXDI_CONFIG}",
        ),
        _config(
            "token_generation_buckets",
            "KV length buckets of token generation; the largest is --max-model-len",
            "int-list",
            NXDI_API,
        ),
        _config(
            "quantized",
            "weight quantization on (the plugin takes quantized, quantization_dtype and "
            "quantized_checkpoints_path from the overrides)",
            "bool",
            f"{NXDI_API}; {PLUGIN_LOADER} (_get_neuron_config_after_override)",
        ),
        _config("quantization_dtype", "the quantized weights' type", "int8|f8e4m3|f8e5m2", NXDI_API),
        _config(
            "quantized_checkpoints_path",
            "where the compile saves the quantized checkpoint (NxDI requires it when quantized)",
            "path",
            f"{NXDI_API}; {NXDI_CONFIG} (_verify_quantized_config)",
        ),
        _env(
            "NEURON_COMPILED_ARTIFACTS",
            "the compiled model: loaded from there, or compiled and saved there when missing or invalid",
            "path",
            f"{USER_GUIDE} (Loading pre-compiled models); {PLUGIN_LOADER} (_get_compiled_model_path)",
        ),
        _env("XLA_HANDLE_SPECIAL_SCALAR", "required for f8e4m3 quantization", "1", NXDI_API),
        _env("HF_TOKEN", "the Hub token (from the model's secretRef)", "str", HF_HUB),
        _env(
            "HUGGING_FACE_HUB_TOKEN", "the Hub token, older name (from the model's secretRef)", "str", HF_HUB
        ),
    ),
)

# NeuronConfig fields the operator derives from the spec (through vLLM's flags or the overrides): an override
# of one would make the artifacts disagree with what vLLM schedules, so it is refused, naming the spec field.
DERIVED = {
    "tp_degree": "neuron.tensorParallel",
    "batch_size": "neuron.batchSize",
    "ctx_batch_size": "neuron.batchSize",
    "seq_len": "neuron.sequenceLength",
    "max_context_length": "neuron.sequenceLength",
    "torch_dtype": "neuron.dtype",
    "context_encoding_buckets": "neuron.buckets.context",
    "token_generation_buckets": "neuron.buckets.generation",
    "logical_nc_config": "nothing: LNC applies to Trn2 and Trn3 only",
    "quantized": "neuron.quantization",
    "quantization_dtype": "neuron.quantization",
    "quantized_checkpoints_path": "neuron.quantization",
    "save_sharded_checkpoint": "nothing: serving pods load the sharded weights from the artifacts",
    "is_prefix_caching": "nothing: prefix caching stays off (the plugin's contiguous KV cache)",
    "is_block_kv_layout": "nothing: prefix caching stays off (the plugin's contiguous KV cache)",
    "pa_num_blocks": "nothing: prefix caching stays off (the plugin's contiguous KV cache)",
    "pa_block_size": "nothing: prefix caching stays off (the plugin's contiguous KV cache)",
}


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def model_dir(compile_hash: str) -> str:
    """NEURON_COMPILED_ARTIFACTS: the NxDI model vLLM compiles and loads."""
    return f"{artifacts_dir(compile_hash)}/model"


def override_neuron_config(spec: NeuronModelSpec, compile_hash: str) -> dict:
    """NxDI NeuronConfig fields over the plugin's defaults (which already carry TP, batch, sequence length,
    context length and dtype from vLLM's flags): self-contained artifacts, buckets, quantization, then
    the spec's own overrides (none of them a derived field: `limits.override_refusals`)."""
    n = spec.neuron
    config: dict = {"save_sharded_checkpoint": True}
    if n.buckets.context:
        config["context_encoding_buckets"] = list(n.buckets.context)
    if n.buckets.generation:
        config["token_generation_buckets"] = list(n.buckets.generation)
    if n.quantization != "none":
        config["quantized"] = True
        config["quantization_dtype"] = QUANTIZATION_DTYPES[n.quantization]
        config["quantized_checkpoints_path"] = f"{artifacts_dir(compile_hash)}/quantized"
    return {**config, **n.overrides}


def engine_args(spec: NeuronModelSpec, compile_hash: str) -> list[tuple[str, object]]:
    """The engine arguments serving and compiling share, as (flag, value; None for a switch), in order."""
    n = spec.neuron
    out: list[tuple[str, object]] = [
        ("--tensor-parallel-size", n.tensorParallel),
        ("--max-num-seqs", n.batchSize),
        ("--max-model-len", n.sequenceLength),
        ("--dtype", n.dtype),
        ("--no-enable-prefix-caching", None),
        ("--num-gpu-blocks-override", n.batchSize),  # one block of max_model_len per sequence
        ("--additional-config", {OVERRIDE: override_neuron_config(spec, compile_hash)}),
    ]
    if spec.model.revision:
        out.append(("--revision", spec.model.revision))
    return out


def engine_env(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    env = {"NEURON_COMPILED_ARTIFACTS": model_dir(compile_hash)}
    if spec.neuron.quantization == "fp8":
        env["XLA_HANDLE_SPECIAL_SCALAR"] = "1"
    return env


def _artifact_files(spec: NeuronModelSpec) -> list[str]:
    """What a complete compile leaves in NEURON_COMPILED_ARTIFACTS (NXDI_APP compile/load): the traced model,
    its NeuronConfig and the sharded weights of the first and last rank."""
    last = spec.neuron.tensorParallel - 1
    return ["model.pt", "neuron_config.json", "weights/tp0_sharded_checkpoint.safetensors",
            f"weights/tp{last}_sharded_checkpoint.safetensors"]  # fmt: skip


def start_guard(spec: NeuronModelSpec, compile_hash: str) -> str:
    """sh run before `vllm serve`: vLLM would compile again into NEURON_COMPILED_ARTIFACTS (USER_GUIDE) when
    they are missing or incomplete, which the read-only mount must never see (`common.start_guard`)."""
    files = [f"model/{f}" for f in _artifact_files(spec)]
    return common_start_guard(
        compile_hash, files, "vLLM is not started, since it would compile instead of serving"
    )


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    if role not in ("unified",):  # a rule (limits.RULES) refuses disaggregated vLLM here at apply
        raise ValueError(f"engine vllm serves role unified only, not {role} (see engines.limits)")
    command = ["vllm", "serve", model_reference(spec), "--host", "0.0.0.0", "--port", str(port)]
    if served_name:
        command += ["--served-model-name", served_name]
    for flag, value in engine_args(spec, compile_hash):
        command += (
            [flag] if value is None else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        )
    guarded = ["/bin/sh", "-c", start_guard(spec, compile_hash), "vllm-start-guard", *command]
    return Container(
        IMAGE, guarded, engine_env(spec, compile_hash), third_party=True,
        capabilities=CAPABILITIES,
    )  # fmt: skip


def _kwarg(flag: str) -> str:
    """`--max-num-seqs` -> `max_num_seqs` (vllm.LLM takes the engine arguments as keywords)."""
    return flag.removeprefix("--no-").removeprefix("--").replace("-", "_")


def compile_program(spec: NeuronModelSpec, compile_hash: str) -> str:
    """compile_vllm.py: the serving pods' engine arguments through `vllm.LLM`, which compiles the model into
    NEURON_COMPILED_ARTIFACTS and loads it. A Hub model is first downloaded at its revision into the working
    folder: given a Hub id, the plugin copies the model into ./local-models without the revision
    (PLUGIN_LOADER `_save_pretrained_model`)."""
    kwargs = {
        _kwarg(flag): (False if value is None else value) for flag, value in engine_args(spec, compile_hash)
    }
    hub = spec.model.uri.startswith("hf://")
    revision = kwargs.pop("revision", None)
    return (
        f'"""neuronfleet: compile of hash {compile_hash} with vLLM {PINNED.versions["vllm"]} and the Neuron '
        'plugin (operator/engines/vllm.py)."""\n\n'
        "import os\nimport sys\n\nfrom huggingface_hub import snapshot_download\nfrom vllm import LLM\n\n"
        f"MODEL = {model_reference(spec)!r}\nREVISION = {revision!r}\nHUB = {hub!r}\n"
        f"ENGINE_ARGS = {kwargs!r}\n\n"
        "model = MODEL\n"
        "if HUB:  # the original/ folders of some Hub repos are a second copy of the weights\n"
        "    try:\n"
        "        model = snapshot_download(\n"
        "            MODEL, revision=REVISION, local_dir=os.path.join(os.getcwd(), 'model'),\n"
        "            ignore_patterns=['original/*'],\n"
        "        )\n"
        "    except Exception as e:  # not found, gated, refused: the operator tries again later\n"
        f"{hub_download_failure('        ')}"
        "LLM(model=model, **ENGINE_ARGS)\n"
    )


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """compile.sh runs compile_vllm.py in a scratch folder beside the artifacts on the cache volume (the Hub
    download), then checks that the compiled model is complete before the manifest is written."""
    step = (
        'WORK="$OUT.work"  # scratch on the cache volume: the Hub download, removed after the compile\n'
        'rm -rf "$WORK" "$OUT/model" && mkdir -p "$WORK" && cd "$WORK"\n'
        f'NEURON_COMPILED_ARTIFACTS="$OUT/model" python {CONFIG_MOUNT}/compile_vllm.py\n'
        'cd / && rm -rf "$WORK"\n'
        f"{missing_files('$OUT/model', _artifact_files(spec))}"
        'if [ -n "$missing" ]; then\n'
        '  msg="vLLM finished without compiled artifacts in $OUT/model:$missing"\n'
        '  echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1\n'
        "fi"
    )
    return {
        "compile_vllm.py": compile_program(spec, compile_hash),
        "compile.sh": compile_script(spec, compile_hash, step),
    }


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """`vllm.LLM` loads the model onto Neuron devices to compile it (NxDI compile, then load; the plugin has
    no compile-only path), so the Job runs where a serving pod would, with its cores (builders)."""
    command = ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"]
    return Container(
        IMAGE, command, engine_env(spec, compile_hash), needs_neuron=True,
        third_party=True, capabilities=CAPABILITIES,
    )  # fmt: skip


def reads_hub_when_serving(spec: NeuronModelSpec) -> bool:
    """Given a Hub id, vLLM reads the model's config and tokenizer from the Hub at start (the weights come
    from the artifacts), with the model's token."""
    return spec.model.uri.startswith("hf://")
