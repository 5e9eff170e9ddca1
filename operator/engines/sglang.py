"""SGLang-Neuron: SGLang's own launcher (`python -m sglang.launch_server`) with the Neuron platform plugin
(SGLANG_PLATFORM=neuron), prefill/decode with `--disaggregation-mode` over NIXL on EFA; `PINNED` records every
name emitted here, with its source for the pinned version.

No compile step ahead: SGLang-Neuron 0.1.0 compiles when each server starts, "a graph runner that compiles
every prefill and decode shape at startup, so the server never compiles while it serves"
(github.com/sgl-project/sglang-neuron@4e24326:README.md), and documents no separate compile that a Job could
run. So the operator runs no compile Job and says so (Compiled=False, reason NoCompileStep); but the servers
keep what they compile and download on the model's cache claim, mounted writable (`SERVING_WRITES_CACHE`):
TorchNeuron's persistent NEFF cache and the Hub cache live in a folder of the claim per image (the
troubleshooting page: a cache built by another image version stops the server, "Give this image its own
cache directory"), so a restart or a scale-up loads instead of compiling and downloading again. An s3:// model
is fetched into the claim by a Job (as compile.serviceAccountName: the `fetch-model` initContainer, then
`compile.sh` checks the folder and writes the manifest), since the serving pods hold no S3 credentials.
"""

from __future__ import annotations

import hashlib

from neuronfleet.contract import CACHE_MOUNT, CONFIG_MOUNT

from ..pod_metrics import Names
from ..spec import NeuronModelSpec
from .common import (
    OWN_IMAGES,
    Container,
    Fact,
    Pinned,
    compile_script,
    model_reference,
)

IMAGE = "public.ecr.aws/neuron/pytorch-inference-sglang-neuron:v0.1.0-neuron-py314-sdk-2.33.0-ubuntu26.04"
# SGLang-Neuron 0.1.0 serves LLMs on Trn3 (its diffusion pipelines, which neuronfleet does not serve, on Trn2)
PLATFORMS = ("trn3",)
# The prefill server's bootstrap port, where decode servers and the router meet it (--disaggregation-
# bootstrap-port: "Bootstrap server port on the prefill server. Default is 8998.", srt/server_args.py)
BOOTSTRAP_PORT = 8998
# NIXL's transport: SGLang reads SGLANG_DISAGGREGATION_NIXL_BACKEND (default UCX); EFA is libfabric's provider
NIXL_BACKEND = "LIBFABRIC"
SERVING_WRITES_CACHE = True
# The model sources a Job fetches into the claim (the serving pods hold no S3 credentials): the only models
# with a compile Job (`compiles`; the CRD's rules read it too: engines.limits)
COMPILE_JOB_SOURCES = ("s3://",)
# The servers' own folder in the model's folder of the cache claim, one per image (its tag's hash)
SERVER_CACHE = f"{CACHE_MOUNT}/sglang/{hashlib.sha256(IMAGE.encode()).hexdigest()[:16]}"
# --cap-add SYS_NICE in the container options of the configuration reference (_CONFIG), which gives no
# reason; CAP_SYS_NICE lets a process raise scheduling priorities and set other processes' CPU affinity
# (capabilities(7)). IPC_LOCK with EFA: pod_parts.
CAPABILITIES = ("SYS_NICE",)
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3"}  # spec -> --kv-cache-dtype (the announcement's)
# The scheduler's gauges and the tokenizer manager's TTFT histogram, with --enable-metrics
# (sgl-project/sglang python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector and
# TokenizerMetricsCollector; read at 00ae9c1, the image's 43881a7 not being readable)
METRICS = Names(
    waiting="sglang:num_queue_reqs",
    running="sglang:num_running_reqs",
    kv_usage="sglang:token_usage",
    ttft="sglang:time_to_first_token_seconds",
)

_ARGS = (
    "github.com/sgl-project/sglang@43881a7:python/sglang/srt/server_args.py (ServerArgs, the commit the "
    "image holds); https://docs.sglang.io/advanced_features/server_arguments.html"
)
_PD = "https://docs.sglang.io/advanced_features/pd_disaggregation.html; " + _ARGS
_CONFIG = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/sglang-neuron/reference/configuration.html "
    "(SGLang-Neuron 0.1.0: Container options --cap-add SYS_NICE, --init, --ipc=host) and "
    "reference/troubleshooting.html (a cache directory per image; EFA devices, IPC_LOCK and memlock for P/D)"
)
_TORCHNEURON = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/about-compiler-artifacts.html "
    "(TorchNeuron stores each NEFF in the persistent NEFF cache, TORCH_NEURONX_NEFF_CACHE_DIR)"
)
_METRICS = "github.com/sgl-project/sglang python/sglang/srt/metrics/collector.py (sglang:* names)"
_TROUBLESHOOTING = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/sglang-neuron/reference/troubleshooting.html "
    '(SGLang-Neuron 0.1.0: "Failed to load the backend extension: torch_neuronx" when "Python started in '
    '/workspace": "keep the working directory out of /workspace")'
)
# Where the server's Python starts: out of /workspace (_TROUBLESHOOTING), in the pod's own /tmp, an emptyDir
# every pod has (pod_parts.volumes), which no image's files can shadow
WORKING_DIR = "/tmp"
# The graphs compile as each server starts (above): its start holds a compile (engines.timeouts). No variable
# that bounds that start was found in SGLang-Neuron 0.1.0's configuration and troubleshooting pages (_CONFIG,
# read in part), so the startup probe's budget is the only bound
COMPILES_AT_START = True
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
        Fact("--enable-metrics", "arg", "Prometheus metrics on /metrics (off by default)", _ARGS, "flag"),
        Fact("--ep-size", "arg", "expert parallelism", f"{_ARGS}; the announcement (--ep-size 8)", "int"),
        Fact("--kv-cache-dtype", "arg", "the KV cache's type: fp8_e4m3", f"{_ARGS}; the announcement",
             "fp8_e4m3"),
        Fact("--mem-fraction-static", "arg", "share of device memory for weights and the KV cache pool",
             f"{_ARGS}; the announcement (0.8)", "float"),
        Fact("HF_HOME", "env", "the Hub cache: downloads on the cache claim, once per image",
             "https://huggingface.co/docs/huggingface_hub/package_reference/environment_variables"),
        Fact("TORCH_NEURONX_NEFF_CACHE_DIR", "env", "TorchNeuron's persistent NEFF cache, on the cache claim",
             _TORCHNEURON),
    ),
)  # fmt: skip


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def compiles(spec: NeuronModelSpec) -> bool:
    """The graphs compile at each server's start (see above): a compile Job only fetches an s3:// model."""
    return spec.model.uri.startswith(COMPILE_JOB_SOURCES)


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


def compile_neuron_config(spec: NeuronModelSpec) -> dict:
    """compile.json's record of Neuron settings: none (SGLang-Neuron runs on TorchNeuron, not NxD Inference;
    its shapes are its flags)."""
    return {}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """Our CPU image runs compile.sh (a shell check, no Neuron device: placed on any node)."""
    return Container(OWN_IMAGES["cpu"], ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"])


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    n = spec.neuron
    command = ["python", "-m", "sglang.launch_server", "--model-path", model_reference(spec)]
    command += ["--host", "0.0.0.0", "--port", str(port), "--tp-size", str(n.tensorParallel)]
    command += ["--max-running-requests", str(n.batchSize), "--context-length", str(n.sequenceLength)]
    command += ["--dtype", n.dtype, "--enable-metrics"]
    if n.expertParallel:
        command += ["--ep-size", str(n.expertParallel)]
    if n.kvCacheDtype != "auto":
        command += ["--kv-cache-dtype", KV_CACHE_DTYPES[n.kvCacheDtype]]
    if n.memoryFraction is not None:
        command += ["--mem-fraction-static", str(n.memoryFraction)]
    if served_name:
        command += ["--served-model-name", served_name]
    if spec.model.revision:
        command += ["--revision", spec.model.revision]
    env = {
        "SGLANG_PLATFORM": "neuron",
        "HF_HOME": f"{SERVER_CACHE}/hf",
        "TORCH_NEURONX_NEFF_CACHE_DIR": f"{SERVER_CACHE}/neff",
    }
    if role in ("prefill", "decode"):
        command += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl"]
        env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] = NIXL_BACKEND
    container = Container(
        IMAGE, command, env, third_party=True, capabilities=CAPABILITIES,
        init_process=True, working_dir=WORKING_DIR,
    )  # fmt: skip
    if role == "prefill":
        command += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
        container.ports = (("bootstrap", BOOTSTRAP_PORT),)
    return container


def reads_hub_when_serving(spec: NeuronModelSpec) -> bool:
    """Given a Hub id, the server downloads the model at start (into HF_HOME, on the claim: once)."""
    return spec.model.uri.startswith("hf://")
