"""vLLM with the vLLM Neuron plugin on Trn2 and Trn3 (the plugin's own model code, no NxD Inference),
pinned in `PINNED`: `vllm serve` with the shapes in vLLM's flags and the plugin's settings in
`--additional-config {"neuron_config": ...}`; prefill and decode servers with vLLM's NIXL KV connector over
LIBFABRIC (EFA).

Compile ahead: the plugin compiles one graph per bucket while the server warms up, into its local compile
cache ($VLLM_CACHE_ROOT/neuron/compile_cache/<key>/, CACHE), and a server started with
VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 treats a cache miss as a fatal RuntimeError instead of compiling. So the
compile Job downloads the model into artifacts/<hash>/model, starts the server once per tensor parallelism the
pods run, waits until it has warmed up (or exited), and copies the compile cache into artifacts/<hash>/neff;
serving pods copy that folder into their own local cache (an emptyDir: the cache takes file locks, which a
shared file system may not honour) and start with warm-up compilation off, so a graph the compile did not make
fails the pod (its message is the termination message) instead of compiling on a Neuron node. On Trn2 and
Trn3 the Job compiles on a CPU node (VLLM_NEURON_CPU_COMPILE=1, NEURON_PLATFORM_TARGET_OVERRIDE=trn2|trn3:
CPU_COMPILE, CPU_TARGETS says what was read). The compile and start timeouts (the plugin's and vLLM's
variables, TIMEOUTS) come from the model's size or the spec (`timeouts`).

Pinned at Neuron SDK 2.32.0, the newest release whose image recipe and plugin documentation could be read in
full at that version: 2.33.0's image tag is published (0.29.0.1.2.0, SDK 2.33.0 DLC page) but its plugin pages
could be read only in part, and the remote-cache variable's name differs between the pages that could be read
(NEURON_LIBTORCH_REMOTE_CACHE, VLLM_NEURON_REMOTE_CACHE); docs/engine-vllm.md says what moving the pin needs.
"""

from __future__ import annotations

import json
import shlex

from neuronfleet.contract import CONFIG_MOUNT, KV_EVENTS_CONFIG

from .. import parallelism, topology
from ..spec import NeuronModelSpec
from . import timeouts
from .common import (
    HF_HUB,
    HUB_DOWNLOAD_SCRIPT,
    Container,
    Fact,
    Pinned,
    artifacts_dir,
    compile_script,
    hub_download_script,
    kv_events_wanted,
    model_reference,
)
from .common import start_guard as common_start_guard

# ---- the pinned version and its sources --------------------------------------------------------------------

SDK = "aws-neuron/aws-neuron-sdk@v2.32.0"
DLC = (
    "aws-neuron/deep-learning-containers@2.32.0:README.md (vllm-inference-neuronx: 0.24.0.1.1.0, Neuron "
    "2.32.0, trn2, trn3, py313) and vllm/inference/0.24.0.1.1.0/Dockerfile.neuronx (vllm-neuron branch "
    "release-0.24.0.1.1.0 into /opt/vllm, neuronx-cc 2.27.5334.0, libtorch-neuronx-lite 2.11.0.1.0.1284, the "
    "EFA installer, a libcuda.so.1 stub for NIXL's LIBFABRIC backend; no USER line: root; WORKDIR "
    "/workspace/vllm)"
)
RELEASE = f"{SDK}:release-notes (2.32.0: vLLM Neuron 0.24.0.1.1.0 = vLLM 0.24.0, plugin 1.1.0)"
REF = f"{SDK}:vllm-neuron/docs/guides/reference-configuration.md"
FEATURES = f"{SDK}:vllm-neuron/docs/guides/features-guide.md"
CACHE = f"{SDK}:vllm-neuron/docs/design/compilation/compilation_cache.md (Cache Tiers, Environment Variables)"
CPU_COMPILE = (
    f"{SDK}:vllm-neuron/docs/design/compilation/cpu_compilation.md and vllm-neuron/docs/model-dev/"
    "cpu-development.md (6. Use CPU compilation mode: the remote cache workflow for production)"
)
NEURONX_CC = f"{SDK}:compiler/neuronx-cc/api-reference-guide/index.rst (--target: inf2, trn1, trn1n, trn2)"
# trn3 as the compiler's target at this SDK: its release notes speak of "trn2 and trn3 targets" (2.31.0's new
# code generation backend) and of compiling for trn3 (2.32.0, compiler 2.27.5334.0, the image's), and an NKI
# example of v2.32.0 passes `--target trn3` to neuronx-cc in NEURON_CC_FLAGS
NEURONX_CC_TRN3 = (
    f"{SDK}:release-notes/components/compiler.rst:37,87 and nki/deep-dives/src/mxfp-matmul/mx_toplevel.py:12 "
    "(NEURON_CC_FLAGS --target trn3); nki/api/nki/__init__.py:17-21 (NEURON_PLATFORM_TARGET_OVERRIDE: "
    "trn1|inf2|gen2, trn2|gen3, trn3|gen4)"
)
# The timeouts the plugin's recipes raise (each recipe's exports, `timeouts` has the values): the plugin's
# compile timeout under both names the pin's pages use (the reference page documents the libtorch one), vLLM's
# execute_model RPC timeout and its wait for the engine core to be ready
TIMEOUTS = (
    f"{SDK}:vllm-neuron/docs/tutorials/tutorial-llama3-70b.md:70-71, tutorial-gpt-oss.md:193-195, "
    "tutorial-di-1p1d-xpyd.md:111-113 and :343; getting-started/quickstart-online-serving.md:30-31"
)
LIBTORCH_TIMEOUT = (
    f"{SDK}:vllm-neuron/docs/guides/reference-configuration.md:198 (Timeout in seconds for individual NEFF "
    "compilation), design/compilation/compilation_cache.md:152 (default 600), tutorials/"
    "tutorial-qwen3-vl-32b.md:50"
)
DI_TUTORIAL = f"{SDK}:vllm-neuron/docs/tutorials/tutorial-di-1p1d-xpyd.md"
DI_DESIGN = f"{SDK}:vllm-neuron/docs/design/vllm/disaggregated-inference.md"
QUICKSTART = f"{SDK}:deploy/environments/quickstart-deploy-dlc.rst (Step 2, Step 3)"
LNC_DOC = f"{SDK}:about-neuron/arch/neuron-features/logical-neuroncore-config.rst"
VLLM_ARGS = "vLLM 0.24.0 engine arguments (vllm/engine/arg_utils.py; docs.vllm.ai configuration/engine_args)"
# --kv-events-config at vLLM 0.24.0 (the vllm-0.24.0 sdist on PyPI, sha256 0862453a...): the flag at
# vllm/engine/arg_utils.py:1513, its JSON's keys and defaults in vllm/config/kv_events.py (KVEventsConfig:
# enable_kv_cache_events, publisher zmq when enabled, endpoint tcp://*:5557, replay_endpoint, buffer_steps,
# hwm, max_queue_size, topic), the publisher and the batch's encoding in vllm/distributed/kv_events.py
KV_EVENTS = "vllm-0.24.0 sdist: vllm/engine/arg_utils.py:1513 and vllm/config/kv_events.py"
VLLM_SERVE = "vLLM 0.24.0 `vllm serve` (vllm/entrypoints/openai/cli_args.py)"
VLLM_ENVS = "vLLM 0.24.0 vllm/envs.py (VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT)"

IMAGE = (
    "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:0.24.0.1.1.0-neuronx-py313-sdk2.32.0-ubuntu24.04"
)
PLATFORMS = ("trn2", "trn3")
# The Neuron platforms the Job compiles for on a CPU node. The plugin takes as NEURON_PLATFORM_TARGET_OVERRIDE
# any of the installed compiler's --target values (CPU_COMPILE: cpu_compilation.md:31-33, "Valid list of
# target values can be found as part of the --target flag ... of neuron compiler"); the compiler's API
# reference at this SDK lists inf2, trn1, trn1n, trn2 (NEURONX_CC), but the compiler of this SDK compiles for
# trn3 (NEURONX_CC_TRN3), and the plugin picks its Trn3 kernels from the same platform target
# (design/framework/model_factory_design.md:75-92, get_platform_target() == "trn3"). What the plugin's own
# code at release-0.24.0.1.1.0 does with trn3 in CPU mode (its static HBM size per platform for the KV budget:
# design/vllm/determine_available_memory_design.md:183-186) could not be read: a real CPU compile for trn3 is
# what proves it (docs/engine-vllm.md).
CPU_TARGETS = ("trn2", "trn3")
NEURON_CONFIG = "neuron_config"  # the key of --additional-config the plugin reads (REF, Overview)
# The plugin's buckets are its own (chunked prefill, decode context lengths), not bounded by the spec's limits
# (the CRD's rule of the largest bucket skips them: engines.limits)
BUCKETS_ARE_LIMITS = False
# Where the pods keep vLLM's local compile cache: an emptyDir (VLLM_CACHE_ROOT; the cache takes file locks)
LOCAL_CACHE_ROOT = "/var/cache/vllm"
COMPILE_PORT = 8000  # the compile Job's server, on 127.0.0.1 only
SIDE_CHANNEL_PORT = 5557  # NIXL's handshake (DI_DESIGN's default; set explicitly)
# The connector for models whose attention slides (DI_DESIGN: NeuronNixlConnector "for DCP topologies and
# sliding-window models such as GPT-OSS"; NixlConnector for standard TP, hybrid TP included)
SLIDING_WINDOW_MODEL_TYPES = ("gpt_oss",)
# The capabilities the image is documented with (QUICKSTART: docker run --cap-add SYS_ADMIN --cap-add
# IPC_LOCK), which it gives no reason for. IPC_LOCK lets a process pin memory past the memlock limit (the
# Neuron runtime's and EFA's DMA buffers: the SDK's Kubernetes tutorial deploy/tutorials/inference/
# k8s-rn50-demo.rst adds IPC_LOCK "to the container"); SYS_ADMIN no Kubernetes page of the SDK adds, but the
# image is documented, and tested by its makers, only with it, so it is kept (docs/security.md says so).
CAPABILITIES = ("SYS_ADMIN", "IPC_LOCK")


def _arg(name: str, meaning: str, value: str, source: str = VLLM_ARGS) -> Fact:
    return Fact(name, "arg", meaning, source, value)


def _config(name: str, meaning: str, value: str, source: str = REF) -> Fact:
    return Fact(f"{NEURON_CONFIG}.{name}", "config", meaning, source, value)


def _env(name: str, meaning: str, value: str, source: str) -> Fact:
    return Fact(name, "env", meaning, source, value)


PINNED = Pinned(
    image=IMAGE,
    versions={
        "vllm": "0.24.0",
        "vllm-neuron": "0.24.0.1.1.0",
        "neuron-sdk": "2.32.0",
        "neuronx-cc": "2.27.5334.0",
        "libtorch-neuronx-lite": "2.11.0.1.0.1284",
        "python": "3.13",
    },
    source=f"{DLC}; {RELEASE}",
    facts=(
        _arg(
            "model_tag",
            "positional: the model, a local folder here (the compile's download)",
            "path",
            VLLM_SERVE,
        ),
        _arg("--host", "address the OpenAI server listens on", "str", VLLM_SERVE),
        _arg("--port", "port of the OpenAI server", "int", VLLM_SERVE),
        _arg("--served-model-name", "the model's name in the API", "str"),
        _arg(
            "--tensor-parallel-size",
            "tensor parallelism: Neuron (logical) cores of the server",
            "int",
            f"{VLLM_ARGS}; {DI_TUTORIAL} (TP may differ between prefill and decode)",
        ),
        _arg(
            "--max-num-seqs",
            "requests decoded together; the largest num_seqs_bucket",
            "int",
            f"{VLLM_ARGS}; {REF}",
        ),
        _arg(
            "--max-model-len",
            "prompt plus generated tokens; vLLM's only bound on a prompt, which must leave "
            "a token to generate",
            "int",
        ),
        _arg("--dtype", "weights and activations", "auto|half|float16|bfloat16|float|float32"),
        _arg(
            "--max-num-batched-tokens",
            "tokens of one prefill step: the largest num_batched_tokens_bucket",
            "int",
            f"{VLLM_ARGS}; {REF} (Compilation options)",
        ),
        _arg(
            "--kv-cache-dtype",
            "fp8: the KV cache in FP8 (needs calibrated scales in the checkpoint)",
            "fp8",
            f"{VLLM_ARGS}; {REF} (KV cache options)",
        ),
        _arg(
            "--enable-expert-parallel",
            "experts spread over the cores (ep_degree)",
            "flag",
            f"{VLLM_ARGS}; {FEATURES} (Expert parallelism)",
        ),
        _arg(
            "--additional-config", f"a JSON object; the plugin reads its '{NEURON_CONFIG}' key", "json", REF
        ),
        _arg(
            "--kv-transfer-config",
            "vLLM's KV connector: NIXL over LIBFABRIC, kv_producer (prefill) or kv_consumer (decode)",
            "json",
            f"{DI_TUTORIAL}; {DI_DESIGN}",
        ),
        _arg(
            "--kv-events-config",
            "KV-cache events (blocks stored / removed) on a ZeroMQ PUB socket: prefill servers of a model "
            "routed kv-aware publish them, the router follows them",
            "json",
            KV_EVENTS,
        ),
        Fact("kv_events.enable_kv_cache_events", "config", "publish the KV-cache events", KV_EVENTS, "bool"),
        Fact(
            "kv_events.endpoint",
            "config",
            "the PUB socket (zmq, the publisher when enabled): tcp://*:PORT binds every address",
            KV_EVENTS,
            "str",
        ),
        Fact(
            "kv_events.replay_endpoint",
            "config",
            "a ROUTER socket answering a subscriber that missed batches with the buffered ones",
            KV_EVENTS,
            "str",
        ),
        Fact(NEURON_CONFIG, "config", "the plugin's settings of a text model", REF, "json"),
        _config(
            "num_batched_tokens_buckets",
            "compiled prefill token counts; the largest equals --max-num-batched-tokens",
            "int-list",
        ),
        _config(
            "decode_context_length_buckets",
            "compiled decode context lengths: ascending, below --max-model-len, multiples of 128",
            "int-list",
        ),
        _config(
            "ep_degree",
            "expert parallelism; with --enable-expert-parallel, divides the world size",
            "int",
            f"{REF}; {FEATURES} (Expert parallelism)",
        ),
        Fact(
            "kv_connector",
            "config",
            "NixlConnector, or NeuronNixlConnector for sliding-window models",
            DI_DESIGN,
            "NixlConnector|NeuronNixlConnector",
        ),
        Fact(
            "kv_role",
            "config",
            "kv_producer (prefill) or kv_consumer (decode)",
            DI_DESIGN,
            "kv_producer|kv_consumer",
        ),
        Fact(
            "kv_buffer_device",
            "config",
            "the KV buffer's device as the tutorial names it",
            DI_TUTORIAL,
            "cuda",
        ),
        Fact(
            "kv_connector_extra_config.backends",
            "config",
            "NIXL's backends: LIBFABRIC (EFA)",
            DI_DESIGN,
            "json",
        ),
        _env(
            "NEURON_LOGICAL_NC_CONFIG",
            "logical NeuronCore configuration, the same at compile and serve",
            "1|2",
            LNC_DOC,
        ),
        _env(
            "VLLM_CACHE_ROOT",
            "vLLM's cache root; the Neuron compile cache is $VLLM_CACHE_ROOT/neuron/compile_cache/<key>/",
            "path",
            CACHE,
        ),
        _env(
            "VLLM_NEURON_CPU_COMPILE",
            "compile the graphs on a CPU instance without executing them",
            "1",
            CPU_COMPILE,
        ),
        _env(
            "NEURON_PLATFORM_TARGET_OVERRIDE",
            "the platform a CPU compile targets (required with VLLM_NEURON_CPU_COMPILE)",
            "trn2|trn3",
            f"{CPU_COMPILE}; {NEURONX_CC}; {NEURONX_CC_TRN3}",
        ),
        _env(
            "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
            "a compile cache miss is a fatal RuntimeError, never a compile",
            "1",
            f"{CACHE}; {CPU_COMPILE} (Preventing Compilation on Production Instances)",
        ),
        _env(
            "NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND",
            "no graph capture on production instances (with VLLM_NEURON_DISABLE_WARMUP_COMPILE)",
            "1",
            CPU_COMPILE,
        ),
        _env(
            "NEURON_SKIP_EFA_AFFINITY",
            "a server without EFA devices starts (without it, it fails)",
            "1",
            QUICKSTART,
        ),
        _env(
            "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "the address NIXL's handshake listens on and advertises (the pod's IP)",
            "str",
            f"{DI_TUTORIAL}; {DI_DESIGN}; {VLLM_ENVS}",
        ),
        _env("VLLM_NIXL_SIDE_CHANNEL_PORT", "NIXL's handshake port", "int", f"{DI_DESIGN}; {VLLM_ENVS}"),
        _env(
            "FI_EFA_ENABLE_SHM_TRANSFER",
            "0: required when prefill and decode share a node (output can be wrong without it)",
            "0",
            DI_TUTORIAL,
        ),
        _env(
            "VLLM_NEURON_COMPILATION_TIMEOUT",
            "seconds one graph's compile may take (the compile Job; default 600)",
            "int",
            TIMEOUTS,
        ),
        _env(
            "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
            "the same, as the reference page names it (the compile Job)",
            "int",
            LIBTORCH_TIMEOUT,
        ),
        _env(
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
            "seconds vLLM waits for a model step of its workers (a first step compiles or loads its graph)",
            "int",
            TIMEOUTS,
        ),
        _env(
            "VLLM_ENGINE_READY_TIMEOUT_S",
            "seconds vLLM waits for its engine to be ready: the compile Job's server compiles every graph "
            "first; a serving pod's loads them",
            "int",
            TIMEOUTS,
        ),
        _env(
            "HF_TOKEN",
            "the Hub token (from the model's secretRef)",
            "str",
            HF_HUB,
        ),
        _env(
            "HUGGING_FACE_HUB_TOKEN",
            "the Hub token, older name (from the model's secretRef)",
            "str",
            HF_HUB,
        ),
    ),
)

# neuron_config keys neuronfleet derives from the spec: an override of one is refused, naming the field
DERIVED = {
    "num_batched_tokens_buckets": "neuron.buckets.context",
    "decode_context_length_buckets": "neuron.buckets.generation",
    "ep_degree": "neuron.expertParallel",
}


def image(spec: NeuronModelSpec) -> str:
    return IMAGE


def model_dir(spec: NeuronModelSpec, compile_hash: str) -> str:
    """The folder vLLM loads: the compile's download of a Hub model, else the mounted or fetched source."""
    if spec.model.uri.startswith("hf://"):
        return f"{artifacts_dir(compile_hash)}/model"
    return model_reference(spec)


def neff_dir(compile_hash: str) -> str:
    """The compiled graphs: the compile's local compile cache, one folder per cache key."""
    return f"{artifacts_dir(compile_hash)}/neff"


def lnc(spec: NeuronModelSpec) -> int:
    inst = topology.INSTANCES[spec.neuron.instanceType]
    return spec.neuron.logicalCores or inst.default_logical_cores


def compile_passes(spec: NeuronModelSpec) -> int:
    """The compile Job starts a server once per tensor parallelism the pods run (`compile_files`)."""
    return len(parallelism.tensor_parallel_degrees(spec))


def compile_neuron_config(spec: NeuronModelSpec) -> dict:
    """compile.json's record of the Neuron settings compiled: the plugin's neuron_config (no NxD Inference
    key: the plugin has its own model code)."""
    return neuron_config(spec)


def cpu_compiles(spec: NeuronModelSpec) -> bool:
    """Whether the compile runs on a CPU node (the platform is a documented compiler target), not a Neuron
    one."""
    return topology.INSTANCES[spec.neuron.instanceType].platform in CPU_TARGETS


def connector(spec: NeuronModelSpec) -> str:
    kv = spec.serving.kvTransfer
    if kv.connector:
        return kv.connector
    shape = topology.known_model(spec.model.uri)
    sliding = shape is not None and shape.model_type in SLIDING_WINDOW_MODEL_TYPES
    return "NeuronNixlConnector" if sliding else "NixlConnector"


def kv_transfer_config(spec: NeuronModelSpec, role: str) -> dict:
    """The prefill (producer) or decode (consumer) server's KV connector: NIXL over LIBFABRIC
    (DI_TUTORIAL)."""
    return {
        "kv_connector": connector(spec),
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cuda",
        "kv_connector_extra_config": {"backends": ["LIBFABRIC"]},
    }


def neuron_config(spec: NeuronModelSpec) -> dict:
    n = spec.neuron
    config: dict = {}
    if n.buckets.context:
        config["num_batched_tokens_buckets"] = list(n.buckets.context)
    if n.buckets.generation:
        config["decode_context_length_buckets"] = list(n.buckets.generation)
    if n.expertParallel:
        config["ep_degree"] = n.expertParallel
    return {**config, **n.overrides}


def engine_args(spec: NeuronModelSpec, role: str) -> list[tuple[str, object]]:
    """What a role's server is started with beside its model, host, port and name, as (flag, value; None for a
    switch): the compile Job runs each tensor parallelism's unified arguments, so the graphs are the ones the
    pods load (the KV connector adds no graph of its own)."""
    n = spec.neuron
    out: list[tuple[str, object]] = [
        ("--tensor-parallel-size", parallelism.role_tensor_parallel(spec, role)),
        ("--max-num-seqs", n.batchSize),
        ("--max-model-len", n.sequenceLength),
        ("--dtype", n.dtype),
    ]
    if n.buckets.context:
        out.append(("--max-num-batched-tokens", max(n.buckets.context)))
    if n.kvCacheDtype == "fp8":
        out.append(("--kv-cache-dtype", "fp8"))
    if n.expertParallel:
        out.append(("--enable-expert-parallel", None))
    if config := neuron_config(spec):
        out.append(("--additional-config", {NEURON_CONFIG: config}))
    if role in ("prefill", "decode"):
        out.append(("--kv-transfer-config", kv_transfer_config(spec, role)))
    if kv_events_wanted(spec, role):  # what the router follows to know what each server holds
        out.append(("--kv-events-config", json.loads(KV_EVENTS_CONFIG)))
    return out


def _words(args: list[tuple[str, object]]) -> list[str]:
    out: list[str] = []
    for flag, value in args:
        if value is None:
            out.append(flag)
        else:
            out += [flag, json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)]
    return out


def engine_env(spec: NeuronModelSpec, role: str) -> dict[str, str]:
    env = {
        "NEURON_LOGICAL_NC_CONFIG": str(lnc(spec)),
        "VLLM_CACHE_ROOT": LOCAL_CACHE_ROOT,
        "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "1",
        "NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND": "1",
        # the start (loads every compiled graph and the weights) and each step, as the recipes raise them
        "VLLM_ENGINE_READY_TIMEOUT_S": str(timeouts.start_seconds(spec, compiles_at_start=False)),
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(timeouts.graph_seconds(spec)),
    }
    kv = spec.serving.kvTransfer
    if role in ("prefill", "decode"):
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(SIDE_CHANNEL_PORT)
        env["FI_EFA_ENABLE_SHM_TRANSFER"] = (
            "0"  # the scheduler may put a prefill and a decode pod on one node
        )
    if role not in ("prefill", "decode") or not kv.efaInterfaces:
        env["NEURON_SKIP_EFA_AFFINITY"] = "1"
    return env


def start_guard(spec: NeuronModelSpec, compile_hash: str) -> str:
    """sh run before `vllm serve`: the artifacts of this hash (the manifest, the compiled graphs, a Hub
    model's download) must be there, then the graphs are copied into the pod's local compile cache."""
    files = ["model/config.json"] if spec.model.uri.startswith("hf://") else []
    local = f"{LOCAL_CACHE_ROOT}/neuron/compile_cache"
    copy = (
        f'if [ -z "$(ls -A {neff_dir(compile_hash)} 2>/dev/null)" ]; then\n'
        f'  msg="no compiled graphs in {neff_dir(compile_hash)}; vLLM is not started, since it would compile '
        'instead of serving"\n'
        '  echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1\n'
        "fi\n"
        f"mkdir -p {local} && cp -a {neff_dir(compile_hash)}/. {local}/\n"
    )
    return common_start_guard(
        compile_hash, files, "vLLM is not started, since it would compile instead of serving", copy
    )


def serve(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, served_name: str | None
) -> Container:
    command = ["vllm", "serve", model_dir(spec, compile_hash), "--host", "0.0.0.0", "--port", str(port)]
    if served_name:
        command += ["--served-model-name", served_name]
    command += _words(engine_args(spec, role))
    guarded = ["/bin/sh", "-c", start_guard(spec, compile_hash), "vllm-start-guard", *command]
    container = Container(
        IMAGE, guarded, engine_env(spec, role), writable=(LOCAL_CACHE_ROOT,),
        third_party=True, capabilities=CAPABILITIES,
    )  # fmt: skip
    if role in ("prefill", "decode"):
        container.field_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "status.podIP"}
        container.ports = (("nixl", SIDE_CHANNEL_PORT),)
    return container


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """compile.sh: a Hub model is downloaded into $OUT/model; then, for each tensor parallelism the pods run,
    the server is started on 127.0.0.1 with the serving arguments and stopped once it has warmed up (every
    bucket compiled); the local compile cache is then copied into $OUT/neff. A server that exits with an
    error fails the compile (its log is the pod's)."""
    lines = [
        'WORK="$OUT.work"  # scratch on the cache volume: the Hub cache, removed after the compile',
        'rm -rf "$WORK" "$OUT/neff" && mkdir -p "$WORK" "$OUT/neff"',
        'export HF_HOME="$WORK/hf"',
    ]
    files: dict[str, str] = {}
    if spec.model.uri.startswith("hf://"):
        files[HUB_DOWNLOAD_SCRIPT] = hub_download_script()
        download = [
            "python3",
            f"{CONFIG_MOUNT}/{HUB_DOWNLOAD_SCRIPT}",
            model_reference(spec),
            spec.model.revision or "",
        ]
        lines.append(" ".join(shlex.quote(w) for w in download) + ' "$OUT/model"')
    model = shlex.quote(model_dir(spec, compile_hash))
    health = f"http://127.0.0.1:{COMPILE_PORT}/health"
    roles = ("prefill", "decode") if spec.serving.mode == "disaggregated" else ("unified",)
    seen: set[int] = set()
    for role in roles:
        tp = parallelism.role_tensor_parallel(spec, role)
        if tp in seen:
            continue
        seen.add(tp)
        args = [(f, v) for f, v in engine_args(spec, role) if f != "--kv-transfer-config"]
        serve_words = ["vllm", "serve", *_words(args)]
        lines += [
            f'echo "compiling at tensor parallelism {tp}"',
            f"{shlex.join(serve_words[:2])} {model} --host 127.0.0.1 --port {COMPILE_PORT} "
            f"{shlex.join(serve_words[2:])} &",
            "pid=$!",
            "while :; do",
            f"  if python3 -c 'import urllib.request; urllib.request.urlopen(\"{health}\", timeout=5)' "
            "2>/dev/null; then kill $pid; wait $pid || true; break; fi",
            "  if ! kill -0 $pid 2>/dev/null; then",
            "    if wait $pid; then break; fi",
            f'    msg="vLLM exited while compiling at tensor parallelism {tp} (its log is above)"',
            '    echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1',
            "  fi",
            "  sleep 10",
            "done",
        ]
    lines += [
        f'if [ -d "{LOCAL_CACHE_ROOT}/neuron/compile_cache" ]; then '
        f'cp -a "{LOCAL_CACHE_ROOT}/neuron/compile_cache/." "$OUT/neff/"; fi',
        'rm -rf "$WORK"',
        'if [ -z "$(ls -A "$OUT/neff")" ]; then',
        '  msg="vLLM finished without compiled graphs in $VLLM_CACHE_ROOT/neuron/compile_cache"',
        '  echo "$msg" >&2; echo "$msg" > "$LOG" || true; exit 1',
        "fi",
    ]
    files["compile.sh"] = compile_script(spec, compile_hash, "\n".join(lines))
    return files


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """On a CPU node for a platform the compiler targets without a device (CPU_COMPILE), else on a node of the
    serving instance type with the cores of the largest tensor parallelism (builders)."""
    graph = str(timeouts.graph_seconds(spec))
    env = {"NEURON_LOGICAL_NC_CONFIG": str(lnc(spec)), "VLLM_CACHE_ROOT": LOCAL_CACHE_ROOT,
           "NEURON_SKIP_EFA_AFFINITY": "1",
           # one graph's compile, each step (a first one waits for its graph), the whole warm-up (TIMEOUTS)
           "VLLM_NEURON_COMPILATION_TIMEOUT": graph, "NEURON_LIBTORCH_COMPILATION_TIMEOUT": graph,
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": graph,
           "VLLM_ENGINE_READY_TIMEOUT_S": str(timeouts.compile_pass_seconds(spec))}  # fmt: skip
    on_cpu = cpu_compiles(spec)
    if on_cpu:
        env["VLLM_NEURON_CPU_COMPILE"] = "1"
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = topology.INSTANCES[spec.neuron.instanceType].platform
    return Container(
        IMAGE, ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"], env, writable=(LOCAL_CACHE_ROOT,),
        needs_neuron=not on_cpu, third_party=True,
        capabilities=() if on_cpu else CAPABILITIES,
    )  # fmt: skip


def reads_hub_when_serving(spec: NeuronModelSpec) -> bool:
    return False  # the compile downloaded the model into the artifacts
