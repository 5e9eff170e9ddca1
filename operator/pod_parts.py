"""What every pod the operator makes is given, whatever builds it (the compile Job, a serving Deployment, the
source probe): its security (`pod_security`, `security`: the one place it is decided; docs/security.md), its
environment (the Hub token only from the model's Secret, only where it is used; our images' writable places),
its volumes (the model's own folder of the compile cache, the compile config, a pvc:// model, the engine's
writable places), its resources (`host_resources` fills what the spec leaves out) and, on Neuron, its
placement (instance type, the Neuron taint, a scheduler only where one is named) and devices (`devices`: the
device plugins' extended resources or a DRA claim); a compile pod's
initContainer that downloads an s3:// model. Pure, but for the operator's settings read once from its
environment (the chart's values)."""

from __future__ import annotations

import os
from typing import Any

from neuronfleet.contract import CACHE_MOUNT, CONFIG_MOUNT, HF_TOKEN_ENVS, MODEL_MOUNT, model_cache_folder

from . import devices, engines, host_resources
from .engines.common import Container
from .spec import NeuronModelSpec

NEURON_TAINT = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}
# The scheduler of pods asking for more than one Neuron core, when the cluster runs the Neuron scheduler
# extension: the chart's neuron.schedulerName (AWS's Neuron helm chart installs it, as `my-scheduler`, only
# with scheduler.enabled=true, which is off by default: aws-neuron/neuron-helm-charts values.yaml). Empty: the
# cluster's default scheduler; a pod never names a scheduler the cluster may not run (it would stay Pending).
NEURON_SCHEDULER_ENV = "NEURONFLEET_NEURON_SCHEDULER"
NEURON_SCHEDULER = os.environ.get(NEURON_SCHEDULER_ENV, "")
RUN_AS_USER = 10001  # our images' own user (Dockerfile)
RUNTIME_DEFAULT_SECCOMP = {"type": "RuntimeDefault"}
# Where our images' processes write, their root file system being read-only: the pod's /tmp (an emptyDir) is
# their home, temporary folder and cache (huggingface_hub's, torch's), as their user has no home folder
# (Dockerfile: useradd --no-create-home). What they write for good goes to the compile cache claim.
OWN_WRITABLE_ENV = {"HOME": "/tmp", "TMPDIR": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache"}
# An engine's image keeps the container runtime's default capabilities, which its documentation runs it with
# (`docker run` without --cap-drop), but raw and packet sockets (ping, forged packets on the pod network): no
# engine's transport uses them (HTTP, ZeroMQ and NIXL over TCP sockets, EFA through its verbs device).
ENGINE_DROPPED = ("NET_RAW",)
# Kubernetes counts a container that adds CAP_SYS_ADMIN as one that may escalate its privileges:
# "AllowPrivilegeEscalation is true always when the container is: 1) run as Privileged 2) has CAP_SYS_ADMIN"
# (API reference, SecurityContext, v1.31), and its API refuses `allowPrivilegeEscalation: false` beside
# `CAP_SYS_ADMIN` (pkg/apis/core/validation ValidateSecurityContext): such a container does not claim it.
ESCALATING = "SYS_ADMIN"


def pod_security(container: Container | None = None) -> dict[str, Any]:
    """The pod's own security fields. No ServiceAccount token in any pod: none of them talks to the Kubernetes
    API (the runtime and the engines have no Kubernetes client; an IAM role for the compile's ServiceAccount
    comes as a token volume of its own, which EKS's pod identity webhook adds). Our images (`container` None,
    or not `third_party`): their own non-root user, owning the volumes; an engine's image: the user it
    declares."""
    if container is not None and container.third_party:
        context: dict[str, Any] = {"seccompProfile": dict(RUNTIME_DEFAULT_SECCOMP)}
    else:
        context = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                   "fsGroup": RUN_AS_USER, "seccompProfile": dict(RUNTIME_DEFAULT_SECCOMP)}  # fmt: skip
    return {"automountServiceAccountToken": False, "securityContext": context}


def security(container: Container | None = None, efa: bool = False) -> dict[str, Any]:
    """A container's security context. Ours: non-root, read-only root (it writes only its emptyDirs:
    `OWN_WRITABLE_ENV`), no capabilities, no privilege escalation. An engine's image: its own user and a
    writable root file system (the images declare no unprivileged user and write under their working folders,
    e.g. the vLLM image's /workspace), the container runtime's default capabilities but `ENGINE_DROPPED`, plus
    those the engine's documentation adds (`Container.capabilities`, each with its source in the engine's
    module), no privilege escalation unless one of them is SYS_ADMIN (`ESCALATING`). Both add IPC_LOCK with
    EFA: libfabric's EFA provider pins the memory it registers for RDMA, which needs CAP_IPC_LOCK unless the
    node lifts the memlock limit (AWS, "Manage EFA devices on Amazon EKS"; libfabric's fi_efa(7))."""
    add = list(container.capabilities) if container is not None else []
    if efa and "IPC_LOCK" not in add:
        add.append("IPC_LOCK")
    if container is not None and container.third_party:
        capabilities: dict[str, list[str]] = {"drop": list(ENGINE_DROPPED)}
        if add:
            capabilities["add"] = add
        out: dict[str, Any] = {
            "privileged": False,
            "capabilities": capabilities,
            "seccompProfile": dict(RUNTIME_DEFAULT_SECCOMP),
        }
        if ESCALATING not in add:
            out["allowPrivilegeEscalation"] = False
        return out
    own: dict[str, list[str]] = {"drop": ["ALL"]}
    if add:
        own["add"] = add
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": own,
        "seccompProfile": dict(RUNTIME_DEFAULT_SECCOMP),
    }


def reads_hub_when_serving(spec: NeuronModelSpec, role: str) -> bool:
    """Whether a role's pods download from the Hugging Face Hub at start, so need the model's token: the
    engine's word (`engines.reads_hub_when_serving`); never our router."""
    return role != "router" and engines.reads_hub_when_serving(spec)


def container_env(spec: NeuronModelSpec, container: Container, hub_token: bool) -> list[dict[str, Any]]:
    """A container's environment (`env`): its own, with our images' writable places (`OWN_WRITABLE_ENV`)."""
    own = {} if container.third_party else OWN_WRITABLE_ENV
    return env(spec, {**own, **container.env}, hub_token, container.field_env)


def env(
    spec: NeuronModelSpec, extra: dict[str, str], hub_token: bool, fields: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """A container's environment: `extra` (name -> value), `fields` (name -> the pod field it holds), and
    the Hub token from the model's Secret where `hub_token`."""
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(extra.items())]
    for name, path in sorted((fields or {}).items()):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    ref = spec.model.secretRef
    if ref is not None and hub_token:  # the token comes from the Secret, never from a plain field
        for name in HF_TOKEN_ENVS:
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def source_volumes(spec: NeuronModelSpec) -> tuple[list, list]:
    """What every pod that reads the model source has: /tmp, and a pvc:// model's claim, read-only."""
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.uri.startswith("pvc://"):
        claim = spec.model.uri.removeprefix("pvc://").split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def volumes(
    spec: NeuronModelSpec, compiling: bool, model: str, cache_claim: str, config_map: str,
    writable: tuple[str, ...] = (),
) -> tuple[list, list]:  # fmt: skip
    """The compile pod's volumes (cache writable, the ConfigMap's compile.json and scripts), or a serving
    pod's (cache read-only; no ConfigMap: serving reads only artifacts/<hash>/, so a new compile's ConfigMap
    never touches running pods), beside the `source_volumes`. Of the cache claim, a pod mounts only the
    folder of its `model` (`contract.model_cache_folder`): models that share a claim see none of each other's
    artifacts, downloads or engine caches, so none can plant what another loads."""
    volumes, mounts = source_volumes(spec)
    if engines.shared_cache(spec):  # read-only for serving, but where servers keep their own cache there
        read_only = not compiling and not engines.serving_writes_cache(spec)
        volumes.insert(0, {"name": "cache", "persistentVolumeClaim": {"claimName": cache_claim}})
        mounts.insert(0, {"name": "cache", "mountPath": CACHE_MOUNT, "subPath": model_cache_folder(model),
                          "readOnly": read_only})  # fmt: skip
    if compiling:
        volumes.insert(1, {"name": "config", "configMap": {"name": config_map}})
        mounts.insert(1, {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    for i, path in enumerate(writable):  # what the engine writes beside /tmp (HOME, caches), root read-only
        volumes.append({"name": f"writable-{i}", "emptyDir": {}})
        mounts.append({"name": f"writable-{i}", "mountPath": path})
    return volumes, mounts


def compile_resources(spec: NeuronModelSpec, container: Container) -> dict[str, Any]:
    """The compile container's resources: the spec's, the derived CPU and memory requests for what it leaves
    out (`host_resources`), plus the Neuron cores (or the DRA claim) of its largest tensor parallelism when
    the engine's compile runs the model on devices."""
    derived = host_resources.compile_job(spec, container.needs_neuron, container.loads_model)
    out = host_resources.with_defaults(spec.compile.resources.model_dump(), derived)
    if container.needs_neuron:  # the device plugin's cores, or (DRA) the claim of the pod's template
        if extended := devices.extended_resources(spec, "compile"):
            for kind in ("requests", "limits"):  # extended resources: requests equal limits
                out.setdefault(kind, {}).update(extended)
        out.update(devices.container_claims(spec, "compile"))
    return out


def place_on_neuron(
    spec: NeuronModelSpec, pod_spec: dict[str, Any], node_selector: dict[str, str], tolerations: list,
    cores: int, claim_template: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Puts a pod that uses `cores` Neuron cores on a node of the spec's instance type: its label (and, with
    the device plugin, the chart's LNC label for a non-default LNC: `devices.node_selector`) and the Neuron
    taint tolerated; with DRA, its `claim_template` in spec.resourceClaims (`devices.pod_claims`). Its
    scheduler is the spec's, else, with the device plugin for more than one core (contiguous cores, which the
    Neuron scheduler extension places), the operator's NEURON_SCHEDULER when the cluster runs one; DRA places
    connected devices without it."""
    node_selector["node.kubernetes.io/instance-type"] = spec.neuron.instanceType
    node_selector.update(devices.node_selector(spec))
    pod_spec["nodeSelector"] = node_selector
    pod_spec["tolerations"] = [dict(NEURON_TAINT), *tolerations]
    if claims := devices.pod_claims(claim_template):
        pod_spec["resourceClaims"] = claims
    extension = NEURON_SCHEDULER if cores > 1 and devices.uses_scheduler_extension(spec) else ""
    scheduler = spec.scheduling.schedulerName or extension
    if scheduler:
        pod_spec["schedulerName"] = scheduler


def serving_resources(spec: NeuronModelSpec, role: str) -> dict[str, Any]:
    s = spec.serving
    role_spec = {"unified": s.unified, "prefill": s.prefill, "decode": s.decode}.get(role)
    given = (
        role_spec.resources.model_dump()
        if role_spec
        else {"requests": dict(host_resources.SMALL), "limits": dict(host_resources.SMALL_LIMITS)}
    )
    out = host_resources.with_defaults(given, host_resources.serving(spec, role))
    requests, limits = out.setdefault("requests", {}), out.setdefault("limits", {})
    extended = devices.extended_resources(spec, role)  # the device plugins' Neuron cores and EFA interfaces
    requests.update(extended)  # extended resources: requests equal limits
    limits.update(extended)
    out.update(devices.container_claims(spec, role))  # or DRA's claim
    return {k: v for k, v in out.items() if v}


def fetch_init_container(spec: NeuronModelSpec, mounts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The compile pod's `fetch-model` initContainer (`engines.fetch_container`: an s3:// model for an engine
    whose image has no AWS SDK), with the compile pod's cache and /tmp `mounts`; None when there is none."""
    fetch = engines.fetch_container(spec)
    if fetch is None:
        return None
    return {
        "name": "fetch-model",
        "image": fetch.image,
        "command": fetch.command,
        "env": container_env(spec, fetch, hub_token=False),
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")],
        "resources": {"requests": dict(host_resources.SMALL), "limits": dict(host_resources.SMALL_LIMITS)},
        "securityContext": security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
