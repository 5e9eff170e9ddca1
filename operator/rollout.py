"""Which serving set a NeuronModel runs, when its public Service moves to a new one, and which of its objects
go: the rollout's decisions, as pure functions of the spec, the status and what was observed.

- Versioned by what was compiled: the serving set is built from the spec that produced the serving hash.
  Its model, engine, image and neuron sections are kept in `status.servingSpec`; while a new hash compiles,
  the serving set is built from those sections and the current spec's other sections (`serving_spec`), so a
  change that needs a compile leaves the Deployments exactly as they are until its artifacts exist, then
  rolls once, and a change that needs none (replicas, resources, scheduling) rolls at once.
- A unified model has one Deployment, rolled in place (RollingUpdate, maxUnavailable 0: old pods serve until
  new ones are ready). A disaggregated model runs version-isolated sets: a set's prefill, decode and router
  Deployments and its headless Services carry the set's revision in their names and selectors, and its
  router names only its own set's Services, so no router pairs a prefill of one hash with a decode of
  another. A mode switch (unified <-> disaggregated) is a new set too.
- The public Service keeps selecting the set it serves until the new set is ready (`public_target`); then it
  moves, and only then are the objects of other sets and of roles no longer in the spec deleted (`stale`),
  their entry first (`retire`): the old routers (or unified pods) drain the requests they hold, for their
  termination grace period, before the prefill and decode pods those requests use are deleted.
- A failed compile Job is replaced when a later attempt is asked for (`retry_due`): the spec changed (a new
  generation) or `kubectl annotate neuronmodel NAME neuronfleet.dev/retry=<anything new>`; superseded hashes'
  Jobs are deleted (`superseded_jobs`). A compile that failed because its model source could not be read
  (its termination message says so: contract.SOURCE_UNAVAILABLE) is tried again by itself, 30 s after it
  failed, doubling each time in a row up to every 10 minutes (`source_retry_at`): the file may be copied,
  the claim filled, the Hub access granted. After any other failure the source is fingerprinted (a small
  Job, `builders.build_source_probe`) at once and then every SOURCE_CHECK_SECONDS; a changed fingerprint
  (`source_changed`: a file replaced, a Hub branch moved) compiles again.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from neuronfleet.contract import SOURCE_UNAVAILABLE

from .builders import ATTEMPT_ANNOTATION, LABEL_PREFIX, SOURCE_RETRIES_ANNOTATION
from .spec import NeuronModelSpec

COMPILE_SECTIONS = ("model", "engine", "image", "neuron")  # every input of builders.compile_hash
RETRY_ANNOTATION = f"{LABEL_PREFIX}/retry"
# what a pass may delete: the serving sets' kinds, and NetworkPolicies and DRA claim templates a spec no
# longer asks for (the internal token's Secret stays as long as its model: the garbage collector deletes it
# with the model)
STALE_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ResourceClaimTemplate")


ROLE_TP = "roleTensorParallel"  # in status.servingSpec: the per-role tensor parallelism the compile made


def compiled_sections(spec: NeuronModelSpec) -> dict[str, Any]:
    """The sections of a spec that decide its compile (kept in status.servingSpec), and the prefill and decode
    pods' own tensor parallelism where set (a compile makes the graphs of each)."""
    out = spec.model_dump(mode="json", include=set(COMPILE_SECTIONS))
    roles = {
        r: getattr(spec.serving, r).tensorParallel for r in ("prefill", "decode") if getattr(spec.serving, r)
    }
    if any(roles.values()):
        out[ROLE_TP] = roles
    return out


def serving_spec(
    spec: NeuronModelSpec, stored: dict[str, Any] | None, chash: str, serving_hash: str | None
) -> NeuronModelSpec:
    """The spec the serving set is built from: `spec` once its own hash serves; while another hash serves,
    `spec` with the compiled sections `stored` for that hash (status.servingSpec). Without stored sections
    (a status written before they were kept) the current spec is used."""
    if serving_hash is None or serving_hash == chash or not stored:
        return spec
    merged = {**spec.model_dump(mode="json"), **{k: v for k, v in stored.items() if k in COMPILE_SECTIONS}}
    for role in ("prefill", "decode"):  # the roles' compiled tensor parallelism (none stored: the model's)
        if merged["serving"].get(role) is not None:
            merged["serving"][role]["tensorParallel"] = (stored.get(ROLE_TP) or {}).get(role)
    try:
        return NeuronModelSpec.model_validate(merged)
    except ValidationError:
        return spec


def stored_sections(
    spec: NeuronModelSpec, old: dict[str, Any] | None, chash: str, serving_hash: str | None
) -> dict[str, Any] | None:
    """status.servingSpec to write: the current spec's sections once its hash serves, else the old ones."""
    if serving_hash is not None and serving_hash == chash:
        return compiled_sections(spec)
    return old


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object's controller is the NeuronModel of this uid."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("controller") and r.get("uid") == uid for r in refs)


def deployment_progress(dep: dict[str, Any] | None, chash: str) -> tuple[int, bool]:
    """(ready pods, rolled out) of a Deployment of the serving set at `chash`: rolled out when the
    Deployment controller has seen its latest spec and every pod runs its template
    (https://kubernetes.io/docs/concepts/workloads/controllers/deployment/#complete-deployment)."""
    if dep is None or dep["metadata"].get("labels", {}).get(f"{LABEL_PREFIX}/compile-hash") != chash:
        return 0, False
    status = dep.get("status") or {}
    want = dep.get("spec", {}).get("replicas", 1)
    seen = status.get("observedGeneration", 0) >= dep["metadata"].get("generation", 1)
    ready = status.get("readyReplicas") or 0
    rolled = seen and (status.get("updatedReplicas") or 0) >= want and (status.get("replicas") or 0) <= want
    return ready, rolled and ready >= want


def selects(selector: dict[str, str], dep: dict[str, Any]) -> bool:
    """Whether a Service of this selector selects the pods of this Deployment (and it has any)."""
    template = dep.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
    wants_pods = dep.get("spec", {}).get("replicas", 1) > 0
    return wants_pods and bool(selector) and all(template.get(k) == v for k, v in selector.items())


def public_target(
    current: dict[str, str] | None, target: dict[str, str], target_ready: bool, deployments: list[dict]
) -> dict[str, str]:
    """The public Service's selector: the new set's once it is ready, or when the Service selects nothing
    that exists (first deploy, or its set is gone); until then the set it serves."""
    if not current or current == target or target_ready:
        return target
    if not any(selects(current, d) for d in deployments):
        return target
    return current


def stale(observed: list[dict[str, Any]], keep: set[tuple[str, str]], uid: str) -> list[tuple[str, str]]:
    """(kind, name) of this model's objects that are not wanted any more: other sets' and other roles'
    (called once the public Service serves the wanted set). Objects of another controller are never ours
    to delete."""
    out = []
    for obj in observed:
        key = (obj["kind"], obj["metadata"]["name"])
        if obj["kind"] in STALE_KINDS and key not in keep and owned_by(obj, uid):
            out.append(key)
    return sorted(out)


ENTRY_ROLES = ("router", "unified")  # the pods a public Service selects
ROUTER_DRAIN_POLL = 5  # seconds until a pass looks again at retired router pods still draining


def _time(value: str) -> datetime.datetime:
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def retire(
    stale_keys: list[tuple[str, str]], observed: list[dict[str, Any]], drain_until: str | None, now: str,
    pods: Sequence[dict[str, Any]] = (),
) -> tuple[list[tuple[str, str]], str | None]:  # fmt: skip
    """(what to delete now, until when the entry pods drain) of the stale objects: the stale entry
    Deployments (and their PDBs) first, then, once their pods' termination grace period has passed, the
    rest; a pass during the drain deletes nothing. Where routers are among them (a disaggregated set's, a
    unified set's front door), the routers alone are the entry: the pods behind them serve until the routers
    have drained (a front door draining with no ready pod behind it would refuse what it holds). `pods`: the
    model's pods; while a router pod whose Deployment is gone still runs (draining), nothing else goes, even
    where `drain_until` is not seen yet (a pass right after the one that wrote it); until `drain_until`,
    nothing goes even where no router pod is seen (one deleted at once, not left Terminating: the pods behind
    it would otherwise count as the entry and go while it drains)."""
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in observed}
    if draining_routers(observed, pods):  # (come back soon where drain_until is not seen)
        soon = (_time(now) + datetime.timedelta(seconds=ROUTER_DRAIN_POLL)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return [], drain_until or soon
    if drain_until and _time(now) < _time(drain_until):  # (before the entries: once the routers are gone,
        # the unified pods behind them would count as the entry and go while the routers still drain)
        return [], drain_until
    role = {
        k: by_key[k]["metadata"].get("labels", {}).get(f"{LABEL_PREFIX}/role")
        for k in stale_keys if k[0] == "Deployment"
    }  # fmt: skip
    entry_roles = ("router",) if "router" in role.values() else ENTRY_ROLES
    entries = [k for k in role if role[k] in entry_roles]
    if entries:
        grace = max(
            by_key[k]
            .get("spec", {})
            .get("template", {})
            .get("spec", {})
            .get("terminationGracePeriodSeconds", 30)
            for k in entries
        )
        until = _time(now) + datetime.timedelta(seconds=grace)
        names = {name for _, name in entries}
        now_keys = [
            k for k in stale_keys if k in entries or (k[0] == "PodDisruptionBudget" and k[1] in names)
        ]
        return now_keys, until.strftime("%Y-%m-%dT%H:%M:%SZ")
    return list(stale_keys), None


def draining_routers(observed: list[dict[str, Any]], pods: Sequence[dict[str, Any]]) -> bool:
    """Whether a router pod runs whose Deployment is gone (deleted: it drains until its grace period ends)."""
    label = lambda o, key: (o["metadata"].get("labels") or {}).get(f"{LABEL_PREFIX}/{key}")  # noqa: E731
    routers = {
        label(o, "set") for o in observed if o["kind"] == "Deployment" and label(o, "role") == "router"
    }
    return any(
        label(p, "role") == "router" and label(p, "set") not in routers
        and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        for p in pods
    )  # fmt: skip


def seconds_until(when: str, now: str) -> float:
    return max(0.0, (_time(when) - _time(now)).total_seconds())


def superseded_jobs(jobs: list[dict[str, Any]], chash: str, uid: str) -> list[str]:
    """Names of this model's compile Jobs of other hashes: a running one compiles what is no longer asked
    for; a finished one's artifacts stay in the cache."""
    return sorted(
        j["metadata"]["name"]
        for j in jobs
        if owned_by(j, uid) and j["metadata"].get("labels", {}).get(f"{LABEL_PREFIX}/compile-hash") != chash
    )


def attempt(generation: int, annotations: dict[str, str] | None) -> str:
    """The compile attempt a pass asks for: the spec's generation and the retry annotation's value."""
    return f"{generation}/{(annotations or {}).get(RETRY_ANNOTATION, '')}"


def retry_due(job: dict[str, Any] | None, state: str, wanted: str) -> bool:
    """Whether a failed compile Job should be replaced: a later attempt than the one it ran is asked for."""
    if job is None or state != "failed":
        return False
    return (job["metadata"].get("annotations") or {}).get(ATTEMPT_ANNOTATION, "") != wanted


SOURCE_RETRY_SECONDS = (30.0, 600.0)  # after a compile whose model source was unreadable: first, most


def source_retries(job: dict[str, Any] | None) -> int:
    """How many times in a row this Job's hash was compiled again because its source was unreadable."""
    value = ((job or {}).get("metadata", {}).get("annotations") or {}).get(SOURCE_RETRIES_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0


def source_retry_at(job: dict[str, Any] | None, failure: str) -> str | None:
    """When a failed compile Job whose model source was unreadable (`failure`, its pod's termination message)
    is tried again: SOURCE_RETRY_SECONDS[0] after it failed, doubled per try in a row, at most [1]; None for
    any other failure, or a Job with no failure time."""
    if job is None or SOURCE_UNAVAILABLE not in failure:
        return None
    failed_at = next(
        (c.get("lastTransitionTime") for c in (job.get("status") or {}).get("conditions") or []
         if c.get("type") == "Failed" and c.get("status") == "True"),
        None,
    )  # fmt: skip
    if not failed_at:
        return None
    first, most = SOURCE_RETRY_SECONDS
    delay = min(first * 2 ** source_retries(job), most)
    return (_time(failed_at) + datetime.timedelta(seconds=delay)).strftime("%Y-%m-%dT%H:%M:%SZ")


SOURCE_CHECK_SECONDS = 600  # how often the source of a failed compile is fingerprinted (any other failure)


def source_changed(kept: str | None, probed: str | None) -> bool:
    """Whether a failed compile's model source changed since it was last fingerprinted: only a fingerprint
    that differs from a kept one counts (the first one is the baseline; a failed probe says nothing)."""
    return kept is not None and probed is not None and probed != kept


def later(now: str, seconds: float) -> str:
    return (_time(now) + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
