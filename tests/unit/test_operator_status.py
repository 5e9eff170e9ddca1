"""The NeuronModel status as a pure function of what the operator observed, table by table: (validation
errors, compile Job, compile report, serving hash, replicas per role, previous status) -> phase, conditions,
replicas, artifacts, endpoint; the compile Job's state; the compile pod's report; a change's events."""

from __future__ import annotations

import json

import pytest

from neuronfleet.operator.status import (
    CONDITION_TYPES,
    compile_report,
    compute_status,
    job_state,
    pod_problem,
    pod_problems,
    transitions,
)

NEW, OLD = "a" * 16, "b" * 16  # the spec's compile hash, and the one served before it
AT, LATER = "2026-11-30T01:00:00Z", "2026-11-30T02:00:00Z"
ENDPOINT = "http://m.default.svc:8000"
RUNNING = ("running", "compile Job m-compile is running")
FAILED = ("failed", "BackoffLimitExceeded: the compile ran out of memory")
SUCCEEDED = ("succeeded", "")


def status(
    *,
    old=None,
    errors=(),
    serving=None,
    job=("absent", ""),
    roles=None,
    report=None,
    at=AT,
    rolled_out=None,
    live=True,
    serving_now=False,
    failing=None,
    retry_at=None,
    replicas_notice=None,
) -> dict:
    roles = roles or {}
    if rolled_out is None:  # by default: rolled out when every role has its pods ready
        rolled_out = all(r >= d for d, r in roles.values())
    return compute_status(
        old=old or {}, generation=3, errors=list(errors), compile_hash=NEW, serving_hash=serving, job=job,
        roles=roles, rolled_out=rolled_out, live=live, serving_now=serving_now, report=report,
        failing=failing, retry_at=retry_at, endpoint=ENDPOINT, at=at, replicas_notice=replicas_notice,
    )  # fmt: skip


def conditions(s: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


SCALED = "spec.replicas (2, what kubectl scale sets) decides the unified pods; ..."
READY_BEFORE = status(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)})
LOST_ALL = status(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 0)})

# name, inputs, phase, {condition: (status, reason)}
CASES = [
    ("a new model compiles", dict(job=("absent", "")), "Compiling",
     {"Validated": ("True", "Valid"), "Compiled": ("False", "Compiling"), "Ready": ("False", "NotCompiled"),
      "Progressing": ("True", "Compiling"), "Degraded": ("False", "Healthy")}),
    ("its compile Job runs", dict(job=RUNNING), "Compiling",
     {"Compiled": ("False", "Compiling"), "Ready": ("False", "NotCompiled"),
      "Degraded": ("False", "Healthy")}),
    ("its first compile failed: nothing progresses", dict(job=FAILED), "Failed",
     {"Compiled": ("False", "CompileFailed"), "Ready": ("False", "NotCompiled"),
      "Progressing": ("False", "CompileFailed"), "Degraded": ("True", "CompileFailed")}),
    ("compiled, pods starting", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 0)}), "Deploying",
     {"Compiled": ("True", "Compiled"), "Ready": ("False", "Waiting"), "Progressing": ("True", "Deploying"),
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
      "Progressing": ("True", "Recovering")}),
    ("a model that lost all its pods stays Degraded on the next passes",
     dict(old=LOST_ALL, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 0)}), "Degraded",
     {"Ready": ("False", "Waiting"), "Degraded": ("True", "ReplicasUnavailable")}),
    ("a scale-up is not a loss", dict(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (3, 2)},
                                      serving_now=True), "Rolling",
     {"Ready": ("False", "Waiting"), "Degraded": ("False", "Healthy"), "Progressing": ("True", "Rolling")}),
    ("a scale-down is not a loss",
     dict(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)}),
     "Ready", {"Degraded": ("False", "Healthy")}),
    ("a pod short, never ready before", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)}),
     "Deploying", {"Degraded": ("False", "Healthy")}),
    ("a spec change compiles while the old hash serves: Rolling, not Ready",
     dict(old=READY_BEFORE, serving=OLD, job=RUNNING, roles={"unified": (2, 2)}, serving_now=True), "Rolling",
     {"Compiled": ("False", "Compiling"), "Ready": ("True", "AllReplicasReady"),
      "Progressing": ("True", "Compiling"), "Degraded": ("False", "Healthy")}),
    ("a spec change fails to compile while the old hash serves",
     dict(old=READY_BEFORE, serving=OLD, job=FAILED, roles={"unified": (2, 2)}, serving_now=True), "Degraded",
     {"Compiled": ("False", "CompileFailed"), "Ready": ("True", "AllReplicasReady"),
      "Progressing": ("False", "CompileFailed"), "Degraded": ("True", "CompileFailed")}),
    ("a new set starts while the old one serves",
     dict(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"prefill": (1, 0), "decode": (1, 0),
          "router": (1, 0)}, rolled_out=False, live=False, serving_now=True), "Rolling",
     {"Ready": ("False", "Waiting"), "Progressing": ("True", "Rolling"), "Degraded": ("False", "Healthy")}),
    ("the new set is ready but the Service has not moved yet",
     dict(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"router": (1, 1)}, live=False,
          serving_now=True),
     "Rolling", {"Ready": ("False", "Waiting")}),
    ("disaggregated, one role short", dict(serving=NEW, job=SUCCEEDED,
                                           roles={"prefill": (1, 1), "decode": (2, 1), "router": (1, 1)}),
     "Deploying", {"Ready": ("False", "Waiting")}),
    ("disaggregated, all roles ready", dict(serving=NEW, job=SUCCEEDED,
                                            roles={"prefill": (1, 1), "decode": (2, 2), "router": (1, 1)}),
     "Ready", {"Ready": ("True", "AllReplicasReady")}),
    ("an invalid spec", dict(errors=["tensorParallel 3 is not a documented degree"]), "Failed",
     {"Validated": ("False", "Invalid"), "Progressing": ("False", "Invalid")}),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "phase", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_phase_and_conditions(inputs, phase, expected):
    s = status(**inputs)
    assert s["phase"] == phase
    got = conditions(s)
    assert {t: got[t] for t in expected} == expected
    assert s["observedGeneration"] == 3 and all(c["observedGeneration"] == 3 for c in s["conditions"])
    assert all(c["message"] for c in s["conditions"]), "every condition says why"
    if phase in ("Failed", "Degraded"):  # a model in trouble says why, and does not claim progress
        assert got["Validated"][0] == "False" or got["Degraded"][0] == "True"
        assert got["Progressing"][0] == "False" or got["Degraded"][1] == "ReplicasUnavailable"


def test_every_condition_is_reported_in_a_fixed_order():
    for _, inputs, *_ in CASES:
        if not inputs.get("errors"):
            assert tuple(c["type"] for c in status(**inputs)["conditions"]) == CONDITION_TYPES


# name, inputs, readyReplicas, replicas
COUNTS = [
    ("nothing compiled yet", dict(job=RUNNING), "0/0", {}),
    ("more ready than desired counts as desired", dict(serving=NEW, job=SUCCEEDED, roles={"unified": (2, 3)}),
     "2/2", {"unified": {"desired": 2, "ready": 2, "reached": 2}}),
    ("summed over roles", dict(serving=NEW, job=SUCCEEDED, roles={"prefill": (1, 0), "decode": (2, 1)}),
     "1/3",
     {"prefill": {"desired": 1, "ready": 0, "reached": 0},
      "decode": {"desired": 2, "ready": 1, "reached": 1}}),
    ("a set that is not live yet has reached nothing",
     dict(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1), "router": (1, 1)}, live=False), "1/1",
     {"unified": {"desired": 1, "ready": 1, "reached": 0},
      "router": {"desired": 1, "ready": 1, "reached": 0}}),
    ("routers serve no model: not counted (their pods beside a unified pod that is not ready)",
     dict(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0), "router": (1, 1)}), "0/1",
     {"unified": {"desired": 1, "ready": 0, "reached": 0},
      "router": {"desired": 1, "ready": 1, "reached": 1}}),
    ("a disaggregated model's router is not counted either",
     dict(serving=NEW, job=SUCCEEDED, roles={"prefill": (1, 1), "decode": (1, 1), "router": (1, 1)}),
     "2/2",
     {"prefill": {"desired": 1, "ready": 1, "reached": 1}, "decode": {"desired": 1, "ready": 1, "reached": 1},
      "router": {"desired": 1, "ready": 1, "reached": 1}}),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "ready", "replicas"), [c[1:] for c in COUNTS], ids=[c[0] for c in COUNTS])
def test_replica_counts(inputs, ready, replicas):
    s = status(**inputs)
    assert s["readyReplicas"] == ready and s["replicas"] == replicas


def test_a_router_not_ready_keeps_the_model_from_ready_and_says_so():
    s = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1), "router": (1, 0)}, rolled_out=False)
    ready = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert (ready["status"], s["readyReplicas"]) == ("False", "1/1")
    assert ready["message"] == "1/1 pods ready; router 0/1 ready"


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


def test_the_serving_spec_is_kept_with_the_hash_it_compiled():
    sections = {"neuron": {"batchSize": 2}}
    served = compute_status(
        old={}, generation=1, errors=[], compile_hash=NEW, serving_hash=NEW, job=SUCCEEDED,
        roles={"unified": (1, 1)}, serving_spec=sections, endpoint=ENDPOINT, at=AT,
    )  # fmt: skip
    assert served["servingSpec"] == sections and served["compileHash"] == NEW
    assert "servingSpec" not in status(job=RUNNING)  # nothing serves: nothing to keep


def test_an_invalid_spec_keeps_the_last_hash_and_the_other_conditions():
    before = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)})
    s = status(old={**before, "compileHash": NEW}, errors=["a", "b"], at=LATER)
    assert s["compileHash"] == NEW and s["observedGeneration"] == 3
    validated, *rest, progressing = s["conditions"]
    assert validated["message"] == "a; b" and validated["lastTransitionTime"] == LATER
    assert rest == [c for c in before["conditions"] if c["type"] not in ("Validated", "Progressing")]
    assert (progressing["type"], progressing["status"]) == ("Progressing", "False")


def test_a_condition_keeps_its_transition_time_until_its_status_changes():
    first = status(job=RUNNING, at=AT)
    same = status(old=first, job=RUNNING, at=LATER)
    assert [c["lastTransitionTime"] for c in same["conditions"]] == [AT] * 5
    ready = status(old=same, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)}, at=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Validated": AT, "Compiled": LATER, "Ready": LATER, "Progressing": LATER, "Degraded": AT}


COMPILING = status(job=RUNNING)
ROLLING = status(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0), "router": (1, 0)},
                 rolled_out=False, live=False, serving_now=True)  # fmt: skip
NEXT = compute_status(
    old=READY_BEFORE, generation=4, errors=[], compile_hash=OLD, serving_hash=NEW, job=RUNNING,
    roles={"unified": (2, 2)}, serving_now=True, endpoint=ENDPOINT, at=AT,
)  # fmt: skip

# name, old status, new status, events
EVENTS = [
    ("nothing changed", READY_BEFORE, READY_BEFORE, []),
    ("the first status: a compile starts", {}, COMPILING,
     [("Normal", "CompileStarted", f"compiling {NEW}: compile Job m-compile is running")]),
    ("still compiling: no event", COMPILING, status(old=COMPILING, job=RUNNING), []),
    ("compiled and rolled out", COMPILING, READY_BEFORE,
     [("Normal", "Compiled", f"artifacts/{NEW}/ is complete"),
      ("Normal", "RolledOut", f"2/2 pods ready; serving artifacts/{NEW}/")]),
    ("a cache hit", COMPILING, status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)},
                                      report={"cacheHit": True}),
     [("Normal", "CacheHit", f"artifacts/{NEW}/ existed already: nothing was compiled"),
      ("Normal", "RolledOut", f"1/1 pods ready; serving artifacts/{NEW}/")]),
    ("a change compiles while the old hash serves", READY_BEFORE, NEXT,
     [("Normal", "CompileStarted", f"compiling {OLD}: compile Job m-compile is running")]),
    ("a new set rolls", READY_BEFORE, ROLLING,
     [("Normal", "Rolling", f"0/1 pods of artifacts/{NEW}/ ready")]),
    ("the compile failed", COMPILING, status(old=COMPILING, job=FAILED),
     [("Warning", "CompileFailed", f"compile of {NEW} failed: {FAILED[1]}")]),
    ("pods lost", READY_BEFORE, LOST_ALL,
     [("Warning", "ReplicasUnavailable", "pods lost: unified 0/2 ready")]),
    ("pods back", LOST_ALL, status(old=LOST_ALL, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)}),
     [("Normal", "RolledOut", f"2/2 pods ready; serving artifacts/{NEW}/"),
      ("Normal", "Recovered", "2/2 pods ready")]),
    ("kubectl scale", READY_BEFORE,
     status(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)}, replicas_notice=SCALED),
     [("Normal", "ReplicasFromScale", f"the spec fits its instance type; {SCALED}")]),
    ("refused", READY_BEFORE,
     status(old=READY_BEFORE, errors=["tensorParallel 3 is not a documented degree"]),
     [("Warning", "Refused", "tensorParallel 3 is not a documented degree")]),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "events"), [c[1:] for c in EVENTS], ids=[c[0] for c in EVENTS])
def test_events_say_progress_as_normal_and_only_problems_as_warnings(old, new, events):
    got = transitions(old, new)
    assert got == events
    assert all(message for _, _, message in got)


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


# ---- pods that will not become ready ---------------------------------------------------------------------


def pod(name="m-unified-7c9-x", role="unified", ready=False, deleting=False, phase="Running", **container):
    """A pod as the kubelet reports it (containerStatuses as in the core/v1 API)."""
    meta = {"name": name, "labels": {"neuronfleet.dev/role": role}}
    if deleting:
        meta["deletionTimestamp"] = AT
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if "scheduled" in container:
        conditions.append(container.pop("scheduled"))
    statuses = [{"name": "server", "restartCount": 0, "state": {"running": {}}, **container}] if container \
        else []  # fmt: skip
    return {
        "metadata": meta,
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses},
    }


CRASHING = dict(
    restartCount=4,
    state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
    lastState={"terminated": {"exitCode": 2, "reason": "Error", "message":
        "Traceback...\nneuronfleet: error: model folder /var/cache/neuronfleet/artifacts/a/model "
        "does not exist\n"}},
)  # fmt: skip


@pytest.mark.parametrize(
    "observed, problem",
    [
        (
            pod(**CRASHING),
            "pod m-unified-7c9-x is crash-looping (4 restarts; last exit code 2: neuronfleet: "
            "error: model folder /var/cache/neuronfleet/artifacts/a/model does not exist)",
        ),
        (
            pod(state={"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}}),
            'pod m-unified-7c9-x: ImagePullBackOff: Back-off pulling image "x:1"',
        ),
        (
            pod(
                scheduled={
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient aws.amazon.com/neuroncore.",
                }
            ),
            "pod m-unified-7c9-x cannot be scheduled: 0/3 nodes are available: 3 Insufficient "
            "aws.amazon.com/neuroncore.",
        ),
        (pod(state={"waiting": {"reason": "ContainerCreating"}}), None),  # starting: give it time
        (pod(restartCount=1, state={"running": {}}), None),  # restarted once, running again: not stuck
        (pod(ready=True, **CRASHING), None),  # (a ready pod is fine whatever its history)
        (pod(deleting=True, **CRASHING), None),  # going anyway
        (pod(phase="Succeeded"), None),
    ],
    ids=["crash loop", "image", "unschedulable", "creating", "restarted once", "ready", "deleting", "done"],
)
def test_a_pod_that_will_not_become_ready_says_why(observed, problem):
    assert pod_problem(observed) == problem


def test_pod_problems_skip_compile_pods_and_name_at_most_three():
    pods = [pod(name=f"m-unified-{i}", **CRASHING) for i in range(5)] + [pod(role="compile", **CRASHING)]
    found = pod_problems(pods)
    assert len(found) == 4 and found[-1] == "and 2 more"
    assert all("m-unified-" in p for p in found[:3])


def test_pods_that_will_not_start_make_the_model_degraded_with_a_warning_that_says_why():
    problem = pod_problem(pod(**CRASHING))
    deploying = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0)})
    stuck = status(old=deploying, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0)}, failing=[problem])
    assert stuck["phase"] == "Degraded"
    assert conditions(stuck)["Degraded"] == ("True", "PodsFailing")
    assert conditions(stuck)["Progressing"] == ("True", "Recovering")
    degraded = next(c for c in stuck["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == problem
    assert transitions(deploying, stuck) == [("Warning", "PodsFailing", problem)]
    # more restarts: the message follows, but no second Warning for the same problem
    again = status(old=stuck, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0)},
                   failing=[problem.replace("4 restarts", "5 restarts")])  # fmt: skip
    assert transitions(stuck, again) == []
    # fixed: the pod became ready
    fixed = status(old=again, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)})
    assert fixed["phase"] == "Ready"
    assert ("Normal", "Recovered", "1/1 pods ready") in transitions(again, fixed)


def test_new_pods_failing_while_the_old_ones_serve_keep_the_model_rolling_with_a_warning():
    problem = pod_problem(pod(**CRASHING))
    ready = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)})
    # the Deployment rolls in place: the old pod stays ready (maxUnavailable 0), the new one crash-loops
    rolling = status(old=ready, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1)}, rolled_out=False,
                     serving_now=True, failing=[problem])  # fmt: skip
    assert rolling["phase"] == "Rolling"
    assert conditions(rolling)["Degraded"] == ("True", "PodsFailing")
    assert ("Warning", "PodsFailing", problem) in transitions(ready, rolling)


def test_lost_pods_whose_replacements_will_not_start_say_both():
    problem = pod_problem(pod(**CRASHING))
    lost = status(old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)})
    assert conditions(lost)["Degraded"] == ("True", "ReplicasUnavailable")
    stuck = status(old=lost, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 1)}, failing=[problem])
    degraded = next(c for c in stuck["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == (
        "PodsFailing",
        f"pods lost: unified 1/2 ready; {problem}",
    )
    assert transitions(lost, stuck) == [("Warning", "PodsFailing", degraded["message"])]


def test_a_failed_compile_says_the_compiles_own_error_and_when_an_unreadable_source_is_tried_again():
    from neuronfleet.operator.rollout import source_retry_at
    from neuronfleet.operator.status import compile_failure

    def compile_pod(exit_code, message, finished):
        terminated = {"exitCode": exit_code, "message": message, "finishedAt": finished}
        return {"status": {"containerStatuses": [{"state": {"terminated": terminated}}]}}

    pods = [
        compile_pod(1, "Traceback\nneuronfleet compile: model source unavailable: pvc://m/x: not found", AT),
        compile_pod(1, "neuronfleet compile: model source unavailable: pvc://m/x: not found at /m/x", LATER),
        compile_pod(0, '{"engine": "embedded"}', LATER),  # (a report, not a failure)
    ]
    assert (
        compile_failure(pods) == "neuronfleet compile: model source unavailable: pvc://m/x: not found at /m/x"
    )
    assert compile_failure([compile_pod(0, "{}", AT)]) == ""
    # a Hub that cannot be reached: huggingface_hub's error spans lines, and the words retried on stay
    hub = (
        "neuronfleet compile: model source unavailable: hf://org/m: LocalEntryNotFoundError: Got: "
        "ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to locate the "
        "files on the Hub. Please check your internet connection and try again.\n"
    )
    words = compile_failure([compile_pod(2, hub, AT)])
    assert words.startswith("neuronfleet compile: model source unavailable: hf://org/m: ") and words.endswith(
        "; An error happened while trying to locate the files on the Hub. Please check your internet "
        "connection and try again."
    )
    failed = {"metadata": {"name": "m-compile-x"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}  # fmt: skip
    assert source_retry_at(failed, words) == "2026-01-01T00:00:30Z"  # retried after 30 s, doubling
    retrying = status(job=FAILED, retry_at=LATER)
    assert retrying["compileRetryAt"] == LATER
    assert "compiling again at " + LATER in next(
        c["message"] for c in retrying["conditions"] if c["type"] == "Progressing"
    )
    assert status(job=FAILED)["compileRetryAt"] is None


def test_once_said_which_replica_count_decides_it_is_not_said_again():
    scaled = status(
        old=READY_BEFORE, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)}, replicas_notice=SCALED
    )
    assert conditions(scaled)["Validated"] == ("True", "ReplicasFromScale")
    again = status(old=scaled, serving=NEW, job=SUCCEEDED, roles={"unified": (2, 2)}, replicas_notice=SCALED)
    assert transitions(scaled, again) == []


def test_pods_stopped_together_start_as_a_deploy_not_a_loss():
    """Local mode's `down` stops every pod, `up` starts them again: the status it leaves for the operator
    counts none ready nor reached, so the first pass reports a deploy and no ReplicasUnavailable Warning."""
    from neuronfleet.operator.status import pods_stopped

    before = status(serving=NEW, job=SUCCEEDED, roles={"unified": (1, 1), "router": (1, 1)})
    assert before["phase"] == "Ready" and before["readyReplicas"] == "1/1"
    stopped = pods_stopped(before)
    assert stopped["readyReplicas"] == "0/1"
    assert stopped["replicas"] == {"unified": {"desired": 1, "ready": 0, "reached": 0},
                                   "router": {"desired": 1, "ready": 0, "reached": 0}}  # fmt: skip
    starting = status(old=stopped, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0), "router": (1, 0)},
                      rolled_out=False)  # fmt: skip
    assert starting["phase"] == "Deploying" and starting["readyReplicas"] == "0/1"
    assert not [e for e in transitions(stopped, starting) if e[0] == "Warning"]
    lost = status(old=before, serving=NEW, job=SUCCEEDED, roles={"unified": (1, 0), "router": (1, 0)},
                  rolled_out=False)  # fmt: skip
    assert ("Warning", "ReplicasUnavailable") in [e[:2] for e in transitions(before, lost)]  # (a real loss)
    assert pods_stopped({"phase": "Compiling"}) == {"phase": "Compiling"}
