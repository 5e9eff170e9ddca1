"""What every pod the operator makes is given, whatever builds it (the compile Job, a serving Deployment):
its security context (non-root, read-only root where the engine allows, no capabilities but EFA's
IPC_LOCK), its environment (the Hub token only from the model's Secret, only where it is used), its volumes
(the compile cache, the compile config, a pvc:// model, the engine's writable places), its resources and,
on Neuron, its placement (instance type, the Neuron taint, the scheduler extension); a compile pod's
initContainer that downloads an s3:// model. Pure."""

from __future__ import annotations

from typing import Any

from neuronfleet.contract import CACHE_MOUNT, CONFIG_MOUNT, HF_TOKEN_ENVS, MODEL_MOUNT

from . import engines, validation
from .spec import NeuronModelSpec

NEURON_TAINT = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}
NEURON_SCHEDULER = "my-scheduler"  # AWS's Neuron scheduler extension chart names it so
RUN_AS_USER = 10001  # the images' own user (Dockerfile)


def pod_security() -> dict[str, Any]:
    """The pod's security context: the images' own non-root user, owning its volumes."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER}


def security(read_only_root: bool, efa: bool = False) -> dict[str, Any]:
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


def reads_hub_when_serving(spec: NeuronModelSpec, role: str) -> bool:
    """Whether a role's pods download from the Hugging Face Hub at start, so need the model's token. Ours
    (embedded, every router) and TGI serve the compiled folder only; vLLM and SGLang are given the Hub id
    (`engines.model_reference`) and load its config and tokenizer from the Hub (vLLM: `vllm serve <model>`
    "Hugging Face model name or path", docs.vllm.ai/en/stable/cli/serve.html; SGLang: `--model-path`
    "local folder or a Hugging Face repo ID", docs.sglang.ai/advanced_features/server_arguments.html)."""
    return role != "router" and spec.engine in ("vllm", "sglang") and spec.model.uri.startswith("hf://")


def env(spec: NeuronModelSpec, extra: dict[str, str], hub_token: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(extra.items())]
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
    spec: NeuronModelSpec, compiling: bool, cache_claim: str, config_map: str, writable: tuple[str, ...] = ()
) -> tuple[list, list]:
    """The compile pod's volumes (cache writable, the ConfigMap's compile.json and scripts), or a serving
    pod's (cache read-only; no ConfigMap: serving reads only artifacts/<hash>/, so a new compile's ConfigMap
    never touches running pods), beside the `source_volumes`."""
    volumes, mounts = source_volumes(spec)
    if engines.compiles(spec):  # (an engine that compiles as it starts has no artifacts to read)
        volumes.insert(0, {"name": "cache", "persistentVolumeClaim": {"claimName": cache_claim}})
        mounts.insert(0, {"name": "cache", "mountPath": CACHE_MOUNT, "readOnly": not compiling})
    if compiling:
        volumes.insert(1, {"name": "config", "configMap": {"name": config_map}})
        mounts.insert(1, {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    for i, path in enumerate(writable):  # what the engine writes beside /tmp (HOME, caches), root read-only
        volumes.append({"name": f"writable-{i}", "emptyDir": {}})
        mounts.append({"name": f"writable-{i}", "mountPath": path})
    return volumes, mounts


def compile_resources(spec: NeuronModelSpec, needs_neuron: bool) -> dict[str, Any]:
    """The compile container's resources: the spec's, plus the serving pods' Neuron cores when the
    engine's compile runs the model on devices."""
    out = {k: dict(v) for k, v in spec.compile.resources.model_dump().items() if v}
    if needs_neuron:
        cores = str(validation.neuron_devices(spec)[1])
        for kind in ("requests", "limits"):  # extended resources: requests equal limits
            out.setdefault(kind, {})["aws.amazon.com/neuroncore"] = cores
    return out


def place_on_neuron(
    spec: NeuronModelSpec, pod_spec: dict[str, Any], node_selector: dict[str, str], tolerations: list
) -> None:
    """Puts a pod that uses Neuron cores on a node of the spec's instance type: its label, the Neuron
    taint tolerated, and the Neuron scheduler extension when it needs contiguous cores."""
    node_selector["node.kubernetes.io/instance-type"] = spec.neuron.instanceType
    pod_spec["nodeSelector"] = node_selector
    pod_spec["tolerations"] = [dict(NEURON_TAINT), *tolerations]
    if validation.neuron_devices(spec)[1] > 1:  # contiguous cores: the Neuron scheduler extension
        pod_spec["schedulerName"] = spec.scheduling.schedulerName or NEURON_SCHEDULER


def serving_resources(spec: NeuronModelSpec, role: str) -> dict[str, Any]:
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
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": security(read_only_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
