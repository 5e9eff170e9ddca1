"""The operator's own Prometheus metrics (served on `neuronfleet operator --metrics-port`): reconcile passes
by outcome and their duration, NeuronModels by phase, and the builtin autoscaler's decisions and scrapes."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "neuronfleet_operator_reconciles",
    "Reconcile passes of NeuronModels, by outcome (ok, error).",
    ["outcome"],
)
RECONCILE_SECONDS = Histogram(
    "neuronfleet_operator_reconcile_seconds",
    "Time of one reconcile pass.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
MODELS = Gauge("neuronfleet_operator_models", "NeuronModels by status phase.", ["phase"])
AUTOSCALER_DESIRED = Gauge(
    "neuronfleet_operator_autoscaler_desired_replicas",
    "Provider builtin: the replicas the autoscaler decided, per model and role.",
    ["namespace", "model", "role"],
)
AUTOSCALER_DECISIONS = Counter(
    "neuronfleet_operator_autoscaler_decisions",
    "Provider builtin: decisions that changed the replicas, by direction (up, down) and dry run.",
    ["direction", "dry_run"],
)
AUTOSCALER_SCRAPES = Counter(
    "neuronfleet_operator_autoscaler_scrapes",
    "Provider builtin: reads of serving pods' /metrics, by outcome (ok, failed).",
    ["outcome"],
)

_phases: dict[tuple[str, str], str] = {}  # (namespace, name) -> phase of the last pass
_seen: set[str] = set()


def model_phase(namespace: str, name: str, phase: str | None) -> None:
    """Record a model's phase after a pass; None: the model is gone."""
    key = (namespace, name)
    if phase is None:
        _phases.pop(key, None)
    else:
        _phases[key] = phase
    _seen.update(_phases.values())
    for p in _seen:  # a phase no model has any more reads 0
        MODELS.labels(p).set(sum(1 for q in _phases.values() if q == p))
