"""A NeuronModel's NetworkPolicies (`serving.networkPolicy`, on by default) and the peers the operator's
settings name for them, pure: objects as dicts; `builders` places them among the model's children (before
the pods), `planner` widens the public one to the role the public Service still selects during a switch.

Two policies, networking.k8s.io/v1, Ingress only (a pod selected by a policy of type Ingress takes only what
some rule of those policies admits; rules add up; a port by name is the target container's port of that name:
https://kubernetes.io/docs/concepts/services-networking/network-policies/):
- `NAME-pods` selects every pod of the model (label neuronfleet.dev/model; compile pods too, which serve
  nothing) and admits (1) the model's own pods, on every port: the KV port (tcp), the KV-event ports (5570
  live, 5571 replay), the internal HTTP endpoints, SGLang's bootstrap and vLLM's NIXL side channel, and the
  data ports UCX and libfabric's tcp provider pick at run time (EFA's own traffic is no IP traffic: no policy
  sees it); two serving sets of one model (a rollout) have different ports, so the rule names none; (2) the
  operator's pods (`Peers.operator`: the chart's labels in its namespace) and the chart's `metricsFrom`
  (Prometheus) to port `http` only, where every serving pod serves `/metrics` (the builtin autoscaler reads
  it there, and the front door's held requests);
- `NAME-public` selects the pods the public Service selects (routers, or a unified model's pods without a
  front door: `roles`) and admits clients (`Peers.clients`; none named: any source) to port `http` only:
  the model's API, through its Service, a gateway's InferencePool (the same pods and port) or an Ingress.
Egress is not restricted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HTTP_PORT = "http"  # the serving container's port of the API and /metrics (builders.build_deployment)
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")  # a NetworkPolicyPeer's fields
SETTING_ENV = "NEURONFLEET_NETWORK_POLICY"  # the chart's networkPolicy values, as JSON (charts/neuronfleet)
# Without the chart's word: the operator as the chart labels it (app.kubernetes.io/name neuronfleet,
# component operator), in any namespace
DEFAULT_OPERATOR = (
    {
        "namespaceSelector": {},
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "neuronfleet",
                "app.kubernetes.io/component": "operator",
            }
        },
    },
)


@dataclass(frozen=True)
class Peers:
    """Who the policies admit besides the model's own pods, each a list of NetworkPolicyPeers: the operator
    (to `http`: /metrics), `metrics` (Prometheus, to `http`), `clients` (to the public pods' `http`; empty:
    any source)."""

    operator: tuple[dict[str, Any], ...] = DEFAULT_OPERATOR
    metrics: tuple[dict[str, Any], ...] = ()
    clients: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_setting(cls, text: str | None) -> Peers:
        """The setting's JSON object {"operator": [...], "metrics": [...], "clients": [...]} (each key
        optional), or the defaults for None or an empty text; ValueError says what is wrong."""
        if not text or not text.strip():
            return cls()
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{SETTING_ENV}: not JSON ({e}); expected an object of peer lists") from None
        if not isinstance(value, dict) or set(value) - {"operator", "metrics", "clients"}:
            raise ValueError(
                f"{SETTING_ENV}: expected a JSON object with keys among operator, metrics and clients, each "
                f"a list of NetworkPolicyPeers; got {text[:200]!r}"
            )
        out = {}
        for key, peers in value.items():
            if peers is None:
                continue
            if not isinstance(peers, list) or not all(_peer(p) for p in peers):
                raise ValueError(
                    f"{SETTING_ENV}: {key} must be a list of NetworkPolicyPeers (objects with podSelector, "
                    f'namespaceSelector or ipBlock), e.g. [{{"namespaceSelector": {{"matchLabels": '
                    f'{{"kubernetes.io/metadata.name": "monitoring"}}}}}}]; got {json.dumps(peers)[:200]}'
                )
            out[key] = tuple(peers)
        return cls(**out)


def _peer(peer: Any) -> bool:
    return isinstance(peer, dict) and bool(peer) and set(peer) <= set(PEER_KEYS)


def _http() -> list[dict[str, Any]]:
    return [{"port": HTTP_PORT, "protocol": "TCP"}]


def build_pods_policy(meta: dict[str, Any], model: dict[str, str], peers: Peers) -> dict[str, Any]:
    """`NAME-pods`: the model's pods (`model`: the model's label) take the model's own pods on every port,
    and the operator and the metrics peers on `http`."""
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": dict(model)}}]}]
    scrapers = [*peers.operator, *peers.metrics]
    if scrapers:
        ingress.append({"from": [dict(p) for p in scrapers], "ports": _http()})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {"podSelector": {"matchLabels": dict(model)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def build_public_policy(
    meta: dict[str, Any], model: dict[str, str], role_key: str, roles: list[str], peers: Peers
) -> dict[str, Any]:
    """`NAME-public`: the model's pods of `roles` (under the label `role_key`) take clients on `http`."""
    rule: dict[str, Any] = {"ports": _http()}
    if peers.clients:
        rule["from"] = [dict(p) for p in peers.clients]
    selector = {
        "matchLabels": dict(model),
        "matchExpressions": [{"key": role_key, "operator": "In", "values": sorted(set(roles))}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": [rule]},
    }


def with_roles(policy: dict[str, Any], roles: list[str]) -> None:
    """Admit clients to the pods of `roles` too (the public policy; the role the public Service still
    selects while a new set rolls out)."""
    (term,) = policy["spec"]["podSelector"]["matchExpressions"]
    term["values"] = sorted(set(term["values"]) | {r for r in roles if r})
