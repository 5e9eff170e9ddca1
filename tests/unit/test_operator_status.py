"""The NeuronModel status as a pure function of what the operator observed, table by table: (validation
errors, compile Job, compile report, serving hash, replicas per role, previous status) -> phase, conditions,
replicas, artifacts, endpoint; the compile Job's state; the compile pod's report; a change's events."""

from __future__ import annotations

import json

import pytest

from neuronfleet.operator.status import (
    CONDITION_TYPES,
    FAILURE_REASONS,
    compile_report,
    compute_status,
    job_state,
    transitions,
)

NEW, OLD = "a" * 16, "b" * 16  # the spec's compile hash, and the one served before it
AT, LATER = "2026-11-30T01:00:00Z", "2026-11-30T02:00:00Z"
ENDPOINT = "http://m.default.svc:8000"
RUNNING = ("running", "compile Job m-compile is running")
FAILED = ("failed", "BackoffLimitExceeded: the compile ran out of memory")
SUCCEEDED = ("succeeded", "")


def status(*, old=None, errors=(), serving=None, job=("absent", ""), roles=None, report=None, at=AT) -> dict:
    return compute_status(
        old=old or {}, generation=3, errors=list(errors), compile_hash=NEW, serving_hash=serving, job=job,
        roles=roles or {}, report=report, endpoint=ENDPOINT, at=at,
    )  # fmt: skip


def conditions(s: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


READY_BEFORE = status(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)})

# name, inputs, phase, {condition: (status, reason)}
CASES = [
    ("a new model compiles", dict(job=("absent", "")), "Compiling",
     {"Validated": ("True", "Valid"), "Compiled": ("False", "Compiling"), "Ready": ("False", "NotCompiled"),
      "Progressing": ("True", "Rolling"), "Degraded": ("False", "Healthy")}),
    ("its compile Job runs", dict(job=RUNNING), "Compiling",
     {"Compiled": ("False", "Compiling"), "Ready": ("False", "NotCompiled"),
      "Degraded": ("False", "Healthy")}),
    ("its first compile failed", dict(job=FAILED), "Failed",
     {"Compiled": ("False", "CompileFailed"), "Ready": ("False", "NotCompiled"),
      "Degraded": ("True", "CompileFailed")}),
    ("compiled, pods starting", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 0)}), "Deploying",
     {"Compiled": ("True", "Compiled"), "Ready": ("False", "Waiting"), "Progressing": ("True", "Rolling"),
      "Degraded": ("False", "Healthy")}),
    ("compiled, every pod ready", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)}), "Ready",
     {"Validated": ("True", "Valid"), "Compiled": ("True", "Compiled"), "Ready": ("True", "AllReplicasReady"),
      "Progressing": ("False", "Stable"), "Degraded": ("False", "Healthy")}),
    ("another model had compiled it", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)},
                                           report={"cacheHit": True}), "Ready",
     {"Compiled": ("True", "CacheHit"), "Ready": ("True", "AllReplicasReady")}),
    ("a ready model loses a pod",
     dict(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)}), "Degraded",
     {"Ready": ("False", "Waiting"), "Degraded": ("True", "ReplicasUnavailable"),
      "Progressing": ("True", "Rolling")}),
    ("a pod short, never ready before", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)}),
     "Deploying", {"Degraded": ("False", "Healthy")}),
    ("a spec change compiles while the old hash serves", dict(old=READY_BEFORE, serving=OLD, job=RUNNING,
                                                              roles={"unified": (2, 2)}), "Deploying",
     {"Compiled": ("False", "Compiling"), "Ready": ("True", "AllReplicasReady"),
      "Progressing": ("True", "Rolling"), "Degraded": ("False", "Healthy")}),
    ("a spec change fails to compile while the old hash serves",
     dict(old=READY_BEFORE, serving=OLD, job=FAILED, roles={"unified": (2, 2)}), "Degraded",
     {"Compiled": ("False", "CompileFailed"), "Ready": ("True", "AllReplicasReady"),
      "Degraded": ("True", "CompileFailed")}),
    ("disaggregated, one role short", dict(serving=NEW, job=SUCCEEDED,
                                           roles={"prefill": (1, 1), "decode": (2, 1), "router": (1, 1)}),
     "Deploying", {"Ready": ("False", "Waiting")}),
    ("disaggregated, all roles ready", dict(serving=NEW, job=SUCCEEDED,
                                            roles={"prefill": (1, 1), "decode": (2, 2), "router": (1, 1)}),
     "Ready", {"Ready": ("True", "AllReplicasReady")}),
    ("an invalid spec", dict(errors=["tensorParallel 3 is not a documented degree"]), "Failed",
     {"Validated": ("False", "Invalid")}),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "phase", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_phase_and_conditions(inputs, phase, expected):
    s = status(**inputs)
    assert s["phase"] == phase
    got = conditions(s)
    assert {t: got[t] for t in expected} == expected
    assert s["observedGeneration"] == 3 and all(c["observedGeneration"] == 3 for c in s["conditions"])
    if phase in ("Failed", "Degraded"):  # a model in trouble says why, with one of the failure reasons
        assert {reason for _, reason in got.values()} & FAILURE_REASONS


def test_every_condition_is_reported_in_a_fixed_order():
    for _, inputs, *_ in CASES:
        if not inputs.get("errors"):
            assert tuple(c["type"] for c in status(**inputs)["conditions"]) == CONDITION_TYPES


# name, inputs, readyReplicas, replicas
COUNTS = [
    ("nothing compiled yet", dict(job=RUNNING), "0/0", {}),
    ("more ready than desired counts as desired", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 3)}),
     "2/2", {"unified": {"desired": 2, "ready": 2}}),
    ("summed over roles", dict(serving=NEW, job=SUCCEEDED, roles={"prefill": (1, 0), "decode": (2, 1)}),
     "1/3",
     {"prefill": {"desired": 1, "ready": 0}, "decode": {"desired": 2, "ready": 1}}),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "ready", "replicas"), [c[1:] for c in COUNTS], ids=[c[0] for c in COUNTS])
def test_replica_counts(inputs, ready, replicas):
    s = status(**inputs)
    assert s["readyReplicas"] == ready and s["replicas"] == replicas


def test_artifacts_endpoint_and_hash_appear_once_something_serves():
    compiling = status(job=RUNNING)
    assert compiling["compileHash"] is None and "artifacts" not in compiling and "endpoint" not in compiling
    report = {"bytes": 1234, "compiledAt": AT, "cacheHit": False, "other": "ignored"}
    served = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)}, report=report)
    assert served["compileHash"] == NEW and served["endpoint"] == ENDPOINT
    artifacts = {"path": f"artifacts/{NEW}/", "bytes": 1234, "compiledAt": AT, "cacheHit": False}
    assert served["artifacts"] == artifacts
    # a later pass without the report (its pod is gone) keeps what the status already says about the same path
    again = status(old=served, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)})
    assert again["artifacts"] == served["artifacts"]
    # while a new hash compiles, the artifacts are the served ones
    rolling = status(old=served, serving=OLD, job=RUNNING, roles={"unified": (1, 1)})
    assert rolling["artifacts"] == {"path": f"artifacts/{OLD}/"} and rolling["compileHash"] == OLD


def test_an_invalid_spec_keeps_the_last_hash_and_the_other_conditions():
    before = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)})
    s = status(old={**before, "compileHash": NEW}, errors=["a", "b"], at=LATER)
    assert s["compileHash"] == NEW and s["observedGeneration"] == 3
    validated, *rest = s["conditions"]
    assert validated["message"] == "a; b" and validated["lastTransitionTime"] == LATER
    assert rest == [c for c in before["conditions"] if c["type"] != "Validated"]


def test_a_condition_keeps_its_transition_time_until_its_status_changes():
    first = status(job=RUNNING, at=AT)
    same = status(old=first, job=RUNNING, at=LATER)
    assert [c["lastTransitionTime"] for c in same["conditions"]] == [AT] * 5
    ready = status(old=same, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)}, at=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Validated": AT, "Compiled": LATER, "Ready": LATER, "Progressing": LATER, "Degraded": AT}


# name, old status, new status, events
EVENTS = [
    ("nothing changed", READY_BEFORE, READY_BEFORE, []),
    ("the first status", {}, status(job=RUNNING),
     [("Normal", "Valid", "the spec fits its instance type"),
      ("Warning", "Compiling", "compile Job m-compile is running"),
      ("Warning", "NotCompiled", "0/0 pods ready"), ("Normal", "Rolling", "compiling or rolling out"),
      ("Normal", "Healthy", "")]),
    ("ready", status(job=RUNNING), READY_BEFORE,
     [("Normal", "Compiled", f"artifacts/{NEW}/ is complete"),
      ("Normal", "AllReplicasReady", "2/2 pods ready"),
      ("Warning", "Stable", "up to date")]),
    ("degraded", READY_BEFORE,
     status(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)}),
     [("Warning", "Waiting", "1/2 pods ready"), ("Normal", "Rolling", "compiling or rolling out"),
      ("Warning", "ReplicasUnavailable", "1/2 pods ready")]),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "events"), [c[1:] for c in EVENTS], ids=[c[0] for c in EVENTS])
def test_transitions_emit_one_event_per_changed_condition(old, new, events):
    assert transitions(old, new) == events


# name, Job, state
JOBS = [
    ("no Job", None, ("absent", "")),
    ("no status yet", {"metadata": {"name": "j"}}, ("running", "compile Job j is running")),
    ("complete", {"metadata": {"name": "j"}, "status": {"conditions": [
        {"type": "Complete", "status": "True", "message": "done"}]}}, ("succeeded", "done")),
    ("succeeded without conditions", {"metadata": {"name": "j"}, "status": {"succeeded": 1}},
     ("succeeded", "")),
    ("failed", {"metadata": {"name": "j"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too slow"}]}},
     ("failed", "DeadlineExceeded: too slow")),
    ("a condition not true yet", {"metadata": {"name": "j"}, "status": {"conditions": [
        {"type": "Failed", "status": "False"}]}}, ("running", "compile Job j is running")),
]  # fmt: skip


@pytest.mark.parametrize(("job", "state"), [c[1:] for c in JOBS], ids=[c[0] for c in JOBS])
def test_compile_job_state(job, state):
    assert job_state(job) == state


def pod(message: str | None) -> dict:
    terminated = {"exitCode": 0} if message is None else {"exitCode": 0, "message": message}
    return {"status": {"containerStatuses": [{"name": "compile", "state": {"terminated": terminated}}]}}


# name, pods, report
REPORTS = [
    ("no pod", [], None),
    ("a pod still running", [{"status": {"containerStatuses": [{"state": {"running": {}}}]}}], None),
    ("no message", [pod(None)], None),
    ("not JSON", [pod("Killed")], None),
    ("JSON but not an object", [pod("[1, 2]")], None),
    ("the manifest", [pod(json.dumps({"bytes": 5, "cacheHit": True}))], {"bytes": 5, "cacheHit": True}),
    ("the first pod with one", [pod("oops"), pod('{"bytes": 7}')], {"bytes": 7}),
]  # fmt: skip


@pytest.mark.parametrize(("pods", "report"), [c[1:] for c in REPORTS], ids=[c[0] for c in REPORTS])
def test_compile_report(pods, report):
    assert compile_report(pods) == report
