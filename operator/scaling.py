"""The NeuronModel's scale (pure): `spec.replicas`, what the scale subresource writes, mapped to replicas per
serving role; the scale status (`status.scaleReplicas`, `status.selector`); and the objects that let the
cluster scale a model: an autoscaling/v2 HorizontalPodAutoscaler (`provider: hpa`) or a KEDA ScaledObject
(`provider: keda`), both on the NeuronModel's scale subresource. (What autoscaling settings a model may
have is the CRD's rules: the spec's, and `engines.limits` for a signal an engine's pods do not export.)

The metric names are the runtime's (`runtime/serving/server.py`, `runtime/engine/engine.py`, vLLM's names). An
HPA reads them as custom Pods metrics, which an adapter such as prometheus-adapter serves under the same names
(docs/autoscaling.md has its rules); a ScaledObject queries Prometheus itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import engines, front_door
from .autoscaler import Policy, RolePolicy
from .engines.limits import SIGNAL_FIELD
from .spec import API_VERSION, DEFAULT_TARGETS, KIND, Autoscaling, NeuronModelSpec

# The runtime's metric per signal (what the pods export on /metrics).
QUEUE_METRIC = "vllm:num_requests_waiting"  # gauge: requests waiting for a slot
OCCUPANCY_METRIC = "vllm:kv_cache_usage_perc"  # gauge, 0-1: KV cache (slots x length) in use
TTFT_METRIC = "vllm:time_to_first_token_seconds"  # histogram, seconds
HELD_METRIC = "neuronfleet:router_requests_held"  # the front door's: requests held while no pod is ready
TTFT_QUANTILE = 0.9
# The name an adapter gives the TTFT p90 (a histogram has no per-pod value): docs/autoscaling.md.
TTFT_P90_METRIC = f"{TTFT_METRIC}:p90"
HPA_METRIC = {"queue": QUEUE_METRIC, "occupancy": OCCUPANCY_METRIC, "ttft": TTFT_P90_METRIC}

# KEDA, the version whose ScaledObject CRD the objects are checked against (tests/data/keda-v2.20.2-*).
KEDA_VERSION = "v2.20.2"
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_POLLING_SECONDS = 15  # KEDA's own default pollingInterval (ScaledObject spec, v2.20.2)
RATE_WINDOW = "2m"  # the PromQL window of the TTFT histogram's rate


def scaled_role(spec: NeuronModelSpec) -> str:
    """The role spec.replicas (the scale subresource) sets: unified, or decode (prefill follows it)."""
    return "unified" if spec.serving.mode == "unified" else "decode"


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def prefill_for(spec: NeuronModelSpec, decode: int) -> int:
    """Prefill pods for `decode` decode pods: the ratio serving.prefill : serving.decode says, kept within
    autoscaling.prefillDecodeRatio and autoscaling.prefill's bounds when given; none when decode is none."""
    s, a = spec.serving, spec.autoscaling
    assert s.prefill is not None and s.decode is not None  # mode disaggregated (the spec's rule)
    if decode == 0:
        return 0
    ratio = s.prefill.replicas / s.decode.replicas if s.decode.replicas else 1.0
    if a.prefillDecodeRatio is not None:
        ratio = min(max(ratio, a.prefillDecodeRatio.min), a.prefillDecodeRatio.max)
    prefill = max(1, math.ceil(decode * ratio - 1e-9))
    if a.prefill is not None:
        prefill = _clamp(prefill, max(1, a.prefill.min), a.prefill.max)
    return prefill


def replicas_notice(spec: NeuronModelSpec) -> str | None:
    """One replica count: spec.replicas (what `kubectl scale neuronmodel`, an HPA or KEDA writes) decides the
    scaled role's pods whenever it is set; serving.<role>.replicas is the count while it is unset. Said (the
    Validated condition's message, and an Event) when the two differ on a model no autoscaler scales, so a
    reader of the serving block knows it is not what runs; None otherwise."""
    if spec.replicas is None or spec.autoscaling.enabled:
        return None
    role = scaled_role(spec)
    declared = getattr(spec.serving, role).replicas
    if declared == spec.replicas:
        return None
    follows = ", prefill following serving's prefill:decode ratio" if role == "decode" else ""
    return (
        f"spec.replicas ({spec.replicas}, what kubectl scale sets) decides the {role} pods{follows}; "
        f"serving.{role}.replicas ({declared}) counts only while spec.replicas is unset"
    )


def role_replicas(spec: NeuronModelSpec) -> dict[str, int]:
    """Role -> replicas: serving.*.replicas, or, when spec.replicas is set, that many unified pods, or that
    many decode pods with prefill following (`prefill_for`); the router keeps its own count (a unified model
    has one when it may scale to zero: its front door, `front_door`)."""
    s = spec.serving
    if s.mode == "unified":
        unified = {"unified": s.unified.replicas if spec.replicas is None else spec.replicas}
        return {**unified, "router": s.router.replicas} if front_door.unified_front_door(spec) else unified
    assert s.prefill is not None and s.decode is not None  # the spec's rule
    if spec.replicas is None:
        return {"prefill": s.prefill.replicas, "decode": s.decode.replicas, "router": s.router.replicas}
    return {
        "prefill": prefill_for(spec, spec.replicas),
        "decode": spec.replicas,
        "router": s.router.replicas,
    }


def scale_status(
    spec: NeuronModelSpec, roles: dict[str, tuple[int, int]], pod_selector: dict[str, str]
) -> dict[str, Any]:
    """status.scaleReplicas (the pods the scaled role's Deployment runs in the wanted serving set; 0 before
    one exists) and status.selector (its pods, of every set, as a label selector string)."""
    desired, _ = roles.get(scaled_role(spec), (0, 0))
    return {
        "scaleReplicas": desired,
        "selector": ",".join(f"{k}={v}" for k, v in sorted(pod_selector.items())),
    }


def signal_metric(spec: NeuronModelSpec, role: str, signal: str) -> str | None:
    """The name a role's pods export a signal under (`engines.metric_names`, the field of it
    `limits.SIGNAL_FIELD` names): waiting requests (queue), KV cache use (occupancy, as an HPA or a
    ScaledObject reads it) or the TTFT histogram; None: not exported (the CRD's rule refuses such a model:
    `limits.UNEXPORTED`)."""
    return getattr(engines.metric_names(spec, role), SIGNAL_FIELD[signal])


def target(a: Autoscaling) -> float:
    """The signal's target per replica (ttft: the SLO in seconds)."""
    if a.metric == "ttft":
        assert a.ttftSLOMilliseconds is not None  # the spec's rule
        return a.ttftSLOMilliseconds / 1000
    return a.target if a.target is not None else DEFAULT_TARGETS[a.metric]


def quantity(value: float) -> str:
    """A Kubernetes quantity for a metric value: whole numbers as they are, others in thousandths (750m)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _number(value: float) -> str:
    """A KEDA trigger's metadata value (strings only): 2, 0.75."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _target_ref(model: str) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": model}


def _behavior(a: Autoscaling) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": a.scaleUp.stabilizationSeconds},
        "scaleDown": {"stabilizationWindowSeconds": a.scaleDown.stabilizationSeconds},
    }


def build_hpa(spec: NeuronModelSpec, meta: dict[str, Any]) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on the NeuronModel's scale subresource (`meta`: its
    metadata, named as the model, owned by it): one Pods metric, averaged over the pods of status.selector,
    against the target per replica; the stabilisation windows as its behaviour."""
    a = spec.autoscaling
    name = signal_metric(spec, scaled_role(spec), a.metric) or HPA_METRIC[a.metric]
    metric = f"{name}:p90" if a.metric == "ttft" else name
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": _target_ref(meta["name"]),
            "minReplicas": a.min,
            "maxReplicas": a.max,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": quantity(target(a))},
                    },
                }
            ],
            "behavior": _behavior(a),
        },
    }


def _pods(namespace: str, deployment_prefix: str) -> str:
    """PromQL label matchers of one role's pods (named after their Deployment: NAME-ROLE[-REV]-...)."""
    return f'namespace="{namespace}",pod=~"{deployment_prefix}-.*"'


def keda_triggers(spec: NeuronModelSpec, namespace: str, model: str) -> list[dict[str, Any]]:
    """The ScaledObject's prometheus triggers: the signal (a sum over the scaled role's pods, per replica;
    TTFT p90 at the entry, as a value), and with scaleToZero the requests the router holds (activation from
    0)."""
    a = spec.autoscaling
    address = a.prometheusAddress
    scaled = _pods(namespace, f"{model}-{scaled_role(spec)}")
    entry_pods = "unified" if spec.serving.mode == "unified" else "router"
    entry = _pods(namespace, f"{model}-{entry_pods}")
    if a.metric == "ttft":
        ttft = signal_metric(spec, entry_pods, "ttft") or TTFT_METRIC
        rate = f"rate({ttft}_bucket{{{entry}}}[{RATE_WINDOW}])"
        query = f"histogram_quantile({TTFT_QUANTILE}, sum by (le) ({rate}))"
        signal = {"metricType": "Value"}
    else:
        name = signal_metric(spec, scaled_role(spec), a.metric) or HPA_METRIC[a.metric]
        query = f"sum({name}{{{scaled}}})"
        signal = {"metricType": "AverageValue"}
    triggers = [
        {
            "type": "prometheus",
            "name": a.metric,
            **signal,
            "metadata": {
                "serverAddress": address,
                "query": query,
                "threshold": _number(target(a)),
                "activationThreshold": "0",
            },
        }
    ]
    if a.scaleToZero:
        router = _pods(namespace, f"{model}-router")
        triggers.append(
            {
                "type": "prometheus",
                "name": "held-requests",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": address,
                    "query": f"sum({HELD_METRIC}{{{router}}})",
                    "threshold": "1",
                    "activationThreshold": "0",
                },
            }
        )
    return triggers


def build_scaled_object(spec: NeuronModelSpec, meta: dict[str, Any]) -> dict[str, Any]:
    """A KEDA ScaledObject (keda.sh/v1alpha1, KEDA_VERSION) scaling the NeuronModel through its scale
    subresource. With scaleToZero, idleReplicaCount 0 (KEDA needs it below minReplicaCount, so the least
    active count is 1) after idleSeconds without activity (cooldownPeriod)."""
    a = spec.autoscaling
    body: dict[str, Any] = {
        "scaleTargetRef": _target_ref(meta["name"]),
        "pollingInterval": KEDA_POLLING_SECONDS,
        "minReplicaCount": max(1, a.min) if a.scaleToZero else a.min,
        "maxReplicaCount": a.max,
    }
    if a.scaleToZero:
        body["idleReplicaCount"] = 0
        body["cooldownPeriod"] = a.idleSeconds
    body["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}}
    body["triggers"] = keda_triggers(spec, meta["namespace"], meta["name"])
    return {"apiVersion": KEDA_API_VERSION, "kind": "ScaledObject", "metadata": meta, "spec": body}


AUTOSCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")


def made_autoscaler(conditions: list[dict[str, Any]]) -> str | None:
    """The kind of autoscaler object the operator made for the model, as its AutoscalingActive condition
    says (its reason is the kind), so that one a changed spec no longer wants is deleted."""
    for c in conditions:
        if c.get("type") == "AutoscalingActive" and c.get("reason") in AUTOSCALER_KINDS:
            return c["reason"]
    return None


def autoscaler_kind(spec: NeuronModelSpec) -> str | None:
    """The kind of object the cluster scales the model with (`build_autoscaler`), or None."""
    a = spec.autoscaling
    if not a.enabled or a.provider == "builtin":
        return None
    return "HorizontalPodAutoscaler" if a.provider == "hpa" else "ScaledObject"


def build_autoscaler(spec: NeuronModelSpec, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The object the cluster scales the model with: an HPA, a ScaledObject, or none (builtin, disabled)."""
    a = spec.autoscaling
    if not a.enabled or a.provider == "builtin":
        return None
    return build_hpa(spec, meta) if a.provider == "hpa" else build_scaled_object(spec, meta)


# ---- provider builtin: the spec in the autoscaler's terms, and the replicas it decided -------------------

TICK_SECONDS = 15.0  # how often the operator reads the pods' /metrics and decides (autoscale_loop.py)
TICK_ENV = (
    "NEURONFLEET_AUTOSCALE_INTERVAL_SECONDS"  # the operator's setting (--autoscale-interval, the chart)
)


def tick_seconds(environ: Mapping[str, str]) -> float:
    """How often the builtin autoscaler decides: the operator's setting, else TICK_SECONDS. A setting that is
    not a number of seconds above 0 is refused with what would be right."""
    raw = environ.get(TICK_ENV)
    if raw is None:
        return TICK_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(
            f"{TICK_ENV}={raw!r}: the autoscaler's interval must be a number of seconds above 0, e.g. "
            f"{TICK_SECONDS:g}"
        )
    return seconds


def builtin(spec: NeuronModelSpec) -> bool:
    """Whether the operator's own autoscaler scales this model (autoscaling enabled, provider builtin)."""
    return spec.autoscaling.enabled and spec.autoscaling.provider == "builtin"


def _role_target(a: Autoscaling, signal: str) -> float:
    """The target per replica of `signal`: the spec's own when it is the spec's metric, else the default."""
    if signal == a.metric:
        return target(a)
    return DEFAULT_TARGETS[signal]


def policy(spec: NeuronModelSpec, cold_start: float = 0.0) -> Policy:
    """spec.autoscaling as the decision's Policy. Unified: min/max and the spec's metric. Disaggregated:
    decode between min and max, prefill between autoscaling.prefill's bounds (default: decode's); prefill
    decides on its queued prompt work (queue) or TTFT (metric ttft), decode on occupancy (or queue with
    metric queue); the spec's target for the spec's metric, the default target (DEFAULT_TARGETS) for the
    other. With scaleToZero every role's min is 0 and idleSeconds is the idle period. `cold_start`: the last
    measured one (status.autoscaling.coldStartSeconds), how far ahead a rising load is extrapolated."""
    a = spec.autoscaling
    low = 0 if a.scaleToZero else a.min
    if spec.serving.mode == "unified":
        roles = {"unified": RolePolicy(low, a.max, a.metric, target(a))}
        ratio = None
    else:
        bounds = a.prefill or a
        prefill_signal = "ttft" if a.metric == "ttft" else "queue"
        decode_signal = "queue" if a.metric == "queue" else "occupancy"
        roles = {
            "prefill": RolePolicy(
                0 if a.scaleToZero else bounds.min,
                bounds.max,
                prefill_signal,
                _role_target(a, prefill_signal),
            ),
            "decode": RolePolicy(low, a.max, decode_signal, _role_target(a, decode_signal)),
        }
        ratio = (a.prefillDecodeRatio.min, a.prefillDecodeRatio.max) if a.prefillDecodeRatio else None
    return Policy(
        roles=roles,
        scale_up_window=float(a.scaleUp.stabilizationSeconds),
        scale_down_window=float(a.scaleDown.stabilizationSeconds),
        scale_to_zero=a.scaleToZero,
        idle=float(a.idleSeconds),
        ratio=ratio,
        slots=spec.neuron.batchSize,
        dry_run=a.dryRun,
        metrics={role: engines.metric_names(spec, role) for role in roles},
        cold_start=max(0.0, cold_start),
    )


def start_replicas(spec: NeuronModelSpec) -> dict[str, int]:
    """The replicas of the autoscaled roles before any decision: the spec's, within the policy's bounds."""
    p, replicas = policy(spec), role_replicas(spec)
    return {role: _clamp(replicas[role], rp.min, rp.max) for role, rp in p.roles.items()}


def decided_replicas(spec: NeuronModelSpec, status: dict[str, Any]) -> dict[str, int] | None:
    """status.autoscaling.desired (the builtin autoscaler's last decision: its only writer) for a model it
    scales, each role within the spec's bounds (a spec edited since the decision moves them); None when it
    does not scale the model, is in dry run (the spec's replicas run) or has decided nothing yet."""
    if not builtin(spec) or spec.autoscaling.dryRun:
        return None
    desired = (status.get("autoscaling") or {}).get("desired") or {}
    p = policy(spec)
    if set(desired) != set(p.roles) or not all(isinstance(n, int) for n in desired.values()):
        return None
    return {role: _clamp(desired[role], rp.min, rp.max) for role, rp in p.roles.items()}


def with_replicas(spec: NeuronModelSpec, replicas: dict[str, int] | None) -> NeuronModelSpec:
    """The spec whose serving roles run `replicas` (the autoscaler's decision), for the builders; `spec`
    itself when there is none."""
    if not replicas:
        return spec
    if spec.serving.mode == "unified":
        return spec.model_copy(update={"replicas": replicas["unified"]})
    assert spec.serving.prefill is not None and spec.serving.decode is not None  # the spec's rule
    serving = spec.serving.model_copy(
        update={
            "prefill": spec.serving.prefill.model_copy(update={"replicas": replicas["prefill"]}),
            "decode": spec.serving.decode.model_copy(update={"replicas": replicas["decode"]}),
        }
    )
    return spec.model_copy(update={"replicas": None, "serving": serving})
