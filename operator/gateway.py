"""A model behind an inference gateway (`serving.gateway`, docs/gateway.md): its InferencePool and optional
HTTPRoute, and the role labels an endpoint picker filters serving pods by. Pure: objects as dicts; `builders`
places them among the model's children, `reconcile` applies the pool with the public Service's selector.

What the pool selects: the pods the model's public Service selects (`builders.public_selector`, as
`rollout.public_target` moves it), on the serving port. For a unified model without a front door those are
its serving pods, each a full model server the picker chooses among by its metrics. For a disaggregated model
or one that scales to zero they are its routers: our P/D router is the only client that can hand a request's
KV cache from a prefill pod to a decode pod (internal token, NetworkPolicy), and the front door is what holds
a request at zero replicas and wakes the autoscaler; a pool of the pods behind them would bypass both.

Pinned versions (their CRDs are in tests/data): InferencePool `inference.networking.k8s.io/v1` of the Gateway
API Inference Extension v1.6.0 (api/v1/inferencepool_types.go); HTTPRoute `gateway.networking.k8s.io/v1` of
Gateway API v1.6.1 (standard channel); role labels of llm-d's router v0.8.0
(llm-d/llm-d-inference-scheduler@v0.8.0 pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go).
"""

from __future__ import annotations

import copy
from typing import Any

from .spec import NeuronModelSpec

POOL_GROUP, POOL_VERSION = "inference.networking.k8s.io", "v1"
ROUTE_GROUP, ROUTE_VERSION = "gateway.networking.k8s.io", "v1"
POOL_KIND, ROUTE_KIND = "InferencePool", "HTTPRoute"
KINDS = (POOL_KIND, ROUTE_KIND)

# llm-d v0.8.0 roles.go: RoleLabel; its decode filter takes decode, prefill-decode (and the deprecated both)
# or no label at all, its prefill filter prefill or prefill-decode. Routers carry none: a picker's P/D
# profile then finds no prefill pod among them and sends each request whole (our router does the P/D split).
ROLE_LABEL = "llm-d.ai/role"
ROLES = {"unified": "prefill-decode", "prefill": "prefill", "decode": "decode"}


def role_labels(spec: NeuronModelSpec, role: str) -> dict[str, str]:
    """The endpoint picker's role label of a serving pod of `role` (none without `serving.gateway`: adding
    it rolls the pods once)."""
    if spec.serving.gateway is None or role not in ROLES:
        return {}
    return {ROLE_LABEL: ROLES[role]}


def build_pool(meta: dict[str, Any], spec: NeuronModelSpec, selector: dict[str, str]) -> dict[str, Any]:
    """The InferencePool of the pods `selector` matches (the public Service's), on the serving port."""
    picker = spec.serving.gateway.endpointPicker
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": POOL_KIND,
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": spec.serving.port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failureMode,
            },
        },
    }


def build_route(meta: dict[str, Any], spec: NeuronModelSpec) -> dict[str, Any] | None:
    """The HTTPRoute from the spec's Gateways to the pool (named as the model), or None when none is asked."""
    route = spec.serving.gateway.httpRoute
    if route is None:
        return None
    parents = []
    for p in route.parentRefs:
        ref = {"group": ROUTE_GROUP, "kind": "Gateway", "name": p.name}
        if p.namespace:
            ref["namespace"] = p.namespace
        if p.sectionName:
            ref["sectionName"] = p.sectionName
        parents.append(ref)
    body: dict[str, Any] = {"parentRefs": parents}
    if route.hostnames:
        body["hostnames"] = list(route.hostnames)
    body["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": route.path}}],
            "backendRefs": [{"group": POOL_GROUP, "kind": POOL_KIND, "name": meta["name"]}],
        }
    ]
    return {
        "apiVersion": f"{ROUTE_GROUP}/{ROUTE_VERSION}",
        "kind": ROUTE_KIND,
        "metadata": meta,
        "spec": body,
    }


def build(meta: dict[str, Any], spec: NeuronModelSpec, selector: dict[str, str]) -> list[dict[str, Any]]:
    """The model's gateway objects (none without `serving.gateway`); `meta`: the model's child metadata with
    the model's name."""
    if spec.serving.gateway is None:
        return []
    route = build_route(copy.deepcopy(meta), spec)
    return [build_pool(copy.deepcopy(meta), spec, selector), *([route] if route else [])]


def with_selector(pool: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """The pool selecting `selector`: the public Service's selector as the rollout chose it (the pool moves
    to a new serving set together with the Service, once that set is ready)."""
    out = copy.deepcopy(pool)
    out["spec"]["selector"]["matchLabels"] = dict(selector)
    return out


def unwanted(spec: NeuronModelSpec) -> list[str]:
    """The gateway kinds the spec does not ask for (deleted after a spec change, when the model owns them)."""
    gw = spec.serving.gateway
    if gw is None:
        return list(KINDS)
    return [] if gw.httpRoute is not None else [ROUTE_KIND]
