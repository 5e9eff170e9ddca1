"""Engines: a pure mapping from a NeuronModel spec to each serving engine's image, command, arguments and
environment, following that engine's documented contract for its pinned version (one module per engine:
`embedded`, `vllm`, `tgi`, `sglang`), including where it finds the compiled artifacts. Every engine's
router is ours (`neuronfleet serve --role router`): in front of our runtime's prefill and decode pods it
speaks our own KV handoff; in front of vLLM's or SGLang's it speaks that engine's P/D protocol
(`--peer-protocol`, runtime/routing/pd_protocols.py) and reads no model files.

Every spec field meant for the runtime reaches each role's command, environment or compile config
(tests/unit/test_spec_reaches_process.py checks it for every sample); a field an engine has no setting for is
refused (`limits`: at `kubectl apply` where the CRD's CEL can say it, and by `unsupported`, which validation
calls), never dropped.
"""

from __future__ import annotations

import json
from types import ModuleType

from neuronfleet.contract import INTERNAL_TOKEN_FILE, KV_EVENTS_CONFIG, KV_PORT, ServeConfig

from .. import front_door, names, parallelism
from ..pod_metrics import NEURONFLEET, Names
from ..spec import NeuronModelSpec
from ..spec_base import quantity_value
from . import embedded, limits, sglang, tgi, timeouts, vllm, vllm_plugin
from .common import (
    OWN_IMAGES,
    Container,
    artifacts_dir,
    fetch_container,
    kv_events_wanted,
    model_reference,
    nxdi_neuron_config,
)

ENGINES: dict[str, ModuleType] = {"embedded": embedded, "vllm": vllm, "tgi": tgi, "sglang": sglang}
assert ENGINES == limits.ENGINE_MODULES  # (the CRD's rules read the same modules' tables)
# the engines whose prefill and decode servers our router reaches through their own P/D protocol
PEER_PROTOCOLS = {"vllm": "vllm", "sglang": "sglang"}

__all__ = [
    "ENGINES",
    "Container",
    "artifacts_dir",
    "compile_container",
    "compile_deadline",
    "compile_files",
    "compile_neuron_config",
    "compiles",
    "documented_capabilities",
    "engine_router_config",
    "fetch_container",
    "image_for",
    "metric_names",
    "model_reference",
    "notice",
    "nxdi_neuron_config",
    "peer_protocol",
    "publishes_kv_events",
    "reads_hub_when_serving",
    "serve_config",
    "serve_container",
    "serving_writes_cache",
    "shared_cache",
    "start_timeout",
    "startup_probe",
    "unsupported",
]


def publishes_kv_events(spec: NeuronModelSpec, role: str) -> bool:
    """Whether a role's pods publish their KV-cache events for the router that follows them
    (`common.kv_events_wanted`): ours, and vLLM's Neuron plugin (Trn2/Trn3: vLLM 0.24.0's flag, recorded);
    not vLLM over NxD Inference (vLLM 0.16, not recorded), TGI (none) or SGLang (its Neuron release's events
    are not documented)."""
    engine_publishes = spec.engine == "embedded" or (
        spec.engine == "vllm" and vllm.contract(spec) is vllm_plugin
    )
    return engine_publishes and kv_events_wanted(spec, role)


def served_model_folder(spec: NeuronModelSpec, compile_hash: str) -> str:
    """The model folder the serving pods of a hash load (its tokenizer is what a router that follows their
    KV-cache events reads): our compile's artifacts, or the folder vLLM's plugin loads."""
    if spec.engine == "vllm":
        return vllm_plugin.model_dir(spec, compile_hash)
    return f"{artifacts_dir(compile_hash)}/model"


def compiles(spec: NeuronModelSpec) -> bool:
    """Whether the engine has a compile step a Job runs ahead of serving (SGLang-Neuron compiles as each
    server starts: no Job, no artifacts, no Compiled=True; but for an s3:// model, which its Job fetches)."""
    engine = ENGINES[spec.engine]
    if hasattr(engine, "compiles"):
        return engine.compiles(spec)
    return getattr(engine, "COMPILES", True)


def shared_cache(spec: NeuronModelSpec) -> bool:
    """Whether the model has the compile cache claim: an engine that compiles ahead, or one whose servers keep
    their compile cache and downloads on it (`serving_writes_cache`)."""
    return compiles(spec) or serving_writes_cache(spec)


def serving_writes_cache(spec: NeuronModelSpec) -> bool:
    """Whether serving pods mount the cache claim writable: an engine that compiles as each server starts,
    into a folder of the claim that the next server reuses (SGLang-Neuron)."""
    return getattr(ENGINES[spec.engine], "SERVING_WRITES_CACHE", False)


def notice(spec: NeuronModelSpec) -> tuple[str, str] | None:
    """What a user of the spec's engine should know when it is accepted, as the Validated condition's
    (reason, message): TGI is legacy (LegacyEngine), engine embedded on trn2 and trn3 experimental
    (Experimental); else None."""
    return getattr(ENGINES[spec.engine], "notice", lambda _: None)(spec)


def metric_names(spec: NeuronModelSpec, role: str) -> Names:
    """The names a role's pods export the autoscaler's signals under: our runtime's (the embedded engine's
    pods and every router), or the engine's own."""
    return NEURONFLEET if role == "router" else ENGINES[spec.engine].METRICS


def image_for(spec: NeuronModelSpec) -> str:
    return spec.image or ENGINES[spec.engine].image(spec)


def documented_capabilities(spec: NeuronModelSpec) -> tuple[str, ...]:
    """The capabilities an engine's serving pods add because its documentation runs it with them (each with
    its source in the engine's module; pod_parts adds IPC_LOCK with EFA); none for our runtime."""
    return tuple(getattr(_server_module(spec), "CAPABILITIES", ()))


def reads_hub_when_serving(spec: NeuronModelSpec) -> bool:
    """Whether the engine's serving pods read the Hugging Face Hub at start (so get the model's token)."""
    return getattr(ENGINES[spec.engine], "reads_hub_when_serving", lambda _: False)(spec)


def unsupported(spec: NeuronModelSpec) -> list[str]:
    """What the spec's engine cannot take, each refusal saying what works (empty: every field reaches the
    engine): its limits' rules (`limits.RULES`, the CRD's too, so refused at apply) and the refusals of
    neuron.overrides, which CEL cannot read (`limits.override_refusals`)."""
    refused = [rule.refusal(spec) for rule in limits.RULES]
    return [r for r in refused if r is not None] + limits.override_refusals(spec)


def peer_protocol(spec: NeuronModelSpec) -> str:
    """What a disaggregated model's router speaks to its prefill and decode pods."""
    return PEER_PROTOCOLS.get(spec.engine, "neuronfleet")


def engine_router_config(spec: NeuronModelSpec, port: int) -> ServeConfig:
    """The serve options of a router in front of an engine's own prefill and decode servers: the protocol
    and, for SGLang, the port the prefill servers' bootstrap server listens on. No model and no shapes: the
    engines tokenize and check requests themselves (their refusals reach the client as they are)."""
    protocol = peer_protocol(spec)
    extra = {"bootstrap_port": sglang.BOOTSTRAP_PORT} if protocol == "sglang" else {}
    return ServeConfig(role="router", host="0.0.0.0", port=port, peer_protocol=protocol, **extra)  # type: ignore[arg-type]


def serve_config(
    spec: NeuronModelSpec, role: str, compile_hash: str, *, model: str, namespace: str,
    set_suffix: str | None = None, wake_base: str | None = None,
) -> ServeConfig:  # fmt: skip
    """Our runtime's serve options (`neuronfleet serve`) for a role's pods: every role of the embedded engine,
    and every engine's router. `model` is the NeuronModel's name (the name clients use), `set_suffix` the
    serving set whose prefill and decode Services a router names, `wake_base` the operator's wake URL (a
    front door's routers hold requests at zero and wake the autoscaler)."""
    port, n = spec.serving.port, spec.neuron
    # every role of our runtime reads the model's token from its Secret, as a file, never env
    pod: dict = {"served_model_name": model, "internal_token_file": INTERNAL_TOKEN_FILE}
    if role == "router":
        pod.update(front_door.router_options(spec, namespace, model, wake_base))
        if spec.serving.mode == "unified":  # a unified model's front door: no model files but the tokenizer
            door = [front_door.peers_url(model, port)]  # where it follows the pods' KV-cache events
            if publishes_kv_events(spec, "unified"):
                pod["model"] = served_model_folder(spec, compile_hash)
                pod["peer_kv_events"] = KV_EVENTS_CONFIG  # where they publish and answer replays
            return ServeConfig(role="router", host="0.0.0.0", port=port, unified=door, **pod)
        pod["prefill"] = [f"dns://{names.deployment(model, 'prefill', set_suffix)}:{port}"]
        pod["decode"] = [f"dns://{names.deployment(model, 'decode', set_suffix)}:{port}"]
        if peer_protocol(spec) != "neuronfleet":  # the engine's own P/D protocol
            if publishes_kv_events(spec, "prefill"):  # the tokenizer, to follow the prefill servers' events
                pod["model"] = served_model_folder(spec, compile_hash)
                pod["peer_kv_events"] = KV_EVENTS_CONFIG  # where they publish and answer replays
            return engine_router_config(spec, port).model_copy(update=pod)
    kv = spec.serving.kvTransfer
    if role in ("prefill", "decode"):
        pod["kv_transport"] = kv.transport
        if kv.transport == "nixl":
            pod["kv_nixl_backend"] = kv.backend or "ucx"
    sampling = spec.serving.sampling.generation_config()
    if role in ("unified", "router") and sampling:  # the pods that parse requests (our router, not a door)
        pod["override_generation_config"] = json.dumps(sampling)
    if publishes_kv_events(spec, role):  # the router places by its events
        pod["kv_events_config"] = KV_EVENTS_CONFIG
    if role == "decode" and kv.transport == "tcp":  # prefill pods send KV caches to the pod's own IP
        pod["kv_port"] = KV_PORT
    if role != "router" and (tp := parallelism.role_tensor_parallel(spec, role)) > 1:  # a rank per core
        pod["tensor_parallel"] = tp  # (embedded: on trn2 and trn3 with TorchNeuron, unified only)
    if role != "router" and n.compiledSteps != "off":  # the compile Job's graphs (`compiled_ahead`)
        pod["compiled_steps"] = n.compiledSteps
    if role != "router" and n.hostKVCache is not None:  # the host KV store's size (default: the runtime's)
        pod["host_kv_cache_bytes"] = int(quantity_value(n.hostKVCache))
    if role in ("unified", "decode"):  # the pods that hold generating requests: time to finish them all
        pod["grace_period"] = float(timeouts.drain_seconds(spec))
    # the compiled model and shapes, for every role: the router checks requests against the same limits
    if n.buckets.context:
        pod["prefill_buckets"] = list(n.buckets.context)
    if n.buckets.generation:
        pod["decode_buckets"] = list(n.buckets.generation)
    return ServeConfig(
        model=served_model_folder(spec, compile_hash), role=role, host="0.0.0.0", port=port, dtype=n.dtype,
        slots=n.batchSize, max_seq_len=n.sequenceLength, max_input_len=n.maxInputLength, **pod,
    )  # fmt: skip


def serve_container(
    spec: NeuronModelSpec, role: str, compile_hash: str, port: int, config: ServeConfig | None = None,
    served_name: str | None = None,
) -> Container:  # fmt: skip
    """The serving container of a role (unified, prefill, decode or router). For our runtime (the embedded
    engine, and every engine's router) `config` is the role's serve options (`serve_config`); the other
    engines name the model `served_name` in their APIs (default: their own choice)."""
    if spec.engine == "embedded" or role == "router":  # the router is ours whatever the engine
        assert config is not None, "our runtime's container needs its serve_config"
        own = spec
        if spec.engine != "embedded":
            own = spec.model_copy(update={"engine": "embedded", "image": None})
        container = embedded.serve(config, own)
        if role == "router":  # routers use no Neuron device (they run on any node): the CPU image will do
            container.image = OWN_IMAGES["cpu"]
        if spec.engine == "embedded" and spec.image:
            container.image = spec.image
        return container
    container = ENGINES[spec.engine].serve(spec, role, compile_hash, port, served_name)
    container.image = image_for(spec)
    return container


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    """Files the compile Job reads from the runtime ConfigMap (file name -> content), beyond compile.json
    (none for an engine that does not `compiles`: it has no compile Job)."""
    return ENGINES[spec.engine].compile_files(spec, compile_hash) if compiles(spec) else {}


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    """What the compile Job runs: `neuronfleet compile` for our engine, else the engine's own compile."""
    engine = ENGINES[spec.engine]
    container = engine.compile_container(spec, compile_hash)
    if container.image == engine.image(spec):  # spec.image replaces the engine's image, not ours (SGLang's
        container.image = spec.compile.image or image_for(spec)  # fetch-only Job runs our CPU image)
    return container


def _server_module(spec: NeuronModelSpec) -> ModuleType:
    """The module of the server the spec's engine runs (vLLM: its contract for the instance family)."""
    return vllm.contract(spec) if spec.engine == "vllm" else ENGINES[spec.engine]


def compile_neuron_config(spec: NeuronModelSpec) -> dict:
    """compile.json's neuronConfig: the Neuron settings the engine compiles with, in its own names (the vLLM
    Neuron plugin's neuron_config on Trn2/Trn3, none for SGLang-Neuron), else NxD Inference's NeuronConfig
    (our runtime's planned Neuron backend; vLLM over NxD Inference; TGI's optimum-neuron, NxD-based)."""
    own = getattr(_server_module(spec), "compile_neuron_config", None)
    return own(spec) if own is not None else nxdi_neuron_config(spec)


def compile_deadline(spec: NeuronModelSpec) -> int:
    """The compile Job's activeDeadlineSeconds: compile.activeDeadlineSeconds, else derived from the model's
    size and the compile passes the engine runs (`timeouts`; the vLLM plugin: one per tensor parallelism)."""
    passes = getattr(_server_module(spec), "compile_passes", lambda _: 1)(spec)
    return timeouts.compile_deadline(spec, passes)


def start_timeout(spec: NeuronModelSpec, role: str) -> int | None:
    """The seconds a role's engine may take to start (`timeouts.start_seconds`; an engine that compiles as
    each server starts, SGLang-Neuron, compiles within it); None for a router, ours (it loads nothing)."""
    if role == "router":
        return None
    compiles_at_start = getattr(_server_module(spec), "COMPILES_AT_START", False)
    return timeouts.start_seconds(spec, compiles_at_start)


def startup_probe(spec: NeuronModelSpec, role: str) -> tuple[int, int]:
    """(periodSeconds, failureThreshold) of a role's startup probe: a budget that holds the engine's start
    (`start_timeout`), so the engine's own timeout, where it has one, fires first and says why."""
    neuron = role != "router" and spec.neuron.instanceType != "cpu"
    return timeouts.startup_probe(spec, neuron, start_timeout(spec, role))
