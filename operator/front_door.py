"""The front door of a unified model: a router Deployment before its unified pods, when it may scale to zero
(autoscaling enabled with scaleToZero, provider builtin or keda: the front door never scales to zero, holds
the requests that find no ready serving pod, bounded in number and time, and, for provider builtin, wakes the
operator's autoscaler at once: `--wake-url`, served by `operator/wake.py`) or when it routes kv-aware over
more than one pod (docs/routing.md). Pure: what a model's front door is and the serve options of every
router (routing, holding); `builders` makes the objects.

A unified model's front door (`neuronfleet serve --role router --unified dns://NAME-unified:PORT`) finds its
peers through a headless Service of the unified pods, named as their Deployment (as a disaggregated set's
prefill and decode Services are), and the model's Service selects the router pods instead of the unified
ones. It reads no model files and no internal token (the unified pods' API is the public one).

How much it holds:
- `--hold-requests`: HOLD_BATCHES x slots x max replicas, what the model at its largest runs at once plus
  three such batches waiting: a burst the scaled-out model absorbs in a few batches is held, a larger one is
  over even the largest fleet's capacity and is refused at once (429 with Retry-After) instead of queued.
- `--hold-seconds`: HOLD_SECONDS (600), the autoscaler's pending deadline (`autoscaler.Policy`): past it the
  scale-up that would serve the request counts as stuck (no capacity) and holding longer serves no one; it is
  also the OpenAI Python client's default request timeout, so a client that waits that long is still there to
  read the 503 and its Retry-After.
"""

from __future__ import annotations

from typing import Any

from neuronfleet.contract import ROUTING_LOAD_MARGIN

from . import names
from .autoscaler import Policy
from .spec import NeuronModelSpec

PROVIDERS = ("builtin", "keda")  # hpa cannot scale to zero (spec rule)
HOLD_BATCHES = 4
HOLD_SECONDS = Policy.pending_deadline
WAKE_PATH = "/wake/{namespace}/{name}"  # the operator's wake endpoint (operator/wake.py)


def holds(spec: NeuronModelSpec) -> bool:
    """Whether the model's routers hold requests at zero: autoscaling enabled with scaleToZero by builtin or
    keda."""
    a = spec.autoscaling
    return a.enabled and a.scaleToZero and a.provider in PROVIDERS


def most_unified_pods(spec: NeuronModelSpec) -> int:
    """The most unified pods the spec may run: its replicas (serving.unified or spec.replicas), or the
    autoscaler's bound."""
    a = spec.autoscaling
    most = max(spec.serving.unified.replicas, spec.replicas or 0)
    return max(most, a.max) if a.enabled else most


def routes_by_prefix(spec: NeuronModelSpec) -> bool:
    """A unified model whose front door routes kv-aware: routing policy kv-aware over more than one pod, with
    no inference gateway (its endpoint picker routes instead: docs/routing.md)."""
    return (
        spec.serving.mode == "unified"
        and spec.serving.routing.policy == "kv-aware"
        and spec.serving.gateway is None
        and most_unified_pods(spec) > 1
    )


def has_front_door(spec: NeuronModelSpec) -> bool:
    """Whether the model keeps a front door (router pods before its unified pods): it may scale to zero, or
    it routes kv-aware over more than one pod."""
    return holds(spec) or routes_by_prefix(spec)


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


def hold_requests(spec: NeuronModelSpec) -> int:
    return HOLD_BATCHES * spec.neuron.batchSize * spec.autoscaling.max


def load_margin(spec: NeuronModelSpec) -> int:
    """serving.routing.loadMargin, else a quarter of a pod's slots, at least ROUTING_LOAD_MARGIN."""
    given = spec.serving.routing.loadMargin
    return given if given is not None else max(ROUTING_LOAD_MARGIN, spec.neuron.batchSize // 4)


def routing_options(spec: NeuronModelSpec) -> dict[str, Any]:
    """Every router's routing options: the policy, its load margin, and what a pod's prefix cache holds at
    most (its slots full at the sequence length)."""
    return {
        "routing": spec.serving.routing.policy,
        "routing_load_margin": load_margin(spec),
        "routing_cache_tokens": spec.neuron.batchSize * spec.neuron.sequenceLength,
    }


def router_options(spec: NeuronModelSpec, namespace: str, name: str, wake_base: str | None) -> dict[str, Any]:
    """A router's options: its routing (`routing_options`), and the hold (and, for provider builtin with a
    known base URL, wake) options where the model may scale to zero (other routers hold nothing)."""
    out: dict[str, Any] = routing_options(spec)
    if not holds(spec):
        return out
    out |= {"hold_requests": hold_requests(spec), "hold_seconds": HOLD_SECONDS}
    if spec.autoscaling.provider == "builtin" and wake_base:
        out["wake_url"] = wake_url(wake_base, namespace, name)
    return out
