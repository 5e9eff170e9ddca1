"""The operator at scale and at its edges, against the emulated API server (no kubelet: the test marks compile
Jobs complete itself) with its audit log: a few hundred models settle, then cost no requests while idle; a
deleted or edited child is repaired within 2 s; a kill -9 mid-way leaves no duplicates; two models whose
children share a name do not fight over it (the second reports a Conflict); deleting a model needs no
operator; SIGTERM stops the operator with exit status 0 and no traceback."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable

import pytest
import yaml
from support import (
    OPERATOR_USER,
    ROOT,
    OperatorCluster,
    Process,
    wait_until,
)

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"  # no kubelet here: the test plays it
MODELS = 300
IDLE_WINDOW = 30.0  # seconds of idle the test counts the operator's requests over
READS_PER_MODEL_PER_5_MIN = 1  # the target
REPAIR_SECONDS = 2.0  # the target for any deleted or edited child
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
NM = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels"
PATHS = {
    "Job": "/apis/batch/v1/namespaces/default/jobs",
    "Deployment": "/apis/apps/v1/namespaces/default/deployments",
    "Service": "/api/v1/namespaces/default/services",
    "ConfigMap": "/api/v1/namespaces/default/configmaps",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
    "PersistentVolumeClaim": "/api/v1/namespaces/default/persistentvolumeclaims",
}


class Cluster(OperatorCluster):
    """The emulated API server with the CRD and an audit log; operators run as their own user (the audit log
    tells their calls from the test's); plain HTTP for the test's own bulk calls."""

    def wait_for(self, what: str, check: Callable[[], object], interval: float = 0.1) -> object:
        """Wait while the newest operator lives and works (`interval`: between checks; a LIST of hundreds of
        objects costs the API server more than one of a handful)."""
        return self.operators[-1].wait_until(check, what, interval=interval)

    def stop_operator(self, operator: Process) -> None:
        """SIGTERM: the operator exits 0, and its log has no traceback."""
        rc = operator.stop()
        assert rc == 0, operator.output()[-3000:]
        assert "Traceback" not in operator.output(), operator.output()[-3000:]

    # ---- HTTP ----

    def items(self, kind: str, selector: str = "neuronfleet.dev/model") -> list[dict]:
        return self.call("GET", f"{PATHS[kind]}?labelSelector={selector}")["items"]

    def audit(self, leases: bool = False) -> list[dict]:
        """The operator's calls; without its Lease's (leader election: a GET and a PUT every 2 s, whatever
        the models), unless `leases`."""
        lines = (self.state / "audit.jsonl").read_text().splitlines()
        calls = [c for c in map(json.loads, lines) if c["user"] == OPERATOR_USER]
        return calls if leases else [c for c in calls if c["resource"] != "leases"]


@pytest.fixture()
def cluster(tmp_path):
    api = Cluster(tmp_path)
    yield api
    api.stop()


def model(name: str, **serving) -> dict:
    obj = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"] = {"name": name, "namespace": "default"}
    # two pods routed by load, behind the front door every unified model has (its router Deployment and the
    # pods' headless Service)
    obj["spec"]["serving"] = serving or {"unified": {"replicas": 2}, "routing": {"policy": "least-loaded"}}
    return obj


def complete(api: Cluster, job: str) -> None:
    status = {
        "succeeded": 1,
        "conditions": [
            {"type": "Complete", "status": "True", "reason": "Emulated", "message": "by the test"}
        ],
    }
    api.call("PATCH", f"{PATHS['Job']}/{job}/status", {"status": status}, "application/merge-patch+json")


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def all_ready(obj: dict) -> bool:
    ready, _, desired = (obj.get("status") or {}).get("readyReplicas", "0/").partition("/")
    return ready == desired


def repaired(api: Cluster, kind: str, name: str, done: Callable[[dict | None], bool]) -> float:
    """Seconds until `done(the object)` holds, polled every 10 ms (the operator is given up to a minute)."""
    started = time.monotonic()
    while not done(api.call("GET", f"{PATHS[kind]}/{name}")):
        assert time.monotonic() - started < 60, f"{kind} {name} was not repaired in a minute"
        time.sleep(0.01)
    return time.monotonic() - started


def test_hundreds_of_models_settle_cost_nothing_idle_repair_drift_fast_and_survive_kill_9(cluster):
    api = cluster
    operator = api.start_operator()
    names = [f"m{i:03d}" for i in range(MODELS)]
    clock = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal clock
        phases[name], clock = time.monotonic() - clock, time.monotonic()

    for name in names:
        api.call("POST", NM, model(name))
    phase("models created")
    # kill -9 while the operator works through them; a new one finishes without duplicates
    api.wait_for("a third of the compile Jobs", lambda: len(api.items("Job")) >= MODELS // 3, 0.5)
    operator.kill()
    operator = api.start_operator()
    cpu = operator.cpu()  # (the killed one's is lost)
    phase("killed at a third of the Jobs")
    jobs = api.wait_for("every compile Job", lambda: len(j := api.items("Job")) >= MODELS and j, 1.0)
    phase("every compile Job")
    for job in jobs:
        complete(api, job["metadata"]["name"])
    phase("Jobs marked complete")
    # SIGTERM while the operator works through them: it exits 0 without a traceback; a new one goes on
    api.wait_for("the first Deployments", lambda: api.items("Deployment"), 0.5)
    cpu += operator.cpu()
    api.stop_operator(operator)
    operator = api.start_operator()
    api.wait_for("every Deployment", lambda: len(api.items("Deployment")) >= 2 * MODELS, 1.0)
    api.wait_for(
        "every model's status to name its serving hash",
        lambda: all((m.get("status") or {}).get("compileHash") for m in api.call("GET", NM)["items"]),
        1.0,
    )
    phase("every model deployed")

    def settled() -> bool:  # no request of the operator's but its watches for 5 s
        before = len(api.audit())
        time.sleep(5)
        return all(c["verb"] == "watch" for c in api.audit()[before:])

    api.wait_for("the operator to settle", settled)
    phase("settled (5 s without requests)")
    cpu = {"operator": cpu + operator.cpu(), "API server": api.api.process.cpu()}
    print(f"{MODELS} models, seconds per phase: {phases}; CPU seconds: {cpu}")
    per_model = Counter()
    for kind in PATHS:
        for obj in api.items(kind):
            per_model[(kind, obj["metadata"]["labels"]["neuronfleet.dev/model"])] += 1
    # the pods' and their front door's Deployments, the public Service and the pods' headless one; a PDB for
    # the two pods (one router pod has none)
    expected = {"Job": 1, "Deployment": 2, "Service": 2, "ConfigMap": 1, "PodDisruptionBudget": 1}
    expected["PersistentVolumeClaim"] = 1
    assert {(k, n): per_model[(k, n)] for k in expected for n in names} == {
        (k, n): count for k, count in expected.items() for n in names
    }  # one of each per model: nothing duplicated by the kill -9
    assert len(api.items("Job")) == MODELS

    # idle: no writes, and reads within one per model per 5 minutes
    before, leases_before = len(api.audit()), len(api.audit(leases=True))
    time.sleep(IDLE_WINDOW)
    idle = Counter(c["verb"] for c in api.audit()[before:])
    lease_calls = len(api.audit(leases=True)) - leases_before - sum(idle.values())
    assert lease_calls <= 2 * (IDLE_WINDOW / 2 + 1), lease_calls  # a read and a renewal every retry period
    reads = idle["get"] + idle["list"]
    print(f"idle {IDLE_WINDOW:.0f} s with {MODELS} models: operator requests by verb {dict(idle)}, "
          f"and {lease_calls} on its Lease")  # fmt: skip
    assert sum(idle[v] for v in WRITES) == 0, idle
    assert reads <= MODELS * READS_PER_MODEL_PER_5_MIN * IDLE_WINDOW / 300, idle

    # drift: deleted and edited children come back within REPAIR_SECONDS
    target, times = "m123", {}
    children = {
        "Service": target,
        "ConfigMap": next(
            c["metadata"]["name"] for c in api.items("ConfigMap", f"neuronfleet.dev/model={target}")
        ),
        "PodDisruptionBudget": f"{target}-unified",
        "Deployment": f"{target}-unified",
    }
    for kind, name in children.items():
        uid = api.call("GET", f"{PATHS[kind]}/{name}")["metadata"]["uid"]
        api.call("DELETE", f"{PATHS[kind]}/{name}")
        times[f"deleted {kind}"] = repaired(
            api, kind, name, lambda o, u=uid: o is not None and o["metadata"]["uid"] != u
        )
        label = {"metadata": {"labels": {"app.kubernetes.io/part-of": "edited"}}}
        api.call("PATCH", f"{PATHS[kind]}/{name}", label, "application/merge-patch+json")
        times[f"edited {kind}"] = repaired(
            api, kind, name, lambda o: o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "neuronfleet"
        )
    scaled = {"spec": {"replicas": 7}}
    api.call("PATCH", f"{PATHS['Deployment']}/{target}-unified", scaled, "application/merge-patch+json")
    times["scaled Deployment"] = repaired(
        api, "Deployment", f"{target}-unified", lambda o: o["spec"]["replicas"] == 2
    )
    print("repaired in (s): " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    assert max(times.values()) < REPAIR_SECONDS, times
    api.stop_operator(operator)


def test_models_whose_children_share_a_name_do_not_fight_over_it(cluster):
    """`col` (disaggregated) has a headless Service `col-prefill-<revision>`; a unified model of that name has
    a public Service of the same name. The first owner keeps it; the other model reports Conflict and never
    patches it."""
    api = cluster
    operator = api.start_operator()
    disaggregated = {
        "mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
        "kvTransfer": {"transport": "tcp"},
    }  # fmt: skip
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(model("col", **disaggregated)))
    job = api.wait_for("col's compile Job", lambda: api.items("Job", "neuronfleet.dev/model=col"))[0]
    complete(api, job["metadata"]["name"])
    prefill = "neuronfleet.dev/model=col,neuronfleet.dev/role=prefill"
    service = api.wait_for("col's prefill Service", lambda: (s := api.items("Service", prefill)) and s[0])
    taken = service["metadata"]["name"]  # col-prefill-<revision>
    col_uid = api.kubectl.get("nm", "col")["metadata"]["uid"]
    assert taken.startswith("col-prefill-") and service["metadata"]["ownerReferences"][0]["uid"] == col_uid
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(model(taken)))
    job = api.wait_for("the second model's Job", lambda: api.items("Job", f"neuronfleet.dev/model={taken}"))[
        0
    ]
    complete(api, job["metadata"]["name"])
    api.wait_for("its Deployment", lambda: api.kubectl.get("deployment", f"{taken}-unified"))
    # every Deployment's pods become ready: both models reconcile, the second one wants its public Service
    for dep in api.items("Deployment"):
        replicas = dep["spec"]["replicas"]
        status = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}
        path = f"{PATHS['Deployment']}/{dep['metadata']['name']}/status"
        api.call("PATCH", path, {"status": status}, "application/merge-patch+json")
    loser = api.wait_for(
        "the second model's Conflict", lambda: condition(m := api.kubectl.get("nm", taken), "Conflict") and m
    )
    conflict = condition(loser, "Conflict")
    assert conflict["status"] == "True"
    assert f"Service {taken} is controlled by NeuronModel col" in conflict["message"], conflict
    assert condition(api.kubectl.get("nm", "col"), "Conflict") is None
    events = api.kubectl("get", "events", "-o", "json").stdout
    assert '"reason": "Conflict"' in events
    api.wait_for("col to be Ready", lambda: all_ready(api.kubectl.get("nm", "col")))
    after = api.kubectl.get("service", taken)
    assert after["metadata"]["ownerReferences"][0]["uid"] == col_uid
    assert after["metadata"]["resourceVersion"] == service["metadata"]["resourceVersion"]
    assert not [c for c in api.audit() if c["resource"] == "services" and c["verb"] == "patch"]
    api.stop_operator(operator)


def test_a_model_is_deleted_with_the_operator_stopped_and_its_children_are_collected(cluster):
    api = cluster
    operator = api.start_operator()
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(model("gone")))
    job = api.wait_for("the compile Job", lambda: api.items("Job"))[0]
    complete(api, job["metadata"]["name"])
    api.wait_for("the Deployment", lambda: api.kubectl.get("deployment", "gone-unified"))
    assert not api.kubectl.get("nm", "gone")["metadata"].get("finalizers")
    api.stop_operator(operator)  # SIGTERM: exit 0, no traceback
    run = api.kubectl("delete", "nm", "gone", "--timeout=60s")
    assert 'neuronmodel.neuronfleet.dev "gone" deleted' in run.stdout
    assert api.kubectl("get", "nm", "gone", check=False).returncode != 0
    wait_until(
        lambda: all(api.items(kind) == [] for kind in PATHS), "the garbage collector to delete the children"
    )
