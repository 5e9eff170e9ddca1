"""The operator's own Prometheus metrics (served on `neuronfleet operator --metrics-port`): reconcile passes
by outcome and their duration, NeuronModels by phase and their replicas per role, compile Jobs (duration,
cache hits), and the builtin autoscaler's decisions and scrapes. The chart's dashboard
(charts/neuronfleet/dashboards/) reads them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

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

MODEL_REPLICAS = Gauge(
    "neuronfleet_operator_model_replicas",
    "Replicas per model and role of its serving set, desired and ready (status.replicas).",
    ["namespace", "model", "role", "state"],
)
COMPILES = Counter(
    "neuronfleet_operator_compiles",
    "Compile Jobs seen succeeded, by cache (hit: the artifacts existed already; miss: compiled).",
    ["cache"],
)
COMPILE_SECONDS = Histogram(
    "neuronfleet_operator_compile_seconds",
    "Compile Jobs' duration (status.startTime to status.completionTime), by cache (hit, miss).",
    ["cache"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
)
LEADER = Gauge(
    "neuronfleet_operator_leader",
    "1 while this operator replica leads (leader election: it reconciles, scales, answers wake calls); "
    "0 while it follows.",
)
LEADER_TRANSITIONS = Counter(
    "neuronfleet_operator_leader_transitions", "Times this replica became leader or stopped leading.", ["to"]
)
# every outcome's series exists from the start (a dashboard reads 0, not "no data", until one happens)
for _cache in ("hit", "miss"):
    COMPILES.labels(_cache)
    COMPILE_SECONDS.labels(_cache)
for _outcome in ("ok", "error"):
    RECONCILES.labels(_outcome)
for _outcome in ("ok", "failed"):
    AUTOSCALER_SCRAPES.labels(_outcome)

_phases: dict[tuple[str, str], str] = {}  # (namespace, name) -> phase of the last pass
_seen: set[str] = set()


_leading: list[bool] = []  # this replica's last leadership (empty: not known yet)


def leader(leading: bool) -> None:
    """Record whether this replica leads; a change is counted."""
    if _leading and _leading[-1] != leading:
        LEADER_TRANSITIONS.labels("leader" if leading else "follower").inc()
    _leading[:] = [leading]
    LEADER.set(1 if leading else 0)


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


_replicas: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (namespace, name) -> its (role, state) series


def model_replicas(namespace: str, name: str, replicas: dict[str, dict[str, int]] | None) -> None:
    """Record a model's status.replicas ({role: {desired, ready, ...}}) after a pass; None: the model is
    gone (its series are removed)."""
    key = (namespace, name)
    now = {(role, state): n for role, r in (replicas or {}).items() for state, n in r.items()
           if state in ("desired", "ready")}  # fmt: skip
    for role, state in _replicas.get(key, set()) - set(now):
        MODEL_REPLICAS.remove(namespace, name, role, state)
    for (role, state), n in now.items():
        MODEL_REPLICAS.labels(namespace, name, role, state).set(n)
    _replicas[key] = set(now)
    if not now:
        _replicas.pop(key)


def _time(value: str | None) -> datetime | None:
    """An RFC 3339 time of a Job's status; None when absent or unreadable (a metric never fails a pass)."""
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None
    except (ValueError, AttributeError):
        return None


def compile_succeeded(job: dict[str, Any] | None, report: dict[str, Any] | None) -> None:
    """Count a compile Job seen succeeded (once: on the pass that reads its pod's report) and observe its
    duration from the Job's status.startTime and status.completionTime (batch/v1 JobStatus,
    https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/job-v1/#JobStatus)."""
    cache = "hit" if (report or {}).get("cacheHit") else "miss"
    COMPILES.labels(cache).inc()
    status = (job or {}).get("status") or {}
    start, end = _time(status.get("startTime")), _time(status.get("completionTime"))
    if start is not None and end is not None:
        COMPILE_SECONDS.labels(cache).observe(max(0.0, (end - start).total_seconds()))
