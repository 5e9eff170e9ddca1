"""The contract between the operator and the runtime: what the operator renders into a pod and what the
runtime's commands parse back, typed once.

- `ServeConfig`: every option of `neuronfleet serve`. The operator builds one per serving role and renders
  it with `to_args()`; the serve command's flags are generated from its fields (`add_serve_arguments`), so
  a field without a flag, or a flag without a field, cannot exist.
- `CompileConfig`: compile.json, which the operator writes into the runtime ConfigMap and
  `neuronfleet compile` reads.
- Where pods find things (mount paths), the environment variables both sides name, and the defaults both
  sides rely on.
- The compile's progress lines (`CompileProgress`): what a compile prints, the operator and the CLI read.

Only pydantic and the standard library: the operator's image has no runtime packages, the runtime's no
operator packages, and both import this module.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Sequence
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ---- where pods find things --------------------------------------------------------------------------------

# the compile cache (artifacts/<hash>/): in each pod, its model's own folder of the claim (model_cache_folder)
CACHE_MOUNT = "/var/lib/neuronfleet/cache"
CONFIG_MOUNT = "/etc/neuronfleet"  # the runtime ConfigMap (compile.json, engines' compile scripts)
COMPILE_CONFIG_FILE = "compile.json"  # the ConfigMap's key, a file under CONFIG_MOUNT
MODEL_MOUNT = "/var/lib/neuronfleet/model"  # a pvc:// model's claim, read-only
INTERNAL_TOKEN_DIR = "/var/run/neuronfleet/internal"  # the internal token Secret, read-only
INTERNAL_TOKEN_FILE = f"{INTERNAL_TOKEN_DIR}/token"


def model_cache_folder(model: str) -> str:
    """A model's own folder of its compile cache claim, which is all its pods mount of it (a volumeMount's
    subPath) at CACHE_MOUNT: its artifacts/<hash>/, its s3:// downloads (sources/) and its engine's caches.
    Claims are namespaced, so the name is the model's own on that claim."""
    return f"models/{model}"


# ---- environment variables ---------------------------------------------------------------------------------

TERMINATION_LOG_ENV = "NEURONFLEET_TERMINATION_LOG"  # where a compile leaves its manifest (default below)
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes shows its content as the termination message
# `neuronfleet` exits with this on a refusal (a ValueError: a bad setting, a model the spec cannot serve, a
# source that is not there): the same input fails the same way, so the compile Job fails at once on it
# (its podFailurePolicy) instead of running backoffLimit more pods
EXIT_REFUSED = 2
# how a failed compile's termination message starts when its model source could not be read (missing file,
# empty claim, Hub access refused): the operator tries it again later, as the source may be fixed
SOURCE_UNAVAILABLE = "model source unavailable:"
INTERNAL_TOKEN_ENV = "NEURONFLEET_INTERNAL_TOKEN"  # the internal token, when no token file is given
PEER_HOSTS_FILE_ENV = "NEURONFLEET_PEER_HOSTS_FILE"  # the router's --peer-hosts-file, when not given
POD_IP_ENV = "POD_IP"  # a decode pod's own address (the downward API), advertised to prefill pods
HF_TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # a model's download token, from its secretRef

# ---- defaults both sides rely on ---------------------------------------------------------------------------

SERVE_PORT = 8000  # HTTP port of the serving pods
KV_PORT = 7000  # decode pods' KV receiver when the operator runs them
GRACE_PERIOD = 30.0  # seconds a serving pod finishes requests in flight after SIGTERM
# seconds a request may be expected to wait for a slot before it is refused with Retry-After: well under the
# OpenAI Python client's default timeout (600 s, openai._constants.DEFAULT_TIMEOUT), leaving time to answer
MAX_QUEUE_WAIT = 60.0
HEADER_TIMEOUT = 30.0  # seconds an HTTP client has to send a request's headers, from its first byte
BODY_TIMEOUT = 60.0  # seconds an HTTP client has to send a request's whole body, once its headers are in

# how a router chooses a request's pod (runtime/routing/prefix_routing.py; docs/routing.md), and its knobs'
# defaults: requests a pod may carry above the least loaded one and still win for its prefix, and the tokens
# of prompt a pod's prefix cache is taken to hold when the operator does not say (8 slots of 4096)
RoutingPolicy = Literal["kv-aware", "least-loaded"]
ROUTING_LOAD_MARGIN = 2
ROUTING_CACHE_TOKENS = 32768


class KvEventsConfig(BaseModel):
    """`--kv-events-config`: where a serving pod publishes its KV-cache events (block stored / removed), the
    JSON that vLLM's flag of the same name takes, with vLLM's keys and defaults (vllm-project/vllm,
    `vllm/config/kv_events.py`), so the operator renders one form for vLLM pods and ours. Routers that
    tokenize subscribe to it (runtime/routing/kv_event_index.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1)
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return (self.publisher or ("zmq" if self.enable_kv_cache_events else "null")) == "zmq"

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """From the flag's JSON; a ValueError says what is wrong and what is expected."""
        try:
            return cls.model_validate_json(text)
        except ValueError as e:
            keys = ", ".join(cls.model_fields)
            raise ValueError(
                f"--kv-events-config {text!r}: expected a JSON object with keys among {keys} (vLLM's), "
                f'e.g. \'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}}\': {e}'
            ) from None


# where the operator's pods (ours, vLLM's) publish their KV-cache events for the router that follows them:
# not vLLM's default endpoint port, 5557, which the vLLM Neuron plugin's disaggregated-inference pages give
# NIXL's side channel (VLLM_NIXL_SIDE_CHANNEL_PORT) on the same prefill pods; vLLM offsets both by the
# data-parallel index, so 13 apart leaves room for that
KV_EVENTS_PORT = 5570
KV_EVENTS_REPLAY_PORT = 5571  # their replay endpoint: a router that missed batches asks for them there
KV_EVENTS_CONFIG = json.dumps({
    "enable_kv_cache_events": True,
    "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
    "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
})  # fmt: skip

Role = Literal["unified", "prefill", "decode", "router"]
# what a router's prefill and decode peers speak: our runtime's /internal/* exchange, or an engine's own P/D
# protocol at the OpenAI HTTP level (runtime/routing/pd_protocols.py)
PeerProtocol = Literal["neuronfleet", "vllm", "sglang"]
ServeDType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8", "int4"]
CompiledSteps = Literal["off", "inductor", "aot_eager", "neuron"]  # runtime/model/compiled_steps.py
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch sizes below the slot count
# graphs a compiled server may run, one per bucket (seconds to a minute each with Inductor on 2 cores, in the
# compile Job or a serving pod): a bucket table that makes more is refused with what to change
MAX_COMPILED_GRAPHS = 256
# TorchNeuron, the engine embedded's backend on trn2 and trn3 (experimental; runtime/model/neuron_device.py
# cites each fact): the versions the runtime-neuron image pins, and the variable that tells a compile Job and
# its pods the instance family the NEFFs are compiled for (part of their key)
TORCHNEURON_PINNED = {"torch-neuronx": "2.13.3.1", "torch": "2.13.0", "neuron-sdk": "2.34.0"}
NEURON_TARGET_ENV = "NEURONFLEET_NEURON_TARGET"
TORCHNEURON_FAMILIES = ("trn2", "trn3")  # the instance families torch-neuronx serves


def instance_family(instance_type: str) -> str:
    """The engine matrix's family of an instance type (trn1n is trn1, trn2u trn2)."""
    return instance_type.split(".")[0].rstrip("nu") if instance_type != "cpu" else "cpu"


def batch_buckets(slots: int) -> list[int]:
    """Decode batch sizes (and a compiled prefill group's row counts): powers of two below the slot count, and
    the slot count."""
    return [b for b in BATCH_BUCKETS if b < slots] + [slots]


def compiled_buckets(slots: int, prefill: Sequence[int], decode: Sequence[int]) -> list[tuple]:
    """Every bucket compiled passes may run for these (sorted) tables, a graph each: ("decode", batch,
    length), a batch bucket by a length bucket; ("prefill", rows, length, context), a row count by a prompt
    bucket by a context bucket (the cache positions it reads: a length bucket past the prompt bucket
    below)."""
    rows = batch_buckets(slots)
    out: list[tuple] = [("decode", b, n) for b in rows for n in decode]
    for r in rows:
        for length, low in zip(prefill, [0, *prefill[:-1]], strict=True):
            out += [("prefill", r, length, c) for c in decode if c > low]
    return out


AUTO_HELP = (
    "weights and activations; auto (the default): bfloat16 where the CPU computes it natively (AVX512-BF16, "
    "AMX-BF16, ARM BF16), else float32, with a served model's float weights held in float16 on an x86 CPU "
    "(fbgemm's float16-weight GEMM, float32 arithmetic: half the bytes a decode step reads); bfloat16 on "
    "every CPU for int8/int4 weights (their kernels take it); resolved once at start (/info says which, and "
    "that it was auto)"
)
QUANT_HELP = (
    "weight-only quantization on torch's packed CPU kernels: int8 (per output channel) or int4 (groups of "
    "32) "
    "of every decoder linear layer, the LM head and embedding int8; default: what the model folder holds "
    "(float, or what neuronfleet compile quantized); a float folder is quantized once at start"
)
CompileDType = Literal["auto", "bfloat16", "float16", "float32"]


# ---- what a model was trained for --------------------------------------------------------------------------

# RoPE scalings whose max_position_embeddings already counts the scaled length (Llama 3.1's llama3, Phi-3's
# longrope and its older name su); others (linear, dynamic, yarn) stretch it by their factor
_ROPE_SCALINGS_ALREADY_COUNTED = ("default", "llama3", "longrope", "su")


def model_length_limit(config: dict[str, Any]) -> int | None:
    """The longest sequence a Hugging Face config.json says its model serves: `max_position_embeddings`
    (of its `text_config` for a model with one), stretched by a RoPE scaling's factor where the scaling does
    not count itself in it, so a long-context model is never refused short. None when the config says
    nothing. The compile (`check_lengths`) and the operator's validation (hf:// models, read from the Hub)
    both refuse a `neuron.sequenceLength` past it."""
    text = config.get("text_config")
    config = text if isinstance(text, dict) and "max_position_embeddings" in text else config
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        if kind not in _ROPE_SCALINGS_ALREADY_COUNTED and isinstance(factor, int | float) and factor > 1:
            limit = int(limit * factor)
    return limit


def length_refusal(sequence_length: int, limit: int, where: str) -> str:
    """The refusal of a `neuron.sequenceLength` past a model's limit, said the same by the compile and the
    operator (`where`: what the limit was read from)."""
    return (
        f"neuron.sequenceLength {sequence_length} is past the model's max_position_embeddings ({limit}, "
        f"{where}): set it to {limit} or less (and neuron.maxInputLength below it)"
    )


def parse_buckets(text: str) -> list[int]:
    """--prefill-buckets/--decode-buckets: comma-separated token lengths, e.g. 128,512,2048."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token lengths like 128,512, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"bucket lengths must be positive integers, got {text!r}")
    return sorted(set(values))


def _flag(default: Any, help: str, **flag: Any) -> Any:
    """A serve option: its default, its help text and, where the flag is not `--<field-name>`, its spelling
    (`flag="--no-prefix-reuse"` for a switch that turns a default-true field off)."""
    return Field(default, description=help, json_schema_extra=flag or None)


class ServeConfig(BaseModel):
    """`neuronfleet serve`: field names are the parsed options' names (`args.<field>`), flags are
    `--field-name`. Fields are in the order the operator renders them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = _flag(
        None,
        "Hugging Face-format model folder (every role but a router with --peer-protocol vllm|sglang; a "
        "front door with --unified or a vllm router reads only its tokenizer, to route by the token blocks "
        "the pods cache)",
    )
    role: Role = _flag("unified", "what this process serves: one model, a role of a disaggregated one")
    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(SERVE_PORT, "HTTP port")
    slots: int = _flag(8, "static batch: requests decoded together")
    max_seq_len: int = _flag(2048, "prompt + generated tokens per slot")
    max_input_len: int | None = _flag(
        None,
        "longest prompt in tokens, the largest prefill bucket (default: the largest --prefill-buckets, else "
        "--max-seq-len)",
    )
    prefill_buckets: list[int] | None = _flag(None, "prompt length buckets, e.g. 128,512 (default: derived)")
    decode_buckets: list[int] | None = _flag(
        None, "KV length buckets for decode; the largest is --max-seq-len"
    )
    prefill: list[str] | None = _flag(None, "router: a prefill peer URL (http://host:port); repeat")
    decode: list[str] | None = _flag(None, "router: a decode peer URL (http://host:port); repeat")
    unified: list[str] | None = _flag(
        None,
        "router as a front door: a unified pod (any engine) as http://host:port, or dns://name:port of their "
        "headless Service; repeat. Every request path but /health, /ready and /metrics goes as is to the "
        "least loaded ready one; no model files (no --model)",
    )
    peer_protocol: PeerProtocol = _flag(
        "neuronfleet",
        "router: what the peers speak: neuronfleet (our runtime's KV handoff), or the P/D protocol of vllm "
        "(kv_transfer_params) or sglang (bootstrap host/port/room) at the OpenAI HTTP level, which needs no "
        "model files (--model: a vllm router reads the tokenizer only, to route by token blocks)",
    )
    bootstrap_port: int | None = _flag(
        None, "router, --peer-protocol sglang: the prefill servers' --disaggregation-bootstrap-port"
    )
    served_model_name: str | None = _flag(None, "model name in the APIs (default: the folder's name)")
    kv_transport: Literal["tcp", "nixl", "efa"] = _flag(
        "tcp",
        "prefill/decode KV transport: tcp (our own), nixl (NIXL, the backend --kv-nixl-backend names; pip "
        "install 'neuronfleet[nixl]'), efa (NIXL over LIBFABRIC: EFA devices and libfabric >= 1.21)",
    )
    kv_nixl_backend: Literal["ucx", "libfabric"] | None = _flag(
        None,
        "prefill/decode, --kv-transport nixl: NIXL's backend, ucx (any network; the default) or libfabric "
        "(EFA)",
    )
    kv_port: int = _flag(0, "decode, --kv-transport tcp: port of the KV receiver (0: a free one)")
    internal_token_file: str | None = _flag(
        None, f"prefill/decode: the model's internal token (else {INTERNAL_TOKEN_ENV})"
    )
    dtype: ServeDType = _flag("auto", AUTO_HELP)
    quantization: Quantization | None = _flag(None, QUANT_HELP)
    prefix_reuse: bool = _flag(
        True,
        "prefill every prompt whole, even when its slot's cache already holds its first tokens",
        flag="--no-prefix-reuse",
    )
    host_kv_cache_bytes: int | None = _flag(
        None,
        "bytes of host memory that keep KV blocks after their slot is overwritten, for later prompts to copy "
        "back instead of prefilling (a prefix cache that outlives its slot; its blocks count in the KV "
        "events); 0: none (default: as many bytes as the slots' own KV cache, --slots x --max-seq-len "
        "tokens)",
    )
    decode_graph: bool = _flag(
        True,
        "decode op by op from Python (by default, on CPU, a step that only decodes replays a graph of the "
        "model's layers recorded on the first one: the same results, without Python between the ops)",
        flag="--no-decode-graph",
    )
    tensor_parallel: int = _flag(
        1,
        "ranks the model is split over (tensor parallelism: each holds its share of every layer's heads and "
        "MLP columns), processes of this server joined by torch.distributed (gloo on cpu); role unified only",
    )
    compiled_steps: CompiledSteps = _flag(
        "off",
        "run the model's passes as compiled graphs of static shapes, one per bucket, compiled as each bucket "
        "is first run (inductor: compiled to C++ on CPU, a compiler needed; aot_eager: traced only, the "
        "graphs a device is given; neuron: on a Trainium device with TorchNeuron, experimental, loading the "
        "graphs the compile Job warmed into the artifacts' NEFF cache and compiling none; off: op by op). "
        "Float weights only",
    )
    kv_leases: int | None = _flag(None, "decode: concurrent KV handoffs (default: --slots)")
    kv_wait: float = _flag(
        30.0,
        "seconds a handoff may take: the router's wait for a prefill and its push, the prefill pod's for the "
        "decode pod's acknowledgements, the decode pod's for the bytes (then it prefills itself)",
    )
    kv_lease_ttl: float = _flag(60.0, "decode: seconds a KV lease lives unless used")
    kv_advertise: str | None = _flag(
        None,
        f"decode: HOST[:PORT] that prefill pods should send KV caches to (default: ${POD_IP_ENV}, else "
        "--host; the port defaults to --kv-port)",
    )
    peer_probe_interval: float = _flag(2.0, "router: seconds between peer health probes")
    local_prefill_below: int = _flag(
        0,
        "router: prompts shorter than this many tokens are prefilled on their decode pod, without a handoff "
        "(0: every prompt goes to a prefill pod)",
    )
    peer_timeout: float = _flag(
        60.0,
        "router: seconds of silence from a decode pod before its request moves to another, and the longest a "
        "peer may take to answer a status probe",
    )
    peer_hosts_file: str | None = _flag(
        None,
        "router: a static name -> addresses map for environments without cluster DNS (JSON: "
        '{"name:port": ["host:port", ...]}), looked up before DNS for dns:// peers and read again at each '
        f"resolution (else {PEER_HOSTS_FILE_ENV})",
    )
    hold_requests: int = _flag(
        0,
        "router: while no pod a request needs is ready (at zero), hold up to this many requests until one is "
        "(one more gets 429); 0: hold none. With holding the router's /ready is 200 even with no pod",
    )
    hold_seconds: float = _flag(300.0, "router: the longest a request is held; then 503 with Retry-After")
    max_resumes: int = _flag(
        2,
        "router with --unified or --peer-protocol vllm|sglang, with --model: the most times one streamed "
        "OpenAI answer whose pod dies is resumed on another pod from the prompt and the tokens already sent "
        "(0: never; it then ends cut)",
    )
    wake_url: str | None = _flag(
        None, "router: POSTed (no body) when a request is held, again every 5 s while any stays held"
    )
    routing: RoutingPolicy = _flag(
        "kv-aware",
        "router: how a request's pod is chosen: kv-aware (the pod with the lowest expected time to first "
        "token: its wait for a slot plus the prefill of the prompt's prefix it does not hold, from the pods' "
        "load and the router's own timings of them; before those are measured, the pod expected to hold the "
        "longest prefix unless it carries more than --routing-load-margin requests above the least loaded "
        "pod) or least-loaded",
    )
    routing_load_margin: int = _flag(
        ROUTING_LOAD_MARGIN,
        "router, kv-aware, until the pods' timings are measured (or where a pod's slots are unknown): "
        "requests a pod may carry above the least loaded pod and still be chosen for the prefix it holds",
    )
    routing_cache_tokens: int = _flag(
        ROUTING_CACHE_TOKENS, "router, kv-aware: tokens of prompt each pod's prefix cache is taken to hold"
    )
    routing_pod_slots: int = _flag(
        0,
        "router, kv-aware: slots (requests at once) of each pod whose status does not say them (a front "
        "door's pods: the model's batch size), to price a pod's wait for a slot; 0: unknown",
    )
    router_queue: bool = _flag(
        True,
        "router with --unified: while every ready pod's slots are taken (as its status says, else "
        "--routing-pod-slots), a request waits at the front door, in arrival order, for the first slot to "
        "free and its pod is chosen then (late binding), instead of waiting in the queue of the pod chosen "
        "when it came; within --max-queue-wait",
        flag="--no-router-queue",
    )
    override_generation_config: str | None = _flag(
        None,
        "sampling defaults laid over the model's generation_config.json, as vLLM's flag of the same name: a "
        "JSON object of temperature, top_p, top_k, repetition_penalty; an OpenAI request that leaves one out "
        "gets it (/info says what they are), its own values always win",
    )
    kv_events_config: str | None = _flag(
        None,
        "unified, prefill, decode: publish the KV-cache's block stored / removed events on ZeroMQ, in vLLM's "
        "format and with its flag's JSON (keys enable_kv_cache_events, publisher, endpoint, replay_endpoint, "
        "buffer_steps, hwm, max_queue_size, topic), for routers that place requests by what each pod holds",
    )
    peer_kv_events: str | None = _flag(
        None,
        "router with --peer-protocol vllm or --unified: where its (prefill or unified) peers publish "
        "KV-cache events when they do not say: the JSON of their --kv-events-config (vLLM's), its endpoint "
        "and replay_endpoint at each peer's own address (tcp://*:PORT); with --model the router names the "
        "events' blocks and routes by what each peer holds",
    )
    max_waiting: int = _flag(256, "bound of the waiting queue")
    max_queue_wait: float = _flag(
        MAX_QUEUE_WAIT,
        "unified, decode, our prefill/decode router and a front door: the longest a request may be expected "
        "to wait for a slot, in seconds (from the requests ahead and the service rate measured); past it the "
        "request is refused at once (OpenAI 429, TGI 503) with Retry-After, and one that has waited that "
        "long is refused then. 0: no bound",
    )
    max_body_bytes: int = _flag(1 << 20, "largest request body in bytes")
    header_timeout: float = _flag(
        HEADER_TIMEOUT,
        "seconds a client has to send a request's headers (from a new connection, or from the next request's "
        "first byte on a kept-alive one); then 408 and the connection closed",
    )
    body_timeout: float = _flag(
        BODY_TIMEOUT,
        "seconds a client has to send a request's whole body; then 408 and the connection closed",
    )
    grace_period: float = _flag(GRACE_PERIOD, "seconds to finish requests on SIGTERM")

    @model_validator(mode="after")
    def _roles_need(self) -> ServeConfig:
        """What each role needs, said clearly: a model folder, except for a router that speaks an engine's
        protocol (it reads none); the bootstrap port exactly for sglang peers."""
        front_door = self.role == "router" and bool(self.unified)
        engine_router = self.role == "router" and (self.peer_protocol != "neuronfleet" or front_door)
        if self.unified and (
            self.role != "router" or self.prefill or self.decode or self.peer_protocol != "neuronfleet"
        ):
            raise ValueError(
                "--unified is for --role router as a front door to unified pods, without --prefill, --decode "
                "or --peer-protocol"
            )
        if self.role != "router" and (self.hold_requests or self.wake_url):
            raise ValueError(f"--hold-requests and --wake-url are for --role router, not {self.role}")
        if not self.max_queue_wait >= 0:
            raise ValueError(
                f"--max-queue-wait {self.max_queue_wait:g}: the longest expected wait for a slot admitted, "
                "in seconds (0: no bound)"
            )
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise ValueError(
                f"--header-timeout {self.header_timeout:g} --body-timeout {self.body_timeout:g}: seconds a "
                "client has to send a request's headers and its body, each over 0"
            )
        if self.hold_requests < 0 or self.hold_seconds <= 0:
            raise ValueError(
                f"--hold-requests {self.hold_requests} --hold-seconds {self.hold_seconds:g}: the most "
                "requests held at once (0: none) and the longest one is held, in seconds (over 0)"
            )
        if self.max_resumes < 0:
            raise ValueError(f"--max-resumes {self.max_resumes}: the most resumes of one stream (0: none)")
        if self.host_kv_cache_bytes is not None and self.host_kv_cache_bytes < 0:
            raise ValueError(
                f"--host-kv-cache-bytes {self.host_kv_cache_bytes}: bytes of host memory for KV blocks (0: "
                "no host KV store)"
            )
        routing = {n for n in ("routing", "routing_load_margin", "routing_cache_tokens", "routing_pod_slots",
                               "router_queue") if getattr(self, n) != _default(n)}  # fmt: skip
        if self.role != "router" and routing:
            flags = ", ".join(sorted(_spelling(n) for n in routing))
            raise ValueError(f"{flags}: for --role router, not {self.role}")
        if self.routing_load_margin < 0 or self.routing_cache_tokens < 1 or self.routing_pod_slots < 0:
            raise ValueError(
                f"--routing-load-margin {self.routing_load_margin} --routing-cache-tokens "
                f"{self.routing_cache_tokens} --routing-pod-slots {self.routing_pod_slots}: requests above "
                "the least loaded pod (0 or more), tokens a pod's prefix cache holds (1 or more) and a pod's "
                "slots (0: unknown, or more)"
            )
        if self.override_generation_config is not None:
            if front_door or engine_router:
                raise ValueError(
                    "--override-generation-config is for the pods that parse requests (unified, and our "
                    "router over prefill and decode pods); a front door or an engine's router passes them on"
                )
            try:
                override = json.loads(self.override_generation_config)
            except ValueError:
                override = None
            if not isinstance(override, dict):
                raise ValueError(
                    f"--override-generation-config {self.override_generation_config!r}: expected a JSON "
                    'object such as \'{"temperature": 0.2, "top_p": 0.9}\''
                )
        if self.kv_events_config is not None:
            if self.role == "router":
                raise ValueError("--kv-events-config is for serving pods (unified, prefill, decode)")
            KvEventsConfig.parse(self.kv_events_config)
        if self.wake_url is not None and not self.wake_url.startswith(("http://", "https://")):
            raise ValueError(f"--wake-url {self.wake_url!r}: an http:// or https:// URL")
        if self.role != "router" and self.peer_protocol != "neuronfleet":
            raise ValueError(f"--peer-protocol {self.peer_protocol} is for --role router, not {self.role}")
        if self.model is None and not engine_router:
            raise ValueError(
                f"--role {self.role} needs --model (a Hugging Face-format folder); only a router with "
                "--peer-protocol vllm|sglang or --unified serves without one"
            )
        if self.model is not None and self.peer_protocol == "sglang":
            raise ValueError(
                "a router with --peer-protocol sglang reads no model files (its peers tokenize); remove "
                "--model"
            )
        if self.peer_kv_events is not None:
            if (
                self.role != "router"
                or not (front_door or self.peer_protocol == "vllm")
                or self.model is None
            ):
                raise ValueError(
                    "--peer-kv-events is for --role router with --unified or --peer-protocol vllm, with "
                    "--model (the events name token ids: the router needs the model's tokenizer to name a "
                    "prompt's blocks alike)"
                )
            try:
                peers = KvEventsConfig.parse(self.peer_kv_events)
            except ValueError as e:
                raise ValueError(f"--peer-kv-events takes the peers' --kv-events-config: {e}") from None
            for name in ("endpoint", "replay_endpoint"):
                value = getattr(peers, name)
                if value is not None and (
                    not value.startswith("tcp://") or not value.rpartition(":")[2].isdigit()
                ):
                    raise ValueError(
                        f"--peer-kv-events: {name} {value!r} is not a ZeroMQ tcp endpoint such as "
                        "tcp://*:5570 (the router connects to each peer's address)"
                    )
        if (self.peer_protocol == "sglang") != (self.bootstrap_port is not None):
            raise ValueError(
                "--bootstrap-port (the prefill servers' --disaggregation-bootstrap-port) is needed with "
                f"--peer-protocol sglang, and only there (here: {self.peer_protocol})"
            )
        return self

    def to_args(self) -> list[str]:
        """The command-line options of this configuration: `model` and every field that was set."""
        out: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name not in self.model_fields_set and name != "model":
                continue
            flag = _spelling(name)
            if isinstance(value, bool):
                if value != _default(name):
                    out.append(flag)
            elif value is None:
                continue
            elif name in ("prefill_buckets", "decode_buckets"):
                out += [flag, ",".join(map(str, value))]
            elif isinstance(value, list):
                for item in value:
                    out += [flag, str(item)]
            else:
                out += [flag, str(value)]
        return out

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServeConfig:
        """The configuration a parsed serve command line holds."""
        return cls(**{name: getattr(args, name) for name in cls.model_fields})


def _default(name: str) -> Any:
    return ServeConfig.model_fields[name].default


def _spelling(name: str) -> str:
    extra = ServeConfig.model_fields[name].json_schema_extra or {}
    return extra.get("flag") or f"--{name.replace('_', '-')}"  # type: ignore[union-attr,return-value]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `neuronfleet serve`, one per ServeConfig field (dest = the field's name)."""
    for name, field in ServeConfig.model_fields.items():
        kwargs: dict[str, Any] = {"dest": name, "help": field.description}
        annotation = field.annotation
        if get_origin(annotation) in (Union, types.UnionType):  # X | None
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        if field.is_required():
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default
        if annotation is bool:
            kwargs["action"] = "store_false" if field.default else "store_true"
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        elif annotation == list[int]:
            kwargs["type"] = parse_buckets
        elif annotation == list[str]:
            kwargs["action"] = "append"
        else:
            kwargs["type"] = annotation
        parser.add_argument(_spelling(name), **kwargs)


# ---- compile.json ------------------------------------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CompileModel(_Wire):
    uri: str = Field(description="Where the weights are (the NeuronModel's model.uri).")
    revision: str | None = Field(None, description="Revision for hf:// models.")
    tokenizer: str | None = Field(None, description="A folder whose tokenizer files replace the model's.")


class CompileBuckets(_Wire):
    context: list[int] = Field(default_factory=list, description="Prompt length buckets; empty: derived.")
    generation: list[int] = Field(default_factory=list, description="KV length buckets; empty: derived.")


class CompileConfig(_Wire):
    """compile.json: what `neuronfleet compile --config` compiles, as the operator wrote it (field names as
    in the file, which are the NeuronModel's)."""

    compileHash: str = Field(description="The spec's compile hash: artifacts/<compileHash>/.")
    engine: str = Field("embedded", description="The serving engine.")
    model: CompileModel
    instanceType: str = Field("cpu", description="The target: cpu, or a Neuron instance type.")
    tensorParallel: int = Field(1, ge=1)
    batchSize: int = Field(ge=1)
    sequenceLength: int = Field(ge=1)
    maxInputLength: int = Field(ge=1)
    dtype: CompileDType
    quantization: Quantization = Field(
        "none", description="Weight-only quantization the embedded engine's compile stores (CPU)."
    )
    buckets: CompileBuckets = Field(default_factory=CompileBuckets)
    compiledSteps: Literal["off", "inductor", "neuron"] = Field(
        "off",
        description="The embedded engine's passes compiled ahead for its pods: off; inductor (cpu: "
        "AOTInductor packages, one per bucket of the pods' tables, in the artifacts' graphs/ folder); or "
        "neuron (trn2, trn3: TorchNeuron's NEFF cache warmed for every bucket, in the artifacts' neff/ "
        "folder).",
    )
    neuronConfig: dict[str, Any] = Field(
        default_factory=dict,
        description="The Neuron settings the engine compiles the spec's shapes with, in its own names: the "
        "vLLM Neuron plugin's neuron_config (Trn2/Trn3), none for SGLang-Neuron, else NxDI NeuronConfig "
        "fields.",
    )

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


# ---- compile progress --------------------------------------------------------------------------------------
# A compile prints one line per update to its stdout (the pod's log): PROGRESS_PREFIX and then a compact JSON
# object of CompileProgress' fields. The operator reads the tail of a running compile pod's log (it needs no
# write permission in the pod) and shows the newest line in the NeuronModel's status; the local CLI shows the
# same in a bar. Unknown fields are ignored and absent ones are unknown, so older and newer compiles' lines
# both parse.

PROGRESS_PREFIX = "neuronfleet-progress "
PROGRESS_PHASES = ("download", "convert", "compile", "validate")  # in the order a compile runs them


class CompileProgress(BaseModel):
    """One progress update of a compile: its phase, the bytes and files that phase has done of its totals
    (None: not known), and the seconds since the compile started."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    phase: str = Field(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9-]*$")
    bytesDone: int | None = Field(None, ge=0)
    bytesTotal: int | None = Field(None, ge=0)
    filesDone: int | None = Field(None, ge=0)
    filesTotal: int | None = Field(None, ge=0)
    elapsed: float = Field(0.0, ge=0)

    def line(self) -> str:
        """The log line (no newline) for this update."""
        fields = self.model_dump(exclude_none=True)
        fields["elapsed"] = round(self.elapsed, 1)
        return PROGRESS_PREFIX + json.dumps(fields, separators=(",", ":"))


def parse_progress(text: str) -> CompileProgress | None:
    """The newest progress update in a log tail: the last line that is a whole, valid progress line (other
    output, a line cut at the start or end of the tail, and malformed updates are skipped), or None."""
    for raw in reversed(text.splitlines()):
        line = raw.strip()
        if not line.startswith(PROGRESS_PREFIX):
            continue
        try:
            return CompileProgress.model_validate_json(line[len(PROGRESS_PREFIX) :])
        except ValueError:  # (pydantic's ValidationError, for bad JSON too)
            continue
    return None


def duration_text(seconds: float) -> str:
    """42s, 4m10s, 1h02m."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _sizes(done: int, total: int | None) -> str:
    """1.2/3.4GB (decimal units, chosen by the larger number), or 96MB without a total."""
    top = max(done, total or 0)
    unit, scale = next(
        (u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)) if top >= s or s == 1
    )
    digits = 0 if scale == 1 or top / scale >= 100 else 1
    show = lambda n: f"{n / scale:.{digits}f}"  # noqa: E731
    return f"{show(done)}/{show(total)}{unit}" if total is not None else f"{show(done)}{unit}"


def progress_text(progress: CompileProgress, elapsed: float | None = None) -> str:
    """What a person reads: `download 35% 1.2/3.4GB 42s`, `convert 3/12 files 1m05s`, `compile 4m10s`
    (`elapsed`: the seconds to show, else the update's own)."""
    parts = [progress.phase]
    done, total = progress.bytesDone, progress.bytesTotal
    if done is not None and total:
        parts += [f"{min(100, done * 100 // total)}%", _sizes(done, total)]
    elif done:
        parts.append(_sizes(done, None))
    elif progress.filesTotal:
        parts.append(f"{progress.filesDone or 0}/{progress.filesTotal} files")
    parts.append(duration_text(progress.elapsed if elapsed is None else elapsed))
    return " ".join(parts)
