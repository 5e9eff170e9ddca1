"""The rollout's decisions as pure functions, table by table: which spec the serving set is built from while
another hash compiles, when the public Service moves to a new set, what is stale once it has, which compile
Jobs are superseded or due for a retry; and the names of a model's children against Kubernetes' limits."""

from __future__ import annotations

import pytest
import yaml
from support import ROOT

from neuronfleet.operator import builders, names, rollout, validation
from neuronfleet.operator.spec import NeuronModelSpec

UID = "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b"
OWNER = builders.Owner("m", "default", UID)
SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"


def spec(**neuron) -> NeuronModelSpec:
    obj = yaml.safe_load(SAMPLE.read_text())["spec"]
    obj["neuron"].update(neuron)
    return NeuronModelSpec.model_validate(obj)


def deployments(s: NeuronModelSpec, chash: str) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o for o in builders.build_serving(OWNER, s, chash) if o["kind"] == "Deployment"
    }


def test_a_change_that_needs_a_compile_leaves_the_deployments_exactly_as_they_are():
    before = spec(batchSize=4)
    h1 = builders.compile_hash(before)
    stored = rollout.compiled_sections(before)
    after = spec(batchSize=2)
    h2 = builders.compile_hash(after)
    assert h1 != h2
    # compiling h2: the set is built from h1's compiled sections: identical objects, so nothing is patched
    while_compiling = rollout.serving_spec(after, stored, h2, h1)
    assert deployments(while_compiling, h1) == deployments(before, h1)
    assert rollout.stored_sections(after, stored, h2, h1) == stored
    # h2 compiled: built from the new spec, once (its template differs: new artifacts and new slots)
    rolled = deployments(rollout.serving_spec(after, stored, h2, h2), h2)
    assert sorted(rolled) == [f"{OWNER.name}-router", f"{OWNER.name}-unified"]  # (the front door)
    dep = rolled[f"{OWNER.name}-unified"]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--slots") + 1] == "2" and cmd[cmd.index("--model") + 1].endswith(
        f"artifacts/{h2}/model"
    )
    assert rollout.stored_sections(after, stored, h2, h2)["neuron"]["batchSize"] == 2


def test_a_change_that_needs_no_compile_rolls_at_once_even_while_another_compiles():
    before = spec(batchSize=4)
    h1, stored = builders.compile_hash(before), rollout.compiled_sections(before)
    after = spec(batchSize=2)
    after.serving.unified.replicas = 3
    after.serving.unified.resources.requests = {"cpu": "2"}
    built = rollout.serving_spec(after, stored, builders.compile_hash(after), h1)
    dep = deployments(built, h1)[builders.deployment_name(OWNER, "unified")]  # (and 3 pods' front door)
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--slots") + 1] == "4"  # still the compiled shapes


def test_a_new_tensor_parallelism_of_a_role_rolls_once_its_compile_has_made_its_graphs():
    """vLLM prefill/decode on Trn2 compile each role's tensor parallelism: a change of decode's is a new
    compile, and until it is done the decode pods keep the one the serving compile made."""
    obj = yaml.safe_load(
        (ROOT / "crds" / "samples" / "llama-3.3-70b-vllm-trn2-disaggregated.yaml").read_text()
    )
    before = NeuronModelSpec.model_validate(obj["spec"])
    h1, stored = builders.compile_hash(before), rollout.compiled_sections(before)
    assert stored[rollout.ROLE_TP] == {"prefill": 16, "decode": None}
    obj["spec"]["serving"]["decode"]["tensorParallel"] = 16
    after = NeuronModelSpec.model_validate(obj["spec"])
    h2 = builders.compile_hash(after)
    assert h2 != h1

    def tp(built: NeuronModelSpec, chash: str, role: str) -> str:
        (dep,) = [d for d in builders.build_serving(OWNER, built, chash) if d["kind"] == "Deployment"
                  and d["metadata"]["labels"]["neuronfleet.dev/role"] == role]  # fmt: skip
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        return cmd[cmd.index("--tensor-parallel-size") + 1]

    assert tp(rollout.serving_spec(after, stored, h2, h1), h1, "decode") == "32"  # the compiled one
    assert tp(rollout.serving_spec(after, stored, h2, h2), h2, "decode") == "16"  # once h2 serves


def test_without_stored_sections_the_current_spec_is_used():
    s = spec(batchSize=2)
    assert rollout.serving_spec(s, None, builders.compile_hash(s), "b" * 16) is s


def dep(name: str, labels: dict, replicas: int = 1, ready: int = 0, status: dict | None = None) -> dict:
    return {
        "kind": "Deployment",
        "metadata": {"name": name, "generation": 2, "labels": labels,
                     "ownerReferences": [{"uid": UID, "controller": True}]},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}}},
        "status": {"readyReplicas": ready, **(status or {})},
    }  # fmt: skip


H = "a" * 16
LABELS = {"neuronfleet.dev/compile-hash": H}
DONE = {"observedGeneration": 2, "updatedReplicas": 2, "replicas": 2}

# name, deployment, (ready, rolled out)
PROGRESS = [
    ("absent", None, (0, False)),
    ("another hash's", dep("d", {"neuronfleet.dev/compile-hash": "b" * 16}, 2, 2, DONE), (0, False)),
    ("rolled out, all ready", dep("d", LABELS, 2, 2, DONE), (2, True)),
    ("its latest spec not seen yet", dep("d", LABELS, 2, 2, {**DONE, "observedGeneration": 1}), (2, False)),
    ("old pods still serve", dep("d", LABELS, 2, 2, {**DONE, "updatedReplicas": 1}), (2, False)),
    ("a surge pod still there", dep("d", LABELS, 2, 2, {**DONE, "replicas": 3}), (2, False)),
    ("a pod not ready", dep("d", LABELS, 2, 1, DONE), (1, False)),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "want"), [c[1:] for c in PROGRESS], ids=[c[0] for c in PROGRESS])
def test_deployment_progress(obj, want):
    assert rollout.deployment_progress(obj, H) == want


UNIFIED = {"neuronfleet.dev/model": "m", "neuronfleet.dev/role": "unified", "neuronfleet.dev/set": "unified"}
NEW_SET = {"neuronfleet.dev/model": "m", "neuronfleet.dev/role": "router", "neuronfleet.dev/set": "r2"}
SERVING = [dep("m-unified", UNIFIED, 1, 1)]

# name, current selector, target ready, deployments, chosen
PUBLIC = [
    ("a first deploy selects the new set at once", None, False, [], NEW_SET),
    ("the set it serves stays until the new one is ready", UNIFIED, False, SERVING, UNIFIED),
    ("then it moves", UNIFIED, True, SERVING, NEW_SET),
    ("a set that is gone is not kept", UNIFIED, False, [], NEW_SET),
    ("a set scaled to zero is not kept", UNIFIED, False, [dep("m-unified", UNIFIED, 0, 0)], NEW_SET),
    ("already there", NEW_SET, False, SERVING, NEW_SET),
]  # fmt: skip


@pytest.mark.parametrize(("current", "ready", "deps", "chosen"), [c[1:] for c in PUBLIC],
                         ids=[c[0] for c in PUBLIC])  # fmt: skip
def test_the_public_service_moves_only_to_a_ready_set(current, ready, deps, chosen):
    assert rollout.public_target(current, NEW_SET, ready, deps) == chosen


def obj(kind: str, name: str, uid: str = UID) -> dict:
    return {"kind": kind, "metadata": {"name": name, "ownerReferences": [{"uid": uid, "controller": True}]}}


def test_stale_objects_are_other_sets_and_roles_never_another_owners():
    observed = [
        obj("Deployment", "m-unified"),
        obj("Deployment", "m-router-r2"),
        obj("Service", "m"),
        obj("Service", "m-prefill-r1"),
        obj("PodDisruptionBudget", "m-unified"),
        obj("NetworkPolicy", "m-internal"),  # an earlier operator's, replaced by m-pods and m-public
        obj("Secret", "m-internal"),  # the model's token: it goes with the model, never before
        obj("Service", "m-prefill-x", uid="someone-else"),
        obj("ConfigMap", "m-runtime-old"),  # not a kind a rollout deletes
    ]
    keep = {("Deployment", "m-router-r2"), ("Service", "m")}
    assert rollout.stale(observed, keep, UID) == [
        ("Deployment", "m-unified"),
        ("NetworkPolicy", "m-internal"),
        ("PodDisruptionBudget", "m-unified"),
        ("Service", "m-prefill-r1"),
    ]


def job(name: str, chash: str, state: str = "", attempt: str | None = None, uid: str = UID) -> dict:
    j = obj("Job", name, uid)
    j["metadata"]["labels"] = {"neuronfleet.dev/compile-hash": chash}
    if attempt is not None:
        j["metadata"]["annotations"] = {builders.ATTEMPT_ANNOTATION: attempt}
    return j


def test_superseded_compile_jobs_are_those_of_other_hashes():
    jobs = [job("m-compile-a", H), job("m-compile-b", "b" * 16), job("x-compile-c", "c" * 16, uid="other")]
    assert rollout.superseded_jobs(jobs, H, UID) == ["m-compile-b"]


# name, job, state, wanted attempt, retry?
RETRIES = [
    ("a running Job", job("j", H, attempt="3/"), "running", "4/", False),
    ("failed, nothing new asked", job("j", H, attempt="3/"), "failed", "3/", False),
    ("failed, then the spec changed", job("j", H, attempt="3/"), "failed", "4/", True),
    ("failed, then annotated neuronfleet.dev/retry", job("j", H, attempt="3/"), "failed", "3/now", True),
    ("failed, annotated again with the same value", job("j", H, attempt="3/now"), "failed", "3/now", False),
    ("no Job", None, "absent", "3/", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("j", "state", "wanted", "due"), [c[1:] for c in RETRIES], ids=[c[0] for c in RETRIES]
)
def test_a_failed_compile_is_retried_when_a_new_attempt_is_asked_for(j, state, wanted, due):
    assert rollout.retry_due(j, state, wanted) is due


def test_the_attempt_is_the_generation_and_the_retry_annotation():
    assert rollout.attempt(3, None) == "3/"
    assert rollout.attempt(3, {"neuronfleet.dev/retry": "2026-11-30", "other": "x"}) == "3/2026-11-30"


# name, model name, error fragment (None: accepted)
NAMES = [
    ("short", "smollm2", None),
    ("the longest that fits", "m" * names.max_model_name(), None),
    ("one more", "m" * (names.max_model_name() + 1), f"at most {names.max_model_name()} fit"),
    ("62 characters: the compile Job would have 81", "m" * 62, "(81 characters) and Kubernetes allows 63"),
    ("a digit first: not a Service name", "2fast", "RFC 1035 label"),
    ("upper case", "S-Bad_Name", "RFC 1035 label"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "error"), [c[1:] for c in NAMES], ids=[c[0] for c in NAMES])
def test_model_names_whose_children_would_break_kubernetes_limits_are_refused(name, error):
    errors = names.name_errors(name)
    assert (not errors) if error is None else (error in errors[0])
    if error is None:  # and every child name indeed fits
        s = spec()
        owner = builders.Owner(name, "default", UID)
        disaggregated = s.model_copy(deep=True)
        disaggregated.serving.mode = "disaggregated"
        disaggregated.serving.prefill = disaggregated.serving.decode = disaggregated.serving.unified
        disaggregated.serving.kvTransfer.transport = "tcp"
        for m in (s, disaggregated):
            for o in builders.build_all(owner, m, "f" * 16, internal_token="t"):
                assert len(o["metadata"]["name"]) <= 63, o["metadata"]["name"]


def test_validate_refuses_the_name_with_the_maximum_length():
    obj = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"]["name"] = "m" * 62
    (error,) = validation.check(obj).errors
    assert f"at most {names.max_model_name()} fit" in error and "its compile Job" in error


def entry(kind: str, name: str, role: str, grace: int = 45) -> dict:
    o = obj(kind, name)
    o["metadata"]["labels"] = {"neuronfleet.dev/role": role}
    o["spec"] = {"template": {"spec": {"terminationGracePeriodSeconds": grace}}}
    return o


OLD_SET = [
    entry("Deployment", "m-router-r1", "router"),
    entry("Deployment", "m-prefill-r1", "prefill"),
    entry("Deployment", "m-decode-r1", "decode"),
    obj("Service", "m-prefill-r1"),
    obj("PodDisruptionBudget", "m-router-r1"),
]
OLD_KEYS = sorted((o["kind"], o["metadata"]["name"]) for o in OLD_SET)
T0, DRAINED = "2026-11-30T01:00:00Z", "2026-11-30T01:00:45Z"

# name, stale objects, drain until (before), now, deleted now, drain until (after)
RETIRE = [
    ("the old router goes first, with its PDB; its peers wait for it to drain", OLD_SET, None, T0,
     [("Deployment", "m-router-r1"), ("PodDisruptionBudget", "m-router-r1")], DRAINED),
    ("while it drains nothing else goes", OLD_SET[1:4], DRAINED, "2026-11-30T01:00:30Z", [], DRAINED),
    ("then the rest", OLD_SET[1:4], DRAINED, DRAINED,
     [("Deployment", "m-decode-r1"), ("Deployment", "m-prefill-r1"), ("Service", "m-prefill-r1")], None),
    ("an old unified Deployment is an entry too", [entry("Deployment", "m-unified", "unified", 10)], None, T0,
     [("Deployment", "m-unified")], "2026-11-30T01:00:10Z"),
    ("nothing entry-like: all at once", [obj("Secret", "m-internal")], None, T0,
     [("Secret", "m-internal")], None),
]  # fmt: skip


def test_a_retired_front_door_goes_before_its_pods_which_stay_while_its_pods_drain():
    """A unified set with its front door: the router alone first; its pods stay while a router pod whose
    Deployment is gone still runs, even in a pass that does not see drain_until yet (read right after the pass
    that wrote it); then, the router pods gone, the unified pods are the entry."""
    door = entry("Deployment", "m-router", "router", 30)
    door["metadata"]["labels"]["neuronfleet.dev/set"] = "unified"
    pods = entry("Deployment", "m-unified", "unified", 50)
    pods["metadata"]["labels"]["neuronfleet.dev/set"] = "unified"
    keys = sorted([("Deployment", "m-router"), ("Deployment", "m-unified"), ("Service", "m-unified")])
    objs = [door, pods, obj("Service", "m-unified")]
    assert rollout.retire(keys, objs, None, T0) == ([("Deployment", "m-router")], "2026-11-30T01:00:30Z")
    draining = {"metadata": {"labels": {"neuronfleet.dev/role": "router", "neuronfleet.dev/set": "unified"}},
                "status": {"phase": "Running"}}  # fmt: skip
    rest = [k for k in keys if k != ("Deployment", "m-router")]
    # (drain_until not seen yet: it looks again in 5 s)
    assert rollout.retire(rest, objs[1:], None, T0, [draining]) == ([], "2026-11-30T01:00:05Z")
    # a pass that sees drain_until deletes nothing before it, even where no router pod is seen (a pod deleted
    # at once, not Terminating: the router's Deployment gone, its pods behind it would count as the entry)
    assert rollout.retire(rest, objs[1:], "2026-11-30T01:00:30Z", "2026-11-30T01:00:10Z", []) == (
        [],
        "2026-11-30T01:00:30Z",
    )
    assert rollout.retire(rest, objs[1:], None, T0, []) == (
        [("Deployment", "m-unified")],
        "2026-11-30T01:00:50Z",
    )  # the router pods gone: the pods drain, then their Service goes


@pytest.mark.parametrize(("objs", "before", "now", "deleted", "after"), [c[1:] for c in RETIRE],
                         ids=[c[0] for c in RETIRE])  # fmt: skip
def test_a_retired_set_goes_entry_first_then_the_rest_after_the_drain(objs, before, now, deleted, after):
    keys = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert rollout.retire(keys, objs, before, now) == (deleted, after)


def failed_job(at: str, retries: int | None = None) -> dict:
    annotations = {} if retries is None else {builders.SOURCE_RETRIES_ANNOTATION: str(retries)}
    condition = {"type": "Failed", "status": "True", "lastTransitionTime": at}
    return {
        "metadata": {"name": "m-compile-x", "annotations": annotations},
        "status": {"conditions": [condition]},
    }


UNREADABLE = "neuronfleet compile: model source unavailable: pvc://models/x.gguf: not found at /models/x.gguf"


@pytest.mark.parametrize(
    ("job", "failure", "at"),
    [
        (failed_job("2026-11-30T10:00:00Z"), UNREADABLE, "2026-11-30T10:00:30Z"),  # 30 s after the failure
        (failed_job("2026-11-30T10:00:00Z", 1), UNREADABLE, "2026-11-30T10:01:00Z"),  # doubling in a row
        (failed_job("2026-11-30T10:00:00Z", 3), UNREADABLE, "2026-11-30T10:04:00Z"),
        (failed_job("2026-11-30T10:00:00Z", 9), UNREADABLE, "2026-11-30T10:10:00Z"),  # at most 10 minutes
        (
            failed_job("2026-11-30T10:00:00Z"),
            "neuronfleet compile: largest decode bucket must equal ...",
            None,
        ),
        (failed_job("2026-11-30T10:00:00Z"), "", None),  # no message: not known to be the source
        (None, UNREADABLE, None),
    ],
    ids=["first", "second", "fourth", "capped", "other failure", "no message", "no job"],
)
def test_a_compile_whose_source_was_unreadable_is_tried_again_later_and_no_other(job, failure, at):
    assert rollout.source_retry_at(job, failure) == at
    assert rollout.source_retries(job) == int(((job or {}).get("metadata", {}).get("annotations") or {}).get(
        builders.SOURCE_RETRIES_ANNOTATION, 0))  # fmt: skip


@pytest.mark.parametrize(
    ("kept", "probed", "changed"),
    [
        (None, "files:1:aa", False),  # the first fingerprint is the baseline
        ("files:1:aa", "files:1:aa", False),
        ("files:1:aa", "files:1:bb", True),  # a file replaced
        ("hf:1234", "hf:5678", True),  # a moved Hub branch
        ("files:1:aa", None, False),  # a probe that failed says nothing
    ],
)
def test_a_failed_compile_runs_again_only_when_its_source_fingerprint_changed(kept, probed, changed):
    assert rollout.source_changed(kept, probed) is changed
    assert rollout.later("2026-11-30T10:00:00Z", rollout.SOURCE_CHECK_SECONDS) == "2026-11-30T10:10:00Z"
