"""A NeuronModel's status (phase, conditions, replicas, artifacts, endpoint) computed from what was observed:
its spec's validation errors, the compile Job, the compile pod's report and the serving Deployments. Pure: no
I/O and no clock (the caller passes the time)."""

from __future__ import annotations

import json
from typing import Any

from .spec import AUTOSCALING_NOT_ACTED_ON

CONDITION_TYPES = ("Validated", "Compiled", "Ready", "Progressing", "Degraded")
FAILURE_REASONS = {"Invalid", "CompileFailed", "ReplicasUnavailable"}


def job_state(job: dict[str, Any] | None) -> tuple[str, str]:
    """(absent | running | succeeded | failed, message) of a compile Job."""
    if job is None:
        return "absent", ""
    status = job.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") == "Complete":
            return "succeeded", c.get("message", "")
        if c.get("status") == "True" and c.get("type") == "Failed":
            return "failed", f"{c.get('reason', 'Failed')}: {c.get('message', 'the compile Job failed')}"
    if status.get("succeeded"):
        return "succeeded", ""
    return "running", f"compile Job {job['metadata']['name']} is running"


def compile_report(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The manifest a compile pod left as its termination message (bytes, compiledAt, cacheHit), if any."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            message = ((status.get("state") or {}).get("terminated") or {}).get("message")
            try:
                report = json.loads(message) if message else None
            except ValueError:
                continue
            if isinstance(report, dict):
                return report
    return None


def condition(
    old: list[dict], type_: str, ok: bool, reason: str, message: str, generation: int, at: str
) -> dict:
    value = "True" if ok else "False"
    previous = next((c for c in old if c.get("type") == type_), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else at
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def compute_status(
    *,
    old: dict[str, Any],
    generation: int,
    errors: list[str],
    compile_hash: str | None,
    serving_hash: str | None,
    job: tuple[str, str],
    roles: dict[str, tuple[int, int]],  # role -> (desired, ready)
    report: dict[str, Any] | None = None,  # the compile pod's manifest, when it left one
    endpoint: str | None,
    at: str,
) -> dict[str, Any]:
    """The NeuronModel status from what was observed (pure)."""
    conds = old.get("conditions") or []
    state, job_message = job
    if errors:
        message = "; ".join(errors)
        return {
            "phase": "Failed",
            "observedGeneration": generation,
            "compileHash": old.get("compileHash"),
            "conditions": [
                condition(conds, "Validated", False, "Invalid", message, generation, at),
                *(c for c in conds if c.get("type") != "Validated"),
            ],
        }
    compiled = serving_hash is not None and serving_hash == compile_hash
    if compiled and report and report.get("cacheHit"):
        compiled_cond = ("CacheHit", f"artifacts/{compile_hash}/ existed already: nothing was compiled")
    elif compiled:
        compiled_cond = ("Compiled", f"artifacts/{compile_hash}/ is complete")
    elif state == "failed":
        compiled_cond = ("CompileFailed", job_message)
    else:
        compiled_cond = ("Compiling", job_message or f"compiling {compile_hash}")
    desired = sum(d for d, _ in roles.values())
    ready = sum(min(r, d) for d, r in roles.values())
    all_ready = serving_hash is not None and desired > 0 and all(r >= d for d, r in roles.values())
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    degraded = state == "failed" or (was_ready and not all_ready and serving_hash is not None)
    progressing = not compiled or not all_ready
    if serving_hash is None:
        phase = "Failed" if state == "failed" else "Compiling"
    elif degraded:
        phase = "Degraded"
    elif all_ready and compiled:
        phase = "Ready"
    else:
        phase = "Deploying"
    progress = ("Rolling", "compiling or rolling out") if progressing else ("Stable", "up to date")
    if state == "failed":
        health = ("CompileFailed", job_message)
    else:
        health = ("ReplicasUnavailable", f"{ready}/{desired} pods ready") if degraded else ("Healthy", "")
    ready_reason = "AllReplicasReady" if all_ready else ("NotCompiled" if serving_hash is None else "Waiting")
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "compileHash": serving_hash,
        "conditions": [
            condition(conds, "Validated", True, "Valid", "the spec fits its instance type", generation, at),
            condition(conds, "Compiled", compiled, *compiled_cond, generation, at),
            condition(
                conds, "Ready", all_ready, ready_reason, f"{ready}/{desired} pods ready", generation, at
            ),
            condition(conds, "Progressing", progressing, *progress, generation, at),
            condition(conds, "Degraded", degraded, *health, generation, at),
        ],
        "replicas": {role: {"desired": d, "ready": min(r, d)} for role, (d, r) in roles.items()},
        "readyReplicas": f"{ready}/{desired}",
    }
    if serving_hash is not None:
        status["artifacts"] = {"path": f"artifacts/{serving_hash}/"}
        if compiled and report:
            status["artifacts"].update(
                {k: report[k] for k in ("bytes", "compiledAt", "cacheHit") if report.get(k) is not None}
            )
        elif (old.get("artifacts") or {}).get("path") == status["artifacts"]["path"]:
            status["artifacts"] = old["artifacts"]
        status["endpoint"] = endpoint
    return status


def autoscaling_condition(old: list[dict], generation: int, at: str) -> dict:
    """AutoscalingActive=False for a spec that enables autoscaling: nothing scales the replicas yet."""
    return condition(
        old, "AutoscalingActive", False, "NotImplemented", AUTOSCALING_NOT_ACTED_ON, generation, at
    )


def transitions(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for every condition whose status changed."""
    before = {c["type"]: c["status"] for c in old.get("conditions") or []}
    out = []
    for c in new.get("conditions") or []:
        if before.get(c["type"]) != c["status"]:
            bad = (c["type"] == "Degraded") == (c["status"] == "True")
            out.append(
                ("Warning" if bad and c["status"] != "Unknown" else "Normal", c["reason"], c["message"])
            )
    return out


def with_conflicts(
    status: dict[str, Any], old: dict[str, Any], conflicts: list[str], generation: int, at: str
) -> dict[str, Any]:
    """The status with a `Conflict=True` condition naming each object another owner controls (the operator
    leaves those alone), or without any Conflict condition when there is none; `old` is the previous status
    (the condition keeps its lastTransitionTime)."""
    conds = [c for c in status.get("conditions") or [] if c.get("type") != "Conflict"]
    if conflicts:
        message = "; ".join(sorted(set(conflicts)))
        previous = old.get("conditions") or []
        conds.append(condition(previous, "Conflict", True, "OwnedElsewhere", message, generation, at))
    return {**status, "conditions": conds}
