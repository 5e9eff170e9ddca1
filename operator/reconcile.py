"""One reconcile path for a NeuronModel, whatever triggered it: parse -> validate -> build -> apply ->
observe -> status. The planning and the status are pure functions; `reconcile` is the thin shell that reads
and writes through `kube.Kube`.

Compile once: the compile Job for the spec's compile hash is created first; serving Deployments point at a
hash only after its Job succeeded (artifacts/<hash>/ exists). A spec change that alters the hash compiles
while the Deployments keep serving the previous hash, then they roll to the new one.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
from collections.abc import Callable
from typing import Any

from . import builders, metrics, validation
from .kube import Kube, KubeError
from .spec import AUTOSCALING_NOT_ACTED_ON

CONDITION_TYPES = ("Validated", "Compiled", "Ready", "Progressing", "Degraded")
FAILURE_REASONS = {"Invalid", "CompileFailed", "ReplicasUnavailable"}
# created, never patched: Jobs' and claims' specs are immutable; the Secret's token is made once
CREATE_ONLY = {"Job", "PersistentVolumeClaim", "Secret"}


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_subset(desired: Any, observed: Any) -> bool:
    """True when every field the operator sets has that value in the observed object (others may differ:
    defaults, status, what other controllers add)."""
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(is_subset(v, observed.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(desired) == len(observed)
            and all(is_subset(d, o) for d, o in zip(desired, observed, strict=True))
        )
    return desired == observed


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


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return not is_subset(new, old)


# ---- the shell -------------------------------------------------------------------------------------------

_locks: dict[tuple[str, str], asyncio.Lock] = {}


async def apply(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    """Create the object, or patch it back to what the operator wants; returns it as the cluster holds it."""
    meta = obj["metadata"]
    existing = await kube.get(obj["kind"], meta["namespace"], meta["name"])
    if existing is None:
        try:
            return await kube.create(obj)
        except KubeError as e:
            if e.status != 409:  # created meanwhile by a concurrent pass: compare below
                raise
            existing = await kube.get(obj["kind"], meta["namespace"], meta["name"])
    if obj["kind"] in CREATE_ONLY or existing is None or is_subset(obj, existing):
        return existing or obj
    return await kube.patch(obj["kind"], meta["namespace"], meta["name"], obj)


async def reconcile(
    kube: Kube, body: dict[str, Any], emit: Callable[[str, str, str], None]
) -> dict[str, Any]:
    """Bring one NeuronModel's children to what its spec asks for and write its status; returns the status."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    async with _locks.setdefault(key, asyncio.Lock()):
        with metrics.RECONCILE_SECONDS.time():
            try:
                fresh = await kube.get(body["kind"], *key)  # the latest state, not the triggering event's
                if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                    metrics.model_phase(*key, None)
                    return {}
                status = await _reconcile_locked(kube, fresh, emit)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                raise
        metrics.RECONCILES.labels("ok").inc()
        metrics.model_phase(*key, status.get("phase"))
        return status


async def _reconcile_locked(kube: Kube, body: dict[str, Any], emit) -> dict[str, Any]:
    meta = body["metadata"]
    old = body.get("status") or {}
    owner = builders.Owner(meta["name"], meta["namespace"], meta["uid"])
    generation = meta.get("generation", 1)
    spec, errors = validation.parse(body)
    if spec is not None:
        errors = validation.validate(spec).errors
    chash = builders.compile_hash(spec) if spec is not None else None
    job: tuple[str, str] = ("absent", "")
    report = None
    serving = old.get("compileHash") if old.get("artifacts") else None
    roles: dict[str, tuple[int, int]] = {}
    service: dict[str, Any] | None = None  # the public Service, as the cluster holds it
    if spec is not None and not errors:
        assert chash is not None
        job = job_state(await kube.get("Job", owner.namespace, builders.compile_job_name(owner, chash)))
        if job[0] == "succeeded":
            serving = chash
            job_name = builders.compile_job_name(owner, chash)
            report = compile_report(await kube.list("Pod", owner.namespace, f"job-name={job_name}"))
        for obj in builders.build_all(owner, spec, serving, internal_token=secrets.token_urlsafe(32)):
            applied = await apply(kube, obj)
            if obj["kind"] == "Service" and obj["metadata"]["name"] == owner.name:
                service = applied  # the public one: its published address is the endpoint
        if serving is not None:
            for role, replicas in builders.serving_roles(spec).items():
                dep = await kube.get("Deployment", owner.namespace, builders.deployment_name(owner, role))
                current = (
                    dep is not None
                    and dep["metadata"].get("labels", {}).get(f"{builders.LABEL_PREFIX}/compile-hash")
                    == serving
                )
                ready = (dep or {}).get("status", {}).get("readyReplicas", 0) if current else 0
                roles[role] = (replicas, ready or 0)
    endpoint = builders.endpoint(owner, spec, service) if spec is not None else None
    status = compute_status(
        old=old, generation=generation, errors=errors, compile_hash=chash, serving_hash=serving,
        job=job, roles=roles, report=report, endpoint=endpoint, at=now(),
    )  # fmt: skip
    if spec is not None and not errors and spec.autoscaling.enabled:  # (a refused spec keeps the old one)
        status["conditions"].append(autoscaling_condition(old.get("conditions") or [], generation, now()))
    if status_changed(old, status):
        for event in transitions(old, status):
            emit(*event)
        await kube.patch_status(owner.namespace, owner.name, status)
    return status
