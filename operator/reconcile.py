"""One reconcile path for a NeuronModel, whatever triggered it: parse -> validate -> build -> apply ->
observe -> status. The planning (builders) and the status (status.py) are pure functions; `reconcile` is the
thin shell that reads and writes through `kube.Kube`.

Compile once: the compile Job for the spec's compile hash is created first; serving Deployments point at a
hash only after its Job succeeded (artifacts/<hash>/ exists), and are built from the spec that compiled it
(`rollout.serving_spec`): a spec change that alters the hash compiles while the Deployments stay exactly as
they are, then they roll once. A new serving set (a disaggregated set of another revision, or a mode switch)
is created beside the one that serves; the public Service moves when the new one is ready; then the old one
is deleted (`rollout`). Apply order: what pods mount (ConfigMap, Secret) before the pods.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from . import builders, engines, gateway, manual_scale, metrics, names, rollout, scaling, validation, wake
from .kube import Kube, KubeError
from .status import (
    PROGRESS_READ_SECONDS,
    PROGRESS_TAIL_LINES,
    PROGRESS_WRITE_SECONDS,
    autoscaling_condition,
    compile_failure,
    compile_progress,
    compile_report,
    compute_status,
    job_state,
    pod_problems,
    progress_due,
    transitions,
    with_conflicts,
)

# how often a failed compile's model source is fingerprinted (the operator's environment may say otherwise:
# local mode's tests check it every few seconds)
SOURCE_CHECK_SECONDS = float(os.environ.get("NEURONFLEET_SOURCE_CHECK_SECONDS", rollout.SOURCE_CHECK_SECONDS))

# how often a running compile's progress is read and written (the operator's environment may say otherwise)
PROGRESS_WRITE = float(os.environ.get("NEURONFLEET_PROGRESS_SECONDS", PROGRESS_WRITE_SECONDS))
PROGRESS_READ = PROGRESS_WRITE * PROGRESS_READ_SECONDS / PROGRESS_WRITE_SECONDS

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


async def apply(kube: Kube, obj: dict[str, Any], conflicts: list[str]) -> dict[str, Any]:
    """Create the object, or patch it back to what the operator wants; returns it as the cluster holds it.
    An object of that name controlled by another owner is left as it is and added to `conflicts` (the
    model's Conflict condition)."""
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
        conflicts.append(f"{obj['kind']} {meta['name']} is controlled by {owner}; it is left as it is")
        return existing
    if obj["kind"] in CREATE_ONLY or existing is None or is_subset(obj, existing):
        return existing or obj
    return await kube.patch(obj["kind"], meta["namespace"], meta["name"], obj)


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
                    metrics.model_replicas(*key, None)
                    return {}
                status = await _reconcile_locked(kube, fresh, emit)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                raise
        metrics.RECONCILES.labels("ok").inc()
        metrics.model_phase(*key, status.get("phase"))
        metrics.model_replicas(*key, status.get("replicas"))
        return status


def _generation(body: dict[str, Any]) -> int:
    return body["metadata"].get("generation", 1)


async def _reconcile_locked(kube: Kube, body: dict[str, Any], emit) -> dict[str, Any]:
    meta = body["metadata"]
    old = body.get("status") or {}
    owner = builders.Owner(meta["name"], meta["namespace"], meta["uid"])
    ns, generation = owner.namespace, meta.get("generation", 1)
    spec, errors = validation.parse(body)
    if spec is not None:
        errors = names.name_errors(owner.name) + validation.validate(spec).errors
    chash = builders.compile_hash(spec) if spec is not None else None
    job: tuple[str, str] = ("absent", "")
    report = None
    retry_at: str | None = None  # a compile whose model source was unreadable is tried again then
    source_check: tuple[str | None, str | None] = (None, None)  # a failed compile's source: fingerprint, next
    source_retries = 0
    progress = None  # a running compile's, from its pod's log (status.compileProgress)
    serving = old.get("compileHash") if old.get("artifacts") else None
    stored = old.get("servingSpec")
    roles: dict[str, tuple[int, int]] = {}
    rolled_out = live = serving_now = False
    drain_until = old.get("drainUntil")
    service: dict[str, Any] | None = None  # the public Service, as the cluster holds it
    conflicts: list[str] = []  # objects of this model's names that another owner controls
    failing: list[str] = []  # serving pods that will not become ready without a change
    seen: dict[str, Any] = {}  # provider builtin: the spec.replicas it saw (status.autoscaling.specReplicas)
    compile_step = spec is None or engines.compiles(spec)
    if spec is not None and not errors:
        assert chash is not None
        compiled = serving == chash  # remembered in status: its Job may be gone (ttlSecondsAfterFinished)
        if not compile_step:  # the engine compiles as each server starts: serve the spec's hash at once
            serving, job = chash, ("succeeded", "")
        elif compiled:
            job, report = ("succeeded", ""), old.get("artifacts")
        else:
            job_name = builders.compile_job_name(owner, chash)
            job_obj = await kube.get("Job", ns, job_name)
            job = job_state(job_obj)
            wanted = rollout.attempt(generation, meta.get("annotations"))
            if rollout.retry_due(job_obj, job[0], wanted):
                await kube.delete("Job", ns, job_name)
                emit("Normal", "CompileRetried", f"compiling {chash} again (attempt {wanted}): {job[1]}")
                job = ("absent", "")
            elif job[0] == "failed":  # say why (the compile's own error), and try again if that may pass
                failure = compile_failure(await kube.list("Pod", ns, f"job-name={job_name}"))
                job = ("failed", f"{job[1]}; {failure}" if failure else job[1])
                retry_at = rollout.source_retry_at(job_obj, failure)
                if retry_at is not None and rollout.seconds_until(retry_at, now()) == 0:
                    await kube.delete("Job", ns, job_name)
                    source_retries = rollout.source_retries(job_obj) + 1
                    emit("Normal", "CompileRetried", f"compiling {chash} again: the model source may be "
                         f"readable now (try {source_retries} after: {failure})")  # fmt: skip
                    job, retry_at = ("absent", ""), None
                elif retry_at is None:  # any other failure: compile again once the source changes
                    source_check = await _check_source(kube, owner, spec, chash, old, conflicts)
                    if source_check is None:
                        await kube.delete("Job", ns, job_name)
                        emit("Normal", "CompileRetried", f"compiling {chash} again: the model source changed "
                             f"since the compile failed ({failure or job[1]})")  # fmt: skip
                        job, source_check = ("absent", ""), (None, None)
            elif job[0] == "running":
                source_retries = rollout.source_retries(job_obj)  # (the Job keeps the count it was made with)
                progress = await _compile_progress(kube, owner, job_name, old)
            if job[0] == "succeeded":
                serving = chash  # the pod's report is read once, on the pass that sees the Job succeed
                report = compile_report(await kube.list("Pod", ns, f"job-name={job_name}"))
                metrics.compile_succeeded(job_obj, report)
        serving_spec = rollout.serving_spec(spec, stored, chash, serving)
        # provider builtin: the replicas are the autoscaler's (status.autoscaling.desired), its only writer
        scaled = scaling.decided_replicas(spec, old) or (
            scaling.start_replicas(spec) if scaling.builtin(spec) else None
        )
        spec, scaled, seen = await _manual_change(kube, body, spec, old, scaled, emit)
        serving_spec = scaling.with_replicas(serving_spec, scaled)
        stored = rollout.stored_sections(spec, stored, chash, serving)
        objects = builders.build_all(
            owner, spec, serving, internal_token=secrets.token_urlsafe(32), serving_spec=serving_spec,
            compile_job=serving != chash, attempt=rollout.attempt(generation, meta.get("annotations")),
            source_retries=source_retries, wake_base=wake.base_url(),
        )  # fmt: skip
        public = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == owner.name) \
            if serving is not None else None  # fmt: skip
        deployments: dict[str, dict[str, Any]] = {}
        if scaled and spec.serving.mode == "disaggregated":  # prefill:decode within bounds between writes too
            objects = await _ratio_ordered(kube, ns, objects, spec)
        pool = next((o for o in objects if o["kind"] == gateway.POOL_KIND), None)
        for obj in objects:
            if obj is public or obj is pool:
                continue  # last: it moves to the new set only once that set is ready; the pool with it
            if obj["kind"] == "Deployment":  # its replicas as written, so that another writer's show
                obj = manual_scale.marked(obj)
            if scaled and obj["kind"] == "Deployment":
                existing = await kube.get("Deployment", ns, obj["metadata"]["name"])
                if reverted := manual_scale.deployment_change(existing, obj):
                    emit("Warning", "ReplicasReverted", reverted)
            applied = await apply(kube, obj, conflicts)
            if obj["kind"] == "Deployment":
                deployments[obj["metadata"]["name"]] = applied
        if serving is not None and public is not None:
            rolled_out = True
            for role, replicas in builders.serving_roles(serving_spec).items():
                name = builders.deployment_name(owner, role, builders.serving_set(serving_spec, serving))
                ready, done = rollout.deployment_progress(deployments.get(name), serving)
                roles[role] = (replicas, ready)
                rolled_out = rolled_out and done
            model_label = f"{builders.LABEL_PREFIX}/model={owner.name}"
            ours = [
                d for d in await kube.list("Deployment", ns, model_label) if rollout.owned_by(d, owner.uid)
            ]
            ours = [deployments.get(d["metadata"]["name"], d) for d in ours]
            if not rolled_out:  # why pods are not ready, when they will not be (from the pod cache)
                failing = pod_problems(await kube.list("Pod", ns, model_label))
            existing = await kube.get("Service", ns, owner.name)
            current = (existing or {}).get("spec", {}).get("selector") if existing and rollout.owned_by(
                existing, owner.uid) else None  # fmt: skip
            target = public["spec"]["selector"]
            chosen = rollout.public_target(current, target, rolled_out, ours)
            public["spec"]["selector"] = chosen
            service = await apply(kube, public, conflicts)
            if pool is not None:
                await apply(kube, gateway.with_selector(pool, chosen), conflicts)
            live = chosen == target
            serving_now = any(
                rollout.selects(chosen, d) and (d.get("status") or {}).get("readyReplicas") for d in ours
            )
            unwanted = any(d["metadata"]["name"] not in deployments for d in ours)
            if live and (
                unwanted or old.get("phase") != "Ready" or old.get("observedGeneration") != generation
            ):
                rolled = chash if serving == chash else None
                # while retired pods drain, status.drainUntil says when to come back (the caller schedules it)
                drain_until = await _delete_stale(kube, owner, objects, ours, rolled, drain_until)
    if job[0] != "running":
        _progress_read.pop((ns, owner.name), None)  # (read at once when a compile runs again)
    endpoint = builders.endpoint(owner, spec, service) if spec is not None else None
    status = compute_status(
        old=old, generation=generation, errors=errors, compile_hash=chash, serving_hash=serving,
        job=job, roles=roles, rolled_out=rolled_out, live=live, serving_now=serving_now, report=report,
        serving_spec=stored, drain_until=drain_until, retry_at=retry_at, source_check=source_check,
        failing=failing, endpoint=endpoint, compiling=progress, compile_step=compile_step,
        notice=engines.notice(spec) if spec is not None else None, at=now(),
    )  # fmt: skip
    made = scaling.made_autoscaler(old.get("conditions") or [])  # what a former spec had made, if any
    autoscaler = None
    if spec is not None and not errors:  # (a refused spec keeps the old one)
        pods = builders.selector(owner, scaling.scaled_role(spec))
        status.update(scaling.scale_status(spec, roles, pods))
        autoscaler = next((o for o in objects if o["kind"] in scaling.AUTOSCALER_KINDS), None)
        if old.get("observedGeneration") != generation:  # a spec change may drop serving.gateway's objects
            for kind in gateway.unwanted(spec):
                found = await kube.get(kind, ns, owner.name)
                if found is not None and rollout.owned_by(found, owner.uid):
                    await kube.delete(kind, ns, owner.name)
        if made and made != (autoscaler or {}).get("kind"):  # the provider changed: the cluster's goes
            found = await kube.get(made, ns, owner.name)
            if found is not None and rollout.owned_by(found, owner.uid):
                await kube.delete(made, ns, owner.name)
        if spec.autoscaling.enabled:
            conds = old.get("conditions") or []
            builtin = ("DryRun" if spec.autoscaling.dryRun else "Builtin") if scaling.builtin(spec) else None
            status["conditions"].append(autoscaling_condition(conds, generation, now(), autoscaler, builtin))
    if spec is not None and not errors:
        status.update(seen)
    status = with_conflicts(status, old, conflicts, generation, now())
    if status_changed(old, status):
        for event in transitions(old, status):
            emit(*event)
        await kube.patch_status(owner.namespace, owner.name, status)
    return status


async def _manual_change(
    kube: Kube,
    body: dict[str, Any],
    spec: Any,
    old: dict[str, Any],
    scaled: dict[str, int] | None,
    emit: Callable[[str, str, str], None],
) -> tuple[Any, dict[str, int] | None, dict[str, Any]]:
    """spec.replicas changed by someone other than the operator while the builtin autoscaler scales the
    model (`manual_scale.spec_change`): adopted (the autoscaler's new desired replicas, Normal
    ManualScaleAdopted) or refused (spec.replicas patched back, Warning ManualScaleRefused). Returns the spec
    and replicas to build from, and the status.autoscaling fields to write (specReplicas: what it saw)."""
    auto = old.get("autoscaling") or {}
    if not manual_scale.watched(spec):  # a later autoscaler starts from what it then sees
        return spec, scaled, {"autoscaling": {"specReplicas": None}} if "specReplicas" in auto else {}
    meta, seen = body["metadata"], manual_scale.spec_replicas(spec)
    change = manual_scale.spec_change(spec, meta["name"], old)
    extra: dict[str, Any] = {}
    if isinstance(change, manual_scale.Refuse):
        patch = {"spec": {"replicas": change.replicas}}
        await kube.patch(body["kind"], meta["namespace"], meta["name"], patch)
        emit("Warning", "ManualScaleRefused", change.message)
        spec, seen = spec.model_copy(update={"replicas": change.replicas}), auto["specReplicas"]
        scaled = change.current
    elif isinstance(change, manual_scale.Adopt):
        emit("Normal", "ManualScaleAdopted", change.message)
        earlier = (auto.get("lastScale") or {}).get("signals") or {}  # not this change's: removed
        last = {"from": change.before, "to": change.desired, "reason": change.message, "at": now()}
        extra = {"desired": change.desired, "lastScale": {**last, "signals": dict.fromkeys(earlier)}}
        scaled = change.desired
    return spec, scaled, {"autoscaling": {"specReplicas": seen, **extra}}


async def _ratio_ordered(
    kube: Kube, ns: str, objects: list[dict[str, Any]], spec: Any
) -> list[dict[str, Any]]:
    """`manual_scale.ratio_ordered` with the Deployments' replicas as the cache has them."""
    before = {}
    for obj in objects:
        role = (obj["metadata"].get("labels") or {}).get(f"{builders.LABEL_PREFIX}/role")
        if obj["kind"] == "Deployment" and role in ("prefill", "decode"):
            found = await kube.get("Deployment", ns, obj["metadata"]["name"])
            if found is not None and (found.get("spec") or {}).get("replicas") is not None:
                before[role] = found["spec"]["replicas"]
    return manual_scale.ratio_ordered(objects, before, scaling.policy(spec).ratio)


async def _delete_stale(
    kube: Kube,
    owner: builders.Owner,
    wanted: list[dict[str, Any]],
    deployments: list[dict],
    rolled: str | None,
    drain_until: str | None,
) -> str | None:
    """Once the public Service serves the wanted set: delete the other sets' objects and those of roles no
    longer in the spec, entry pods first (`rollout.retire`); once the spec's own hash (`rolled`) serves, the
    compile Jobs of other hashes. Returns until when retired entry pods drain."""
    ns, label = owner.namespace, f"{builders.LABEL_PREFIX}/model={owner.name}"
    observed = [{**d, "kind": "Deployment"} for d in deployments]
    for kind in ("Service", "PodDisruptionBudget"):
        observed += [{**o, "kind": kind} for o in await kube.list(kind, ns, label)]
    for kind in ("Secret", "NetworkPolicy"):  # one each, by name: no need to list Secrets
        found = await kube.get(kind, ns, builders.internal_secret_name(owner))
        observed += [{**found, "kind": kind}] if found else []
    keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    stale = rollout.stale(observed, keep, owner.uid or "")
    delete, drain_until = rollout.retire(stale, observed, drain_until, now())
    for kind, name in delete:
        await kube.delete(kind, ns, name)
    if rolled is not None:
        for name in rollout.superseded_jobs(await kube.list("Job", ns, label), rolled, owner.uid or ""):
            await kube.delete("Job", ns, name)
    return drain_until


async def _check_source(
    kube: Kube, owner: builders.Owner, spec: Any, chash: str, old: dict[str, Any], conflicts: list[str]
) -> tuple[str | None, str | None] | None:
    """After a compile failed (for a reason other than an unreadable source): fingerprint its model source
    with a small Job (`builders.build_source_probe`) at once, then every SOURCE_CHECK_SECONDS. Returns the
    (fingerprint, next check) to keep in status, or None when the source changed since the last fingerprint
    (then the caller compiles again)."""
    ns, kept, check_at = owner.namespace, old.get("sourceFingerprint"), old.get("sourceCheckAt")
    name = names.source_probe(owner.name, chash)
    probe = await kube.get("Job", ns, name)
    state = job_state(probe)[0]
    if state in ("succeeded", "failed"):
        probed = None
        if state == "succeeded":
            probed = (compile_report(await kube.list("Pod", ns, f"job-name={name}")) or {}).get("fingerprint")
        await kube.delete("Job", ns, name)
        if rollout.source_changed(kept, probed):
            return None
        return probed or kept, rollout.later(now(), SOURCE_CHECK_SECONDS)
    if probe is None and (check_at is None or rollout.seconds_until(check_at, now()) == 0):
        await apply(kube, builders.build_source_probe(owner, spec, chash), conflicts)
    return kept, check_at


_progress_read: dict[tuple[str, str], float] = {}  # model -> when its compile pod's log was last read


async def _compile_progress(
    kube: Kube, owner: builders.Owner, job_name: str, old: dict[str, Any]
) -> dict[str, Any] | None:
    """status.compileProgress of a running compile Job: the tail of its running pod's log, read at most every
    PROGRESS_READ seconds per model (between reads, what status holds), kept as written for PROGRESS_WRITE
    seconds unless its phase changed (`status.progress_due`)."""
    kept, key = old.get("compileProgress"), (owner.namespace, owner.name)
    if time.monotonic() - _progress_read.get(key, float("-inf")) < PROGRESS_READ:
        return kept
    _progress_read[key] = time.monotonic()
    pods = [
        p for p in await kube.list("Pod", owner.namespace, f"job-name={job_name}")
        if (p.get("status") or {}).get("phase") == "Running"
    ]  # fmt: skip
    if not pods:
        return kept
    pod = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    running = [((c.get("state") or {}).get("running") or {}).get("startedAt") for c in
               pod["status"].get("containerStatuses") or []]  # fmt: skip
    started = next((t for t in running if t), None) or pod["status"].get("startTime")
    try:
        tail = await kube.pod_log(owner.namespace, pod["metadata"]["name"], PROGRESS_TAIL_LINES)
    except KubeError:
        return kept  # (the compile goes on; the next read may answer)
    at = now()
    return progress_due(kept, compile_progress(tail, started, at), at, PROGRESS_WRITE)
