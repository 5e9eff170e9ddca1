"""The front door of a unified model: a router Deployment before its unified pods, for every unified model
but one whose `serving.gateway` pool is its serving pods (the gateway's endpoint picker chooses the pod there,
and the gateway's path never crosses a front door; with scale to zero the pool is the front door instead:
docs/gateway.md). It never scales to zero and holds the requests that find no ready serving pod, bounded in
number and time (then 429 or 503 with Retry-After): at zero, and whenever a model's last ready pod is lost or
replaced (a node lost, an OOM kill, a roll of its only pod), so the replacement answers them. Where the model
may scale to zero with provider builtin it also wakes the operator's autoscaler at once (`--wake-url`, served
by `operator/wake.py`). Kv-aware, it follows the unified pods' KV-cache events (docs/routing.md). Pure: what a
model's front door is and the serve options of every router (routing, holding); `builders` makes the objects.

Nothing here reads the replica count (spec.replicas, serving.unified.replicas) and the unified pods' options
read no autoscaling bound: scaling a model (1 -> 3 -> 1, by hand or by an autoscaler) changes Deployments'
replicas only, never a pod template, so it restarts no pod (a model load of minutes on Neuron).

A unified model's front door (`neuronfleet serve --role router --unified dns://NAME-unified:PORT`) finds its
peers through a headless Service of the unified pods, named as their Deployment (as a disaggregated set's
prefill and decode Services are), and the model's Service selects the router pods instead of the unified
ones. It reads no model files and no internal token (the unified pods' API is the public one).

How much every router holds (the front door, and a disaggregated model's router, which holds while no decode
pod is ready):
- `--hold-requests`: HOLD_BATCHES x slots x pods, what the model runs at once plus three such batches waiting,
  pods being autoscaling.max where the model autoscales (a burst the scaled-out model absorbs in a few
  batches is held, a larger one is over even the largest fleet's capacity and is refused at once: 429 with
  Retry-After), else one pod (what the replacement of a lone pod serves in a few batches; not the replica
  count, which would roll the routers at each scale). A model set to zero pods by hand (no autoscaling) holds
  nothing: no pod is coming, its routers answer 503 at once.
- `--hold-seconds`: HOLD_SECONDS (600), the autoscaler's pending deadline (`autoscaler.Policy`): past it the
  scale-up that would serve the request counts as stuck (no capacity) and holding longer serves no one; it is
  also the OpenAI Python client's default request timeout, so a client that waits that long is still there to
  read the 503 and its Retry-After. A replacement pod's start (a Neuron model load) fits within it.
"""

from __future__ import annotations

from typing import Any

from neuronfleet.contract import ROUTING_LOAD_MARGIN

from . import names
from .autoscaler import Policy
from .host_kv import host_kv_tokens
from .spec import NeuronModelSpec

PROVIDERS = ("builtin", "keda")  # hpa cannot scale to zero (spec rule)
HOLD_BATCHES = 4
HOLD_SECONDS = Policy.pending_deadline
WAKE_PATH = "/wake/{namespace}/{name}"  # the operator's wake endpoint (operator/wake.py)


def holds(spec: NeuronModelSpec) -> bool:
    """Whether the model may scale to zero (autoscaling enabled with scaleToZero by builtin or keda): its
    routers wake the autoscaler (provider builtin) and the builtin autoscaler counts what they hold."""
    a = spec.autoscaling
    return a.enabled and a.scaleToZero and a.provider in PROVIDERS


def routes_by_prefix(spec: NeuronModelSpec) -> bool:
    """A unified model whose front door routes kv-aware: routing policy kv-aware, with no inference gateway
    (its endpoint picker routes instead: docs/routing.md). At every replica count, one pod included: what
    the pods publish for it must not change when the model scales."""
    return (
        spec.serving.mode == "unified"
        and spec.serving.routing.policy == "kv-aware"
        and spec.serving.gateway is None
    )


def has_front_door(spec: NeuronModelSpec) -> bool:
    """Whether the model's public Service selects router pods: a disaggregated model's routers, or a unified
    model's front door, which every unified model has but one whose gateway pool is its serving pods (a
    gateway without scale to zero)."""
    return spec.serving.mode != "unified" or spec.serving.gateway is None or holds(spec)


def unified_front_door(spec: NeuronModelSpec) -> bool:
    """A unified model with a front door: it gets a router role of its own (disaggregated ones have one)."""
    return spec.serving.mode == "unified" and has_front_door(spec)


def peers_service(model: str) -> str:
    """The headless Service of a unified model's pods, its front door's peers: named as their Deployment."""
    return names.deployment(model, "unified")


def peers_url(model: str, port: int) -> str:
    return f"dns://{peers_service(model)}:{port}"


def wake_url(base: str, namespace: str, name: str) -> str:
    """The model's wake URL under the operator's base URL (NEURONFLEET_WAKE_URL)."""
    return base.rstrip("/") + WAKE_PATH.format(namespace=namespace, name=name)


def paused(spec: NeuronModelSpec) -> bool:
    """A model set to zero pods by hand (no autoscaling; its unified or decode pods 0): no pod is coming, so
    its routers hold nothing and answer 503 at once."""
    role = spec.serving.unified if spec.serving.mode == "unified" else spec.serving.decode
    count = spec.replicas if spec.replicas is not None else role.replicas
    return not spec.autoscaling.enabled and count == 0


def hold_requests(spec: NeuronModelSpec) -> int:
    """HOLD_BATCHES x slots x autoscaling.max where the model autoscales, else x one pod (the module's
    docstring says why); none for a model paused at zero."""
    a = spec.autoscaling
    return 0 if paused(spec) else HOLD_BATCHES * spec.neuron.batchSize * (a.max if a.enabled else 1)


def load_margin(spec: NeuronModelSpec) -> int:
    """serving.routing.loadMargin, else a quarter of a pod's slots, at least ROUTING_LOAD_MARGIN (what the
    routers use until they have timed the pods: `prefix_routing.choose`)."""
    given = spec.serving.routing.loadMargin
    return given if given is not None else max(ROUTING_LOAD_MARGIN, spec.neuron.batchSize // 4)


def routing_options(spec: NeuronModelSpec) -> dict[str, Any]:
    """Every router's routing options: the policy, its load margin, what a pod's prefix cache holds at most
    (its slots full at the sequence length, and our runtime's host KV store: `host_kv.host_kv_tokens`)
    and a pod's slots (its batch size: the front door's pods do not say them; a pod template's, so nothing
    here reads the replica count)."""
    return {
        "routing": spec.serving.routing.policy,
        "routing_load_margin": load_margin(spec),
        "routing_cache_tokens": spec.neuron.batchSize * spec.neuron.sequenceLength + host_kv_tokens(spec),
        "routing_pod_slots": spec.neuron.batchSize,
    }


def router_options(spec: NeuronModelSpec, namespace: str, name: str, wake_base: str | None) -> dict[str, Any]:
    """A router's options: its routing (`routing_options`) and its hold (every router holds while no pod it
    needs is ready); the wake URL where the model may scale to zero with provider builtin and the operator's
    base URL is known."""
    out: dict[str, Any] = routing_options(spec)
    if hold := hold_requests(spec):
        out |= {"hold_requests": hold, "hold_seconds": HOLD_SECONDS}
    if holds(spec) and spec.autoscaling.provider == "builtin" and wake_base:
        out["wake_url"] = wake_url(wake_base, namespace, name)
    return out
