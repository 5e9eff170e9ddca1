"""SGLang-Neuron: SGLang's own launcher (`python -m sglang.launch_server`) with the Neuron platform plugin
(SGLANG_PLATFORM=neuron), prefill/decode with `--disaggregation-mode` over NIXL on EFA; `PINNED` records every
name emitted here, with its source for the pinned version.

No compile step: SGLang-Neuron 0.1.0 compiles when each server starts, "a graph runner that compiles every
prefill and decode shape at startup, so the server never compiles while it serves"
(github.com/sgl-project/sglang-neuron@4e24326:README.md), and documents no separate compile that a Job could
run and the serving pods reuse. So `compiles` is False: the operator runs no compile Job, keeps no artifacts
and says so (Compiled=False, reason NoCompileStep); the pods' startup (the startup probe allows an hour)
includes the compile. An s3:// model is the exception: the compile Job (as compile.serviceAccountName) only
downloads it into the compile cache (the `fetch-model` initContainer, then `compile.sh` checks the folder
and writes the manifest), and the serving pods, which hold no S3 credentials, read it there.
"""

from __future__ import annotations

from neuronfleet.contract import CONFIG_MOUNT

from .. import topology
from ..spec import NeuronModelSpec, valued
from .common import (
    OWN_IMAGES,
    Container,
    Fact,
    Pinned,
    compile_script,
    model_reference,
    refusals_of_nxdi_fields,
)

IMAGE = "public.ecr.aws/neuron/pytorch-inference-sglang-neuron:v0.1.0-neuron-py314-sdk-2.33.0-ubuntu26.04"
# SGLang-Neuron 0.1.0 serves LLMs on Trn3 (its diffusion pipelines, which neuronfleet does not serve, on Trn2)
PLATFORMS = ("trn3",)
# The prefill server's bootstrap port, where decode servers and the router meet it (--disaggregation-
# bootstrap-port: "Bootstrap server port on the prefill server. Default is 8998.", srt/server_args.py)
BOOTSTRAP_PORT = 8998
# NIXL's transport: SGLang reads SGLANG_DISAGGREGATION_NIXL_BACKEND (default UCX); EFA is libfabric's provider
NIXL_BACKEND = "LIBFABRIC"
# The writable places, each an emptyDir beside /tmp, the root read-only: HOME (a Hub model is downloaded into
# HF_HOME, ~/.cache/huggingface, at start; torch's caches; the image's user has no home) and /var/tmp (the
# Neuron compiler's cache, /var/tmp/neuron-compile-cache by default). torch.compile's own cache is under /tmp.
HOME = "/home/neuronfleet"
NEURON_CACHE_DIR = "/var/tmp"

_ARGS = (
    "github.com/sgl-project/sglang@43881a7:python/sglang/srt/server_args.py (ServerArgs, the commit the "
    "image holds); https://docs.sglang.io/advanced_features/server_arguments.html"
)
_PD = "https://docs.sglang.io/advanced_features/pd_disaggregation.html; " + _ARGS
_PLUGIN = (
    "github.com/sgl-project/sglang-neuron@4e24326:README.md, @v0.1.0:docs/getting-started/setup-guide.md; "
    "the AWS announcement of SGLang-Neuron (SGLANG_PLATFORM=neuron python -m sglang.launch_server on Trn3)"
)

PINNED = Pinned(
    image=IMAGE,
    versions={"sglang-neuron": "0.1.0", "sglang": "43881a7", "neuron-sdk": "2.33.0", "python": "3.14"},
    source=(
        "the SGLang-Neuron announcement (the image tag); github.com/sgl-project/sglang-neuron@v0.1.0:docs/"
        "getting-started/setup-guide.md (the image holds SGLang at 43881a7, the plugin, Neuron SDK 2.33.0 "
        "and NIXL); awsdocs-neuron release-notes/components/sglang-plugin.rst (0.1.0: LLMs on Trn3)"
    ),
    facts=(
        Fact("python -m sglang.launch_server", "arg", "SGLang's server launcher", _PLUGIN),
        Fact("SGLANG_PLATFORM", "env", "neuron: selects the plugin's platform at start", _PLUGIN),
        Fact("--model-path", "arg", "a Hub id or a local folder", _ARGS),
        Fact("--host", "arg", "the HTTP server's address", _ARGS),
        Fact("--port", "arg", "the HTTP server's port", _ARGS),
        Fact("--tp-size", "arg", "tensor parallelism (Neuron cores)", _ARGS),
        Fact("--max-running-requests", "arg", "requests run at once (the batch)", _ARGS),
        Fact("--context-length", "arg", "prompt plus generated tokens", _ARGS),
        Fact("--dtype", "arg", "weights and activations: bfloat16, float16, float32", _ARGS),
        Fact("--served-model-name", "arg", "the model's name in the API", _ARGS),
        Fact("--revision", "arg", "the Hub revision", _ARGS),
        Fact("--disaggregation-mode", "arg", "prefill or decode", _PD),
        Fact("--disaggregation-transfer-backend", "arg", "nixl: the KV cache over NIXL", _PD),
        Fact("--disaggregation-bootstrap-port", "arg", f"the prefill's port ({BOOTSTRAP_PORT})", _PD),
        Fact("SGLANG_DISAGGREGATION_NIXL_BACKEND", "env", f"{NIXL_BACKEND}: NIXL over libfabric (EFA)",
             "github.com/sgl-project/sglang@43881a7:python/sglang/srt/environ.py (default UCX); " + _PD),
        Fact("HOME", "env", "a writable home: HF_HOME (~/.cache/huggingface) and torch's caches",
             "https://huggingface.co/docs/huggingface_hub/package_reference/environment_variables"),
    ),
)  # fmt: skip


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def compiles(spec: NeuronModelSpec) -> bool:
    """The graphs compile at each server's start (see above): a compile Job only fetches an s3:// model."""
    return spec.model.uri.startswith("s3://")


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """compile.sh for an s3:// model: the download the initContainer left must hold files; nothing else."""
    folder = model_reference(spec)
    step = (
        f'if [ -z "$(ls -A {folder} 2>/dev/null)" ]; then\n'
        f'  msg="the download left no files in {folder}"\n'
        '  echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1\n'
        "fi"
    )
    return {"compile.sh": compile_script(spec, compile_hash, step)}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """Our CPU image runs compile.sh (a shell check, no Neuron device: placed on any node)."""
    return Container(OWN_IMAGES["cpu"], ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], read_only_root=True)


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
    env = {"SGLANG_PLATFORM": "neuron", "HOME": HOME}
    if role in ("prefill", "decode"):
        command += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl"]
        env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] = NIXL_BACKEND
    if role == "prefill":
        command += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    return Container(IMAGE, command, env, writable=(HOME, NEURON_CACHE_DIR))


def unsupported(spec: NeuronModelSpec) -> list[str]:
    """What SGLang-Neuron 0.1.0 cannot do as asked, each refusal saying what works."""
    n, use = spec.neuron, "engine vllm"
    out = refusals_of_nxdi_fields(spec, "SGLang-Neuron", use)
    if n.maxInputLength != n.sequenceLength - 1:  # (its default: unset, it is that)
        out.append(
            f"{valued(n, 'maxInputLength')} must be neuron.sequenceLength - 1 ({n.sequenceLength - 1}) for "
            "engine sglang: SGLang bounds a prompt by the context length only (--context-length), so a lower "
            f"limit would not be enforced; remove neuron.maxInputLength (its default is that) or use {use}"
        )
    inst = topology.INSTANCES.get(n.instanceType)
    if inst is not None and inst.platform not in PLATFORMS:
        trn3 = ", ".join(name for name, i in topology.INSTANCES.items() if i.platform in PLATFORMS)
        out.append(
            f"engine sglang (SGLang-Neuron {PINNED.versions['sglang-neuron']}) serves LLMs on Trn3 instances "
            f"({trn3}), not {inst.name}; use one of those, or {use} on {inst.name}"
        )
    if spec.serving.mode == "disaggregated" and spec.serving.kvTransfer.transport != "efa":
        out.append(
            f"kvTransfer.transport {spec.serving.kvTransfer.transport}: SGLang-Neuron moves the KV cache "
            "over NIXL on EFA; use kvTransfer.transport efa"
        )
    return out
