"""One reconcile path for a NeuronModel, whatever triggered it: parse -> validate -> build -> apply ->
observe -> status. The planning (builders) and the status (status.py) are pure functions; `reconcile` is the
thin shell that reads and writes through `kube.Kube`.

Compile once: the compile Job for the spec's compile hash is created first; serving Deployments point at a
hash only after its Job succeeded (artifacts/<hash>/ exists). A spec change that alters the hash compiles
while the Deployments keep serving the previous hash, then they roll to the new one.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import secrets
from collections.abc import Callable
from typing import Any

from . import builders, metrics, validation
from .kube import Kube, KubeError
from .spec import KIND
from .status import (
    autoscaling_condition,
    compile_report,
    compute_status,
    job_state,
    transitions,
    with_conflicts,
)

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


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return not is_subset(new, old)


# ---- the shell -------------------------------------------------------------------------------------------

_locks: dict[tuple[str, str], asyncio.Lock] = {}
_conflicts: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("conflicts", default=None)


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def foreign_owner(desired: dict[str, Any], existing: dict[str, Any]) -> str | None:
    """Who controls `existing` when it is not the owner `desired` names (None when it is ours): a controller
    ownerReference with another uid, or none at all (made by hand or by another tool). The operator never
    patches such an object: two owners patching one object fight for ever."""
    ours = _controller(desired)
    if ours is None:
        return None
    theirs = _controller(existing)
    if theirs is not None:
        if theirs.get("uid") == ours.get("uid"):
            return None
        return f"{theirs.get('kind')} {theirs.get('name')} (uid {theirs.get('uid')})"
    refs = (existing.get("metadata") or {}).get("ownerReferences") or []
    if any(r.get("uid") == ours.get("uid") for r in refs):
        return None
    return "no NeuronModel (it has no controller reference: made by hand or by another tool)"


async def apply(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    """Create the object, or patch it back to what the operator wants; returns it as the cluster holds it.
    An object of that name controlled by another owner is left as it is and reported (a Conflict condition
    on the model, see `reconcile`)."""
    meta = obj["metadata"]
    existing = await kube.get(obj["kind"], meta["namespace"], meta["name"])  # from the cache
    if existing is None:
        try:
            return await kube.create(obj)
        except KubeError as e:
            if e.status != 409:  # exists already (the cache had not seen it yet): compare below
                raise
            existing = await kube.get(obj["kind"], meta["namespace"], meta["name"], live=True)
    if existing is not None and (owner := foreign_owner(obj, existing)):
        found = _conflicts.get()
        if found is not None:
            found.append(f"{obj['kind']} {meta['name']} is controlled by {owner}; it is left as it is")
        return existing
    if obj["kind"] in CREATE_ONLY or existing is None or is_subset(obj, existing):
        return existing or obj
    return await kube.patch(obj["kind"], meta["namespace"], meta["name"], obj)


class _Pass:
    """The client one reconcile pass uses: `kube` itself, except that the status it writes carries the
    pass's Conflict condition (so that one write holds the whole status)."""

    def __init__(self, kube: Kube, old: dict[str, Any], conflicts: list[str], generation: int) -> None:
        self._kube, self._old, self._conflicts, self._generation = kube, old, conflicts, generation
        self.written: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kube, name)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.written = with_conflicts(status, self._old, self._conflicts, self._generation, now())
        if not status_changed(self._old, self.written):  # only the Conflict condition made it look new
            return await self._kube.get(KIND, namespace, name) or {}
        return await self._kube.patch_status(namespace, name, self.written)


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


async def reconcile(
    kube: Kube, body: dict[str, Any], emit: Callable[[str, str, str], None]
) -> dict[str, Any]:
    """Bring one NeuronModel's children to what its spec asks for and write its status; returns the status.
    Reads come from the operator's caches (kube.Kube answers them); `body` (the trigger's copy) is used when
    it is newer than the cached one."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    async with _locks.setdefault(key, asyncio.Lock()):
        with metrics.RECONCILE_SECONDS.time():
            try:
                fresh = await kube.get(body["kind"], *key)  # the latest state, not the triggering event's
                if fresh is None:  # kopf's watch may be ahead of the cache's: ask the API server
                    fresh = await kube.get(body["kind"], *key, live=True)
                elif _generation(body) > _generation(fresh):
                    fresh = body
                if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                    metrics.model_phase(*key, None)
                    return {}
                status = await _reconcile_with_conflicts(kube, fresh, emit)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                raise
        metrics.RECONCILES.labels("ok").inc()
        metrics.model_phase(*key, status.get("phase"))
        return status


def _generation(body: dict[str, Any]) -> int:
    return body["metadata"].get("generation", 1)


async def _reconcile_with_conflicts(kube: Kube, body: dict[str, Any], emit) -> dict[str, Any]:
    """One pass, collecting the objects another owner controls; a change in them is written and announced."""
    old = body.get("status") or {}
    conflicts: list[str] = []
    one_pass = _Pass(kube, old, conflicts, _generation(body))
    token = _conflicts.set(conflicts)
    try:
        status = await _reconcile_locked(one_pass, body, emit)  # type: ignore[arg-type]
    finally:
        _conflicts.reset(token)
    if not status:
        return status
    status = one_pass.written or with_conflicts(status, old, conflicts, _generation(body), now())
    before, after = _condition(old, "Conflict"), _condition(status, "Conflict")
    if (before or {}).get("message") != (after or {}).get("message"):
        if one_pass.written is None:
            await kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], status)
        if after is not None:
            emit("Warning", "Conflict", after["message"])
        else:
            emit("Normal", "ConflictResolved", "no object of this model is controlled by another owner")
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
