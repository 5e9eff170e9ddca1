"""Pure builders of the Kubernetes objects a NeuronModel owns, as plain dicts, and its compile hash.

`build_all` returns, for one model: the compile-cache PVC (unless an existing claim is named), the runtime
ConfigMap, the compile Job for the model's compile hash, and, once that hash has compiled, a Deployment per
serving role (unified | prefill + decode + router), the public Service, headless Services per role,
PodDisruptionBudgets, and for a disaggregated model the Secret holding its internal token (created once, with
a token the caller generates) and, when asked for, a NetworkPolicy that lets only the model's own pods reach
its prefill and decode pods. Every object carries `app.kubernetes.io/*` labels, neuronfleet's own
(`neuronfleet.dev/model`, `role`, `compile-hash`) and an ownerReference to the NeuronModel.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from neuronfleet.contract import (
    CACHE_MOUNT,
    COMPILE_CONFIG_FILE,
    CONFIG_MOUNT,
    GRACE_PERIOD,
    HF_TOKEN_ENVS,
    INTERNAL_TOKEN_DIR,
    INTERNAL_TOKEN_FILE,
    KV_PORT,
    MODEL_MOUNT,
    POD_IP_ENV,
    CompileBuckets,
    CompileConfig,
    CompileModel,
    ServeConfig,
)

from . import engines, topology, validation
from .spec import API_VERSION, KIND, NeuronModelSpec

LABEL_PREFIX = "neuronfleet.dev"
NEURON_TAINT = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}
NEURON_SCHEDULER = "my-scheduler"  # AWS's Neuron scheduler extension chart names it so
RUN_AS_USER = 10001  # the images' own user (Dockerfile)


@dataclass(frozen=True)
class Owner:
    """The NeuronModel that owns the objects."""

    name: str
    namespace: str
    uid: str


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
    fixed at compile time, the platform family, logical cores and compiler settings."""
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
    }
    if spec.model.tokenizer:  # only when set: the hashes of models without one stay as they were
        identity["tokenizer"] = spec.model.tokenizer
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def labels(owner: Owner, component: str, chash: str | None = None) -> dict[str, str]:
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
    return out


def selector(owner: Owner, component: str) -> dict[str, str]:
    return {f"{LABEL_PREFIX}/model": owner.name, f"{LABEL_PREFIX}/role": component}


def metadata(owner: Owner, name: str, component: str, chash: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component, chash),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def cache_claim_name(owner: Owner, spec: NeuronModelSpec) -> str:
    return spec.compile.cache.claimName or f"{owner.name}-compile-cache"


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
        buckets=CompileBuckets(context=n.buckets.context, generation=n.buckets.generation),
        neuronConfig=engines.nxdi_neuron_config(spec),
    )


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-runtime"


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


def _security(read_only_root: bool, efa: bool = False) -> dict[str, Any]:
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if efa:
        # IPC_LOCK only: libfabric's EFA provider pins the memory it registers for RDMA, which needs
        # CAP_IPC_LOCK unless the node lifts the memlock limit (AWS, "Manage EFA devices on Amazon EKS",
        # and the aws-efa-k8s-device-plugin's example pods; libfabric's fi_efa(7)).
        capabilities["add"] = ["IPC_LOCK"]
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _env(spec: NeuronModelSpec, extra: dict[str, str]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(extra.items())]
    ref = spec.model.secretRef
    if ref is not None:  # the token comes from the Secret, never from a plain field
        for name in HF_TOKEN_ENVS:
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _volumes(owner: Owner, spec: NeuronModelSpec, cache_read_only: bool) -> tuple[list, list]:
    volumes = [
        {"name": "cache", "persistentVolumeClaim": {"claimName": cache_claim_name(owner, spec)}},
        {"name": "config", "configMap": {"name": config_map_name(owner)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "cache", "mountPath": CACHE_MOUNT, "readOnly": cache_read_only},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.model.uri.startswith("pvc://"):
        claim = spec.model.uri.removeprefix("pvc://").split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def compile_job_name(owner: Owner, chash: str) -> str:
    return f"{owner.name}-compile-{chash[:10]}"


def build_compile_job(owner: Owner, spec: NeuronModelSpec, chash: str) -> dict[str, Any]:
    container = engines.compile_container(spec, chash)
    volumes, mounts = _volumes(owner, spec, cache_read_only=False)
    resources = spec.compile.resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER},
        "containers": [
            {
                "name": "compile",
                "image": container.image,
                "command": container.command,
                "env": _env(spec, container.env),
                "volumeMounts": mounts,
                "resources": {k: v for k, v in resources.model_dump().items() if v},
                "securityContext": _security(read_only_root=spec.engine == "embedded"),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
    }
    if spec.compile.nodeSelector:
        pod_spec["nodeSelector"] = dict(spec.compile.nodeSelector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(owner, compile_job_name(owner, chash), "compile", chash),
        "spec": {
            "backoffLimit": spec.compile.backoffLimit,
            "activeDeadlineSeconds": spec.compile.activeDeadlineSeconds,
            "ttlSecondsAfterFinished": 86400,
            "template": {"metadata": {"labels": labels(owner, "compile", chash)}, "spec": pod_spec},
        },
    }


def serving_roles(spec: NeuronModelSpec) -> dict[str, int]:
    """Role -> replicas."""
    s = spec.serving
    if s.mode == "unified":
        return {"unified": s.unified.replicas}
    assert s.prefill is not None and s.decode is not None  # the spec's rule
    return {"prefill": s.prefill.replicas, "decode": s.decode.replicas, "router": s.router.replicas}


def deployment_name(owner: Owner, role: str) -> str:
    return f"{owner.name}-{role}"


def _resources(spec: NeuronModelSpec, role: str) -> dict[str, Any]:
    s = spec.serving
    role_spec = {"unified": s.unified, "prefill": s.prefill, "decode": s.decode}.get(role)
    requests = dict(role_spec.resources.requests) if role_spec else {"cpu": "500m", "memory": "512Mi"}
    limits = dict(role_spec.resources.limits) if role_spec else {"memory": "1Gi"}
    _, cores = validation.neuron_devices(spec)
    extended: dict[str, str] = {}
    if role != "router" and cores:
        extended["aws.amazon.com/neuroncore"] = str(cores)
    if role in ("prefill", "decode") and s.kvTransfer.transport == "efa" and s.kvTransfer.efaInterfaces:
        extended["vpc.amazonaws.com/efa"] = str(s.kvTransfer.efaInterfaces)
    requests.update(extended)  # extended resources: requests equal limits
    limits.update(extended)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def serve_config(owner: Owner, spec: NeuronModelSpec, role: str, chash: str) -> ServeConfig:
    """Our runtime's serve options for a role's pods: the spec's (`engines.serve_config`), plus the model's
    name, its peers, the KV transport and port, and the internal token's file."""
    port, transport = spec.serving.port, spec.serving.kvTransfer.transport
    pod: dict[str, Any] = {"served_model_name": owner.name}  # clients name the model as the NeuronModel
    if role == "router":
        pod["prefill"] = [f"dns://{owner.name}-prefill:{port}"]
        pod["decode"] = [f"dns://{owner.name}-decode:{port}"]
    if role in ("prefill", "decode"):
        pod["kv_transport"] = transport
    if role == "decode":  # prefill pods send KV caches to the pod's own IP
        pod["kv_port"] = KV_PORT
    if role in ("prefill", "decode", "router"):  # the token from its Secret, as a file, never env
        pod["internal_token_file"] = INTERNAL_TOKEN_FILE
    return engines.serve_config(spec, role, chash, port).model_copy(update=pod)


def build_deployment(owner: Owner, spec: NeuronModelSpec, role: str, replicas: int, chash: str) -> dict:
    port = spec.serving.port
    ours = spec.engine == "embedded" or role == "router"
    config = serve_config(owner, spec, role, chash) if ours else None
    container = engines.serve_container(spec, role, chash, port, config, served_name=owner.name)
    env = _env(spec, container.env)
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    volumes, mounts = _volumes(owner, spec, cache_read_only=True)
    transport = spec.serving.kvTransfer.transport
    if ours and role == "decode":
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if ours and role in ("prefill", "decode", "router"):
        volumes.append(
            {"name": "internal-token",
             "secret": {"secretName": internal_secret_name(owner), "defaultMode": 0o440}}
        )  # fmt: skip
        mounts.append({"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True})
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    neuron = role != "router" and spec.neuron.instanceType != "cpu"
    efa = role in ("prefill", "decode") and transport == "efa" and spec.serving.kvTransfer.efaInterfaces > 0
    health, ready = ("/health", "/ready") if ours else ("/health", "/health")

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 5,
        }

    pod_spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER},
        # requests in flight finish within the grace period, then the process exits
        "terminationGracePeriodSeconds": int(config.grace_period if config else GRACE_PERIOD) + 15,
        "containers": [
            {
                "name": "server",
                "image": container.image,
                "command": container.command,
                "env": env,
                "ports": ports,
                "resources": _resources(spec, role),
                "volumeMounts": mounts,
                # model loads take minutes on Neuron: up to an hour to start, then strict liveness
                "startupProbe": probe(health, 10, 360),
                "readinessProbe": probe(ready, 5, 3),
                "livenessProbe": probe(health, 10, 6),
                "securityContext": _security(read_only_root=ours, efa=efa),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
    }
    sched = spec.scheduling
    node_selector = dict(sched.nodeSelector)
    tolerations = list(sched.tolerations)
    if neuron:
        node_selector["node.kubernetes.io/instance-type"] = spec.neuron.instanceType
        tolerations.insert(0, dict(NEURON_TAINT))
        if validation.neuron_devices(spec)[1] > 1:  # contiguous cores: the Neuron scheduler extension
            pod_spec["schedulerName"] = sched.schedulerName or NEURON_SCHEDULER
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if sched.affinity:
        pod_spec["affinity"] = dict(sched.affinity)
    if sched.priorityClassName:
        pod_spec["priorityClassName"] = sched.priorityClassName
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, deployment_name(owner, role), role, chash),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels(owner, role, chash)}, "spec": pod_spec},
        },
    }


def public_role(spec: NeuronModelSpec) -> str:
    return "unified" if spec.serving.mode == "unified" else "router"


def build_services(owner: Owner, spec: NeuronModelSpec) -> list[dict[str, Any]]:
    port = spec.serving.port
    ports = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    public = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, owner.name, "endpoint"),
        "spec": {"type": "ClusterIP", "selector": selector(owner, public_role(spec)), "ports": ports},
    }
    out = [public]
    if spec.serving.mode == "disaggregated":  # the router finds its peers through DNS
        for role in ("prefill", "decode"):
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": metadata(owner, f"{owner.name}-{role}", role),
                    "spec": {
                        "clusterIP": "None",
                        "publishNotReadyAddresses": False,
                        "selector": selector(owner, role),
                        "ports": ports,
                    },
                }
            )
    return out


def build_pdb(owner: Owner, role: str, replicas: int) -> dict[str, Any] | None:
    if replicas < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, f"{owner.name}-{role}", role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner, role)}},
    }


def internal_secret_name(owner: Owner) -> str:
    return f"{owner.name}-internal"


def build_internal_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The per-model token of the prefill, decode and router pods' internal endpoints (created once)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, internal_secret_name(owner), "internal-token"),
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def build_network_policy(owner: Owner, spec: NeuronModelSpec) -> dict[str, Any]:
    """Only this model's own pods (router, prefill, decode) reach its prefill and decode pods: their internal
    endpoints and the KV port. The public endpoint (router or unified pods) stays reachable."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, f"{owner.name}-internal", "internal"),
        "spec": {
            "podSelector": {
                "matchLabels": {f"{LABEL_PREFIX}/model": owner.name},
                "matchExpressions": [
                    {"key": f"{LABEL_PREFIX}/role", "operator": "In", "values": ["prefill", "decode"]}
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {f"{LABEL_PREFIX}/model": owner.name}}}]}],
        },
    }


def endpoint(owner: Owner, spec: NeuronModelSpec, service: dict[str, Any] | None = None) -> str:
    """The model's URL: the address the Service publishes in status.loadBalancer.ingress when it has one (a
    load balancer, or local mode's proxy on this machine), else its in-cluster DNS name."""
    for ingress in ((service or {}).get("status") or {}).get("loadBalancer", {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        ports = [p["port"] for p in ingress.get("ports") or [] if p.get("port")]
        if host:
            return f"http://{host}:{ports[0] if ports else spec.serving.port}"
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.serving.port}"


def build_all(
    owner: Owner, spec: NeuronModelSpec, serving_hash: str | None = None, internal_token: str | None = None
) -> list[dict[str, Any]]:
    """Every object of a model. Serving objects use `serving_hash`: the hash whose artifacts exist (the
    current one once it compiled; the previous one while a new one compiles); none until the first compile.
    `internal_token`: a fresh random token for a disaggregated model's Secret (the operator creates the Secret
    once and never changes it, so only the first pass's token is used)."""
    chash = compile_hash(spec)
    objects = [
        build_pvc(owner, spec),
        build_config_map(owner, spec, chash),
        build_compile_job(owner, spec, chash),
    ]
    if serving_hash is not None:
        for role, replicas in serving_roles(spec).items():
            objects.append(build_deployment(owner, spec, role, replicas, serving_hash))
            objects.append(build_pdb(owner, role, replicas))
        objects.extend(build_services(owner, spec))
    if spec.serving.mode == "disaggregated":
        if internal_token is not None:
            objects.append(build_internal_secret(owner, internal_token))
        if spec.serving.networkPolicy:
            objects.append(build_network_policy(owner, spec))
    return [o for o in objects if o is not None]
