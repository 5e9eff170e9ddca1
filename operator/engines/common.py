"""What every engine path shares: the container a role runs, where a compile hash's artifacts live, how an
engine names the model, the NxDI NeuronConfig of the spec's shapes, our runtime's serve options (the
embedded engine and every engine's router), and the compile script that wraps an engine's own compile step
(cache hit at once, manifest written last, the termination message the operator reads)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Literal

from neuronfleet import __version__
from neuronfleet.contract import (
    CACHE_MOUNT,
    MODEL_MOUNT,
    PROGRESS_PREFIX,
    SOURCE_UNAVAILABLE,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
)

from .. import front_door
from ..spec import NeuronModelSpec

# Our own runtime's images, built from the repository's Dockerfile (targets runtime-cpu and runtime-neuron);
# the chart's runtimeImages may name others. runtime-cpu runs every router and every instanceType cpu model;
# runtime-neuron (TorchNeuron: torch-neuronx, its compiler and the Neuron runtime) runs engine embedded on
# trn2 and trn3, experimental.
OWN_IMAGES = {
    target: os.environ.get(f"NEURONFLEET_RUNTIME_IMAGE_{target.upper()}")
    or f"ghcr.io/neuronfleet/runtime-{target}:{__version__}"
    for target in ("cpu", "neuron")
}


@dataclass(frozen=True)
class Fact:
    """One name the operator emits for an engine, with its meaning and the public source that documents it
    for the pinned version: a command-line argument (`--max-model-len`), an environment variable
    (`MAX_BATCH_SIZE`) or a config key (`override_neuron_config.tp_degree`)."""

    name: str
    kind: Literal["arg", "env", "config"]
    meaning: str
    source: str  # repository@tag:path, or a versioned documentation page
    # the values the engine takes: "flag" (a switch, no value), "int", "str", "path", "bool", "json" (an
    # object), "int-list" (a JSON list of integers), or choices "a|b|c"; "" when not recorded
    value: str = ""


@dataclass(frozen=True)
class Pinned:
    """An engine's pinned version: the image and the engine/SDK versions inside it, each with its source,
    and every name the operator emits for it."""

    image: str
    versions: dict[str, str]  # component -> version (e.g. {"vllm": "0.11.0", "neuron-sdk": "2.27.1"})
    source: str  # where the image and its versions are published
    facts: tuple[Fact, ...]

    def fact(self, name: str) -> Fact | None:
        return next((f for f in self.facts if f.name == name), None)


# Where the Hub's token variables are read (HF_TOKEN, and HUGGING_FACE_HUB_TOKEN, its older name)
HF_HUB = "huggingface_hub 2.4.0 (the version read here): huggingface_hub/_login.py (both token variables)"


@dataclass
class Container:
    """What a container of one role runs: image, command + args, environment (name -> value); the folders it
    writes beside /tmp (each an emptyDir). Our images run non-root with a read-only root; an engine's own
    image (`third_party`) runs as the user it declares, with a writable root, the container runtime's default
    capabilities and the `capabilities` its documentation adds (pod_parts.security). For a compile container:
    whether it needs Neuron devices (it then runs on a node of the serving instance type with the cores of
    the largest tensor parallelism it compiles) and whether it loads the model (its memory follows the
    model's size: `host_resources`)."""

    image: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    writable: tuple[str, ...] = ()
    needs_neuron: bool = False
    third_party: bool = False
    capabilities: tuple[str, ...] = ()
    loads_model: bool = True
    ports: tuple[tuple[str, int], ...] = ()  # (name, port) the container listens on beside its HTTP port
    field_env: dict[str, str] = field(default_factory=dict)  # name -> the pod field it holds (status.podIP)
    shm_size: str = "8Gi"  # its memory-backed /dev/shm
    init_process: bool = False  # the pod's first process reaps the server's orphaned workers (docker --init)
    working_dir: str | None = None  # the container's workingDir; None: the image's own


def kv_events_wanted(spec: NeuronModelSpec, role: str) -> bool:
    """Whether a role's pods are to publish their KV-cache events (vLLM's `--kv-events-config`, port
    KV_EVENTS_PORT) for a router that follows them, where the engine publishes them (`engines.
    publishes_kv_events`): the prefill pods of a disaggregated model routed kv-aware, and the unified pods
    behind a front door routing kv-aware."""
    if spec.serving.routing.policy != "kv-aware":
        return False
    return role == "prefill" or (role == "unified" and front_door.routes_by_prefix(spec))


def artifacts_dir(compile_hash: str) -> str:
    return f"{CACHE_MOUNT}/artifacts/{compile_hash}"


def own_image(spec: NeuronModelSpec) -> str:
    """Our runtime's image: runtime-neuron where it runs TorchNeuron (neuron.compiledSteps neuron, on trn2 or
    trn3), else runtime-cpu (engine embedded on another Neuron instance type is refused by validation)."""
    return OWN_IMAGES["neuron" if spec.neuron.compiledSteps == "neuron" else "cpu"]


def s3_source_dir(uri: str) -> str:
    """Where an s3:// model is downloaded on the compile cache: sources/<sha256 of the URI, 16 hex>/ (as
    runtime/artifacts/s3_source.py cache_folder names it; serving pods mount the cache read-only: they read it
    too)."""
    return f"{CACHE_MOUNT}/sources/{hashlib.sha256(uri.encode()).hexdigest()[:16]}"


def fetch_container(spec: NeuronModelSpec) -> Container | None:
    """For an engine whose image has no AWS SDK (vLLM, TGI), the compile Job's first step (an initContainer,
    our CPU image): `neuronfleet fetch-model` downloads an s3:// model into `s3_source_dir`, resumable and
    verified, which the engine's compile (and serving) then read as a local folder (`model_reference`). None
    for other sources, and for our engine, whose `neuronfleet compile` downloads it itself."""
    if not spec.model.uri.startswith("s3://") or spec.engine == "embedded":
        return None
    command = ["neuronfleet", "fetch-model", "--uri", spec.model.uri, "--into", s3_source_dir(spec.model.uri)]
    return Container(OWN_IMAGES["cpu"], command)


def model_reference(spec: NeuronModelSpec) -> str:
    """How an engine names the model: a Hub id for hf://, a mounted path for pvc:// and file://, the
    download on the compile cache for s3:// (`fetch_container`)."""
    uri = spec.model.uri
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://")
    if uri.startswith("pvc://"):
        return f"{MODEL_MOUNT}/{uri.removeprefix('pvc://').split('/', 1)[1]}".rstrip("/")
    if uri.startswith("file://"):
        return uri.removeprefix("file://")
    if uri.startswith("s3://"):
        return s3_source_dir(uri)
    return uri


def nxdi_neuron_config(spec: NeuronModelSpec) -> dict:
    """NxDI NeuronConfig fields for the spec's shapes, overrides last."""
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


def source_check(spec: NeuronModelSpec) -> str:
    """A shell line that stops the compile when a `file://` or `pvc://` model is not there, saying so in the
    termination message in the words the operator retries on (contract.SOURCE_UNAVAILABLE); empty for the
    other sources (a Hub download reports its own failure: `hub_download_failure`)."""
    if not spec.model.uri.startswith(("file://", "pvc://")):
        return ""
    path = model_reference(spec)
    message = shlex.quote(f"{SOURCE_UNAVAILABLE} {spec.model.uri}: not found at {path}")
    return f'[ -e {shlex.quote(path)} ] || {{ echo {message} | tee "$LOG" >&2; exit 1; }}\n'


def hub_download_failure(indent: str = "") -> str:
    """Python lines, for an `except Exception as e:` around a Hub download, that leave the failure as the
    termination message in the words the operator retries on (contract.SOURCE_UNAVAILABLE), then exit 1."""
    return (
        f"{indent}message = f'{SOURCE_UNAVAILABLE} hf://{{MODEL}}: {{type(e).__name__}}: {{e}}'\n"
        f"{indent}print(message, file=sys.stderr)\n"
        f"{indent}with open(os.environ.get({TERMINATION_LOG_ENV!r}, {TERMINATION_LOG!r}), 'w') as log:\n"
        f"{indent}    log.write(message[:4000])\n"
        f"{indent}sys.exit(1)\n"
    )


HUB_DOWNLOAD_SCRIPT = "hub_download.py"


def hub_download_script() -> str:
    """hub_download.py MODEL REVISION FOLDER: a Hub model at its revision into FOLDER (without the original/
    second copy some repos carry, nor .pth files: what the engines load is the safetensors), its failure left
    as the termination message the operator retries on (`hub_download_failure`)."""
    return (
        "import os\nimport sys\n\nfrom huggingface_hub import snapshot_download\n\n"
        "MODEL = sys.argv[1]\n"
        "try:\n"
        "    snapshot_download(\n        repo_id=MODEL,\n        revision=sys.argv[2] or None,\n"
        '        local_dir=sys.argv[3],\n        ignore_patterns=["original/*", "*.pth"],\n    )\n'
        "except Exception as e:  # not found, gated, refused: the operator tries again later\n"
        f"{hub_download_failure('    ')}"
    )


def progress_echo(phase: str) -> str:
    """sh: the progress line (`contract.CompileProgress`) of a phase boundary, with the seconds since $T0."""
    head = shlex.quote(
        PROGRESS_PREFIX + json.dumps({"phase": phase}, separators=(",", ":"))[:-1] + ',"elapsed":'
    )
    return "echo " + head + "$(( $(date +%s) - T0 ))'}'\n"


def compile_script(spec: NeuronModelSpec, compile_hash: str, step: str) -> str:
    """compile.sh: the engine's compile `step` into artifacts/<hash>/ ($OUT), manifest.json (the completion
    marker) written last, and an immediate exit when the manifest exists already (a cache hit); a model
    folder or file that is not there stops it first (`source_check`). The step's start is a progress line in
    the pod's log (phase compile), which the operator shows with the time it has taken since."""
    manifest = json.dumps({"engine": spec.engine, "compileHash": compile_hash})
    return (
        "#!/bin/sh\nset -eu\n"
        "T0=$(date +%s)\n"
        f"OUT={artifacts_dir(compile_hash)}\n"
        f'LOG="${{{TERMINATION_LOG_ENV}:-{TERMINATION_LOG}}}"  # the termination message the operator reads\n'
        'if [ -f "$OUT/manifest.json" ]; then echo "cache hit: $OUT"; '
        'sed \'s/}$/, "cacheHit": true}/\' "$OUT/manifest.json" > "$LOG" || true; exit 0; fi\n'
        f"{source_check(spec)}"
        'mkdir -p "$OUT"\n'
        f"{progress_echo('compile')}"
        f"{step}\n"
        f'echo {shlex.quote(manifest)} > "$OUT/manifest.json.tmp"\n'
        'mv "$OUT/manifest.json.tmp" "$OUT/manifest.json"\n'
        'sed \'s/}$/, "cacheHit": false}/\' "$OUT/manifest.json" > "$LOG" || true\n'
    )


def missing_files(folder: str, files: list[str]) -> str:
    """sh: collects the files of `files` absent under `folder` in $missing."""
    names = " ".join(shlex.quote(f) for f in files)
    return f'missing=""\nfor f in {names}; do [ -f "{folder}/$f" ] || missing="$missing $f"; done\n'


def start_guard(compile_hash: str, files: list[str], why: str, before_exec: str = "") -> str:
    """sh run before an engine's server (its command follows as "$@"): starts it only when artifacts/<hash>/
    holds this hash's manifest (written last by the compile) and `files`; otherwise writes what is missing
    and `why` the engine is not started to the termination log (Kubernetes' termination message, which the
    operator shows as PodsFailing) and exits 1: a serving pod never compiles or exports into its read-only
    mount. `before_exec`: sh lines run once the artifacts are there, before the server starts."""
    art = artifacts_dir(compile_hash)
    marker = f'"compileHash": "{compile_hash}"'  # as compile_script writes the manifest
    return (
        "set -u\n"
        f'LOG="${{{TERMINATION_LOG_ENV}:-{TERMINATION_LOG}}}"\n'
        f"{missing_files(art, ['manifest.json', *files])}"
        f'if [ -z "$missing" ] && ! grep -q {shlex.quote(marker)} '
        f'"{art}/manifest.json"; then missing=" manifest.json of compile hash {compile_hash}"; fi\n'
        'if [ -n "$missing" ]; then\n'
        f'  msg="compiled artifacts missing at {art}:$missing; {why}: the compile Job of hash {compile_hash} '
        'has not completed"\n'
        '  echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1\n'
        "fi\n"
        f"{before_exec}"
        'exec "$@"\n'
    )
