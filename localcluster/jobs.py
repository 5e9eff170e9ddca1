"""A Job as the Job controller and the TTL-after-finished controller read and write it, without I/O: its pods'
labels, its Complete / Failed conditions, when it finished and whether its TTL has run out.

Kubernetes: pkg/controller/job/job_controller.go (pod labels, conditions), pkg/controller/ttlafterfinished
(jobFinishTime: the finishing condition's lastTransitionTime; a Job without one is never deleted).
"""

from __future__ import annotations

from typing import Any

from .podlogs import parse_time
from .semantics import now

FINISHED = ("Complete", "Failed")


def pod_labels(job: dict[str, Any]) -> dict[str, str]:
    """The labels the Job controller gives its pods (the API server puts them on the template too):
    `kubectl logs job/NAME` finds the pod by the Job's selector."""
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    return {"job-name": name, "controller-uid": uid, "batch.kubernetes.io/job-name": name,
            "batch.kubernetes.io/controller-uid": uid}  # fmt: skip


def condition(type_: str, reason: str, message: str) -> dict[str, Any]:
    stamp = now()
    return {"type": type_, "status": "True", "reason": reason, "message": message[:1000],
            "lastProbeTime": stamp, "lastTransitionTime": stamp}  # fmt: skip


def finished(job: dict[str, Any]) -> bool:
    return any(
        c.get("type") in FINISHED and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions", [])
    )


def finished_at(job: dict[str, Any]) -> float | None:
    """When a Job finished, in seconds since the epoch (its finishing condition's lastTransitionTime); None
    while it runs or where no time is set."""
    for c in (job.get("status") or {}).get("conditions", []):
        if c.get("type") in FINISHED and c.get("status") == "True" and c.get("lastTransitionTime"):
            return parse_time(c["lastTransitionTime"]) / 1e9
    return None


def expired(job: dict[str, Any], at: float) -> bool:
    """A finished Job whose `spec.ttlSecondsAfterFinished` has run out at time `at`."""
    ttl = (job.get("spec") or {}).get("ttlSecondsAfterFinished")
    done = finished_at(job)
    return ttl is not None and done is not None and at >= done + ttl


def fail_job_rule(job: dict[str, Any], pods: list[dict[str, Any]]) -> str | None:
    """A failed pod that a `FailJob` rule of the Job's podFailurePolicy matches by a container's exit code
    (`onExitCodes`, operators In and NotIn; exit code 0 never matches), said as the Job controller says it
    (pkg/controller/job/pod_failure_policy.go); None when none does (the backoffLimit decides)."""
    rules = ((job.get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Failed":
            continue
        for index, rule in enumerate(rules):
            codes = rule.get("onExitCodes")
            if rule.get("action") != "FailJob" or not codes:
                continue
            for s in (pod.get("status") or {}).get("containerStatuses") or []:
                code = ((s.get("state") or {}).get("terminated") or {}).get("exitCode")
                if code in (None, 0) or codes.get("containerName") not in (None, s.get("name")):
                    continue
                if (code in codes.get("values", [])) == (codes.get("operator") == "In"):
                    where = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                    return (f"Container {s.get('name')} for pod {where} failed with exit code {code} "
                            f"matching FailJob rule at index {index}")  # fmt: skip
    return None
