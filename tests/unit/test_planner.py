"""The reconcile's pure core (operator/planner.py) as tables: the compile state machine, the rollout and the
public Service's switch, the deletions once a new set serves, and whole plans from a model and what the
cluster held. The e2e operator tests drive the same code through the API server; these pin each case."""

from __future__ import annotations

import calendar
import json
import time

import pytest
import yaml
from support import ROOT

from neuronfleet.contract import SOURCE_UNAVAILABLE
from neuronfleet.operator import builders, names, planner, rollout
from neuronfleet.operator.planner import Apply, Delete, Observed, Settings
from neuronfleet.operator.reconcile import CREATE_ONLY
from neuronfleet.operator.status import transitions

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
AT = "2026-12-03T12:00:00Z"
UID = "uid-1"


def model(generation: int = 1, status: dict | None = None, annotations: dict | None = None, **spec) -> dict:
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"].update(uid=UID, generation=generation, annotations=annotations or {})
    body["spec"].update(spec)
    if status is not None:
        body["status"] = status
    return body


def job(
    state: str, *, attempt: str = "1/", failed_at: str = "2026-12-03T11:59:00Z", retries: int = 0
) -> dict:
    conditions = {
        "running": [],
        "succeeded": [{"type": "Complete", "status": "True"}],
        "failed": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "failed",
                    "lastTransitionTime": failed_at}],
    }[state]  # fmt: skip
    annotations = {rollout.ATTEMPT_ANNOTATION: attempt, rollout.SOURCE_RETRIES_ANNOTATION: str(retries)}
    return {"metadata": {"name": "j", "annotations": annotations}, "status": {"conditions": conditions}}


def pod_that_ended(message: str, code: int = 1) -> dict:
    terminated = {"exitCode": code, "message": message, "finishedAt": AT}
    return {
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "c", "state": {"terminated": terminated}}],
        }
    }


REPORT = {"path": "artifacts/x", "bytes": 1, "cacheHit": False}
FINGERPRINT_REPORT = {"fingerprint": "new"}


@pytest.mark.parametrize(
    "case, status, annotations, observed, want_job, want_writes, want_event",
    [
        ("nothing yet", None, None, Observed(), "absent", [], None),
        ("running", None, None, Observed(job=job("running")), "running", [], None),
        ("succeeded: its report", None, None,
         Observed(job=job("succeeded"), job_pods=[pod_that_ended(json.dumps(REPORT), 0)]),
         "succeeded", [], None),
        ("failed: retry asked for", None, {rollout.RETRY_ANNOTATION: "again"},
         Observed(job=job("failed")), "absent", ["Delete Job"], "again (attempt 1/again)"),
        ("failed: unreadable source, not due yet", None, None,
         Observed(job=job("failed", failed_at=AT), job_pods=[pod_that_ended(f"{SOURCE_UNAVAILABLE} x")]),
         "failed", [], None),
        ("failed: unreadable source, due", None, None,
         Observed(job=job("failed"), job_pods=[pod_that_ended(f"{SOURCE_UNAVAILABLE} x")]),
         "absent", ["Delete Job"], "may be readable now (try 1"),
        ("failed: other reason, the source probed first", None, None,
         Observed(job=job("failed"), job_pods=[pod_that_ended("boom")]), "failed", ["Apply Job"], None),
        ("failed: the probe shows the source changed", {"sourceFingerprint": "old"}, None,
         Observed(job=job("failed"), job_pods=[pod_that_ended("boom")], probe=job("succeeded"),
                  probe_pods=[pod_that_ended(json.dumps(FINGERPRINT_REPORT), 0)]),
         "absent", ["Delete Job", "Delete Job"], "the model source changed"),
        ("failed: the probe shows the same source", {"sourceFingerprint": "new"}, None,
         Observed(job=job("failed"), job_pods=[pod_that_ended("boom")], probe=job("succeeded"),
                  probe_pods=[pod_that_ended(json.dumps(FINGERPRINT_REPORT), 0)]),
         "failed", ["Delete Job"], None),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)  # fmt: skip
def test_the_compile_state_machine(case, status, annotations, observed, want_job, want_writes, want_event):
    body = model(status=status, annotations=annotations)
    parsed = planner.parse(body)
    step = planner.compile_step(parsed, body, observed, AT, Settings())
    assert step.job[0] == want_job, step.job
    writes = [f"{type(w).__name__} {getattr(w, 'kind', None) or w.obj['kind']}" for w in step.writes]
    assert writes == want_writes
    retried = [e[2] for e in step.events if e[1] == "CompileRetried"]
    assert (retried and want_event in retried[0]) if want_event else not retried, step.events
    if want_job == "succeeded":
        assert (step.serving, step.report, step.compiled) == (parsed.chash, REPORT, (observed.job, REPORT))
    else:
        assert step.serving is None and step.compiled is None


def test_a_compiled_hash_is_remembered_and_never_compiled_again():
    parsed = planner.parse(model())
    body = model(status={"compileHash": parsed.chash, "artifacts": REPORT})
    step = planner.compile_step(parsed, body, Observed(), AT, Settings())
    assert (step.serving, step.job, step.report, step.writes) == (parsed.chash, ("succeeded", ""), REPORT, [])


def compiled(**spec) -> tuple[dict, planner.Parsed]:
    parsed = planner.parse(model(**spec))
    return model(status={"compileHash": parsed.chash, "artifacts": REPORT}, **spec), parsed


def as_cluster_holds(obj: dict, ready: bool) -> dict:
    """A Deployment as the API server and its controller hold it, applied, rolled out and ready (or not)."""
    held = json.loads(json.dumps(obj))
    held["metadata"]["generation"] = 1
    replicas = held["spec"]["replicas"]
    held["status"] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                      "readyReplicas": replicas if ready else 0}  # fmt: skip
    return held


@pytest.mark.parametrize("ready", [False, True])
def test_the_public_service_selects_the_new_set_only_once_it_is_ready(ready):
    body, parsed = compiled()
    first = planner.plan(body, parsed, Observed(), AT, Settings())
    applied = [w.obj for w in first.writes if isinstance(w, Apply)]
    deployments = [o for o in applied if o["kind"] == "Deployment"]  # the pods' and their front door's
    assert [d["metadata"]["labels"]["neuronfleet.dev/role"] for d in deployments] == ["unified", "router"]
    assert first.status["phase"] != "Ready"  # just created: nothing ready
    held = [{**as_cluster_holds(d, ready), "kind": "Deployment"} for d in deployments]
    for h, d in zip(held, deployments, strict=True):
        h["metadata"]["ownerReferences"] = d["metadata"]["ownerReferences"]
    observed = Observed(deployments=held)
    second = planner.plan(body, parsed, observed, AT, Settings())
    (public,) = [w.obj for w in second.writes if isinstance(w, Apply) and w.obj["kind"] == "Service"
                 and w.obj["metadata"]["name"] == parsed.owner.name]  # fmt: skip
    assert public["spec"]["selector"]  # the only set: selected at once (nothing else serves)
    assert (second.status["phase"] == "Ready") == ready, second.status["phase"]


def test_a_deployment_that_will_be_patched_is_not_rolled_out_yet():
    _, parsed = compiled()
    objects = builders.build_all(parsed.owner, parsed.spec, parsed.chash)
    deployment, _door = [o for o in objects if o["kind"] == "Deployment"]
    held = as_cluster_holds(deployment, ready=True)
    held["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"  # drifted
    will_be = planner.projected(deployment, held)
    assert will_be["metadata"]["generation"] == 2 and will_be["status"]["observedGeneration"] == 1
    assert rollout.deployment_progress(will_be, parsed.chash) == (1, False)
    assert planner.projected(deployment, as_cluster_holds(deployment, True))["metadata"]["generation"] == 1
    assert planner.projected(deployment, None) is deployment


def test_once_the_wanted_set_serves_the_old_sets_objects_and_superseded_jobs_go():
    _, parsed = compiled()
    owner = parsed.owner
    ref = [{"uid": UID, "controller": True, "kind": "NeuronModel", "name": owner.name}]

    def obj(name: str, **labels: str) -> dict:
        return {"metadata": {"name": name, "ownerReferences": ref, "labels": labels}}

    wanted = builders.build_all(owner, parsed.spec, parsed.chash)
    old_pdb = obj(f"{owner.name}-router-old")
    old_job = obj(names.source_probe(owner.name, "old"), **{f"{builders.LABEL_PREFIX}/compile-hash": "old"})
    observed = Observed(pdbs=[old_pdb], jobs=[old_job])
    writes, drain = planner.stale_deletions(owner, wanted, [], observed, parsed.chash, None, AT)
    assert Delete("PodDisruptionBudget", old_pdb["metadata"]["name"]) in writes
    assert drain is None
    # nothing of the wanted set is deleted
    kept = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    assert not [w for w in writes if (w.kind, w.name) in kept]


def test_a_refused_spec_writes_nothing_but_its_status():
    body = model(neuron={"instanceType": "cpu", "tensorParallel": 3, "batchSize": 4, "sequenceLength": 512,
                         "maxInputLength": 384})  # fmt: skip
    parsed = planner.parse(body)
    assert parsed.errors
    plan = planner.plan(body, parsed, Observed(), AT, Settings())
    assert plan.writes == [] and plan.status["phase"] == "Failed"


def test_reads_outside_the_caches_only_what_a_changed_spec_may_leave_behind():
    body, parsed = compiled()
    body["status"]["observedGeneration"] = 1
    assert planner.reads(parsed, body) == {}  # nothing changed, nothing made
    body["metadata"]["generation"] = 2
    assert set(planner.reads(parsed, body)) == {"InferencePool", "HTTPRoute"}  # a new spec: its gateway kinds


# ---- whole reconciles against a cluster played in memory -------------------------------------------------
# The e2e operator tests (tests/e2e/test_operator_e2e.py) run these cases through kopf, the API server and
# kubectl for the wiring; here each reconcile is `plan` on what a cluster that applied the earlier plans
# holds.


class HeldCluster:
    """What the API server holds after each plan's writes: objects by (kind, name); a Deployment applied is
    rolled out but not ready until `ready()` says so; the model's status is the last plan's."""

    def __init__(self, body: dict) -> None:
        self.body, self.objects, self.events, self.at = body, {}, [], AT

    def later(self, seconds: int) -> None:
        """The clock moved on (a retired entry pod's drain)."""
        at = calendar.timegm(time.strptime(self.at, "%Y-%m-%dT%H:%M:%SZ")) + seconds
        self.at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))

    def observe(self, **extra) -> Observed:
        of = lambda kind: [o for (k, _), o in sorted(self.objects.items()) if k == kind]  # noqa: E731
        name = self.body["metadata"]["name"]
        return Observed(
            deployments=of("Deployment"), services=of("Service"), pdbs=of("PodDisruptionBudget"),
            jobs=of("Job"), service=self.objects.get(("Service", name)),
            network_policies=of("NetworkPolicy"), **extra,
        )  # fmt: skip

    def reconcile(self, **extra) -> planner.Plan:
        parsed = planner.parse(self.body)
        plan = planner.plan(self.body, parsed, self.observe(**extra), self.at, Settings())
        for write in plan.writes:
            if isinstance(write, Apply):
                obj, key = write.obj, (write.obj["kind"], write.obj["metadata"]["name"])
                held = self.objects.get(key)
                if held is not None and obj["kind"] in CREATE_ONLY:
                    continue  # (as `reconcile.apply` does: created once, never patched)
                if obj["kind"] == "Deployment":
                    was_ready = bool(held and held["status"]["readyReplicas"])
                    obj = {**as_cluster_holds(obj, was_ready), "kind": "Deployment"}
                self.objects[key] = json.loads(json.dumps(obj))
            elif isinstance(write, Delete):
                self.objects.pop((write.kind, write.name), None)
        status = {k: v for k, v in plan.status.items() if v is not None}
        self.events += plan.events + transitions(self.body.get("status") or {}, status)
        self.body["status"] = status
        return plan

    def ready(self, name: str) -> None:
        deployment = self.objects[("Deployment", name)]
        deployment["status"]["readyReplicas"] = deployment["spec"]["replicas"]

    def named(self, kind: str) -> set[str]:
        return {n for k, n in self.objects if k == kind}

    def selector(self) -> dict:
        return self.objects[("Service", self.body["metadata"]["name"])]["spec"]["selector"]


def compiled_cluster(**spec) -> HeldCluster:
    body, _ = compiled(**spec)
    body["status"]["observedGeneration"] = 1
    return HeldCluster(body)


def condition(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_a_failed_compile_is_reported_with_its_reason_and_serves_nothing():
    cluster = HeldCluster(model())
    cluster.reconcile()
    assert cluster.named("Job") and not cluster.named("Deployment")  # the compile Job first
    assert ("Normal", "CompileStarted") in {e[:2] for e in cluster.events}
    failed = cluster.reconcile(job=job("failed"), job_pods=[pod_that_ended("the compiler said no")])
    status = failed.status
    assert status["phase"] == "Failed"
    compiled_ = condition(status, "Compiled")
    assert (compiled_["status"], compiled_["reason"]) == ("False", "CompileFailed")
    assert "the compiler said no" in compiled_["message"]
    assert condition(status, "Degraded")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "False"
    assert not cluster.named("Deployment")
    assert ("Warning", "CompileFailed") in {e[:2] for e in cluster.events}


DISAGGREGATED = {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 2},
                 "kvTransfer": {"transport": "tcp"}}  # fmt: skip


def public_roles(cluster: HeldCluster) -> list[str]:
    """The roles whose pods the public NetworkPolicy lets clients reach."""
    policy = cluster.objects[("NetworkPolicy", "smollm2-public")]
    (term,) = policy["spec"]["podSelector"]["matchExpressions"]
    return term["values"]


def test_every_model_gets_its_token_secret_once_and_its_network_policies():
    for serving in ({}, DISAGGREGATED):
        cluster = compiled_cluster(serving=serving) if serving else compiled_cluster()
        cluster.reconcile()
        secret = cluster.objects[("Secret", "smollm2-internal")]
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "NeuronModel"
        deployments = [o for (k, _), o in cluster.objects.items() if k == "Deployment"]
        for d in deployments:  # every pod runs our runtime (engine embedded): each mounts the Secret
            volumes = [v.get("secret") for v in d["spec"]["template"]["spec"]["volumes"]]
            assert {"secretName": "smollm2-internal", "defaultMode": 0o440} in volumes
        assert cluster.named("NetworkPolicy") == {"smollm2-pods", "smollm2-public"}
        assert public_roles(cluster) == ["router"]  # the front door, or the disaggregated set's routers
        cluster.body["spec"]["neuron"]["batchSize"] = 2  # a change; the Secret is not (its token would be)
        cluster.body["metadata"]["generation"] = 2
        cluster.reconcile()
        assert cluster.objects[("Secret", "smollm2-internal")] == secret


def test_network_policies_turned_off_are_deleted_and_the_secret_stays():
    cluster = compiled_cluster()
    cluster.reconcile()
    cluster.ready("smollm2-unified")
    cluster.ready("smollm2-router")
    assert cluster.reconcile().status["phase"] == "Ready"
    cluster.body["spec"]["serving"]["networkPolicy"] = False
    cluster.body["metadata"]["generation"] = 2
    cluster.reconcile()
    assert not cluster.named("NetworkPolicy") and cluster.named("Secret") == {"smollm2-internal"}


def test_a_mode_switch_moves_the_service_only_to_a_ready_set_then_deletes_the_old_one():
    cluster = compiled_cluster()
    cluster.reconcile()
    door = {"smollm2-unified", "smollm2-router"}  # the unified pods and their front door
    for name in door:
        cluster.ready(name)
    assert cluster.reconcile().status["phase"] == "Ready"
    unified = cluster.selector()
    assert (unified["neuronfleet.dev/role"], unified["neuronfleet.dev/set"]) == ("router", "unified")
    # unified -> disaggregated, at the same compile hash (the serving mode is not part of it)
    cluster.body["spec"]["serving"] = DISAGGREGATED
    cluster.body["metadata"]["generation"] = 2
    plan = cluster.reconcile()
    new = cluster.named("Deployment") - door
    roles = {cluster.objects[("Deployment", n)]["metadata"]["labels"]["neuronfleet.dev/role"]: n for n in new}
    assert set(roles) == {"prefill", "decode", "router"}
    written = [(w.obj["kind"]) for w in plan.writes if isinstance(w, Apply)]
    assert written.index("Secret") < written.index("Deployment")  # the token before the pods that read it
    assert written.index("NetworkPolicy") < written.index("Deployment")  # the fence before the pods
    assert plan.status["phase"] == "Rolling" and cluster.selector() == unified
    assert public_roles(cluster) == ["router"]  # both sets' entries are routers
    for role in ("prefill", "decode"):
        cluster.ready(roles[role])
    cluster.reconcile()
    assert cluster.selector() == unified  # the new router is not ready: the Service stays
    assert door <= cluster.named("Deployment")
    pods = [cluster.objects[("Deployment", n)]["spec"]["template"]["spec"] for n in door]
    grace = max(pod["terminationGracePeriodSeconds"] for pod in pods)  # what the old set's pods drain in
    cluster.ready(roles["router"])
    cluster.reconcile()
    set_label = cluster.objects[("Deployment", roles["router"])]["metadata"]["labels"]["neuronfleet.dev/set"]
    assert cluster.selector()["neuronfleet.dev/set"] == set_label
    # the old set's front door retired first; its pods serve what it still holds while it drains
    assert door & cluster.named("Deployment") == {"smollm2-unified"}
    cluster.later(grace + 1)
    cluster.reconcile()
    assert not door & cluster.named("Deployment")  # then the pods
    assert "smollm2-unified" in cluster.named("Service")  # their headless Service after their drain
    cluster.later(grace + 1)
    cluster.reconcile()
    assert "smollm2-unified" not in cluster.named("Service") | cluster.named("PodDisruptionBudget")
    assert public_roles(cluster) == ["router"]
    assert cluster.reconcile().status["phase"] == "Ready"
    # disaggregated -> unified: the old set goes; the model's Secret and NetworkPolicies stay
    cluster.body["spec"]["serving"] = {"mode": "unified", "unified": {"replicas": 1}}
    cluster.body["metadata"]["generation"] = 3
    cluster.reconcile()
    assert cluster.named("Deployment") == new | door
    cluster.ready("smollm2-unified")
    cluster.reconcile()
    assert (
        cluster.selector()["neuronfleet.dev/set"] == set_label
    )  # its front door not ready: the old set serves
    cluster.ready("smollm2-router")
    cluster.reconcile()
    assert cluster.selector() == unified
    assert cluster.named("Deployment") == door | {roles["prefill"], roles["decode"]}  # the router went first
    cluster.reconcile()
    assert len(cluster.named("Deployment")) == 4  # its pods drain (their grace period) before the rest goes
    cluster.later(60)
    cluster.reconcile()
    assert cluster.named("Deployment") == door
    assert cluster.named("Secret") == {"smollm2-internal"}
    assert cluster.named("NetworkPolicy") == {"smollm2-pods", "smollm2-public"}
    assert public_roles(cluster) == ["router"]


def test_scaling_1_3_1_changes_the_replicas_only_the_front_door_serves_throughout():
    cluster = compiled_cluster()
    cluster.reconcile()
    assert cluster.named("Deployment") == {"smollm2-unified", "smollm2-router"}
    assert cluster.selector()["neuronfleet.dev/role"] == "router"  # every unified model's front door
    cluster.ready("smollm2-unified")
    cluster.ready("smollm2-router")
    assert cluster.reconcile().status["phase"] == "Ready"
    templates = {
        n: cluster.objects[("Deployment", n)]["spec"]["template"] for n in cluster.named("Deployment")
    }
    for generation, replicas in ((2, 3), (3, 1)):
        cluster.body["spec"]["serving"]["unified"]["replicas"] = replicas
        cluster.body["metadata"]["generation"] = generation
        cluster.reconcile()
        assert cluster.objects[("Deployment", "smollm2-unified")]["spec"]["replicas"] == replicas
        assert {n: cluster.objects[("Deployment", n)]["spec"]["template"] for n in templates} == templates
        assert cluster.selector()["neuronfleet.dev/role"] == "router"  # never moved: no pod rolled
        cluster.ready("smollm2-unified")
        assert cluster.reconcile().status["phase"] == "Ready"
    assert cluster.named("Deployment") == {"smollm2-unified", "smollm2-router"}
    assert cluster.named("Service") == {"smollm2", "smollm2-unified"}
