"""Which connections NetworkPolicies admit, as Kubernetes defines it (pure; no cluster enforces them in local
mode, so the tests ask this instead). Kubernetes v1.31-1.37, https://kubernetes.io/docs/concepts/services-
networking/network-policies/ ("The two sorts of pod isolation", "Behavior of to and from selectors",
"Targeting a range of ports"), and the NetworkPolicy API (networking.k8s.io/v1 NetworkPolicySpec,
NetworkPolicyPeer, NetworkPolicyPort):
- a pod is isolated for ingress when some NetworkPolicy of its namespace selects it (`spec.podSelector`) and
  has Ingress among its policyTypes (default: Ingress, plus Egress when it has egress rules); a pod no such
  policy selects takes every connection;
- an isolated pod takes a connection that some ingress rule of some policy selecting it admits (policies
  and rules add up): a rule admits a source when its `from` is empty or absent, or one of its peers matches,
  and a port when its `ports` is empty or absent, or one of them matches;
- a peer: `podSelector` alone, the pods of the policy's namespace it selects; `namespaceSelector` alone, every
  pod of the namespaces it selects; both in one peer, the pods it selects in those namespaces; `ipBlock`, the
  addresses in its CIDR but its exceptions;
- a port: its protocol (default TCP) and its `port`, a number (up to `endPort` when set) or the name of one
  of the target pod's container ports (absent: every port of that protocol).
Namespaces carry the label kubernetes.io/metadata.name with their name (set by the API server).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number (TCP)
    ip: str = "10.0.0.1"


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions, ANDed; an empty one selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term["key"], term["operator"], term.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def namespace_labels(namespace: str, extra: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace, **((extra or {}).get(namespace) or {})}


def _peer(peer: dict[str, Any], policy_ns: str, source: Pod, namespaces: dict[str, dict[str, str]]) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(address in ipaddress.ip_network(e) for e in block.get("except") or [])
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(source.namespace, namespaces)):
            return False
    elif source.namespace != policy_ns:  # podSelector alone: the policy's own namespace
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def _port(rule_port: dict[str, Any], target: Pod, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False  # (every port here is TCP)
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):  # a named port: the target's container port of that name
        return target.ports.get(wanted) == port
    return wanted <= port <= rule_port.get("endPort", wanted)


def _ingress(policy: dict[str, Any]) -> bool:
    spec = policy["spec"]
    types = spec.get("policyTypes") or (["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])
    return "Ingress" in types


def admits(
    policies: list[dict[str, Any]], source: Pod, target: Pod, port: int,
    namespaces: dict[str, dict[str, str]] | None = None,
) -> bool:  # fmt: skip
    """Whether a TCP connection from `source` to `target`'s `port` is allowed by `policies` (those of every
    namespace; `namespaces`: extra labels of namespaces by name)."""
    namespaces = namespaces or {}
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == target.namespace and _ingress(p)
        and selects(p["spec"].get("podSelector"), target.labels)
    ]  # fmt: skip
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from") or []
            if peers and not any(
                _peer(p, policy["metadata"]["namespace"], source, namespaces) for p in peers
            ):
                continue
            ports = rule.get("ports") or []
            if not ports or any(_port(p, target, port) for p in ports):
                return True
    return False


def pods_of(deployment: dict[str, Any], count: int = 1) -> list[Pod]:
    """The pods a Deployment would run: its template's labels and container ports, in its namespace."""
    meta, template = deployment["metadata"], deployment["spec"]["template"]
    ports = {
        p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports") or []
        if p.get("name")
    }  # fmt: skip
    return [
        Pod(f"{meta['name']}-{i}", meta["namespace"], dict(template["metadata"]["labels"]), ports)
        for i in range(count)
    ]
