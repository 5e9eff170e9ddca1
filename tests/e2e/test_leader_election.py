"""Leader election with real operator processes against the emulated API server (no kubelet: the test plays
the Job controller), each operator its own user so that the audit log tells their calls apart, with short
lease timings (lease 4 s, renew deadline 3 s, retry 1 s; the rules themselves are proven in simulated time in
tests/unit/test_leadership.py): one leads and acts, the other keeps watching and writes nothing; the leader
killed with SIGKILL is followed once its Lease lapses, one stopped cleanly at once (it releases the Lease);
models created meanwhile are reconciled by the new leader; the metric and an Event say who leads; and the
audit log shows no write from a replica that did not hold the Lease. Then the operator's own parts in this
process (triggers, caches, client, elector) against one API server: a renewal that lands past the renew
deadline mid-pass drops no model, and the operator's own work on its event loop holds no renewal back."""

from __future__ import annotations

import asyncio
import datetime
import logging
import signal
import time
import urllib.error
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, OperatorCluster, free_port, kopf_watching

from neuronfleet.operator import kube, leader, triggers
from neuronfleet.operator.leadership import Timing
from neuronfleet.operator.watching import Observed

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
    # (the follower serves its metrics once it has started: waited for, not read at once)
    procs[other].wait_until(lambda: leader_metric(ports[other]) == 0, "the follower's metric")
    assert holder(api) == first

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


class Clock:
    """Monotonic seconds that the test moves on at once: a jump is what an event loop kept busy past the renew
    deadline sees (every timer late), without the wait."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """One API server for the tests that run the operator's parts in this process."""
    api = OperatorCluster(tmp_path_factory.mktemp("inproc"))
    yield api
    api.stop()


def test_a_leader_whose_renewal_lands_late_drops_no_model(inproc, caplog):
    """A leader's renewal lands past its renew deadline in the middle of its pass over every model (its event
    loop was kept busy: here the clock jumps right after the pass's third compile Job is created, and the test
    holds the renewal back until the workers have taken every queued model): meanwhile it writes nothing but
    what was under way, and what it took is kept, the model whose pass a refused write cut off included; the
    late renewal finds the Lease still its own, it acts again, and every model converges at once, with no
    resync. The operator's own parts in this process (triggers, caches, client, elector) against the emulated
    API server."""
    api, names = inproc, [f"m{i:02d}" for i in range(60)]
    for name in names:
        create_model(api, name)
    timing, clock = Timing(), Clock()
    config = leader.Settings(True, "neuronfleet-operator", "default", "operator-t_1", timing)
    caplog.set_level(logging.INFO, logger="neuronfleet.operator")
    stepped_down: list[int] = []  # (a step-down signals this process: it must not happen here)
    previous = signal.signal(signal.SIGTERM, lambda *_: stepped_down.append(1))

    class Stalled(kube.Kube):
        """The operator's client; the stall lands right after the third compile Job is created, before that
        model's status is written."""

        jobs = 0

        async def create(self, obj: dict) -> dict:
            made = await super().create(obj)
            Stalled.jobs += obj["kind"] == "Job"
            if obj["kind"] == "Job" and Stalled.jobs == 3:
                clock.ahead += timing.renew_deadline + 1  # no renewal for longer than the deadline
            return made

    def reconciled(models: list[dict]) -> set[str]:
        return {m["metadata"]["name"] for m in models if (m.get("status") or {}).get("observedGeneration")}

    def wrote(user: str) -> int:
        return sum(c["user"] == user and c["verb"] in WRITES and c["code"] < 400 for c in api.audit())

    async def scenario() -> tuple[set[str], int]:
        kubeconfig = api.api.kubeconfig_for("operator-t")
        client = Stalled(kube.load_credentials(str(kubeconfig)))
        observed = Observed(["default"], lambda event, obj: work.changed(event, obj))
        work = triggers.Triggers(client, observed)
        client.cache = observed
        elector = leader.LeaderElector(client, config, work.lead, work.resume, clock=clock)
        work.elector, client.may_write = elector, elector.acting
        work.start()
        async with kopf_watching(observed, kubeconfig, ["default"]):
            await observed.synced()
            return await stalled_pass(client, work, elector)

    async def stalled_pass(client, work, elector) -> tuple[set[str], int]:
        try:
            assert await elector.tick() and elector.acting()  # it leads: its pass over every model starts
            while elector.acting():  # (until the stall)
                await asyncio.sleep(0.005)
            stalled = wrote("operator-t")
            await asyncio.wait_for(work.drained(), 60)  # every queued model taken, none reconciled:
            # nothing written but the writes already under way (at most one a worker)
            assert wrote("operator-t") - stalled <= triggers.WORKERS
            before = reconciled(await client.list("NeuronModel", "default", ""))
            assert not any("every model reconciled once" in r.getMessage() for r in caplog.records)
            assert await elector.tick() and elector.acting()  # the renewal, late: the Lease is still its own
            await asyncio.wait_for(work.settled(), 60)
            return before, wrote("operator-t") - stalled
        finally:
            await work.stop()
            await elector.stop()
            await client.close()

    try:
        before, written = asyncio.run(scenario())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not stepped_down
    assert len(before) <= 2 + triggers.WORKERS, before  # the stall came early in the pass
    assert written > len(names)
    messages = [r.getMessage() for r in caplog.records]
    assert any("stopped: this replica does not act now" in m for m in messages)  # the third model's pass
    assert any("put off meanwhile are queued again" in m for m in messages)
    assert any("past the 10 s renew deadline" in m for m in messages)
    assert "leading: every model reconciled once (60)" in messages
    assert reconciled(api.call("GET", MODELS)["items"]) == set(names)  # every model, with no resync
    assert all(len(compile_job(api, name)) == 1 for name in names)


def test_the_operators_own_work_holds_no_renewal_back(inproc):
    """The leader's event loop runs Python for twice its renew deadline without letting any other task run (a
    pass the caches answer alone, a re-list): its renewals go on beside it, on their own thread and
    connection, and it may act all along."""
    timing = Timing(lease_duration=3, renew_deadline=1.5, retry_period=0.25)
    config = leader.Settings(True, "busy", "default", "operator-busy_1", timing)
    client = kube.Kube(kube.load_credentials(str(inproc.api.kubeconfig_for("operator-busy"))))

    async def lead() -> None:
        pass

    async def scenario() -> tuple[int, float]:
        elector = leader.LeaderElector(client, config, lead)
        elector.start()
        try:
            while not elector.acting():
                await asyncio.sleep(0.01)
            started, acted = time.monotonic(), 0
            while time.monotonic() - started < 2 * timing.renew_deadline:  # (no await: nothing else runs)
                assert elector.acting(), time.monotonic() - started
                acted += 1
            return acted, time.monotonic() - started
        finally:
            await elector.stop()
            await client.close()

    acted, busy = asyncio.run(scenario())
    assert acted > 0 and busy >= 2 * timing.renew_deadline
    lease = inproc.call("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/busy")
    assert lease["spec"]["holderIdentity"] is None  # (released at the stop)


@pytest.mark.parametrize("meanwhile", ["renewed", "taken"])
def test_a_stop_releases_the_lease_it_holds_though_its_copy_is_stale(inproc, meanwhile):
    """The Lease changes after the leader last read it (`renewed`: its own renewal that the stop cancelled
    after the API server applied it, the answer never read; `taken`: another replica's write). At the stop it
    releases a Lease still its own, read again after the conflict, and leaves one another replica holds."""
    timing = Timing(lease_duration=120, renew_deadline=90, retry_period=60)  # (one try while the test runs)
    path = "/apis/coordination.k8s.io/v1/namespaces/default/leases/stale-" + meanwhile
    config = leader.Settings(True, "stale-" + meanwhile, "default", "operator-stale_1", timing)
    client = kube.Kube(kube.load_credentials(str(inproc.api.kubeconfig_for("operator-stale"))))

    async def lead() -> None:
        pass

    async def scenario() -> None:
        elector = leader.LeaderElector(client, config, lead)
        elector.start()
        try:
            while not elector.acting():
                await asyncio.sleep(0.01)
            lease = inproc.call("GET", path)
            holder = "operator-stale_1" if meanwhile == "renewed" else "operator-other_1"
            renewed = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            spec = {**lease["spec"], "holderIdentity": holder, "renewTime": renewed}
            assert (
                inproc.call("PUT", path, {**lease, "spec": spec})["metadata"]["resourceVersion"]
                != (lease["metadata"]["resourceVersion"])
            )
        finally:
            await elector.stop()
            await client.close()

    asyncio.run(scenario())
    expected = None if meanwhile == "renewed" else "operator-other_1"
    assert inproc.call("GET", path)["spec"]["holderIdentity"] == expected
