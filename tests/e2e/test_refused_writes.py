"""A write the API server refuses, end to end: the operator's parts in this process (triggers with a short
back-off, caches, client) against the emulated API server, where KEDA's own CRD (tests/data, v2.20.2) carries
one validation rule more, as a cluster's policy would: the API server refuses the model's ScaledObject (422)
in its own words. The refused write is retried at growing intervals (each at least its back-off), a new
generation of the model is tried at once, each distinct refusal is said in one Warning Event (a new message
in another), the policy lifted lets the next pass through and forgets what was said, so the same refusal
later is said again; and the audit log shows nothing written in a loop: the refused writes, the Events,
nothing else twice, no status written while the passes failed."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest
import yaml
from support import ROOT, OperatorCluster, kopf_watching

from neuronfleet.operator import kube, triggers
from neuronfleet.operator.retries import Backoff
from neuronfleet.operator.watching import Observed

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
KEDA_CRD = ROOT / "tests" / "data" / "keda-v2.20.2-scaledobjects.yaml"  # KEDA's published CRD
MODELS = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels"
EVENTS = "/api/v1/namespaces/default/events"
USER = "operator-refused"
NAME = "refused"
# short, so that the test takes seconds: 0.05 s doubling (the operator's own: 1 s doubling up to 300 s)
BACKOFF = Backoff(first=0.05, most=10.0)
WAIT = 60.0  # the most any step may take on a loaded machine
POLICY = "this cluster allows at most 2 replicas per ScaledObject"
OTHER_POLICY = "ScaledObjects here scale to 2 replicas at most (ask the platform team)"


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def keda_crd(policy: str | None) -> str:
    """KEDA's CRD, with the policy's rule on a ScaledObject's spec (none: as published)."""
    crd = yaml.safe_load(KEDA_CRD.read_text())
    if policy is not None:
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        rule = {"rule": "!has(self.maxReplicaCount) || self.maxReplicaCount <= 2", "message": policy}
        spec["x-kubernetes-validations"] = [*spec.get("x-kubernetes-validations", []), rule]
    return json.dumps(crd)


def model(most: int) -> dict:
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"] = {"name": NAME, "namespace": "default"}
    manifest["spec"]["autoscaling"] = {
        "enabled": True, "provider": "keda", "min": 0, "max": most, "scaleToZero": True, "metric": "queue",
        "prometheusAddress": "http://prometheus.monitoring.svc:9090",
    }  # fmt: skip
    return manifest


class Recorded(kube.Kube):
    """The operator's client, noting when each write of a ScaledObject was sent and how it ended (the audit
    log says what the API server answered, in order, but not when)."""

    def __init__(self, credentials: kube.Credentials) -> None:
        super().__init__(credentials)
        self.sent: list[tuple[float, str, int]] = []  # (monotonic time, verb, the refusal's status or 0)

    async def _noted(self, verb: str, write):
        at = time.monotonic()
        try:
            answer = await write
        except kube.KubeError as e:
            self.sent.append((at, verb, e.status))
            raise
        self.sent.append((at, verb, 0))
        return answer

    async def create(self, obj: dict) -> dict:
        if obj["kind"] != "ScaledObject":
            return await super().create(obj)
        return await self._noted("create", super().create(obj))

    async def patch(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        if kind != "ScaledObject":
            return await super().patch(kind, namespace, name, patch)
        return await self._noted("patch", super().patch(kind, namespace, name, patch))


def test_a_refused_write_backs_off_and_is_said_once_per_message(cluster):
    api, kubectl = cluster, cluster.kubectl
    kubectl("apply", "-f", "-", stdin=keda_crd(POLICY))
    client = Recorded(kube.load_credentials(str(api.api.kubeconfig_for(USER))))
    key = ("default", NAME)

    def refusals() -> list[dict]:
        items = api.call("GET", EVENTS)["items"]
        ours = [e for e in items if e["involvedObject"]["name"] == NAME]
        return [e for e in ours if e["reason"] == triggers.REFUSED]

    def change(most: int) -> None:
        api.call("PATCH", f"{MODELS}/{NAME}", {"spec": {"autoscaling": {"max": most}}},
                 "application/merge-patch+json")  # fmt: skip

    async def until(check, what: str):
        deadline = time.monotonic() + WAIT
        while not (found := check()):
            assert time.monotonic() < deadline, f"waited {WAIT:.0f} s for {what}"
            await asyncio.sleep(0.02)
        return found

    async def scenario() -> dict:
        observed = Observed(["default"], lambda event, obj: work.changed(event, obj))
        work = triggers.Triggers(client, observed, BACKOFF)
        client.cache = observed
        work.start()
        async with kopf_watching(observed, api.api.kubeconfig_for(USER), ["default"]):
            return await refused(work)

    async def refused(work) -> dict:
        seen: dict = {}
        try:
            api.call("POST", MODELS, model(3))
            # refused again and again: each try at least its back-off after the one before
            await until(lambda: len(client.sent) >= 7, "seven tries of the ScaledObject")
            tries = client.sent[:7]
            assert all((verb, status) == ("create", 422) for _, verb, status in tries), tries
            seen["intervals"] = [b[0] - a[0] for a, b in itertools.pairwise(tries)]
            assert work.retries.failures(key) >= 7 and triggers.RETRY in work.pending(key)
            seen["first"] = await until(lambda: refusals(), "the ApplyRefused Event")

            # the user changes the model: tried at once, not after the 3.2 s its back-off has ahead
            before = len(client.sent)
            waiting = work.pending(key)[triggers.RETRY] - asyncio.get_running_loop().time()
            due = time.monotonic() + waiting
            change(4)
            await until(lambda: len(client.sent) > before, "the try of the changed model")
            seen["at_once"] = (waiting, due - client.sent[before][0])
            assert len(refusals()) == 1  # (the same words: said once)

            # another message (the policy reworded): said in a second Event, on the model's next change
            kubectl("apply", "-f", "-", stdin=keda_crd(OTHER_POLICY))
            change(5)
            await until(lambda: len(refusals()) == 2, "the reworded refusal's Event")

            # the policy lifted: the next pass goes through, and what was said is forgotten
            kubectl("apply", "-f", "-", stdin=keda_crd(None))
            change(2)
            await until(lambda: client.sent[-1][2] == 0, "the ScaledObject accepted")
            await until(lambda: work.retries.failures(key) == 0, "the model's pass to succeed")
            assert triggers.RETRY not in work.pending(key) and len(work.retries) == 0

            # the same refusal later: said again (the ScaledObject exists: its patch is refused now)
            kubectl("apply", "-f", "-", stdin=keda_crd(POLICY))
            change(6)
            await until(lambda: len(refusals()) == 3, "the refusal said again")
            assert client.sent[-1][1:] == ("patch", 422)
        finally:
            await work.stop()
            seen["pending after stop"] = work.pending(key)
            await client.close()
        return seen

    seen = asyncio.run(scenario())

    # each interval at least its back-off (0.05 s doubling; a timer may fire a moment early), so they grow
    intervals = seen["intervals"]
    for i, interval in enumerate(intervals, start=1):
        assert interval >= BACKOFF.delay(i) - 0.01, (i, intervals)
    waiting, ahead = seen["at_once"]  # the changed model's try came well before its retry was due
    assert waiting > 1.0 and ahead > 0.5, seen["at_once"]
    assert seen["pending after stop"] == {}

    # one Warning Event per distinct refusal, in the server's words, naming what was written
    said = refusals()
    messages = [e["message"] for e in said]
    assert [e["type"] for e in said] == ["Warning"] * 3
    assert sum(POLICY in m for m in messages) == 2 and sum(OTHER_POLICY in m for m in messages) == 1, messages
    first = seen["first"][0]["message"]
    assert first.startswith(f"the API server refused the operator's write of ScaledObject {NAME} (422): ")
    assert f'ScaledObject.keda.sh "{NAME}" is invalid' in first and POLICY in first, first
    assert all(e.get("count", 1) == 1 for e in said)

    # nothing written in a loop: before the first try, the model's children, each created once; from it
    # until the policy was lifted, the refused ScaledObject and one Event per distinct refusal, nothing else
    # (no status); then the status once, the pass's own Event, the refused patch and its Event
    calls = [c for c in api.audit() if c["user"] == USER and c["verb"] in ("create", "update", "patch")]
    scaled = [c for c in calls if c["resource"] == "scaledobjects"]
    assert [c["code"] if c["code"] >= 400 else 0 for c in scaled] == [status for _, _, status in client.sent]
    tried = next(i for i, c in enumerate(calls) if c["resource"] == "scaledobjects")
    accepted = next(i for i, c in enumerate(calls) if c["resource"] == "scaledobjects" and c["code"] < 400)
    children = [c["resource"] for c in calls[:tried]]
    assert all(c["verb"] == "create" for c in calls[:tried]) and "neuronmodels/status" not in children
    assert all(children.count(r) == (2 if r == "networkpolicies" else 1) for r in children), children
    failing = [c["resource"] for c in calls[tried:accepted]]
    assert set(failing) == {"scaledobjects", "events"} and failing.count("events") == 2, failing
    assert [c["resource"] for c in calls].count("neuronmodels/status") == 1
    events = api.call("GET", EVENTS)["items"]
    others = [(e["reason"], e["message"]) for e in events
              if e["involvedObject"]["name"] == NAME and e["reason"] != triggers.REFUSED]  # fmt: skip
    assert len(others) == len(set(others)), others  # (the successful pass's own: each once)
    assert [c["resource"] for c in calls].count("events") == len(others) + len(said)
