"""Leader election with real operator processes against the emulated API server (no kubelet: the test plays
the Job controller), each operator its own user so that the audit log tells their calls apart, with short
lease timings (lease 4 s, renew deadline 3 s, retry 1 s; the rules themselves are proven in simulated time in
tests/unit/test_leadership.py): one leads and acts, the other keeps watching and writes nothing; the leader
killed with SIGKILL is followed once its Lease lapses, one stopped cleanly at once (it releases the Lease);
models created meanwhile are reconciled by the new leader; the metric and an Event say who leads; and the
audit log shows no write from a replica that did not hold the Lease."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, OperatorCluster, free_port

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
TIMING = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "1")
LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/neuronfleet-operator"
MODELS = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels"
JOBS = "/apis/batch/v1/namespaces/default/jobs"
WRITES = ("create", "update", "patch", "delete")


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def holder(api) -> str:
    """The user (pod name) whose identity holds the Lease, or ""."""
    lease = api.call("GET", LEASE)
    identity = ((lease or {}).get("spec") or {}).get("holderIdentity") or ""
    return identity.rsplit("_", 1)[0]


def create_model(api, name: str) -> None:
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = name
    api.call("POST", MODELS, manifest)


def compile_job(api, name: str) -> list[dict]:
    return api.call("GET", f"{JOBS}?labelSelector=neuronfleet.dev/model={name}")["items"]


def leader_metric(port: int) -> float | None:
    """The replica's neuronfleet_operator_leader, or None while its metrics are not served yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT) as r:
            text = r.read().decode()
    except urllib.error.URLError:
        return None
    (line,) = [x for x in text.splitlines() if x.startswith("neuronfleet_operator_leader ")]
    return float(line.split()[1])


def test_one_replica_acts_and_another_takes_over_when_it_goes(cluster):
    api = cluster
    ports = {"operator-a": free_port(), "operator-b": free_port()}
    metrics = lambda port: ("--metrics-port", str(port), "--metrics-host", "127.0.0.1")  # noqa: E731
    procs = {user: api.start_operator(*TIMING, *metrics(port), user=user) for user, port in ports.items()}
    first = procs["operator-a"].wait_until(lambda: holder(api), "a leader")
    other = "operator-b" if first == "operator-a" else "operator-a"
    create_model(api, "m1")
    procs[first].wait_until(lambda: compile_job(api, "m1"), "the leader's compile Job for m1")
    procs[first].wait_until(lambda: leader_metric(ports[first]) == 1, "the leader's metric")
    assert leader_metric(ports[other]) == 0 and holder(api) == first

    # the leader is killed (no release): the other takes over once the Lease lapses, and acts
    procs[first].popen.send_signal(signal.SIGKILL)
    procs[first].popen.wait()
    killed = time.monotonic()
    create_model(api, "m2")
    procs[other].wait_until(lambda: holder(api) == other, "the takeover")
    took = time.monotonic() - killed
    procs[other].wait_until(lambda: compile_job(api, "m2"), "the new leader's compile Job for m2")
    assert leader_metric(ports[other]) == 1
    assert took >= 3, took  # (not before the Lease could lapse: 4 s after the last renewal seen)

    # a replica comes back as a follower; the leader stopped cleanly hands over at once (it releases)
    third = "operator-c"
    ports[third] = free_port()
    procs[third] = api.start_operator(*TIMING, *metrics(ports[third]), user=third)
    procs[third].wait_until(lambda: leader_metric(ports[third]) == 0, "the new replica's metric (a follower)")
    stopped = time.monotonic()
    assert procs[other].stop() == 0
    procs[third].wait_until(lambda: holder(api) == third, "the takeover after a release")
    assert time.monotonic() - stopped < 60  # (a release needs no lapse; a lapse would be 4 s: see above)
    create_model(api, "m3")
    procs[third].wait_until(lambda: compile_job(api, "m3"), "the third leader's compile Job")
    events = [e for e in api.call("GET", "/api/v1/namespaces/default/events")["items"]
              if e["reason"] == "LeaderElection"]  # fmt: skip
    assert {e["message"].split("_")[0] for e in events} == {first, other, third}, events
    assert all(len(compile_job(api, m)) == 1 for m in ("m1", "m2", "m3"))  # each compiled once

    # the audit log, in the order the API server answered: every write of an operator came from the replica
    # whose Lease write succeeded last
    leading, wrote = "", {}
    for call in api.audit():
        if not call["user"].startswith("operator-") or call["verb"] not in WRITES or call["code"] >= 400:
            continue
        if call["resource"] == "leases":
            leading = call["user"]
            continue
        assert call["user"] == leading, (call, leading)
        wrote[call["user"]] = wrote.get(call["user"], 0) + 1
    assert set(wrote) == {first, other, third}, wrote
