"""One reconcile path for a NeuronModel, whatever triggered it: observe -> plan -> execute -> status.
`observe` reads what the cluster holds for the model into one value (`planner.Observed`, from the operator's
caches and the few live reads the plan needs); `planner.plan` (pure) decides the writes, the Events and the
status; `execute` makes the writes in order; the status, with any object another owner controls
(`Conflict`), is written last.

Compile once: the compile Job for the spec's compile hash is created first; serving Deployments point at a
hash only after its Job succeeded (artifacts/<hash>/ exists), and are built from the spec that compiled it
(`rollout.serving_spec`): a spec change that alters the hash compiles while the Deployments stay exactly as
they are, then they roll once. A new serving set (a disaggregated set of another revision, or a mode switch)
is created beside the one that serves; the public Service moves when the new one is ready; then the old one
is deleted (`rollout`). Apply order: what pods mount (ConfigMap, Secret) before the pods.

The internal token's Secret is not cached (the operator may not list or watch Secrets): it is read by name,
live, and created where it is missing; once seen, a model's Secret is not read again for SECRET_RECHECK
seconds (it is created once and never changed).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

from . import builders, hub, metrics, names, network_policy, planner, rollout, validation
from .kube import Kube, KubeError
from .planner import Apply, Delete, Observed, PatchSpec, foreign_owner, is_subset
from .status import (
    PROGRESS_READ_SECONDS,
    PROGRESS_TAIL_LINES,
    PROGRESS_WRITE_SECONDS,
    transitions,
    with_conflicts,
)

# how often a failed compile's model source is fingerprinted (the operator's environment may say otherwise:
# local mode's tests check it every few seconds)
SOURCE_CHECK_SECONDS = float(os.environ.get("NEURONFLEET_SOURCE_CHECK_SECONDS", rollout.SOURCE_CHECK_SECONDS))

# how often a running compile's progress is read and written (the operator's environment may say otherwise)
PROGRESS_WRITE = float(os.environ.get("NEURONFLEET_PROGRESS_SECONDS", PROGRESS_WRITE_SECONDS))
PROGRESS_READ = PROGRESS_WRITE * PROGRESS_READ_SECONDS / PROGRESS_WRITE_SECONDS

# whom the models' NetworkPolicies admit besides their own pods: the chart's networkPolicy values (a bad
# setting stops the operator at start, saying what is wrong)
PEERS = network_policy.Peers.from_setting(os.environ.get(network_policy.SETTING_ENV))

# created, never patched: Jobs' and claims' specs are immutable; the Secret's token is made once
CREATE_ONLY = {"Job", "PersistentVolumeClaim", "Secret"}
SECRET_RECHECK = 600.0  # seconds a model's Secret, once seen, is taken to exist without reading it again
_secrets_seen: dict[tuple[str, str], tuple[str, float]] = {}  # (namespace, name) -> (owner uid, when seen)


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return not is_subset(new, old)


# ---- the shell -------------------------------------------------------------------------------------------

_locks: dict[tuple[str, str], asyncio.Lock] = {}


async def apply(kube: Kube, obj: dict[str, Any], conflicts: list[str]) -> dict[str, Any]:
    """Create the object, or patch it back to what the operator wants; returns it as the cluster holds it.
    An object of that name controlled by another owner is left as it is and added to `conflicts` (the
    model's Conflict condition)."""
    meta = obj["metadata"]
    existing = await kube.get(obj["kind"], meta["namespace"], meta["name"])  # from the cache
    if existing is not None and foreign_owner(obj, existing):  # confirmed live: the cache may still hold an
        # earlier model's object the garbage collector has deleted (the create's answer of a model deleted
        # at once can reach the cache after the deletion's event), which no later event would remove
        existing = await kube.get(obj["kind"], meta["namespace"], meta["name"], live=True)
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


async def apply_secret(kube: Kube, obj: dict[str, Any], conflicts: list[str]) -> None:
    """`apply` of the model's Secret (read live: Secrets are not cached), skipped while it was seen, owned
    by this model, less than SECRET_RECHECK seconds ago."""
    meta = obj["metadata"]
    key, uid = (meta["namespace"], meta["name"]), meta["ownerReferences"][0]["uid"]
    seen = _secrets_seen.get(key)
    if seen is not None and seen[0] == uid and time.monotonic() - seen[1] < SECRET_RECHECK:
        return
    before = len(conflicts)
    await apply(kube, obj, conflicts)
    if len(conflicts) == before:  # ours (another owner's is looked at again each pass, and reported)
        _secrets_seen[key] = (uid, time.monotonic())


async def reconcile(
    kube: Kube, body: dict[str, Any], emit: Callable[[str, str, str], None], wake_url: str | None = None
) -> dict[str, Any]:
    """Bring one NeuronModel's children to what its spec asks for and write its status; returns the status.
    Reads come from kopf's indexes (kube.Kube answers them); `body` (the trigger's copy) is used when it is
    newer than the indexed one. `wake_url`: the operator's wake endpoint as routers reach it (a
    scale-to-zero model's routers are given it)."""
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
                status = await _reconcile_locked(kube, fresh, emit, wake_url)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                raise
        metrics.RECONCILES.labels("ok").inc()
        metrics.model_phase(*key, status.get("phase"))
        metrics.model_replicas(*key, status.get("replicas"))
        return status


def _generation(body: dict[str, Any]) -> int:
    return body["metadata"].get("generation", 1)


async def _reconcile_locked(kube: Kube, body: dict[str, Any], emit, wake_url: str | None) -> dict[str, Any]:
    parsed = planner.parse(body, await model_limit(kube, body))
    observed = await observe(kube, body, parsed)
    at = now()
    settings = planner.Settings(SOURCE_CHECK_SECONDS, PROGRESS_WRITE, wake_url, PEERS)
    plan = planner.plan(body, parsed, observed, at, settings)
    conflicts = await execute(kube, body, plan.writes)
    key = (parsed.owner.namespace, parsed.owner.name)
    if not plan.compiling:
        _progress_read.pop(key, None)  # (read at once when a compile runs again)
    if plan.compiled is not None:
        metrics.compile_succeeded(*plan.compiled)
    for event in plan.events:
        emit(*event)
    old, generation = body.get("status") or {}, body["metadata"].get("generation", 1)
    status = with_conflicts(plan.status, old, conflicts, generation, at)
    if status_changed(old, status):
        for event in transitions(old, status):
            emit(*event)
        await kube.patch_status(*key, status)
    return status


_hub = hub.HubConfigs()  # hf:// models' config.json reads, kept across reconciles


async def model_limit(kube: Kube, body: dict[str, Any]) -> validation.ModelLimit | None:
    """An hf:// model's own length limit, read from the Hub with the token of its secretRef (the Secret read
    by name, live: the operator caches no Secret); None for other sources, or where the read failed (the
    compile checks again as it reads the files)."""
    spec, _ = validation.parse(body)
    if spec is None or not spec.model.uri.startswith("hf://"):
        return None
    token, ref = None, spec.model.secretRef
    if ref is not None and not hub.offline():
        try:
            secret = await kube.get("Secret", body["metadata"]["namespace"], ref.name, live=True)
        except KubeError:
            secret = None  # (read without it: a gated model's read then fails, and refuses nothing)
        token = hub.secret_token(secret, ref.key)
    read = await _hub.read(spec.model.uri, spec.model.revision, token)
    if read.limit is None:
        return None
    return validation.ModelLimit(read.limit, read.where(spec.model.uri, spec.model.revision))


async def observe(kube: Kube, body: dict[str, Any], parsed: planner.Parsed) -> Observed:
    """What the cluster holds for the model, read once (the operator's caches answer all but the compile
    pod's log and the few kinds `planner.reads` names)."""
    owner, ns = parsed.owner, parsed.owner.namespace
    label = f"{builders.LABEL_PREFIX}/model={owner.name}"
    seen = Observed(
        deployments=await kube.list("Deployment", ns, label),
        pods=await kube.list("Pod", ns, label),
        service=await kube.get("Service", ns, owner.name),
        services=await kube.list("Service", ns, label),
        pdbs=await kube.list("PodDisruptionBudget", ns, label),
        jobs=await kube.list("Job", ns, label),
        network_policies=await kube.list("NetworkPolicy", ns, label),
        claim_templates=await kube.list("ResourceClaimTemplate", ns, label),
    )
    if parsed.valid and parsed.chash is not None:
        job_name = builders.compile_job_name(owner, parsed.chash)
        seen.job = await kube.get("Job", ns, job_name)
        if seen.job is not None:
            seen.job_pods = await kube.list("Pod", ns, f"job-name={job_name}")
        probe_name = names.source_probe(owner.name, parsed.chash)
        seen.probe = await kube.get("Job", ns, probe_name)
        if seen.probe is not None:
            seen.probe_pods = await kube.list("Pod", ns, f"job-name={probe_name}")
        seen.progress = await _compile_log(kube, owner, seen.job_pods)
    for kind, name in planner.reads(parsed, body).items():
        seen.others[kind] = await kube.get(kind, ns, name)
    nodes = getattr(getattr(kube, "cache", None), "nodes", None)  # (a client without kopf's caches: none)
    seen.nodes = nodes.offers() if nodes is not None else None  # (kopf's indexes: no request)
    return seen


async def execute(kube: Kube, body: dict[str, Any], writes: list[planner.Write]) -> list[str]:
    """Make the plan's writes in order; returns the objects left alone because another owner controls them
    (the model's Conflict condition)."""
    meta, conflicts = body["metadata"], []
    for write in writes:
        if isinstance(write, Apply) and write.obj["kind"] == "Secret":
            await apply_secret(kube, write.obj, conflicts)
        elif isinstance(write, Apply):
            await apply(kube, write.obj, conflicts)
        elif isinstance(write, Delete):
            await kube.delete(write.kind, meta["namespace"], write.name)
        elif isinstance(write, PatchSpec):
            await kube.patch(body["kind"], meta["namespace"], meta["name"], write.patch)
    return conflicts


_progress_read: dict[tuple[str, str], float] = {}  # model -> when its compile pod's log was last read


async def _compile_log(
    kube: Kube, owner: builders.Owner, job_pods: list[dict[str, Any]]
) -> tuple[dict[str, Any], str] | None:
    """The running compile pod and its log's tail, read at most every PROGRESS_READ seconds per model (None
    between reads, when no compile pod runs, or when the read fails: the status keeps what it holds)."""
    running = [p for p in job_pods if (p.get("status") or {}).get("phase") == "Running"]
    key = (owner.namespace, owner.name)
    if not running or time.monotonic() - _progress_read.get(key, float("-inf")) < PROGRESS_READ:
        return None
    _progress_read[key] = time.monotonic()
    pod = max(running, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    try:
        tail = await kube.pod_log(owner.namespace, pod["metadata"]["name"], PROGRESS_TAIL_LINES)
    except KubeError:
        return None  # (the compile goes on; the next read may answer)
    return pod, tail
