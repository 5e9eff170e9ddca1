"""TGI's Neuron backend: the image's entrypoint (`/tgi-entrypoint.sh`, then `text-generation-launcher`)
serving a model that optimum-neuron exported (`optimum-cli export neuron`), configured by HF_NUM_CORES,
HF_AUTO_CAST_TYPE and the MAX_* variables, which must equal the exported shapes; `PINNED` records every name
emitted here, with its source for the pinned versions.

The compile Job downloads a Hub model into the cache (so the export shards its weights into the exported
folder: serving pods need neither the Hub nor a token), then exports it on a Neuron node: optimum-neuron 0.3.0
documents that LLMs "can only be exported on Neuron platforms, as they are tailored to fit on the actual
devices during export" (docs/source/guides/export_model.mdx), hence `needs_neuron`.
"""

from __future__ import annotations

import shlex

from neuronfleet.contract import CONFIG_MOUNT

from ..pod_metrics import Names
from ..spec import NeuronModelSpec
from .common import (
    HUB_DOWNLOAD_SCRIPT,
    Container,
    Fact,
    Pinned,
    artifacts_dir,
    compile_script,
    hub_download_script,
    model_reference,
    start_guard,
)

IMAGE = "ghcr.io/huggingface/text-generation-inference:3.3.5-neuron"
COMPILES = True  # the export runs in the compile Job; serving pods load its folder
# "Trainium 1, Inferentia 2" (docs/source/backends/neuron.md); optimum-neuron 0.3.0 targets NeuronCore-v2 (its
# NxDNeuronConfig sets no trn2 target unless asked, and this export passes none)
PLATFORMS = ("inf2-trn1",)
AUTO_CAST_TYPES = {"bfloat16": "bf16", "float16": "fp16"}
# optimum-neuron 0.3.0 exports decoders of these model types only (@register_neuron_model_for_inference in
# optimum/neuron/models/inference/auto_models.py; docs/source/package_reference/supported_models.mdx)
MODEL_TYPES = ("granite", "llama", "mixtral", "phi3", "qwen2", "qwen3")
# The image declares no user (Dockerfile.neuron: no USER line, so root, HOME /root) and writes its Hub cache
# under /tmp (HUGGINGFACE_HUB_CACHE=/tmp) and neuronx-cc's cache under /var/tmp: it runs as it is built, its
# root writable (pod_parts). TGI's Neuron guide runs it with the Neuron devices and no added capability.

_TGI = "github.com/huggingface/text-generation-inference@v3.3.5"
_ENV = f"{_TGI}:backends/neuron/server/text_generation_server/tgi_env.py"
_LAUNCHER = f"{_TGI}:launcher/src/main.rs (Args, clap `long, env`)"
_EXPORT = "github.com/huggingface/optimum-neuron@v0.3.0:optimum/commands/export/neuronx.py parse_args_neuronx"
_HUB = "github.com/huggingface/huggingface_hub (snapshot_download; huggingface_hub>=0.29,<1 in the image)"

PINNED = Pinned(
    image=IMAGE,
    versions={
        "text-generation-inference": "3.3.5",
        "optimum-neuron": "0.3.0",
        "neuron-sdk": "2.24.1",
        "neuronx-cc": "2.19.8089.0",
        "torch-neuronx": "2.7.0.2.8.6734",
        "neuronx-distributed": "0.13.14393",
    },
    source=(
        f"{_TGI}:docs/source/backends/neuron.md names the image 3.3.5-neuron; {_TGI}:Dockerfile.neuron "
        "installs optimum-neuron v0.3.0 and neuronx-cc 2.19.8089.0, torch-neuronx 2.7.0.2.8.6734, "
        "neuronx-distributed 0.13.14393 (Neuron SDK 2.24.1: github.com/aws-neuron/aws-neuron-sdk@v2.25.0:"
        "src/helperscripts/n2-manifest.json); its backends/neuron is the same at v3.3.6 and v3.3.7"
    ),
    facts=(
        Fact("/tgi-entrypoint.sh", "arg", "the image's ENTRYPOINT: tgi_entry_point.py (which does nothing "
             "when every HF_*/MAX_* variable is set), then `exec text-generation-launcher \"$@\"`",
             f"{_TGI}:Dockerfile.neuron, backends/neuron/tgi-entrypoint.sh, tgi_entry_point.py"),
        Fact("--model-id", "arg", "the exported model's folder (or a Hub id)", _LAUNCHER),
        Fact("PORT", "env", "the HTTP port the router listens on", _LAUNCHER),
        Fact("HF_NUM_CORES", "env", "Neuron cores = the export's tp_degree (num_cores)",
             f"{_ENV} (tgi_server_env_vars, check_env_and_neuron_config_compatibility)"),
        Fact("HF_AUTO_CAST_TYPE", "env", "the export's auto_cast_type (bf16, fp16)",
             f"{_ENV} (map_torch_dtype)"),
        Fact("MAX_BATCH_SIZE", "env", "= the export's batch_size",
             f"{_ENV} (tgi_router_env_vars); {_LAUNCHER}"),
        Fact("MAX_TOTAL_TOKENS", "env", "= the export's sequence_length", f"{_ENV}; {_LAUNCHER}"),
        Fact("MAX_INPUT_TOKENS", "env", "longest prompt, below sequence_length", f"{_ENV}; {_LAUNCHER}"),
        Fact("MAX_BATCH_PREFILL_TOKENS", "env", "batch_size x MAX_INPUT_TOKENS (neuron_config_to_env's)",
             f"{_ENV} (neuron_config_to_env); {_TGI}:docs/source/backends/neuron.md"),
        Fact("optimum-cli export neuron", "arg", "exports a decoder for the Neuron backend", _EXPORT),
        Fact("--model", "arg", "the checkpoint folder (or Hub id) to export", _EXPORT),
        Fact("--task", "arg", "text-generation", _EXPORT),
        Fact("--batch_size", "arg", "static batch (TGI's slots)", _EXPORT),
        Fact("--sequence_length", "arg", "prompt plus generated tokens", _EXPORT),
        Fact("--num_cores", "arg", "tensor parallelism (NeuronModelForCausalLM._export num_cores)", _EXPORT),
        Fact("--auto_cast_type", "arg", "weights/activations type: bf16 or fp16", _EXPORT),
        Fact("output", "arg", "the export's folder (positional)", _EXPORT),
        Fact("snapshot_download.repo_id", "config", "the Hub model downloaded before the export", _HUB),
        Fact("snapshot_download.revision", "config", "the Hub revision (spec.model.revision)", _HUB),
        Fact("snapshot_download.local_dir", "config", "where the checkpoint is put for the export", _HUB),
        Fact("snapshot_download.ignore_patterns", "config", "original/* and *.pth: not what the export loads",
             _HUB),
    ),
)  # fmt: skip

DOWNLOAD_SCRIPT = HUB_DOWNLOAD_SCRIPT
# The router's gauges (backends/v2/src/queue.rs tgi_queue_size; backends/v2/src/backend.rs
# tgi_batch_current_size, the v2 router the Neuron image installs: Dockerfile.neuron@v3.3.5); no KV usage
# and no time-to-first-token histogram (tgi_request_* histograms time whole requests), so no occupancy from
# the KV cache and no ttft signal (refused at apply: `limits.UNEXPORTED`)
METRICS = Names(waiting="tgi_queue_size", running="tgi_batch_current_size", kv_usage=None, ttft=None)


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def serve_env(spec: NeuronModelSpec, port: int) -> dict[str, str]:
    """The launcher's environment: every shape equal to the export's (TGI refuses a model whose NeuronConfig
    differs: tgi_env.check_env_and_neuron_config_compatibility), and MAX_BATCH_PREFILL_TOKENS as the backend's
    own default (batch_size x MAX_INPUT_TOKENS)."""
    n = spec.neuron
    return {
        "HF_NUM_CORES": str(n.tensorParallel),
        "HF_AUTO_CAST_TYPE": AUTO_CAST_TYPES[n.dtype],
        "MAX_BATCH_SIZE": str(n.batchSize),
        "MAX_TOTAL_TOKENS": str(n.sequenceLength),
        "MAX_INPUT_TOKENS": str(n.maxInputLength),
        "MAX_BATCH_PREFILL_TOKENS": str(n.batchSize * n.maxInputLength),
        "PORT": str(port),
    }


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    """The exported folder, read-only, started only when the export completed (`common.start_guard`: TGI's
    Neuron backend exports a model that is not one, with the environment's shapes, at start:
    tgi_env.py); TGI's launcher has no served-model-name option."""
    command = ["/tgi-entrypoint.sh", "--model-id", f"{artifacts_dir(compile_hash)}/model"]
    why = "TGI is not started, since it would export the model itself instead of serving"
    guarded = ["/bin/sh", "-c", start_guard(compile_hash, [], why), "tgi-start-guard", *command]
    return Container(IMAGE, guarded, serve_env(spec, port), third_party=True)


def export_args(spec: NeuronModelSpec, source: str, out: str) -> list[str]:
    """`optimum-cli export neuron` for the spec's shapes, from a checkpoint folder or Hub id into `out`."""
    n = spec.neuron
    return [
        "optimum-cli", "export", "neuron", "--model", source, "--task", "text-generation",
        "--batch_size", str(n.batchSize), "--sequence_length", str(n.sequenceLength),
        "--num_cores", str(n.tensorParallel), "--auto_cast_type", AUTO_CAST_TYPES[n.dtype], out,
    ]  # fmt: skip


def _shell(args: list[str]) -> str:
    """A shell command line; words that start with $OUT are double-quoted so that the script expands them."""
    return " ".join(f'"{a}"' if a.startswith("$OUT") else shlex.quote(a) for a in args)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """compile.sh: a Hub model is downloaded into $OUT/checkpoint first, so the export shards its weights into
    $OUT/model (optimum-neuron 0.3.0 keeps only a Hub reference when it exports a Hub id), then removed."""
    if not spec.model.uri.startswith("hf://"):
        step = _shell(export_args(spec, model_reference(spec), "$OUT/model"))
        return {"compile.sh": compile_script(spec, compile_hash, step)}
    download = ["python3", f"{CONFIG_MOUNT}/{DOWNLOAD_SCRIPT}", model_reference(spec)]
    download.append(spec.model.revision or "")
    step = "\n".join(
        (
            _shell([*download, "$OUT/checkpoint"]),
            _shell(export_args(spec, "$OUT/checkpoint", "$OUT/model")),
            _shell(["rm", "-rf", "$OUT/checkpoint"]),
        )
    )
    return {DOWNLOAD_SCRIPT: hub_download_script(), "compile.sh": compile_script(spec, compile_hash, step)}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    return Container(
        IMAGE, ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], {}, third_party=True,
        needs_neuron=True,
    )  # fmt: skip


# The backend's status: huggingface/optimum-neuron removed its TGI image and docs (commits 20b28fb9 and
# ccb15d79, 2026-01-19, first in tag v0.4.5), and huggingface/text-generation-inference says it "is now in
# maintenance mode" (README, commit 34988476, 2025-12-11); its Neuron backend last changed at v3.3.5.
LEGACY = (
    "engine tgi is legacy: TGI's Neuron backend is no longer developed (optimum-neuron dropped it in January "
    "2026; TGI is in maintenance mode), so neuronfleet serves it on Inferentia2 and Trainium1 with the "
    f"pinned image {IMAGE} only; engine vllm serves these instances too and gets new Neuron releases"
)


def notice(spec: NeuronModelSpec) -> tuple[str, str]:
    return "LegacyEngine", LEGACY
