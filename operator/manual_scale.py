"""The writes of the replicas of a model the builtin autoscaler scales (it is their only writer): what a
change of spec.replicas by someone else (`kubectl scale neuronmodel`, a GitOps apply) means under
autoscaling.onManualChange, and whether an autoscaled Deployment's replicas were set by someone else. Pure:
the reconcile (reconcile.py) acts on the answers.

spec.replicas as the operator last saw it is kept in status.autoscaling.specReplicas (0 for unset, as the
scale subresource reads it). A spec whose replicas differ from it was changed by someone else (the operator
writes spec.replicas only to refuse such a change, back to that value):
- `adopt`: the new value, within min/max, is the autoscaler's new desired replicas of the scaled role
  (decode for a disaggregated model, prefill following the ratio, `scaling.prefill_for`); it scales on
  from there by its own rules;
- `refuse`: spec.replicas is put back; the Event says to change the bounds instead.

A Deployment's replicas as the operator last wrote them are kept on it in the annotation REPLICAS_ANNOTATION
(a `kubectl scale deployment` or an edit of spec.replicas leaves annotations as they are): replicas that
differ from both it and what the operator wants now were set by someone else, whatever the value, the
replicas before the last decision included.

Between the writes of a disaggregated model's prefill and decode Deployments, prefill:decode stays within
autoscaling.prefillDecodeRatio where an order allows it (`ratio_ordered`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from . import rollout, scaling
from .builders import LABEL_PREFIX
from .spec import NeuronModelSpec

REPLICAS_ANNOTATION = f"{LABEL_PREFIX}/replicas"  # a Deployment's replicas as the operator last wrote them


@dataclass(frozen=True)
class Adopt:
    """spec.replicas `replicas` become the autoscaler's desired replicas `desired` (per role; it ran
    `before`)."""

    replicas: int
    desired: dict[str, int]
    before: dict[str, int]
    message: str


@dataclass(frozen=True)
class Refuse:
    """spec.replicas go back to `replicas` (None: unset, as they were); the autoscaler's `current` replicas
    per role run on."""

    replicas: int | None
    current: dict[str, int]
    message: str


def spec_replicas(spec: NeuronModelSpec) -> int:
    """spec.replicas as the scale subresource reads them (unset: 0)."""
    return spec.replicas if spec.replicas is not None else 0


def watched(spec: NeuronModelSpec) -> bool:
    """Whether manual changes of spec.replicas are decided on: the builtin autoscaler acts (not in dry run,
    where the spec's replicas run)."""
    return scaling.builtin(spec) and not spec.autoscaling.dryRun


def adopted(spec: NeuronModelSpec, replicas: int) -> dict[str, int]:
    """The desired replicas per scaled role for spec.replicas `replicas`: the scaled role's within min/max,
    prefill (disaggregated) following the ratio within its bounds."""
    p = scaling.policy(spec)
    role = scaling.scaled_role(spec)
    bounds = p.roles[role]
    desired = {role: max(bounds.min, min(bounds.max, replicas))}
    if "prefill" in p.roles:
        pb = p.roles["prefill"]
        desired["prefill"] = max(pb.min, min(pb.max, scaling.prefill_for(spec, desired[role])))
    return desired


def current(spec: NeuronModelSpec, status: dict[str, Any]) -> dict[str, int]:
    """The replicas per role the autoscaler runs: its decision, or before any, the spec's as last seen
    (status.autoscaling.specReplicas, not a manual change's)."""
    seen = (status.get("autoscaling") or {}).get("specReplicas")
    before = spec.model_copy(update={"replicas": seen or None}) if isinstance(seen, int) else spec
    return scaling.decided_replicas(spec, status) or scaling.start_replicas(before)


def spec_change(spec: NeuronModelSpec, name: str, status: dict[str, Any]) -> Adopt | Refuse | None:
    """What to do about spec.replicas of the model `name` with status `status`: None when nothing changed,
    the autoscaler does not act, or it has seen no spec.replicas yet (the first pass records them)."""
    seen = (status.get("autoscaling") or {}).get("specReplicas")
    if not watched(spec) or not isinstance(seen, int) or spec_replicas(spec) == seen:
        return None
    a, role, now, running_now = (
        spec.autoscaling,
        scaling.scaled_role(spec),
        spec_replicas(spec),
        current(spec, status),
    )
    running = ", ".join(f"{r} {n}" for r, n in sorted(running_now.items()))
    if a.onManualChange == "refuse":
        return Refuse(
            seen or None,
            running_now,
            f"spec.replicas was set to {now} by someone other than the operator; "
            f"autoscaling.onManualChange is refuse, so it is put back to {seen}: the builtin autoscaler sets "
            f"the replicas ({running} now) within autoscaling.min {a.min} and max {a.max}. To change how "
            "many run, change those bounds "
            f"(kubectl patch neuronmodel {name} --type merge -p "
            f'\'{{"spec":{{"autoscaling":{{"min":{now}}}}}}}\'), or set autoscaling.onManualChange adopt',
        )
    desired = adopted(spec, now)
    within = "" if desired[role] == now else f" (within autoscaling.min {a.min} and max {a.max})"
    return Adopt(
        now,
        desired,
        running_now,
        f"spec.replicas {seen} -> {now}, set by someone other than the operator, adopted: the autoscaler now "
        f"wants {', '.join(f'{r} {n}' for r, n in sorted(desired.items()))}{within} (was {running}) and "
        "scales on from there",
    )


def marked(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment the operator applies, its replicas recorded in REPLICAS_ANNOTATION."""
    out = copy.deepcopy(deployment)
    annotations = out["metadata"].setdefault("annotations", {})
    annotations[REPLICAS_ANNOTATION] = str(out["spec"]["replicas"])
    return out


def deployment_change(existing: dict[str, Any] | None, wanted: dict[str, Any]) -> str | None:
    """Why an autoscaled Deployment's replicas are put back when someone else set them (they differ from
    what the operator wants now and from what it last wrote, REPLICAS_ANNOTATION), else None. A Deployment
    without the annotation was last written by an operator that did not record it: taken as its own."""
    if existing is None or not rollout.owned_by(existing, wanted["metadata"]["ownerReferences"][0]["uid"]):
        return None
    have, want = (existing.get("spec") or {}).get("replicas"), wanted["spec"]["replicas"]
    written = ((existing.get("metadata") or {}).get("annotations") or {}).get(REPLICAS_ANNOTATION)
    if have is None or have == want or written is None or str(have) == written:
        return None
    return (
        f"Deployment {wanted['metadata']['name']} had replicas {have}, set by someone other than the "
        f"autoscaler (its only writer for this model; it last wrote {written}): put back to {want}"
    )


def _role(obj: dict[str, Any]) -> str | None:
    if obj.get("kind") != "Deployment":
        return None
    return (obj["metadata"].get("labels") or {}).get(f"{LABEL_PREFIX}/role")


def ratio_ordered(
    objects: list[dict[str, Any]], before: dict[str, int], ratio: tuple[float, float] | None
) -> list[dict[str, Any]]:
    """The objects to apply, the decode Deployment moved before the prefill one when its new replicas first
    keep prefill:decode within the ratio bounds between the two writes and prefill's first would not (a
    scale-up of both: prefill 2 beside decode 1 would read 2:1). `before`: the Deployments' replicas now."""
    wanted = {_role(o): o["spec"]["replicas"] for o in objects if _role(o) in ("prefill", "decode")}
    if ratio is None or len(wanted) < 2 or not {"prefill", "decode"} <= set(before):
        return objects

    def within(prefill: int, decode: int) -> bool:
        return decode == 0 or ratio[0] <= prefill / decode <= ratio[1]

    if within(wanted["prefill"], before["decode"]) or not within(before["prefill"], wanted["decode"]):
        return objects
    prefill = next(i for i, o in enumerate(objects) if _role(o) == "prefill")
    decode = next(i for i, o in enumerate(objects) if _role(o) == "decode")
    out = list(objects)
    if decode > prefill:
        out.insert(prefill, out.pop(decode))
    return out
