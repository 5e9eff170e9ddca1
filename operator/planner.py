"""The pure core of a NeuronModel's reconcile: `plan(model, observed, at, settings) -> Plan`.

`reconcile.observe` reads what the cluster holds into one `Observed` value; `plan` decides, from the model
(spec and status) and that value alone, the ordered writes (`Apply`, `Delete`, `PatchSpec`), the Events and
the new status; `reconcile.execute` makes the writes. The plan calls three pure steps, each tested as a table:
- `compile_step`: the compile state machine (cached, absent, running with its progress, succeeded with its
  report, failed and retried: on request, when the model source may be readable again, or once a
  fingerprint shows the source changed);
- `serving_step`: the serving objects, how each Deployment will be once applied (`projected`), the rollout's
  progress and the public Service's switch to a ready set (`rollout.public_target`);
- `stale_deletions`: once the wanted set serves, the other sets' objects (entry pods first, with their drain
  time) and superseded compile Jobs.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import astuple, dataclass, field
from typing import Any

from . import (
    builders,
    engines,
    gateway,
    manual_scale,
    names,
    network_policy,
    node_offers,
    rollout,
    scaling,
    validation,
)
from .spec import NeuronModelSpec
from .status import (
    PROGRESS_WRITE_SECONDS,
    autoscaling_condition,
    compile_failure,
    compile_progress,
    compile_report,
    compute_status,
    condition,
    job_state,
    pod_problems,
    progress_due,
)

Event = tuple[str, str, str]  # type (Normal, Warning), reason, message


# ---- the plan's writes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Apply:
    """Create the object, or patch it back to what the operator wants (left alone when another owner
    controls an object of its name)."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str


@dataclass(frozen=True)
class PatchSpec:
    """A merge patch of the model's own spec (a manual spec.replicas change refused)."""

    patch: dict[str, Any]


Write = Apply | Delete | PatchSpec


# ---- what was read, and what is decided ------------------------------------------------------------------


@dataclass
class Observed:
    """What the cluster held for one model when its reconcile began (kopf's indexes, and the few live
    reads `reconcile.observe` makes when the plan will need them)."""

    job: dict[str, Any] | None = None  # the compile Job of the spec's hash
    job_pods: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, Any] | None = None  # the source-fingerprint Job of a failed compile
    probe_pods: list[dict[str, Any]] = field(default_factory=list)
    progress: tuple[dict[str, Any], str] | None = None  # a running compile pod and its log's tail, when read
    deployments: list[dict[str, Any]] = field(default_factory=list)  # the model's (by its label)
    pods: list[dict[str, Any]] = field(default_factory=list)  # the model's serving and compile pods
    service: dict[str, Any] | None = None  # the public Service (by the model's name)
    services: list[dict[str, Any]] = field(default_factory=list)  # the model's (by its label)
    pdbs: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    network_policies: list[dict[str, Any]] = field(default_factory=list)  # the model's (by its label)
    claim_templates: list[dict[str, Any]] = field(default_factory=list)  # DRA's (by the model's label)
    others: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # gateway or autoscaler, by kind
    nodes: node_offers.Offers | None = None  # what the nodes offer, where the operator reads them


@dataclass(frozen=True)
class Settings:
    """The operator's settings a plan reads (its environment may change the defaults)."""

    source_check_seconds: float = rollout.SOURCE_CHECK_SECONDS
    progress_write_seconds: float = PROGRESS_WRITE_SECONDS
    wake_base: str | None = None
    peers: network_policy.Peers = field(default_factory=network_policy.Peers)  # whom NetworkPolicies admit


@dataclass
class Plan:
    """One reconcile's decisions: the writes in order, the Events, the status (before the conflicts the writes
    meet), and what the shell records (a compile that succeeded, whether a compile runs)."""

    writes: list[Write] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    compiled: tuple[dict[str, Any] | None, dict[str, Any] | None] | None = None  # (Job, report) just seen
    compiling: bool = False


@dataclass(frozen=True)
class Parsed:
    """The model parsed and validated (pure): its spec (None when unparsable), the refusals, its hash."""

    owner: builders.Owner
    spec: NeuronModelSpec | None
    errors: list[str]
    chash: str | None

    @property
    def valid(self) -> bool:
        return self.spec is not None and not self.errors


def parse(body: dict[str, Any], limit: validation.ModelLimit | None = None) -> Parsed:
    """The model parsed and validated, with its own length `limit` where it was read (hf:// models)."""
    meta = body["metadata"]
    owner = builders.Owner(meta["name"], meta["namespace"], meta["uid"])
    spec, errors = validation.parse(body)
    if spec is not None:
        errors = names.name_errors(owner.name) + validation.validate(spec, limit).errors
    return Parsed(owner, spec, errors, builders.compile_hash(spec) if spec is not None else None)


def reads(parsed: Parsed, body: dict[str, Any]) -> dict[str, str]:
    """The objects outside the caches a plan of this model needs (kind -> name): serving.gateway's kinds a
    changed spec no longer asks for, and an HPA or ScaledObject a former spec had made."""
    old, spec, owner = body.get("status") or {}, parsed.spec, parsed.owner
    if not parsed.valid:
        return {}
    assert spec is not None
    wanted: dict[str, str] = {}
    if old.get("observedGeneration") != body["metadata"].get("generation", 1):
        wanted.update(dict.fromkeys(gateway.unwanted(spec), owner.name))
    made = scaling.made_autoscaler(old.get("conditions") or [])
    if made and made != scaling.autoscaler_kind(spec):
        wanted[made] = owner.name
    return wanted


# ---- the compile state machine ---------------------------------------------------------------------------


@dataclass
class CompileStep:
    serving: str | None  # the hash whose artifacts serve (None: none yet)
    job: tuple[str, str]  # (state, message): absent, running, succeeded or failed
    report: dict[str, Any] | None = None  # the compile's report (status.artifacts)
    retry_at: str | None = None  # a compile whose model source was unreadable is tried again then
    source_check: tuple[str | None, str | None] | None = (None, None)  # (fingerprint, next check)
    source_retries: int = 0
    progress: dict[str, Any] | None = None  # status.compileProgress
    writes: list[Write] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    compiled: tuple[dict[str, Any] | None, dict[str, Any] | None] | None = None


def compile_step(
    parsed: Parsed, body: dict[str, Any], observed: Observed, at: str, settings: Settings
) -> CompileStep:
    """Where the spec's compile stands, and the Job deletions (retries) and probe it needs."""
    spec, chash, owner = parsed.spec, parsed.chash, parsed.owner
    assert spec is not None and chash is not None
    meta, old = body["metadata"], body.get("status") or {}
    serving = old.get("compileHash") if old.get("artifacts") else None
    if not engines.compiles(spec):  # the engine compiles as each server starts: serve the spec's hash at once
        return CompileStep(serving=chash, job=("succeeded", ""))
    if serving == chash:  # remembered in status: its Job may be gone (ttlSecondsAfterFinished)
        return CompileStep(serving=serving, job=("succeeded", ""), report=old.get("artifacts"))
    step = CompileStep(serving=serving, job=job_state(observed.job))
    job_name = builders.compile_job_name(owner, chash)
    wanted = rollout.attempt(meta.get("generation", 1), meta.get("annotations"))
    if rollout.retry_due(observed.job, step.job[0], wanted):
        step.writes.append(Delete("Job", job_name))
        step.events.append(
            ("Normal", "CompileRetried", f"compiling {chash} again (attempt {wanted}): {step.job[1]}")
        )
        step.job = ("absent", "")
    elif step.job[0] == "failed":  # say why (the compile's own error), and try again if that may pass
        failure = compile_failure(observed.job_pods)
        step.job = ("failed", f"{step.job[1]}; {failure}" if failure else step.job[1])
        step.retry_at = rollout.source_retry_at(observed.job, failure)
        if step.retry_at is not None and rollout.seconds_until(step.retry_at, at) == 0:
            step.writes.append(Delete("Job", job_name))
            step.source_retries = rollout.source_retries(observed.job) + 1
            retried = (f"compiling {chash} again: the model source may be readable now (try "
                       f"{step.source_retries} after: {failure})")  # fmt: skip
            step.events.append(("Normal", "CompileRetried", retried))
            step.job, step.retry_at = ("absent", ""), None
        elif step.retry_at is None:  # any other failure: compile again once the source changes
            step.source_check, writes = source_check(parsed, old, observed, at, settings)
            step.writes += writes
            if step.source_check is None:
                step.writes.append(Delete("Job", job_name))
                retried = (f"compiling {chash} again: the model source changed since the compile failed "
                           f"({failure or step.job[1]})")  # fmt: skip
                step.events.append(("Normal", "CompileRetried", retried))
                step.job, step.source_check = ("absent", ""), (None, None)
    elif step.job[0] == "running":
        step.source_retries = rollout.source_retries(observed.job)  # (the Job keeps its count from creation)
        step.progress = old.get("compileProgress")
        if observed.progress is not None:
            pod, tail = observed.progress
            step.progress = progress_due(
                step.progress, compile_progress(tail, _started(pod), at), at, settings.progress_write_seconds
            )
    if step.job[0] == "succeeded":
        step.serving = chash  # the pod's report is read once, on the pass that sees the Job succeed
        step.report = compile_report(observed.job_pods)
        step.compiled = (observed.job, step.report)
    return step


def _started(pod: dict[str, Any]) -> str | None:
    running = [((c.get("state") or {}).get("running") or {}).get("startedAt")
               for c in (pod.get("status") or {}).get("containerStatuses") or []]  # fmt: skip
    return next((t for t in running if t), None) or (pod.get("status") or {}).get("startTime")


def source_check(
    parsed: Parsed, old: dict[str, Any], observed: Observed, at: str, settings: Settings
) -> tuple[tuple[str | None, str | None] | None, list[Write]]:
    """After a compile failed (for a reason other than an unreadable source): the source's fingerprint, by a
    small Job (`builders.build_source_probe`) made at once and then every `source_check_seconds`. Returns the
    (fingerprint, next check) to keep in status, or None when the source changed since the last fingerprint
    (the caller compiles again), and the probe Job's writes."""
    kept, check_at = old.get("sourceFingerprint"), old.get("sourceCheckAt")
    assert parsed.spec is not None and parsed.chash is not None
    name = names.source_probe(parsed.owner.name, parsed.chash)
    state = job_state(observed.probe)[0]
    if state in ("succeeded", "failed"):
        probed = (
            (compile_report(observed.probe_pods) or {}).get("fingerprint") if state == "succeeded" else None
        )
        writes: list[Write] = [Delete("Job", name)]
        if rollout.source_changed(kept, probed):
            return None, writes
        return (probed or kept, rollout.later(at, settings.source_check_seconds)), writes
    if observed.probe is None and (check_at is None or rollout.seconds_until(check_at, at) == 0):
        return (kept, check_at), [Apply(builders.build_source_probe(parsed.owner, parsed.spec, parsed.chash))]
    return (kept, check_at), []


# ---- serving: the objects, the rollout and the public Service --------------------------------------------


def projected(desired: dict[str, Any], observed: dict[str, Any] | None) -> dict[str, Any]:
    """An object as the cluster will hold it once applied: as observed when it already is what the operator
    wants or another owner controls it; else the desired fields merged over the observed object (a merge
    patch), its generation one newer, which its controller has not seen yet."""
    if observed is None:
        return desired
    if foreign_owner(desired, observed) or is_subset(desired, observed):
        return observed
    merged = _merged(observed, desired)
    merged["metadata"]["generation"] = observed["metadata"].get("generation", 1) + 1
    return merged


def _merged(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merged(base.get(k), v)
        return out
    return copy.deepcopy(patch)


@dataclass
class ServingStep:
    objects: list[dict[str, Any]]  # everything the spec asks for (for the deletions: what to keep)
    writes: list[Write] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    roles: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (replicas, ready)
    rolled_out: bool = False
    live: bool = False  # the public Service selects the wanted set
    serving_now: bool = False  # some pod it selects is ready
    failing: list[str] = field(default_factory=list)
    ours: list[dict[str, Any]] = field(default_factory=list)  # the model's Deployments, as they will be
    unwanted: bool = False  # some Deployment of the model is not wanted


def serving_step(
    parsed: Parsed, body: dict[str, Any], observed: Observed, serving: str | None,
    serving_spec: NeuronModelSpec, spec: NeuronModelSpec, scaled: dict[str, int] | None, source_retries: int,
    settings: Settings,
) -> ServingStep:  # fmt: skip
    """The objects to apply in order (the public Service and the gateway's pool last: they move to the new
    set only once it is ready), how far the serving set has rolled out, and where the public Service
    points."""
    owner, chash, meta = parsed.owner, parsed.chash, body["metadata"]
    assert chash is not None
    objects = builders.build_all(
        owner, spec, serving, internal_token=secrets.token_urlsafe(32), serving_spec=serving_spec,
        compile_job=serving != chash,
        attempt=rollout.attempt(meta.get("generation", 1), meta.get("annotations")),
        source_retries=source_retries, wake_base=settings.wake_base, peers=settings.peers,
    )  # fmt: skip
    step = ServingStep(objects=objects)
    service = observed.service
    current = (service or {}).get("spec", {}).get("selector") if service and rollout.owned_by(
        service, owner.uid) else None  # fmt: skip
    door = names.public_policy(owner.name)
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == door):
        # clients keep reaching the pods the public Service selects until it moves (then the next pass
        # narrows it to the new set's role)
        network_policy.with_roles(policy, [(current or {}).get(f"{builders.LABEL_PREFIX}/role", "")])
    found = {d["metadata"]["name"]: d for d in observed.deployments}
    if scaled and spec.serving.mode == "disaggregated":  # prefill:decode within bounds between writes too
        before = {}
        for obj in objects:
            role = (obj["metadata"].get("labels") or {}).get(f"{builders.LABEL_PREFIX}/role")
            existing = found.get(obj["metadata"]["name"]) if obj["kind"] == "Deployment" else None
            if (
                role in ("prefill", "decode")
                and existing
                and existing.get("spec", {}).get("replicas") is not None
            ):
                before[role] = existing["spec"]["replicas"]
        objects = manual_scale.ratio_ordered(objects, before, scaling.policy(spec).ratio)
    public = None
    if serving is not None:
        public = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == owner.name)
    pool = next((o for o in objects if o["kind"] == gateway.POOL_KIND), None)
    deployments: dict[str, dict[str, Any]] = {}
    for obj in objects:
        if obj is public or obj is pool:
            continue  # last: it moves to the new set only once that set is ready; the pool with it
        if obj["kind"] == "Deployment":  # its replicas as written, so that another writer's show
            obj = manual_scale.marked(obj)
            existing = found.get(obj["metadata"]["name"])
            if scaled and (reverted := manual_scale.deployment_change(existing, obj)):
                step.events.append(("Warning", "ReplicasReverted", reverted))
            deployments[obj["metadata"]["name"]] = projected(obj, existing)
        step.writes.append(Apply(obj))
    if serving is None or public is None:
        return step
    step.rolled_out = True
    for role, replicas in builders.serving_roles(serving_spec).items():
        name = builders.deployment_name(owner, role, builders.serving_set(serving_spec, serving))
        ready, done = rollout.deployment_progress(deployments.get(name), serving)
        step.roles[role] = (replicas, ready)
        step.rolled_out = step.rolled_out and done
    ours = [d for d in observed.deployments if rollout.owned_by(d, owner.uid)]
    step.ours = [deployments.get(d["metadata"]["name"], d) for d in ours]
    if not step.rolled_out:  # why pods are not ready, when they will not be
        step.failing = pod_problems(observed.pods)
    target = public["spec"]["selector"]
    chosen = rollout.public_target(current, target, step.rolled_out, step.ours)
    public["spec"]["selector"] = chosen
    step.writes.append(Apply(public))
    if pool is not None:
        step.writes.append(Apply(gateway.with_selector(pool, chosen)))
    step.live = chosen == target
    step.serving_now = any(
        rollout.selects(chosen, d) and (d.get("status") or {}).get("readyReplicas") for d in step.ours
    )
    step.unwanted = any(d["metadata"]["name"] not in deployments for d in step.ours)
    return step


def stale_deletions(
    owner: builders.Owner, wanted: list[dict[str, Any]], deployments: list[dict[str, Any]],
    observed: Observed, rolled: str | None, drain_until: str | None, at: str,
) -> tuple[list[Write], str | None]:  # fmt: skip
    """Once the public Service serves the wanted set: the other sets' objects and those of roles no longer in
    the spec, entry pods first (`rollout.retire`); once the spec's own hash (`rolled`) serves, the compile
    Jobs of other hashes. Returns the deletions and until when retired entry pods drain."""
    found = [{**d, "kind": "Deployment"} for d in deployments]
    found += [{**o, "kind": "Service"} for o in observed.services]
    found += [{**o, "kind": "PodDisruptionBudget"} for o in observed.pdbs]
    found += [{**o, "kind": "NetworkPolicy"} for o in observed.network_policies]
    found += [{**o, "kind": "ResourceClaimTemplate"} for o in observed.claim_templates]
    keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    stale = rollout.stale(found, keep, owner.uid or "")
    delete, drain_until = rollout.retire(stale, found, drain_until, at, observed.pods)
    writes: list[Write] = [Delete(kind, name) for kind, name in delete]
    if rolled is not None:
        writes += [
            Delete("Job", name) for name in rollout.superseded_jobs(observed.jobs, rolled, owner.uid or "")
        ]
    return writes, drain_until


# ---- a manual spec.replicas change while the builtin autoscaler scales -----------------------------------


def manual_change(
    body: dict[str, Any], spec: NeuronModelSpec, scaled: dict[str, int] | None, at: str
) -> tuple[NeuronModelSpec, dict[str, int] | None, dict[str, Any], list[Write], list[Event]]:
    """spec.replicas changed by someone other than the operator while the builtin autoscaler scales the
    model (`manual_scale.spec_change`): adopted (the autoscaler's new desired replicas, Normal
    ManualScaleAdopted) or refused (spec.replicas patched back, Warning ManualScaleRefused). Returns the spec
    and replicas to build from, the status.autoscaling fields to write (specReplicas: what it saw), the
    writes and the Events."""
    old = body.get("status") or {}
    auto = old.get("autoscaling") or {}
    if not manual_scale.watched(spec):  # a later autoscaler starts from what it then sees
        return spec, scaled, {"autoscaling": {"specReplicas": None}} if "specReplicas" in auto else {}, [], []
    seen = manual_scale.spec_replicas(spec)
    change = manual_scale.spec_change(spec, body["metadata"]["name"], old)
    extra: dict[str, Any] = {}
    writes: list[Write] = []
    events: list[Event] = []
    if isinstance(change, manual_scale.Refuse):
        writes.append(PatchSpec({"spec": {"replicas": change.replicas}}))
        events.append(("Warning", "ManualScaleRefused", change.message))
        spec, seen = spec.model_copy(update={"replicas": change.replicas}), auto["specReplicas"]
        scaled = change.current
    elif isinstance(change, manual_scale.Adopt):
        events.append(("Normal", "ManualScaleAdopted", change.message))
        earlier = (auto.get("lastScale") or {}).get("signals") or {}  # not this change's: removed
        last = {"from": change.before, "to": change.desired, "reason": change.message, "at": at}
        extra = {"desired": change.desired, "lastScale": {**last, "signals": dict.fromkeys(earlier)}}
        scaled = change.desired
    return spec, scaled, {"autoscaling": {"specReplicas": seen, **extra}}, writes, events


# ---- the plan --------------------------------------------------------------------------------------------


def plan(body: dict[str, Any], parsed: Parsed, observed: Observed, at: str, settings: Settings) -> Plan:
    """Everything one reconcile of the model decides, from the model and what the cluster held."""
    meta, old = body["metadata"], body.get("status") or {}
    owner, spec, errors, chash = parsed.owner, parsed.spec, parsed.errors, parsed.chash
    generation = meta.get("generation", 1)
    out = Plan()
    step = CompileStep(serving=old.get("compileHash") if old.get("artifacts") else None, job=("absent", ""))
    stored, drain_until = old.get("servingSpec"), old.get("drainUntil")
    served: ServingStep | None = None
    seen: dict[str, Any] = {}
    if parsed.valid:
        assert spec is not None and chash is not None
        step = compile_step(parsed, body, observed, at, settings)
        out.writes += step.writes
        out.events += step.events
        out.compiled = step.compiled
        serving_spec = rollout.serving_spec(spec, stored, chash, step.serving)
        # provider builtin: the replicas are the autoscaler's (status.autoscaling.desired), its only writer
        scaled = scaling.decided_replicas(spec, old) or (
            scaling.start_replicas(spec) if scaling.builtin(spec) else None
        )
        spec, scaled, seen, writes, events = manual_change(body, spec, scaled, at)
        out.writes += writes
        out.events += events
        serving_spec = scaling.with_replicas(serving_spec, scaled)
        stored = rollout.stored_sections(spec, stored, chash, step.serving)
        served = serving_step(
            parsed, body, observed, step.serving, serving_spec, spec, scaled, step.source_retries, settings
        )
        out.writes += served.writes
        out.events += served.events
        if served.live and (
            served.unwanted
            or drain_until  # retired entry pods drain: the rest of their set goes after
            or old.get("phase") != "Ready"
            or old.get("observedGeneration") != generation
        ):
            rolled = chash if step.serving == chash else None
            # while retired pods drain, status.drainUntil says when to come back (the caller schedules it)
            writes, drain_until = stale_deletions(
                owner, served.objects, served.ours, observed, rolled, drain_until, at
            )
            out.writes += writes
    out.compiling = step.job[0] == "running"
    endpoint = builders.endpoint(owner, spec, observed.service if served and served.roles else None) \
        if spec is not None else None  # fmt: skip
    status = compute_status(
        old=old, generation=generation, errors=errors, compile_hash=chash, serving_hash=step.serving,
        job=step.job, roles=served.roles if served else {}, rolled_out=bool(served and served.rolled_out),
        live=bool(served and served.live), serving_now=bool(served and served.serving_now),
        report=step.report,
        serving_spec=stored, drain_until=drain_until, retry_at=step.retry_at, source_check=step.source_check,
        failing=served.failing if served else [], endpoint=endpoint, compiling=step.progress,
        compile_step=spec is None or engines.compiles(spec),
        notice=engines.notice(spec) if spec is not None else None,
        replicas_notice=scaling.replicas_notice(spec) if spec is not None else None, at=at,
    )  # fmt: skip
    if parsed.valid:  # (a refused spec keeps what it had made)
        assert spec is not None and served is not None
        status.update(
            scaling.scale_status(spec, served.roles, builders.selector(owner, scaling.scaled_role(spec)))
        )
        for (
            kind,
            found,
        ) in observed.others.items():  # what the spec no longer asks for, when the model owns it
            if found is not None and rollout.owned_by(found, owner.uid):
                out.writes.append(Delete(kind, owner.name))
        if spec.autoscaling.enabled:
            autoscaler = next((o for o in served.objects if o["kind"] in scaling.AUTOSCALER_KINDS), None)
            conds = old.get("conditions") or []
            builtin = ("DryRun" if spec.autoscaling.dryRun else "Builtin") if scaling.builtin(spec) else None
            status["conditions"].append(autoscaling_condition(conds, generation, at, autoscaler, builtin))
        verdict = nodes_verdict(parsed, spec, served.objects, step.serving, observed.nodes, at)
        if verdict is not None:  # what the nodes lack, before a pod waits for it
            conds = old.get("conditions") or []
            status["conditions"].append(
                condition(conds, node_offers.CONDITION, *astuple(verdict), generation, at)
            )
        status.update(seen)
    out.status = status
    return out


def nodes_verdict(
    parsed: Parsed, spec: NeuronModelSpec, objects: list[dict[str, Any]], serving: str | None,
    offers: node_offers.Offers | None, at: str,
) -> node_offers.Verdict | None:  # fmt: skip
    """The Schedulable condition (`node_offers.schedulable`) of the pods the plan's objects hold, and, while
    the spec's own hash has not compiled, of the serving pods it will roll to (said before the compile ends,
    not once they wait); None where the nodes are not read or no pod asks for a device."""
    if offers is None or spec.neuron.instanceType == "cpu":
        return None
    assert parsed.chash is not None
    if serving != parsed.chash:
        objects = [*objects, *builders.build_serving(parsed.owner, spec, parsed.chash)]
    return node_offers.schedulable(node_offers.pod_needs(objects), offers, at)


# ---- comparing what the operator wants with what the cluster holds ---------------------------------------


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
