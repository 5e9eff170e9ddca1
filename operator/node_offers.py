"""What the cluster's nodes offer a model's pods, and the condition that says so before a pod waits (pure).

A Neuron pod that asks for what no node of its instance type offers stays Pending without a word from the
operator: the device plugin's `aws.amazon.com/neuroncore` where no Neuron device plugin runs (or where the
Neuron DRA driver runs instead: the two never share a node), `vpc.amazonaws.com/efa` where no EFA device
plugin runs (neither the Neuron helm chart nor the EKS AL2023/Bottlerocket AMIs install it), a DRA claim
whose DeviceClass or driver is missing, more cores or interfaces than a node has (a node's LNC sets how many
cores it offers). The model's `Schedulable` condition says which, and what to install, from two things:
- what the nodes offer, as `node_watch` keeps it (a node's instance type, the labels the operator's pods
  select on, the device plugins' allocatable; DRA's ResourceSlices per node and DeviceClasses): `Offers`;
- what the model's pods ask, read from their rendered templates whatever made them (`pod_needs`: containers'
  extended resources, spec.resourceClaims and the ResourceClaimTemplates they name, the nodeSelector, the
  schedulerName).

`schedulable` decides: False where a pod can never be placed as the nodes are (DevicePluginMissing,
EFADevicePluginMissing, DRADriverMissing, NodesTooSmall), Unknown where no node of the instance type (or
with the labels the pods select on) is in the cluster now (a node autoscaler may add one when the pods wait:
NoNodesOfInstanceType, NoNodesWithLabels) or where the node that lacks a device joined minutes ago (its
device plugin may still be registering: NodesStarting, SETTLE_SECONDS), True otherwise: DevicesOffered, or
SchedulerExtensionAdvised where pods ask for more than one Neuron core of a node that has more, without the
Neuron scheduler extension. It
says nothing (None) for a model whose pods ask for no device, or where the nodes are not read (the chart's
rbac.readNodes off): never a guess. It reads what nodes offer, not what is free now.

Facts, each from the source named (tests/data/node-offers-names.json records where each name appears):
- SDK = github.com/aws-neuron/aws-neuron-sdk at tag v2.32.0 (a3247f5b): the device plugin's two resources
  (deploy/includes/k8s-neuron-device-plugin.rst 5-6) and its install; the scheduler extension "is required
  for scheduling Pods that request more than one Neuron core or device resource", while "requesting one or
  all Neuron cores or devices is always valid" (deploy/infrastructure/scheduler.rst 8, 44), installed as the
  second scheduler `my-scheduler` with scheduler.enabled=true (deploy/includes/k8s-multiple-scheduler.rst
  3, 20, 39); the DRA driver `neuron.aws.com` (deploy/eks/dra.rst 130), installed with draDriver.enabled=true
  (162), never on a node beside the device plugin (582).
- EKS = github.com/awsdocs/amazon-eks-user-guide at 43d79bdb, latest/ug/ml/device-management-efa.adoc ("EFA
  devices"): the EFA device plugin's `vpc.amazonaws.com/efa` and its chart eks/aws-efa-k8s-device-plugin; the
  EFA DRA driver (DRANET) `dra.net` with DeviceClass `efa.networking.k8s.aws` and its chart eks/aws-dranet;
  "The EKS AL2023 and Bottlerocket AMIs do not include the EFA DRA driver or EFA device plugin";
  device-management-neuron.adoc ("Neuron devices"): the DRA driver's install command.
- Neuron helm chart = github.com/aws-neuron/neuron-helm-charts, charts/neuron-helm-chart/values.yaml
  (14049c20): the device plugin's DaemonSet runs only on the instance types its `neuronInstances` lists; its
  templates hold no EFA device plugin.
- DRA's objects (Kubernetes 1.34, resource.k8s.io/v1): a ResourceSlice's spec.driver, spec.nodeName or
  spec.allNodes, spec.devices; a DeviceClass's spec.selectors[].cel.expression and spec.extendedResourceName;
  a claim template's spec.spec.devices.requests[].exactly.deviceClassName, allocationMode, count
  (https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/).
"""

from __future__ import annotations

import calendar
import os
import re
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import devices

CONDITION = "Schedulable"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"  # the well-known label the operator's pods select on
NEURONCORE, NEURON_DEVICE, EFA = devices.NEURONCORE, "aws.amazon.com/neuron", devices.EFA
NEURON_RESOURCES = (NEURONCORE, NEURON_DEVICE)
KEPT_RESOURCES = (*NEURON_RESOURCES, EFA)  # the device plugins' resources a node's offer keeps
NEURON_DRIVER, NEURON_DEVICE_CLASS = devices.NEURON_DRIVER, devices.NEURON_DEVICE_CLASS
EFA_DRIVER, EFA_DEVICE_CLASS = "dra.net", devices.EFA_DEVICE_CLASS
ALL_NODES = "*"  # a ResourceSlice of every node (spec.allNodes), or of nodes its nodeSelector picks
POD_KINDS = ("Deployment", "Job", "StatefulSet", "DaemonSet")  # objects whose spec.template is a pod's
ROLE_LABEL = "neuronfleet.dev/role"  # builders.LABEL_PREFIX + "/role"
MANY = 1 << 30  # a count that did not parse: taken as plenty (never a false alarm)
MESSAGE_LIMIT = 1500  # characters of a condition's message
# A node that joined this recently and lacks a device may not have it registered yet (a device plugin or DRA
# driver advertises its devices once its own pod runs on the node: image pull, start): not a lack, yet (the
# operator's environment may say otherwise: local mode's tests wait seconds)
SETTLE_ENV = "NEURONFLEET_NODE_SETTLE_SECONDS"
SETTLE_SECONDS = float(os.environ.get(SETTLE_ENV, 300))

# reasons: False (the pods cannot be placed as the nodes are), Unknown (no node to tell by), True
DEVICE_PLUGIN_MISSING = "DevicePluginMissing"
EFA_DEVICE_PLUGIN_MISSING = "EFADevicePluginMissing"
DRA_DRIVER_MISSING = "DRADriverMissing"
NODES_TOO_SMALL = "NodesTooSmall"
NO_NODES = "NoNodesOfInstanceType"
NO_LABELLED_NODES = "NoNodesWithLabels"
NODES_STARTING = "NodesStarting"
SCHEDULER_EXTENSION_ADVISED = "SchedulerExtensionAdvised"
DEVICES_OFFERED = "DevicesOffered"

# what to install, with where it is documented
NEURON_DEVICE_PLUGIN_HOW = (
    "install the Neuron device plugin on them: `helm upgrade --install neuron-helm-chart "
    "oci://public.ecr.aws/neuron/neuron-helm-chart` (Neuron SDK 2.32 deploy/includes/k8s-neuron-device-plugin"
    '.rst; EKS user guide "Neuron devices"); its DaemonSet runs only on the instance types of the chart\'s '
    "neuronInstances value"
)
EFA_DEVICE_PLUGIN_HOW = (
    "install the EFA device plugin: `helm repo add eks https://aws.github.io/eks-charts && helm install efa "
    'eks/aws-efa-k8s-device-plugin -n kube-system` (EKS user guide "EFA devices"); neither the Neuron helm '
    "chart nor the EKS AL2023 and Bottlerocket AMIs install it"
)
SCHEDULER_EXTENSION_HOW = (
    "without the Neuron scheduler extension the default scheduler may give a pod cores that are not "
    'contiguous (Neuron SDK 2.32 deploy/infrastructure/scheduler.rst: it "is required for scheduling Pods '
    'that request more than one Neuron core or device resource"): install it (`helm upgrade --install '
    "neuron-helm-chart oci://public.ecr.aws/neuron/neuron-helm-chart --set scheduler.enabled=true`, which "
    "runs the scheduler my-scheduler: deploy/includes/k8s-multiple-scheduler.rst) and set the neuronfleet "
    "chart's neuron.schedulerName to my-scheduler, or allocate with DRA (neuron.deviceAllocation: dra)"
)
DRA_HOW = {  # DeviceClass -> how its driver is installed
    NEURON_DEVICE_CLASS: (
        "install the Neuron DRA driver: `helm upgrade --install neuron-helm-chart "
        "oci://public.ecr.aws/neuron/neuron-helm-chart --namespace neuron-dra-driver --create-namespace "
        '--set devicePlugin.enabled=false --set draDriver.enabled=true` (EKS user guide "Neuron devices"; '
        "Neuron SDK 2.32 deploy/eks/dra.rst: Kubernetes 1.34+, never on a node that runs the Neuron device "
        "plugin)"
    ),
    EFA_DEVICE_CLASS: (
        "install the EFA DRA driver (DRANET): `helm repo add eks https://aws.github.io/eks-charts && helm "
        'install aws-dranet eks/aws-dranet --namespace kube-system` (EKS user guide "EFA devices": '
        "Kubernetes 1.34+, never on a node that runs the EFA device plugin)"
    ),
}
DRA_HOW_OTHER = "install the DRA driver that publishes its devices"
NO_NODES_HOW = (
    "the pods wait until one joins: a node autoscaler (Karpenter, Cluster Autoscaler) may add one for them; "
    "else add nodes of this instance type"
)


# ---- what a node offers, as kept ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """A node as kept: its name, the labels the operator's pods select on (those named when it was read), and
    the device plugins' resources it offers (allocatable, > 0)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    allocatable: tuple[tuple[str, int], ...] = ()
    created: str = ""  # metadata.creationTimestamp (RFC 3339)

    def offers(self, resource: str) -> int:
        return next((n for r, n in self.allocatable if r == resource), 0)

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


@dataclass(frozen=True, slots=True)
class SliceOffer:
    """A ResourceSlice as kept: the DRA driver that publishes it and how many devices it holds."""

    driver: str
    devices: int


@dataclass(frozen=True, slots=True)
class DeviceClassOffer:
    """A DeviceClass as kept: the drivers its CEL selectors name (`device.driver == "..."`; empty where they
    name none) and the extended resource it serves (`spec.extendedResourceName`, Kubernetes 1.34+)."""

    drivers: tuple[str, ...] = ()
    extended_resource: str | None = None


def _count(quantity: Any) -> int:
    """An extended resource's quantity (a whole number, as Kubernetes requires of them); MANY where it does
    not parse (taken as offered: no false alarm)."""
    try:
        return int(str(quantity))
    except ValueError:
        return MANY


def node_offer(node: dict[str, Any], kept_labels: Iterable[str] = ()) -> tuple[str, NodeOffer]:
    """A Node as kept, under its instance type ("" where it has no instance-type label): the labels of
    `kept_labels` it carries and the device plugins' resources it offers."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    offered = tuple((r, n) for r in KEPT_RESOURCES if (n := _count(allocatable.get(r, 0))) > 0)
    kept = tuple((k, str(labels[k])) for k in dict.fromkeys(kept_labels) if k and k in labels)
    created = str(meta.get("creationTimestamp") or "")
    return str(labels.get(INSTANCE_TYPE, "")), NodeOffer(str(meta.get("name", "")), kept, offered, created)


def seconds_between(since: str, at: str) -> float | None:
    """Seconds from one RFC 3339 time (as the API server writes them) to another; None where one is missing
    or does not parse."""
    try:
        then, now = (calendar.timegm(time.strptime(t[:19], "%Y-%m-%dT%H:%M:%S")) for t in (since, at))
    except (TypeError, ValueError):
        return None
    return float(now - then)


def settling(node: NodeOffer, at: str | None) -> bool:
    """Whether the node joined less than SETTLE_SECONDS before `at` (its devices may still register)."""
    age = seconds_between(node.created, at) if at else None
    return age is not None and age < SETTLE_SECONDS


def slice_offer(obj: dict[str, Any]) -> tuple[str, SliceOffer]:
    """A ResourceSlice as kept, under its node's name (ALL_NODES for a slice of every node, or of the nodes
    its nodeSelector picks: counted for every node, never a false alarm)."""
    spec = obj.get("spec") or {}
    where = spec.get("nodeName") or ALL_NODES
    return str(where), SliceOffer(str(spec.get("driver", "")), len(spec.get("devices") or []))


_DRIVER = re.compile(r"""device\.driver\s*==\s*(['"])([^'"]+)\1""")


def device_class_offer(obj: dict[str, Any]) -> tuple[str, DeviceClassOffer]:
    """A DeviceClass as kept, under its name."""
    spec = obj.get("spec") or {}
    expressions = [((s or {}).get("cel") or {}).get("expression") or "" for s in spec.get("selectors") or []]
    drivers = tuple(dict.fromkeys(m.group(2) for e in expressions for m in _DRIVER.finditer(e)))
    name = str((obj.get("metadata") or {}).get("name", ""))
    return name, DeviceClassOffer(drivers, spec.get("extendedResourceName") or None)


@dataclass(frozen=True)
class Offers:
    """What the nodes offer, as read: `nodes` by instance type (kopf's index, or plain lists in tests), the
    labels each node's offer keeps (`kept_labels`: a selector on any other label is not checked), and DRA's
    ResourceSlices by node name and DeviceClasses by name (None where they are not read: the cluster serves
    no resource.k8s.io/v1, or the operator may not list them)."""

    nodes: Mapping[str, Collection[NodeOffer]]
    kept_labels: frozenset[str] = frozenset({INSTANCE_TYPE})
    slices: Mapping[str, Collection[SliceOffer]] | None = None
    classes: Mapping[str, Collection[DeviceClassOffer]] | None = None

    def all_nodes(self) -> list[NodeOffer]:
        return [node for group in list(self.nodes.values()) for node in group]

    def drivers_on(self, node: str) -> dict[str, int]:
        """Devices per DRA driver that the node's ResourceSlices (and every node's) publish."""
        out: dict[str, int] = {}
        for key in (node, ALL_NODES):
            for offer in (self.slices or {}).get(key) or ():
                out[offer.driver] = out.get(offer.driver, 0) + offer.devices
        return out

    def device_class(self, name: str) -> DeviceClassOffer | None:
        found = (self.classes or {}).get(name) or ()
        return next(iter(found), None)


# ---- what a model's pods ask ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimNeed:
    """A device request of a pod's DRA claim: its DeviceClass and how many devices (None: all of a node's, or
    not known)."""

    device_class: str
    count: int | None


@dataclass(frozen=True)
class PodNeeds:
    """What one kind of pod of the model asks: who it is (its role, else its owner), the node labels it
    selects on, the device plugins' resources (per pod), its DRA requests, and its scheduler ("": the
    default)."""

    who: str
    selector: tuple[tuple[str, str], ...]
    resources: tuple[tuple[str, int], ...] = ()
    claims: tuple[ClaimNeed, ...] = ()
    scheduler: str = ""


def _pod_resources(pod: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The device plugins' resources a pod needs: its containers' limits summed, or an init container's where
    that is more (Kubernetes' effective request of a pod)."""

    def asked(containers: Iterable[dict[str, Any]], combine) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in containers:
            limits = ((c or {}).get("resources") or {}).get("limits") or {}
            for r in KEPT_RESOURCES:
                if r in limits:
                    out[r] = combine(out.get(r, 0), _count(limits[r]))
        return out

    total = asked(pod.get("containers") or [], lambda a, b: a + b)
    for r, n in asked(pod.get("initContainers") or [], max).items():
        total[r] = max(total.get(r, 0), n)
    return tuple((r, n) for r in KEPT_RESOURCES if (n := total.get(r, 0)) > 0)


def _claim_needs(template: dict[str, Any]) -> tuple[ClaimNeed, ...]:
    """A ResourceClaimTemplate's device requests (resource.k8s.io/v1 `exactly`, or v1beta1's fields on the
    request itself); a request of alternatives (`firstAvailable`) is not checked."""
    out = []
    claim = (template.get("spec") or {}).get("spec") or {}
    for request in (claim.get("devices") or {}).get("requests") or []:
        exactly = request.get("exactly") or (request if "deviceClassName" in request else None)
        if not exactly or not exactly.get("deviceClassName"):
            continue
        mode = exactly.get("allocationMode") or "ExactCount"
        count = int(exactly.get("count") or 1) if mode == "ExactCount" else None
        out.append(ClaimNeed(str(exactly["deviceClassName"]), count))
    return tuple(out)


def pod_needs(objects: Iterable[dict[str, Any]]) -> list[PodNeeds]:
    """What the pods of `objects` (the model's rendered objects: Deployments, Jobs and the
    ResourceClaimTemplates their pods name) ask of a node, for each pod kind that asks for a device; pods of
    one role asking alike are one."""
    objects = list(objects)
    templates = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ResourceClaimTemplate"}
    found: dict[tuple, PodNeeds] = {}
    for obj in objects:
        if obj.get("kind") not in POD_KINDS:
            continue
        template = (obj.get("spec") or {}).get("template") or {}
        pod = template.get("spec") or {}
        claims = tuple(
            need
            for claim in pod.get("resourceClaims") or []
            if (named := templates.get(claim.get("resourceClaimTemplateName") or "")) is not None
            for need in _claim_needs(named)
        )
        resources = _pod_resources(pod)
        if not resources and not claims:
            continue
        labels = (template.get("metadata") or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        who = f"the {role} pods" if role else f"the pods of {obj['kind']} {obj['metadata']['name']}"
        selector = tuple(sorted((str(k), str(v)) for k, v in (pod.get("nodeSelector") or {}).items()))
        scheduler = pod.get("schedulerName") or ""
        scheduler = "" if scheduler == "default-scheduler" else scheduler
        needs = PodNeeds(who, selector, resources, claims, scheduler)
        found.setdefault((who, selector, resources, claims, needs.scheduler), needs)
    return list(found.values())


# ---- the decision -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The Schedulable condition: status (True, False, None: Unknown), reason, message."""

    status: bool | None
    reason: str
    message: str


@dataclass
class _Problems:
    """What was found, by kind, each once with the pods it concerns (in the order found)."""

    found: dict[tuple[int, str, str], list[str]] = field(default_factory=dict)  # (rank, reason, text) -> who

    def add(self, rank: int, reason: str, text: str, who: str) -> None:
        pods = self.found.setdefault((rank, reason, text), [])
        if who not in pods:
            pods.append(who)


FALSE, UNKNOWN, ADVICE = 0, 1, 2  # a problem's rank: the worst decides the condition


def _joined(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _where(instance_type: str | None) -> str:
    return f"of instance type {instance_type}" if instance_type else "in the cluster"


def schedulable(needs: list[PodNeeds], offers: Offers | None, at: str | None = None) -> Verdict | None:
    """The Schedulable condition of a model whose pods ask `needs`, given what the nodes offer at `at` (a
    node lacking a device within SETTLE_SECONDS of joining is not said to lack it); None where no pod asks
    for a device or the nodes are not read."""
    if offers is None or not needs:
        return None
    problems = _Problems()
    offered: dict[str, dict[str, int]] = {}  # instance type -> resource -> the most a node offers
    for pod in needs:
        selector = dict(pod.selector)
        instance_type = selector.get(INSTANCE_TYPE)
        nodes = list(offers.nodes.get(instance_type) or ()) if instance_type else offers.all_nodes()
        where = _where(instance_type)
        if not nodes:
            problems.add(UNKNOWN, NO_NODES, f"no node {where} is in the cluster now; {NO_NODES_HOW}", pod.who)
            continue
        checked = {k: v for k, v in selector.items() if k in offers.kept_labels and k != INSTANCE_TYPE}
        nodes = [n for n in nodes if all(n.label(k) == v for k, v in checked.items())]
        if not nodes:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(checked.items()))
            text = f"no node {where} has the label {labels} the pods select on; {NO_NODES_HOW} and label"
            problems.add(UNKNOWN, NO_LABELLED_NODES, f"{text} them", pod.who)
            continue
        starting = [n for n in nodes if settling(n, at)]
        for resource, asked in pod.resources:
            most = max(_offered(offers, node, resource) for node in nodes)
            offered.setdefault(instance_type or "", {})[resource] = most
            if most < asked and any(_offered(offers, n, resource) < asked for n in starting):
                problems.add(UNKNOWN, NODES_STARTING, _starting(where, resource), pod.who)
                continue
            _check_resource(problems, pod, offers, nodes, where, resource, asked, most)
        for claim in pod.claims:
            _check_claim(problems, pod, offers, nodes, where, claim, starting)
    return _verdict(problems, offered)


def _offered(offers: Offers, node: NodeOffer, resource: str) -> int:
    """How many of an extended resource a node offers: its allocatable, or the devices DRA publishes for a
    DeviceClass that serves it (spec.extendedResourceName)."""
    count = node.offers(resource)
    if count or offers.classes is None:
        return count
    drivers = offers.drivers_on(node.name)
    for group in list(offers.classes.values()):
        for cls in group:
            if cls.extended_resource == resource:
                count += sum(drivers.get(d, 0) for d in cls.drivers)
    return count


def _check_resource(
    problems: _Problems, pod: PodNeeds, offers: Offers, nodes: list[NodeOffer], where: str, resource: str,
    asked: int, most: int,
) -> None:  # fmt: skip
    if most == 0 and resource == EFA:
        dra = any(EFA_DRIVER in offers.drivers_on(n.name) for n in nodes)
        also = (" (they run the EFA DRA driver, which serves no vpc.amazonaws.com/efa: allocate with DRA, "
                "neuron.deviceAllocation: dra)") if dra else ""  # fmt: skip
        text = (f"no node {where} offers {EFA}{also}: the EFA device plugin does not run there, or the nodes "
                "were launched without EFA interfaces (network interfaces of type efa or efa-only: EKS user "
                f"guide \"EFA devices\"); {EFA_DEVICE_PLUGIN_HOW}")  # fmt: skip
        problems.add(FALSE, EFA_DEVICE_PLUGIN_MISSING, text, f"{pod.who} ({asked} {resource} each)")
    elif most == 0:
        dra = any(NEURON_DRIVER in offers.drivers_on(n.name) for n in nodes)
        if dra:
            how = ("they run the Neuron DRA driver, which serves no Neuron extended resource and never "
                   "runs beside the device plugin: allocate this model's devices with DRA "
                   "(neuron.deviceAllocation: dra)")  # fmt: skip
        else:
            how = NEURON_DEVICE_PLUGIN_HOW
        text = f"no node {where} offers {resource}; {how}"
        problems.add(FALSE, DEVICE_PLUGIN_MISSING, text, f"{pod.who} ({asked} {resource} each)")
    elif most < asked:
        lnc = (" (a node's logical-core setting, LNC, sets how many cores it offers: the device plugin "
               "counts logical cores)") if resource == NEURONCORE else ""  # fmt: skip
        text = f"nodes {where} offer at most {most} {resource}{lnc}"
        problems.add(FALSE, NODES_TOO_SMALL, text, f"{pod.who} ({asked} {resource} each)")
    elif resource in NEURON_RESOURCES and 1 < asked < most and not pod.scheduler:
        text = f"nodes {where} offer {most} {resource}; {SCHEDULER_EXTENSION_HOW}"
        problems.add(ADVICE, SCHEDULER_EXTENSION_ADVISED, text, f"{pod.who} ({asked} {resource} each)")


def _starting(where: str, what: str) -> str:
    took = f"{SETTLE_SECONDS / 60:g} minutes" if SETTLE_SECONDS >= 60 else f"{SETTLE_SECONDS:g} seconds"
    return (f"a node {where} joined less than {took} ago and offers no {what} yet: a "
            "device plugin or DRA driver advertises its devices once its own pod runs there; looked at again "
            "then")  # fmt: skip


def _check_claim(
    problems: _Problems, pod: PodNeeds, offers: Offers, nodes: list[NodeOffer], where: str, claim: ClaimNeed,
    starting: list[NodeOffer],
) -> None:  # fmt: skip
    if offers.classes is None or offers.slices is None:
        return  # DRA is not read: nothing to say
    how = DRA_HOW.get(claim.device_class, DRA_HOW_OTHER)
    cls = offers.device_class(claim.device_class)
    if cls is None:
        text = f"DeviceClass {claim.device_class} does not exist; {how}"
        problems.add(FALSE, DRA_DRIVER_MISSING, text, pod.who)
        return
    if not cls.drivers:
        return  # its selectors name no driver: which nodes serve it is not known here

    def published(n: NodeOffer) -> int:
        return sum(offers.drivers_on(n.name).get(d, 0) for d in cls.drivers)

    most = max(published(n) for n in nodes)
    named = _joined(list(cls.drivers))
    if (most == 0 or (claim.count or 0) > most) and any(
        published(n) < max(claim.count or 1, 1) for n in starting
    ):
        problems.add(UNKNOWN, NODES_STARTING, _starting(where, f"{claim.device_class} device"), pod.who)
    elif most == 0:
        plugin = any(n.offers(r) for n in nodes for r in KEPT_RESOURCES)
        also = (" (they run a device plugin, which never shares a node with the DRA driver: allocate this "
                "model's devices with the device plugin, neuron.deviceAllocation: devicePlugin, or move "
                "these nodes to the DRA driver)") if plugin else ""  # fmt: skip
        text = f"no node {where} publishes devices of DRA driver {named} (ResourceSlices){also}; {how}"
        problems.add(FALSE, DRA_DRIVER_MISSING, text, pod.who)
    elif claim.count is not None and most < claim.count:
        text = f"nodes {where} publish at most {most} {claim.device_class} devices (driver {named})"
        who = f"{pod.who} ({claim.count} {claim.device_class} devices each)"
        problems.add(FALSE, NODES_TOO_SMALL, text, who)


def _verdict(problems: _Problems, offered: dict[str, dict[str, int]]) -> Verdict:
    if not problems.found:
        parts = [
            f"{', '.join(f'{n} {r}' for r, n in sorted(res.items()))} per node of {t}" if t else
            ", ".join(f"{n} {r}" for r, n in sorted(res.items()))
            for t, res in sorted(offered.items()) if res
        ]  # fmt: skip
        said = f" (up to {'; '.join(parts)})" if parts else ""
        return Verdict(True, DEVICES_OFFERED, f"the nodes offer the devices the pods ask for{said}")
    ordered = sorted(problems.found.items(), key=lambda item: item[0][0])
    worst, reason = ordered[0][0][0], ordered[0][0][1]
    message = "; ".join(f"{_joined(pods)}: {text}" for (_, _, text), pods in ordered)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return Verdict({FALSE: False, UNKNOWN: None, ADVICE: True}[worst], reason, message)
