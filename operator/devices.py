"""How a model's Neuron pods get their devices, the one place it is decided: the Neuron device plugin's
extended resources (`devicePlugin`, the default) or Dynamic Resource Allocation (`dra`: a
ResourceClaimTemplate per pod kind, owned by the model, that the pod names in spec.resourceClaims and its
container in resources.claims), chosen per cluster (the chart's neuron.deviceAllocation, the operator's
NEURONFLEET_NEURON_DEVICE_ALLOCATION) and per model (spec.neuron.deviceAllocation); and how a logical-core
setting (LNC) that is not the instance type's default reaches the node: a node label the chart names
(neuron.lncNodeLabel) with the device plugin, the claim's NeuronConfig with DRA, else a refusal. Pure, but for
the operator's settings read once from its environment (the chart's values).

Facts, each from the source named beside it (tests/data/neuron-dra-sdk2.32.0-names.json records every name
with its file and line; tests/unit/test_devices.py holds the renders to it):
- SDK = github.com/aws-neuron/aws-neuron-sdk at tag v2.32.0 (a3247f5b), `deploy/eks/dra.rst`, `deploy/files/`,
  `deploy/eks/prerequisites.rst`.
- EKS = github.com/awsdocs/amazon-eks-user-guide at 43d79bdb, `latest/ug/ml/device-management-neuron.adoc`
  ("Neuron devices") and `latest/ug/ml/device-management-efa.adoc` ("EFA devices").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from . import parallelism, topology
from .spec import NeuronModelSpec

DEVICE_PLUGIN, DRA = "devicePlugin", "dra"
Allocation = Literal["devicePlugin", "dra"]
ALLOCATIONS: tuple[str, ...] = (DEVICE_PLUGIN, DRA)
DEVICE_ALLOCATION_ENV = "NEURONFLEET_NEURON_DEVICE_ALLOCATION"
LNC_NODE_LABEL_ENV = "NEURONFLEET_NEURON_LNC_NODE_LABEL"

# The device plugins' extended resources: NeuronCores (EKS "Neuron devices": the Neuron device plugin
# advertises `aws.amazon.com/neuron` and `aws.amazon.com/neuroncore`) and EFA interfaces (EKS "EFA devices":
# the EFA device plugin advertises `vpc.amazonaws.com/efa`).
NEURONCORE = "aws.amazon.com/neuroncore"
EFA = "vpc.amazonaws.com/efa"

# DRA, Kubernetes 1.34+ (resource.k8s.io/v1; SDK dra.rst "Prerequisites": control plane 1.34+, nodes 1.34.2+).
RESOURCE_API_VERSION = "resource.k8s.io/v1"
# The Neuron DRA driver's DeviceClass and driver name: `neuron.aws.com` (SDK dra.rst 123, 130;
# deploy/files/manifests/deviceclass.yaml 4, 8; EKS "Neuron devices": DeviceClass `neuron.aws.com`). It
# allocates whole Neuron devices (`neurondevice0`..., dra.rst 271), never single cores.
NEURON_DEVICE_CLASS = "neuron.aws.com"
NEURON_DRIVER = "neuron.aws.com"
# Devices of the model's instance type only: the driver's `instanceType` attribute (dra.rst 126, 207, 541).
INSTANCE_TYPE_SELECTOR = "device.attributes['neuron.aws.com'].instanceType == '{}'"
# A connected set of 1, 4, 8 or 16 devices: `allocationMode: ExactCount`, `count`, and a constraint that every
# device shares `resource.aws.com/devicegroup<N>_id` (dra.rst 172-173, 203-210, 571-574; EKS "Neuron devices",
# "Allocate connected device subsets"). The attributes are published on EFA-enabled instances only (dra.rst
# 566-569), so only there is a count rounded up to a connected set and constrained to it.
CONNECTED_SETS = (1, 4, 8, 16)
DEVICE_GROUP = "resource.aws.com/devicegroup{}_id"
# LNC per claim: an opaque config for the driver, `apiVersion: neuron.aws.com/v1`, `kind: NeuronConfig`,
# `logicalNeuronCore: 1` (dra.rst 129-135, 402-409; deploy/files/specs/lnc-setting-trn2.yaml 17-23; EKS
# "Neuron devices", "Configure Logical NeuronCores (LNC)": LNC=1 or LNC=2, no launch template needed).
NEURON_CONFIG_API_VERSION = "neuron.aws.com/v1"
NEURON_CONFIG_KIND = "NeuronConfig"
LNC_PARAMETER = "logicalNeuronCore"
# The EFA DRA driver (DRANET): DeviceClass `efa.networking.k8s.aws`, driver `dra.net`; EFA interfaces paired
# with their topologically-local Neuron devices by one constraint over both requests on
# `resource.aws.com/devicegroup<N>_id`, N the Neuron device count (EKS "EFA devices", "Install the EFA DRA
# driver" and "Topology-aware EFA and GPU/Neuron device allocation").
EFA_DEVICE_CLASS = "efa.networking.k8s.aws"
# The pod's claim (spec.resourceClaims[].name and the container's resources.claims[].name) and the requests
# inside its template (the names are ours: dra.rst 92 "The ResourceClaimTemplate name is a given name").
POD_CLAIM = "neuron-devices"
NEURON_REQUEST, EFA_REQUEST = "neurons", "efas"
# With the device plugin, LNC is the node's: Trn2 runs LNC=2 unless the launch template's user data writes
# NEURON_LOGICAL_NC_CONFIG=1 to /opt/aws/neuron/logical_nc_config (SDK deploy/eks/prerequisites.rst 44-61);
# no node label for it is documented at v2.32.0, so the chart names one (neuron.lncNodeLabel) that the
# cluster's LNC=1 nodes carry with the value "1".
LNC_HOW = (
    "LNC is a node setting with the Neuron device plugin: launch the nodes with a launch template whose user "
    "data writes NEURON_LOGICAL_NC_CONFIG={lnc} to /opt/aws/neuron/logical_nc_config (Neuron SDK "
    "deploy/eks/prerequisites.rst), label them (e.g. neuronfleet.dev/lnc={lnc}) and set the chart's "
    "neuron.lncNodeLabel to that label's key; or allocate with DRA (neuron.deviceAllocation: dra, "
    "Kubernetes 1.34+ with the Neuron DRA driver), whose claim sets LNC per pod; or leave "
    "neuron.logicalCores at {default}"
)


def _setting(environ: Any, name: str, default: str = "") -> str:
    return (environ.get(name) or default).strip()


CLUSTER_ALLOCATION = _setting(os.environ, DEVICE_ALLOCATION_ENV, DEVICE_PLUGIN)
if CLUSTER_ALLOCATION not in ALLOCATIONS:
    raise ValueError(
        f"{DEVICE_ALLOCATION_ENV}={CLUSTER_ALLOCATION!r}: the chart's neuron.deviceAllocation must be one of "
        f"{', '.join(ALLOCATIONS)}"
    )
LNC_NODE_LABEL = _setting(os.environ, LNC_NODE_LABEL_ENV)


@dataclass(frozen=True)
class Settings:
    """The cluster's choices (the chart's neuron values): how devices are allocated, and the node label that
    says a node's LNC ("" none)."""

    allocation: str = DEVICE_PLUGIN
    lnc_node_label: str = ""


def settings() -> Settings:
    """The operator's settings from its environment (read at start)."""
    return Settings(CLUSTER_ALLOCATION, LNC_NODE_LABEL)


def allocation(spec: NeuronModelSpec, cluster: Settings | None = None) -> str:
    """How this model's pods get devices: its own neuron.deviceAllocation, else the cluster's."""
    return spec.neuron.deviceAllocation or (cluster or settings()).allocation


@dataclass(frozen=True)
class PodDevices:
    """What one pod of a role asks for: Neuron cores (device plugin) or devices (DRA), EFA interfaces."""

    cores: int  # Neuron cores the engine runs on (its tensor parallelism)
    devices: int  # whole Neuron devices a DRA claim holds (the cores' devices, rounded up to a connected set)
    efa: int  # EFA interfaces
    connected: bool  # the devices are constrained to one connected set (devicegroup<devices>_id)
    lnc: int | None  # the logical-core setting the claim sets (Trn2, Trn3), else None


def pod_devices(spec: NeuronModelSpec, role: str) -> PodDevices:
    """What a pod of `role` (unified, prefill, decode, router, or `compile`: a compile on devices) asks
    for."""
    n = spec.neuron
    kv = spec.serving.kvTransfer
    efa = kv.efaInterfaces if role in ("prefill", "decode") and kv.over_efa and kv.efaInterfaces else 0
    inst = topology.INSTANCES.get(n.instanceType)
    if inst is None or role == "router":  # (the embedded engine's prefill and decode on cpu may use EFA)
        return PodDevices(0, 0, efa, False, None)
    cores = parallelism.compile_cores(spec) if role == "compile" else parallelism.role_cores(spec, role)
    devices = math.ceil(cores / inst.cores_per_device(n.logicalCores)) if cores else 0
    connected = bool(devices) and inst.efa_interfaces > 0
    if connected:
        devices = next((size for size in CONNECTED_SETS if size >= devices), devices)
    lnc = (n.logicalCores or inst.default_logical_cores) if inst.lnc_configurable else None
    return PodDevices(cores, devices, efa, connected, lnc)


def extended_resources(spec: NeuronModelSpec, role: str, cluster: Settings | None = None) -> dict[str, str]:
    """The device plugins' extended resources a container of `role` asks for (requests equal limits); none
    with DRA."""
    if allocation(spec, cluster) == DRA:
        return {}
    want = pod_devices(spec, role)
    out: dict[str, str] = {}
    if want.cores:
        out[NEURONCORE] = str(want.cores)
    if want.efa:
        out[EFA] = str(want.efa)
    return out


def claim_spec(spec: NeuronModelSpec, role: str, cluster: Settings | None = None) -> dict[str, Any] | None:
    """The ResourceClaimTemplate's `spec` for a pod of `role` with DRA: exactly its Neuron devices of the
    instance type (a connected set where the instance publishes one), the instance type's LNC (the spec's, or
    its default, so a node's own setting never decides it), and its EFA interfaces paired with those devices
    where the count fits their group (else unpaired); None with the device plugin or without devices. (A
    pod with EFA interfaces and no Neuron devices, the embedded engine's on cpu, asks for the interfaces.)"""
    if allocation(spec, cluster) != DRA:
        return None
    want = pod_devices(spec, role)
    if not want.devices and not want.efa:
        return None
    devices: dict[str, Any] = {"requests": []}
    if want.devices:
        selector = {"cel": {"expression": INSTANCE_TYPE_SELECTOR.format(spec.neuron.instanceType)}}
        neurons = {"deviceClassName": NEURON_DEVICE_CLASS, "selectors": [selector],
                   "allocationMode": "ExactCount", "count": want.devices}  # fmt: skip
        devices["requests"].append({"name": NEURON_REQUEST, "exactly": neurons})
    paired = [NEURON_REQUEST]
    if want.efa:
        efas = {"deviceClassName": EFA_DEVICE_CLASS, "allocationMode": "ExactCount", "count": want.efa}
        devices["requests"].append({"name": EFA_REQUEST, "exactly": efas})
        if want.connected and want.efa <= want.devices:  # as many as the group holds (one per device)
            paired.append(EFA_REQUEST)
    if want.connected:
        devices["constraints"] = [{"requests": paired, "matchAttribute": DEVICE_GROUP.format(want.devices)}]
    if want.lnc is not None:
        parameters = {
            "apiVersion": NEURON_CONFIG_API_VERSION, "kind": NEURON_CONFIG_KIND, LNC_PARAMETER: want.lnc
        }  # fmt: skip
        devices["config"] = [
            {"requests": [NEURON_REQUEST], "opaque": {"driver": NEURON_DRIVER, "parameters": parameters}}
        ]
    return {"spec": {"devices": devices}}


def claim_template_name(model: str, role: str, claim: dict[str, Any]) -> str:
    """`MODEL-ROLE-devices-<digest>`: a template's spec cannot change (Kubernetes refuses an update of it), so
    a different claim is a new template, and the one no pod kind names any more is deleted as stale."""
    canonical = json.dumps(claim, sort_keys=True, separators=(",", ":"))
    return f"{model}-{role}-devices-{hashlib.sha256(canonical.encode()).hexdigest()[:10]}"


def claim_template(
    spec: NeuronModelSpec, role: str, metadata: dict[str, Any], cluster: Settings | None = None
) -> dict[str, Any] | None:
    """The ResourceClaimTemplate of a pod of `role`, with `metadata` (labels, owner; its name is set here), or
    None where the pod asks for no DRA devices."""
    claim = claim_spec(spec, role, cluster)
    if claim is None:
        return None
    meta = {**metadata, "name": claim_template_name(metadata["name"], role, claim)}
    kind = "ResourceClaimTemplate"
    return {"apiVersion": RESOURCE_API_VERSION, "kind": kind, "metadata": meta, "spec": claim}


def container_claims(spec: NeuronModelSpec, role: str, cluster: Settings | None = None) -> dict[str, Any]:
    """A container's resources.claims where its pod has a claim (as SDK dra.rst 79-80 and 228-231), else
    {}."""
    return {"claims": [{"name": POD_CLAIM}]} if claim_spec(spec, role, cluster) is not None else {}


def pod_claims(template: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A pod's spec.resourceClaims for `template` (as SDK dra.rst 88-90 and 232-234)."""
    if template is None:
        return []
    return [{"name": POD_CLAIM, "resourceClaimTemplateName": template["metadata"]["name"]}]


def node_selector(spec: NeuronModelSpec, cluster: Settings | None = None) -> dict[str, str]:
    """With the device plugin, a logical-core setting other than the instance type's default selects the
    nodes that run it by the chart's neuron.lncNodeLabel (none where no label is named: `refusals`
    refuses)."""
    cluster = cluster or settings()
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    lnc = spec.neuron.logicalCores
    if inst is None or not inst.lnc_configurable or lnc in (None, inst.default_logical_cores):
        return {}
    if allocation(spec, cluster) == DRA or not cluster.lnc_node_label:
        return {}
    return {cluster.lnc_node_label: str(lnc)}


def uses_scheduler_extension(spec: NeuronModelSpec, cluster: Settings | None = None) -> bool:
    """Whether a multi-core pod is placed by the Neuron scheduler extension: with the device plugin only; DRA
    allocates connected devices itself (SDK dra.rst 167-168: "Before DRA, this use case required using
    Neuron Scheduler Extension. With DRA, this allocation is enabled natively")."""
    return allocation(spec, cluster) != DRA


def refusals(spec: NeuronModelSpec, cluster: Settings | None = None) -> list[str]:
    """Why the model's devices cannot be allocated as its spec says: a non-default LNC with the device plugin
    and no node label that finds the nodes running it."""
    cluster = cluster or settings()
    inst = topology.INSTANCES.get(spec.neuron.instanceType)
    lnc = spec.neuron.logicalCores
    if inst is None or not inst.lnc_configurable or lnc in (None, inst.default_logical_cores):
        return []
    if allocation(spec, cluster) == DRA or cluster.lnc_node_label:
        return []
    return [
        f"neuron.logicalCores {lnc} needs nodes that run LNC={lnc}, and the device plugin cannot find them "
        f"({inst.name} runs LNC={inst.default_logical_cores} unless its node says otherwise): "
        + LNC_HOW.format(lnc=lnc, default=inst.default_logical_cores)
    ]
