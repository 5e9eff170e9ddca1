"""Pure builders of the Kubernetes objects a NeuronModel owns, as plain dicts, and its compile hash.

`build_all` returns, for one model, in the order they must exist (what a pod mounts before the pod): the
compile-cache PVC (unless an existing claim is named), the runtime ConfigMap, the Secret holding the model's
internal token (every model: created once, with a token the caller generates; mounted into every pod that runs
our runtime), the NetworkPolicies (`serving.networkPolicy`, on by default: `network_policy`), the compile Job
for the model's compile hash (unless it has compiled), and, once a hash has compiled, the serving set: one
Deployment `NAME-unified`, rolled in place, or a version-isolated disaggregated set (prefill, decode and
router Deployments and the prefill and decode headless Services, all named `NAME-<role>-<revision>`, the
router naming only its own set's Services), PodDisruptionBudgets, and the public Service, whose selector
(`neuronfleet.dev/set`) names the set it serves; with autoscaling by provider hpa or keda, the
HorizontalPodAutoscaler or KEDA ScaledObject on the model's scale subresource (`scaling`); with DRA
(`devices`), each Neuron pod kind's ResourceClaimTemplate before its pods. Every object
carries `app.kubernetes.io/*` labels,
neuronfleet's own (`neuronfleet.dev/model`, `role`, `compile-hash`, `set`) and, when the owner's uid is
known, an ownerReference to the NeuronModel (`neuronfleet render` knows none and writes none).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from neuronfleet.contract import (
    COMPILE_CONFIG_FILE,
    EXIT_REFUSED,
    GRACE_PERIOD,
    INTERNAL_TOKEN_DIR,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    KV_PORT,
    MODEL_MOUNT,
    POD_IP_ENV,
    CompileBuckets,
    CompileConfig,
    CompileModel,
)

from . import (
    devices,
    engines,
    front_door,
    gateway,
    names,
    network_policy,
    parallelism,
    pod_parts,
    scaling,
    topology,
)
from .spec import API_VERSION, KIND, NeuronModelSpec

LABEL_PREFIX = "neuronfleet.dev"
UNIFIED_SET = "unified"  # the `set` label of unified pods (one Deployment, rolled in place)
ATTEMPT_ANNOTATION = f"{LABEL_PREFIX}/attempt"  # on a compile Job: the generation and retry it was made for
SOURCE_RETRIES_ANNOTATION = f"{LABEL_PREFIX}/source-retries"  # on a compile Job: tries after a source failed
COMPILE_JOB_TTL = 3600  # seconds a finished compile Job stays (ttlSecondsAfterFinished) for its logs
# A deleted serving pod leaves its Service's endpoints while the kubelet stops it, not before: kube-proxy on
# every node (and a gateway's picker) may still send it new requests for a few seconds, which a server that
# drains at SIGTERM would refuse (503). The container's preStop hook sleeps this long first, still serving,
# and the grace period counts it. The `sleep` action is beta and on by default from Kubernetes 1.30, GA in
# 1.34 (KEP-3960); this project supports 1.31 and later, and it needs no sleep binary in any engine's image.
ENDPOINT_DRAIN_SECONDS = 5
# Where an engine's image compiles without Neuron devices: its images are linux/amd64 (well-known node labels,
# https://kubernetes.io/docs/reference/labels-annotations-taints/)
CPU_COMPILE_NODE = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}


@dataclass(frozen=True)
class Owner:
    """The NeuronModel that owns the objects."""

    name: str
    namespace: str
    uid: str | None = None  # None: not known (render), so no ownerReference


def compiled_shapes(spec: NeuronModelSpec) -> dict[str, Any]:
    """The shapes a compile fixes."""
    n = spec.neuron
    return {
        "tensorParallel": n.tensorParallel,
        "batchSize": n.batchSize,
        "sequenceLength": n.sequenceLength,
        "maxInputLength": n.maxInputLength,
        "dtype": n.dtype,
        "buckets": n.buckets.model_dump(),
    }


def compile_hash(spec: NeuronModelSpec) -> str:
    """Canonical hash of the compile identity: model, revision and tokenizer, engine and image, the shapes
    fixed at compile time, the platform family, logical cores and compiler settings, and where the artifacts
    are kept."""
    n = spec.neuron
    inst = topology.INSTANCES.get(n.instanceType)
    identity = {
        "model": spec.model.uri,
        "revision": spec.model.revision,
        "engine": spec.engine,
        "image": engines.image_for(spec),
        "platform": inst.platform if inst else "cpu",
        "logicalCores": n.logicalCores or (inst.default_logical_cores if inst else None),
        **compiled_shapes(spec),
        "quantization": n.quantization,
        "overrides": n.overrides,
        # compiled into the model's own folder of the claim (pod_parts.volumes): a hash compiled into the
        # claim's root by an earlier version is not there, so it is another hash, compiled again
        "cacheFolder": "per-model",
    }
    if spec.model.tokenizer:  # only when set: the hashes of models without one stay as they were
        identity["tokenizer"] = spec.model.tokenizer
    if spec.compile.image:  # likewise: the compiler the artifacts come from
        identity["compileImage"] = spec.compile.image
    if n.compiledSteps != "off":  # likewise: the artifacts hold the compiled graphs too
        identity["compiledSteps"] = n.compiledSteps
    for name in ("expertParallel", "memoryFraction"):  # likewise
        if getattr(n, name) is not None:
            identity[name] = getattr(n, name)
    if n.kvCacheDtype != "auto":
        identity["kvCacheDtype"] = n.kvCacheDtype
    degrees = parallelism.tensor_parallel_degrees(spec)
    if degrees != [n.tensorParallel]:  # prefill and decode at tensor parallelisms of their own
        identity["tensorParallelDegrees"] = degrees
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def labels(
    owner: Owner, component: str, chash: str | None = None, serving_set: str | None = None
) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "neuronmodel",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "neuronfleet",
        "app.kubernetes.io/managed-by": "neuronfleet-operator",
        f"{LABEL_PREFIX}/model": owner.name,
        f"{LABEL_PREFIX}/role": component,
    }
    if chash:
        out[f"{LABEL_PREFIX}/compile-hash"] = chash
    if serving_set:
        out[f"{LABEL_PREFIX}/set"] = serving_set
    return out


def selector(owner: Owner, component: str, serving_set: str | None = None) -> dict[str, str]:
    out = {f"{LABEL_PREFIX}/model": owner.name, f"{LABEL_PREFIX}/role": component}
    if serving_set:
        out[f"{LABEL_PREFIX}/set"] = serving_set
    return out


def metadata(
    owner: Owner, name: str, component: str, chash: str | None = None, serving_set: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component, chash, serving_set),
    }
    if owner.uid:  # a reference to an owner that does not exist would be garbage-collected at once
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def cache_claim_name(owner: Owner, spec: NeuronModelSpec) -> str:
    return spec.compile.cache.claimName or names.cache_claim(owner.name)


def build_pvc(owner: Owner, spec: NeuronModelSpec) -> dict[str, Any] | None:
    cache = spec.compile.cache
    if cache.claimName:
        return None
    pvc_spec: dict[str, Any] = {
        "accessModes": list(cache.accessModes),
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storageClassName:
        pvc_spec["storageClassName"] = cache.storageClassName
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(owner, cache_claim_name(owner, spec), "compile-cache"),
        "spec": pvc_spec,
    }


def compile_config(spec: NeuronModelSpec, chash: str) -> CompileConfig:
    """What `neuronfleet compile --config` reads: the model and the shapes to compile it for."""
    n = spec.neuron
    return CompileConfig(
        compileHash=chash,
        engine=spec.engine,
        model=CompileModel(uri=spec.model.uri, revision=spec.model.revision, tokenizer=spec.model.tokenizer),
        instanceType=n.instanceType,
        tensorParallel=n.tensorParallel,
        batchSize=n.batchSize,
        sequenceLength=n.sequenceLength,
        maxInputLength=n.maxInputLength,
        dtype=n.dtype,
        # the embedded engine's CPU quantization, stored by the compile; on Neuron it is NeuronConfig's
        quantization=n.quantization if n.instanceType == "cpu" else "none",
        buckets=CompileBuckets(context=n.buckets.context, generation=n.buckets.generation),
        compiledSteps=n.compiledSteps,
        neuronConfig=engines.compile_neuron_config(spec),
    )


def config_map_name(owner: Owner) -> str:
    return names.config_map(owner.name)


def build_config_map(owner: Owner, spec: NeuronModelSpec, chash: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_map_name(owner), "config", chash),
        "data": {
            COMPILE_CONFIG_FILE: compile_config(spec, chash).to_json(),
            **engines.compile_files(spec, chash),
        },
    }


def compile_job_name(owner: Owner, chash: str) -> str:
    return names.compile_job(owner.name, chash)


def build_claim_template(owner: Owner, spec: NeuronModelSpec, role: str) -> dict[str, Any] | None:
    """The DRA ResourceClaimTemplate the pods of `role` (or `compile`) name (`devices.claim_template`: named
    by its content, shared by every set that asks the same), or None (the device plugin, or no devices)."""
    return devices.claim_template(spec, role, metadata(owner, owner.name, role))


def build_compile_claim_template(owner: Owner, spec: NeuronModelSpec, chash: str) -> dict[str, Any] | None:
    """The compile pod's ResourceClaimTemplate, where its engine compiles on Neuron devices with DRA."""
    needs_neuron = engines.compile_container(spec, chash).needs_neuron
    return build_claim_template(owner, spec, "compile") if needs_neuron else None


def build_compile_job(
    owner: Owner, spec: NeuronModelSpec, chash: str, attempt: str = "", source_retries: int = 0
) -> dict[str, Any]:
    """The compile Job of a hash. `attempt` (the generation and retry request it was made for) is kept as
    an annotation: a failed Job is replaced when a later attempt is asked for (`rollout.retry_due`);
    `source_retries`: how many times in a row its model source was unreadable (`rollout.source_retry_at`)."""
    container = engines.compile_container(spec, chash)
    volumes, mounts = pod_parts.volumes(
        spec, True, owner.name, cache_claim_name(owner, spec), config_map_name(owner), container.writable
    )
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **pod_parts.pod_security(container),
        "containers": [
            {
                "name": "compile",
                "image": container.image,
                "command": container.command,
                "env": pod_parts.container_env(spec, container, hub_token=True),
                "volumeMounts": mounts,
                "resources": pod_parts.compile_resources(spec, container),
                "securityContext": pod_parts.security(container),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
    }
    if container.third_party:  # an engine's compile runs its server's workers, which share /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": container.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    fetch = pod_parts.fetch_init_container(spec, mounts)
    if fetch is not None:  # an s3:// model, for an engine whose image has no AWS SDK: downloaded first
        pod_spec["initContainers"] = [fetch]
    if spec.compile.serviceAccountName:  # its IAM role (IRSA, EKS Pod Identity) reads an s3:// model
        pod_spec["serviceAccountName"] = spec.compile.serviceAccountName
    tolerations = list(spec.compile.tolerations)
    if container.needs_neuron:  # on a node of the serving instance type, as a serving pod is placed
        cores, claim = parallelism.compile_cores(spec), build_claim_template(owner, spec, "compile")
        pod_parts.place_on_neuron(spec, pod_spec, dict(spec.compile.nodeSelector), tolerations, cores, claim)
    else:
        # an engine's image compiling on CPU: any linux/amd64 node (the images are built for it) the spec's
        # compile.nodeSelector admits; our own compile: where compile.nodeSelector says
        node_selector = dict(CPU_COMPILE_NODE) if container.third_party else {}
        node_selector.update(spec.compile.nodeSelector)
        if node_selector:
            pod_spec["nodeSelector"] = node_selector
        if tolerations:
            pod_spec["tolerations"] = tolerations
    meta = metadata(owner, compile_job_name(owner, chash), "compile", chash)
    if attempt:
        meta["annotations"] = {ATTEMPT_ANNOTATION: attempt}
    if source_retries:
        meta.setdefault("annotations", {})[SOURCE_RETRIES_ANNOTATION] = str(source_retries)
    job_spec: dict[str, Any] = {
        "backoffLimit": spec.compile.backoffLimit,
        # compile.activeDeadlineSeconds, else derived from the model's size and the passes (engines.timeouts)
        "activeDeadlineSeconds": engines.compile_deadline(spec),
        # finished Jobs go after an hour (https://kubernetes.io/docs/concepts/workloads/controllers/
        # ttlafterfinished/); a compiled hash is remembered in status, so it is not compiled again
        "ttlSecondsAfterFinished": COMPILE_JOB_TTL,
        "template": {"metadata": {"labels": labels(owner, "compile", chash)}, "spec": pod_spec},
    }
    if not container.third_party:  # our compile's refusals fail the Job at once: another pod would too
        job_spec["podFailurePolicy"] = {"rules": [{
            "action": "FailJob",
            "onExitCodes": {"containerName": "compile", "operator": "In", "values": [EXIT_REFUSED]},
        }]}  # fmt: skip
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


SOURCE_PROBE_TTL = 600  # seconds a finished source probe stays, if the operator has not deleted it


def build_source_probe(owner: Owner, spec: NeuronModelSpec, chash: str) -> dict[str, Any]:
    """The Job that fingerprints the model source of a failed compile (`neuronfleet source-fingerprint`, our
    CPU image, on any node, as the compile's ServiceAccount: it reads file metadata or asks the Hub or S3,
    never a device): its pod's termination
    message is {"fingerprint": ...}, which the operator compares with the last one (`rollout`)."""
    command = ["neuronfleet", "source-fingerprint", "--uri", spec.model.uri]
    if spec.model.revision:
        command += ["--revision", spec.model.revision]
    volumes, mounts = pod_parts.source_volumes(spec)
    if spec.model.uri.startswith("pvc://"):
        command += ["--model-mount", MODEL_MOUNT]
    container = {
        "name": "fingerprint",
        "image": engines.common.OWN_IMAGES["cpu"],
        "command": command,
        "env": pod_parts.env(spec, pod_parts.OWN_WRITABLE_ENV, hub_token=spec.model.uri.startswith("hf://")),
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": pod_parts.security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = {"restartPolicy": "Never", **pod_parts.pod_security(),
                "containers": [container], "volumes": volumes}  # fmt: skip
    if spec.compile.serviceAccountName:  # as the compile Job: the same credentials read the source
        pod_spec["serviceAccountName"] = spec.compile.serviceAccountName
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(owner, names.source_probe(owner.name, chash), "source-probe", chash),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 300,
            "ttlSecondsAfterFinished": SOURCE_PROBE_TTL,
            "template": {"metadata": {"labels": labels(owner, "source-probe", chash)}, "spec": pod_spec},
        },
    }


def serving_roles(spec: NeuronModelSpec) -> dict[str, int]:
    """Role -> replicas (spec.replicas, the scale subresource, mapped by `scaling.role_replicas`)."""
    return scaling.role_replicas(spec)


def serving_set(spec: NeuronModelSpec, chash: str) -> str:
    """The `set` label of a model's serving pods at a compile hash: `unified`, or for a disaggregated model
    the revision its prefill, decode and router pods share (compile hash, port and KV transport: what pairs
    them), so a router only ever names prefill and decode pods of its own set."""
    if spec.serving.mode == "unified":
        return UNIFIED_SET
    kv = spec.serving.kvTransfer
    backend = [kv.backend] if kv.backend else []  # no part where unset: existing sets keep their name
    return names.revision(chash, spec.serving.port, kv.transport, kv.efaInterfaces, *backend)


def _set_suffix(serving_set_name: str | None) -> str | None:
    return None if serving_set_name in (None, UNIFIED_SET) else serving_set_name


def deployment_name(owner: Owner, role: str, serving_set_name: str | None = None) -> str:
    return names.deployment(owner.name, role, _set_suffix(serving_set_name))


def _engine_router(spec: NeuronModelSpec, role: str) -> bool:
    """A router in front of an engine's own prefill and decode servers, or a unified model's front door (it
    mounts no artifacts, at most the model's tokenizer)."""
    return role == "router" and (
        engines.peer_protocol(spec) != "neuronfleet" or spec.serving.mode == "unified"
    )


def build_deployment(
    owner: Owner, spec: NeuronModelSpec, role: str, replicas: int, chash: str, wake_base: str | None = None
) -> dict:
    port = spec.serving.port
    ours = spec.engine == "embedded" or role == "router"
    pods_set = serving_set(spec, chash)
    config = engines.serve_config(
        spec, role, chash, model=owner.name, namespace=owner.namespace, set_suffix=_set_suffix(pods_set),
        wake_base=wake_base,
    ) if ours else None  # fmt: skip
    container = engines.serve_container(spec, role, chash, port, config, served_name=owner.name)
    env = pod_parts.container_env(spec, container, hub_token=pod_parts.reads_hub_when_serving(spec, role))
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    volumes, mounts = pod_parts.volumes(
        spec, False, owner.name, cache_claim_name(owner, spec), config_map_name(owner), container.writable
    )
    kv = spec.serving.kvTransfer
    if ours and role == "decode" and kv.transport == "tcp":  # NIXL's metadata carries its own addresses
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if engines.publishes_kv_events(spec, role):  # KV-cache events (ZeroMQ), ours or vLLM's
        ports.append({"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"})
        ports.append({"name": "kv-replay", "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"})
    if ours:  # every pod of our runtime: the model's token, a file from its Secret (never env)
        volumes.append(
            {"name": "internal-token",
             "secret": {"secretName": internal_secret_name(owner), "defaultMode": 0o440}}
        )  # fmt: skip
        mounts.append({"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True})
    ports += [{"name": name, "containerPort": number, "protocol": "TCP"} for name, number in container.ports]
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": container.shm_size}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if _engine_router(spec, role):  # no shared memory; its token, its /tmp, and the model's tokenizer (read
        # only) where it follows the prefill servers' KV-cache events
        folder = (config.model if config is not None else None) or ""
        kept = {"tmp", "internal-token"}
        kept |= {m["name"] for m in mounts if folder.startswith(m["mountPath"] + "/")}
        volumes, mounts = ([x for x in xs if x["name"] in kept] for xs in (volumes, mounts))
        mounts = [{**m, "readOnly": True} if m["name"] != "tmp" else m for m in mounts]
    neuron = role != "router" and spec.neuron.instanceType != "cpu"
    efa = role in ("prefill", "decode") and kv.over_efa and kv.efaInterfaces > 0
    health, ready = ("/health", "/ready") if ours else ("/health", "/health")

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 5,
        }

    pod_spec: dict[str, Any] = {
        **pod_parts.pod_security(container),
        # the preStop sleep, then requests in flight finish within the server's grace period, then it exits
        "terminationGracePeriodSeconds": (
            ENDPOINT_DRAIN_SECONDS + int(config.grace_period if config else GRACE_PERIOD) + 15
        ),
        "containers": [
            {
                "name": "server",
                "image": container.image,
                "command": container.command,
                "env": env,
                "ports": ports,
                "resources": pod_parts.serving_resources(spec, role),
                "volumeMounts": mounts,
                # its budget holds the engine's start (engines.timeouts: from the model's size, or
                # serving.startTimeoutSeconds), then strict liveness; a cpu model or a router loads in
                # seconds, so its startup is checked often (Ready soon after)
                "startupProbe": probe(health, *engines.startup_probe(spec, role)),
                "readinessProbe": probe(ready, 5, 3),
                "livenessProbe": probe(health, 10, 6),
                "lifecycle": {"preStop": {"sleep": {"seconds": ENDPOINT_DRAIN_SECONDS}}},
                "securityContext": pod_parts.security(container, efa=efa),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
    }
    if container.working_dir:  # where the engine's documentation says its process must start
        pod_spec["containers"][0]["workingDir"] = container.working_dir
    if container.init_process:  # the pause container is PID 1 and reaps orphaned workers (docker's --init)
        pod_spec["shareProcessNamespace"] = True
    sched = spec.scheduling
    claim = build_claim_template(owner, spec, role)  # DRA (devices): Neuron devices, EFA interfaces
    if neuron:
        cores, tolerations = parallelism.role_cores(spec, role), list(sched.tolerations)
        pod_parts.place_on_neuron(spec, pod_spec, dict(sched.nodeSelector), tolerations, cores, claim)
    else:
        if claims := devices.pod_claims(claim):  # EFA interfaces only (the embedded engine on cpu)
            pod_spec["resourceClaims"] = claims
        if sched.nodeSelector:
            pod_spec["nodeSelector"] = dict(sched.nodeSelector)
        if sched.tolerations:
            pod_spec["tolerations"] = list(sched.tolerations)
        if sched.schedulerName and role != "router":  # (Neuron pods get it in place_on_neuron)
            pod_spec["schedulerName"] = sched.schedulerName
    if sched.affinity:
        pod_spec["affinity"] = dict(sched.affinity)
    if sched.priorityClassName:
        pod_spec["priorityClassName"] = sched.priorityClassName
    # a unified Deployment keeps its selector (immutable) and rolls in place; a disaggregated set's
    # Deployments select only their own set's pods, beside another set's during a switch
    match = selector(owner, role, _set_suffix(pods_set))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, deployment_name(owner, role, pods_set), role, chash, pods_set),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": match},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {**labels(owner, role, chash, pods_set), **gateway.role_labels(spec, role)}
                },
                "spec": pod_spec,
            },
        },
    }


def public_role(spec: NeuronModelSpec) -> str:
    """The role the model's Service selects: its routers, or a unified model's pods without a front door."""
    return "unified" if spec.serving.mode == "unified" and not front_door.has_front_door(spec) else "router"


def public_selector(owner: Owner, spec: NeuronModelSpec, chash: str) -> dict[str, str]:
    """The public Service's selector for the serving set of `spec` at `chash`: always the same three keys
    (model, role, set), so a merge patch replaces every value when the Service moves to another set."""
    return {**selector(owner, public_role(spec)), f"{LABEL_PREFIX}/set": serving_set(spec, chash)}


def build_public_service(owner: Owner, spec: NeuronModelSpec, target: dict[str, str]) -> dict[str, Any]:
    """The model's Service; `target`: the selector of the set it serves (`public_selector`)."""
    port = spec.serving.port
    ports = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, owner.name, "endpoint"),
        "spec": {"type": "ClusterIP", "selector": dict(target), "ports": ports},
    }


def build_peer_services(owner: Owner, spec: NeuronModelSpec, chash: str) -> list[dict[str, Any]]:
    """A disaggregated set's headless prefill and decode Services: its router finds its peers through DNS. An
    SGLang prefill Service also names the bootstrap port, where decode servers meet a prefill server (the
    router sends them the prefill pod's address and that port). A unified model's front door: the headless
    Service of the unified pods."""
    port, pods_set = spec.serving.port, serving_set(spec, chash)
    if front_door.unified_front_door(spec):
        roles = ("unified",)
    elif spec.serving.mode == "disaggregated":
        roles = ("prefill", "decode")
    else:
        return []
    ports = {r: [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}] for r in roles}
    sglang_pd = spec.engine == "sglang" and "prefill" in ports
    if boot := engines.engine_router_config(spec, port).bootstrap_port if sglang_pd else None:
        ports["prefill"].append({"name": "bootstrap", "port": boot, "targetPort": boot, "protocol": "TCP"})
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(owner, deployment_name(owner, role, pods_set), role, chash, pods_set),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": False,
                "selector": selector(owner, role, pods_set),
                "ports": ports[role],
            },
        }
        for role in roles
    ]


def build_pdb(owner: Owner, spec: NeuronModelSpec, role: str, replicas: int, chash: str) -> dict | None:
    if replicas < 2:
        return None
    pods_set = serving_set(spec, chash)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, deployment_name(owner, role, pods_set), role, chash, pods_set),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(owner, role, _set_suffix(pods_set))},
        },
    }


def internal_secret_name(owner: Owner) -> str:
    return names.internal(owner.name)


def build_internal_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The model's internal token (created once, never changed), which every pod of our runtime reads from a
    file (`contract.INTERNAL_TOKEN_FILE`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, internal_secret_name(owner), "internal-token"),
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def build_network_policies(
    owner: Owner, spec: NeuronModelSpec, peers: network_policy.Peers, public: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The model's two NetworkPolicies (`network_policy`): every pod of the model, and the pods clients reach
    (the public Service's role for `spec`, and that of `public`, the selector it keeps, where given)."""
    model = {f"{LABEL_PREFIX}/model": owner.name}
    roles = [public_role(spec), *([public[f"{LABEL_PREFIX}/role"]] if public else [])]
    return [
        network_policy.build_pods_policy(
            metadata(owner, names.pods_policy(owner.name), "network"), model, peers
        ),
        network_policy.build_public_policy(
            metadata(owner, names.public_policy(owner.name), "network"), model, f"{LABEL_PREFIX}/role", roles,
            peers,
        ),
    ]  # fmt: skip


def endpoint(owner: Owner, spec: NeuronModelSpec, service: dict[str, Any] | None = None) -> str:
    """The model's URL: the address the Service publishes in status.loadBalancer.ingress when it has one (a
    load balancer, or local mode's proxy on this machine), else its in-cluster DNS name."""
    for ingress in ((service or {}).get("status") or {}).get("loadBalancer", {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        ports = [p["port"] for p in ingress.get("ports") or [] if p.get("port")]
        if host:
            return f"http://{host}:{ports[0] if ports else spec.serving.port}"
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.serving.port}"


def build_serving(
    owner: Owner, spec: NeuronModelSpec, chash: str, public: dict[str, str] | None = None,
    wake_base: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The serving set of `spec` at the compiled hash `chash` (peer Services, Deployments, PDBs), then the
    public Service, selecting `public` (default: this set)."""
    objects: list[dict[str, Any] | None] = [*build_peer_services(owner, spec, chash)]
    for role, replicas in serving_roles(spec).items():
        objects.append(build_claim_template(owner, spec, role))  # DRA: before the pods that name it
        objects.append(build_deployment(owner, spec, role, replicas, chash, wake_base))
        objects.append(build_pdb(owner, spec, role, replicas, chash))
    target = public or public_selector(owner, spec, chash)
    objects.append(build_public_service(owner, spec, target))
    objects += gateway.build(metadata(owner, owner.name, "gateway"), spec, target)  # the pool follows it
    return [o for o in objects if o is not None]


def build_all(
    owner: Owner,
    spec: NeuronModelSpec,
    serving_hash: str | None = None,
    internal_token: str | None = None,
    *,
    serving_spec: NeuronModelSpec | None = None,
    public: dict[str, str] | None = None,
    compile_job: bool = True,
    attempt: str = "",
    source_retries: int = 0,
    wake_base: str | None = None,
    peers: network_policy.Peers | None = None,
) -> list[dict[str, Any]]:
    """Every object of a model, in the order they must exist. The compile Job (unless `compile_job` is False:
    its hash has compiled) is the spec's; the serving set is built from `serving_spec` (default: `spec`; the
    spec that compiled `serving_hash`, while another compiles: `rollout.serving_spec`) at `serving_hash`,
    the hash whose artifacts exist; none until the first compile. `public`: the selector the public Service
    keeps (default: the serving set's). `internal_token`: a fresh random token for the model's Secret (the
    operator creates the Secret once and never changes it, so only the first pass's token is used; None: no
    Secret). `wake_base`: the operator's wake URL (NEURONFLEET_WAKE_URL), for the routers of a scale-to-zero
    model's front door (`front_door`); None: they are not given one. `peers`: whom the NetworkPolicies admit
    besides the model's pods (the operator's settings; default: `network_policy.Peers()`)."""
    chash = compile_hash(spec)
    serving = serving_spec or spec
    objects: list[dict[str, Any] | None] = []
    if engines.shared_cache(spec):  # the compile cache (also the servers' own, for SGLang-Neuron)
        objects.append(build_pvc(owner, spec))
    if engines.compiles(spec):  # the compile's config; an engine that compiles as it starts: none
        objects.append(build_config_map(owner, spec, chash))
    else:
        compile_job = False
    if internal_token is not None:  # before the pods that mount it
        objects.append(build_internal_secret(owner, internal_token))
    if serving.serving.networkPolicy:  # before the pods it fences
        objects.extend(build_network_policies(owner, serving, peers or network_policy.Peers(), public))
    if compile_job:
        objects.append(build_compile_claim_template(owner, spec, chash))  # DRA: before the pod that names it
        objects.append(build_compile_job(owner, spec, chash, attempt, source_retries))
    if serving_hash is not None:
        objects.extend(build_serving(owner, serving, serving_hash, public, wake_base))
    objects.append(scaling.build_autoscaler(spec, metadata(owner, owner.name, "autoscaler")))
    return [o for o in objects if o is not None]
