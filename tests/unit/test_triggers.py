"""The operator's triggers (operator/triggers.py): a model that found an object of an earlier model of its
name in its way (deleted, then made again: the garbage collector deletes that object) is looked at again, as
no later event may bring it back; a conflict with any other owner is left to the Conflict condition; a pass
that awaits nothing lets the operator's other tasks run between its models. (A leader whose renewal lands
late: tests/e2e/test_leader_election.py.)"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
from pathlib import Path

import pytest
import yaml

from neuronfleet.operator import kube, triggers
from neuronfleet.operator.retries import Backoff
from neuronfleet.operator.watching import CHILD_LABEL, Observed


def conflict(message: str, status: str = "True") -> dict:
    return {
        "conditions": [{"type": "Conflict", "status": status, "reason": "OwnedElsewhere", "message": message}]
    }


@pytest.mark.parametrize(
    ("status", "again"),
    [
        (
            conflict(
                "Deployment m-unified is controlled by NeuronModel m (uid 4f63c8b3); it is left as it is"
            ),
            True,
        ),
        (
            conflict("Deployment m-unified is controlled by NeuronModel other (uid 1); it is left as it is"),
            False,
        ),
        (conflict("Service m is controlled by Service-owner x (uid 2); it is left as it is"), False),
        (
            conflict("Deployment m-unified is controlled by NeuronModel m (uid 4f63c8b3)", status="False"),
            False,
        ),
        ({"conditions": [{"type": "Ready", "status": "True"}]}, False),
        ({}, False),
    ],
)
def test_a_model_in_the_way_of_an_earlier_one_of_its_name_is_looked_at_again(status, again):
    assert triggers._left_by_an_earlier_model(("ns", "m"), status) is again


class TwoViews:
    """The API server's objects and the operator's cache of them, apart: the cache may still hold an object
    the server has deleted (an earlier model's, which the garbage collector took)."""

    def __init__(self, cached: list[dict], live: list[dict]) -> None:
        self.cached = {(o["kind"], o["metadata"]["name"]): o for o in cached}
        self.live = {(o["kind"], o["metadata"]["name"]): o for o in live}
        self.created: list[dict] = []

    async def get(self, kind: str, namespace: str, name: str, live: bool = False) -> dict | None:
        return (self.live if live else self.cached).get((kind, name))

    async def create(self, obj: dict) -> dict:
        self.created.append(obj)
        self.live[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj


def deployment(uid: str) -> dict:
    owner = {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "m", "uid": uid,
             "controller": True}  # fmt: skip
    meta = {"name": "m-unified", "namespace": "ns", "ownerReferences": [owner]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": 1}}


def test_an_earlier_models_object_the_cache_still_holds_is_confirmed_live_before_it_is_a_conflict():
    """The cache holds the Deployment of an earlier model of the name, which the API server no longer has:
    the model's own is created (no conflict); one the API server does hold is a conflict, left alone."""
    import asyncio

    from neuronfleet.operator import reconcile

    stale = TwoViews(cached=[deployment("earlier")], live=[])
    conflicts: list[str] = []
    asyncio.run(reconcile.apply(stale, deployment("now"), conflicts))
    assert conflicts == [] and [o["metadata"]["ownerReferences"][0]["uid"] for o in stale.created] == ["now"]

    held = TwoViews(cached=[deployment("earlier")], live=[deployment("earlier")])
    asyncio.run(reconcile.apply(held, deployment("now"), conflicts))
    assert held.created == [] and len(conflicts) == 1 and "(uid earlier)" in conflicts[0]


def test_a_pass_that_awaits_nothing_lets_other_tasks_run_between_its_models():
    """Models gone from the cache (as converged ones, a pass the cache answers alone): the workers take them
    one by one, and another task (the watches, the wake endpoint) runs between them rather than after the
    whole pass."""
    models = 400

    async def scenario() -> int:
        observed = Observed(None)  # kopf's indexes hold nothing
        observed.synced_event().set()
        work = triggers.Triggers(None, observed)
        work.start()
        turns = 0

        async def other() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        task = asyncio.create_task(other())
        for i in range(models):
            work.enqueue(("ns", f"m{i}"))
        await work.settled()
        task.cancel()
        await work.stop()
        return turns

    assert asyncio.run(scenario()) >= models // (2 * triggers.WORKERS)  # (a turn every WORKERS models)


def test_a_new_leader_takes_the_models_changed_while_no_one_led_first():
    """A takeover pass queues the models whose spec is ahead of their status (a change made while no replica
    led, or a model never reconciled) before the converged ones, each part in name order."""

    def model(name: str, generation: int, observed: int | None, ns: str = "default") -> dict:
        status = {} if observed is None else {"status": {"observedGeneration": observed}}
        return {"metadata": {"namespace": ns, "name": name, "generation": generation}, **status}

    models = [
        model("a-converged", 3, 3),
        model("b-changed", 4, 3),
        model("c-new", 1, None),
        model("d-converged", 1, 1),
        model("a-changed", 2, 1, ns="other"),
    ]
    assert triggers.takeover_order(models) == [
        ("default", "b-changed"),
        ("default", "c-new"),
        ("other", "a-changed"),
        ("default", "a-converged"),
        ("default", "d-converged"),
    ]


# ---- failing passes: back-off, one timer per reason, each refusal said once ---------------------------

KEY = ("ns", "m")
SAMPLE = Path(__file__).resolve().parents[2] / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
WEBHOOK = 'admission webhook "status-guard.example.com" denied the request: status.phase may not be set'


class Guarded:
    """An API server holding one NeuronModel (and the operator's cache of it, which answers alike), whose
    admission refuses every write of the model's status with `refusal` while it is set; the children's
    writes pass. It notes every write and when each status write came."""

    def __init__(self, refusal: Exception | None) -> None:
        model = yaml.safe_load(SAMPLE.read_text())
        model["metadata"] = {"name": "m", "namespace": "ns", "uid": "u1", "generation": 1}
        self.objects: dict[tuple[str, str], dict] = {("NeuronModel", "m"): model}
        self.refusal = refusal
        self.writes: list[tuple[str, str, str]] = []
        self.status_tries: list[float] = []
        self.events: list[tuple[str, str, str]] = []

    def change_spec(self) -> dict:
        model = self.objects[("NeuronModel", "m")]
        model["metadata"]["generation"] += 1
        return copy.deepcopy(model)

    async def get(self, kind: str, namespace: str, name: str, live: bool = False) -> dict | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict]:
        label, _, value = selector.partition("=")
        found = [o for (k, _), o in self.objects.items() if k == kind]
        return [copy.deepcopy(o) for o in found if (o["metadata"].get("labels") or {}).get(label) == value]

    async def create(self, obj: dict) -> dict:
        self.writes.append(("create", obj["kind"], obj["metadata"]["name"]))
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = f"uid-{len(self.writes)}"
        self.objects[(obj["kind"], obj["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    async def patch(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        self.writes.append(("patch", kind, name))
        self.objects[(kind, name)] = {**self.objects[(kind, name)], **patch}
        return copy.deepcopy(self.objects[(kind, name)])

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None

    async def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        self.writes.append(("patch", "NeuronModel", f"{name}/status"))
        self.status_tries.append(asyncio.get_running_loop().time())
        if self.refusal is not None:
            raise self.refusal
        self.objects[("NeuronModel", name)]["status"] = status
        return copy.deepcopy(self.objects[("NeuronModel", name)])

    async def post_event(self, about: dict, type_: str, reason: str, message: str) -> None:
        self.writes.append(("create", "Event", reason))
        self.events.append((type_, reason, message))

    async def pod_log(self, namespace: str, name: str, tail_lines: int) -> str | None:
        return None

    # (the cache's side)
    async def synced(self) -> None:
        pass

    def models(self) -> list[dict]:
        return [copy.deepcopy(self.objects[("NeuronModel", "m")])]


async def until(check, what: str, seconds: float = 60.0):
    deadline = asyncio.get_running_loop().time() + seconds
    while not (found := check()):
        assert asyncio.get_running_loop().time() < deadline, f"waited {seconds:.0f} s for {what}"
        await asyncio.sleep(0.005)
    return found


def test_a_refused_status_write_backs_off_and_says_each_event_once():
    """The model's status write is refused by a webhook on every pass: the passes come at growing intervals
    (0.02 s doubling, at most 0.16 s here), the refusal is said once in a Warning Event naming the status
    write and quoting the server, the pass's own Events (the status it could not write) once, no child is
    written twice; once the webhook lets it through, the model's back-off and what was said are forgotten."""
    backoff = Backoff(first=0.02, most=0.16)

    async def scenario() -> tuple[Guarded, list[float], triggers.Triggers]:
        server = Guarded(kube.KubeError(403, WEBHOOK))
        work = triggers.Triggers(server, server, backoff)
        work.start()
        try:
            work.enqueue(KEY)
            await until(lambda: len(server.status_tries) >= 8, "eight tries of the status")
            tries = list(server.status_tries)
            server.refusal = None  # (the webhook fixed)
            await until(lambda: work.retries.failures(KEY) == 0, "a pass that succeeds")
            return server, tries, work
        finally:
            await work.stop()

    server, tries, work = asyncio.run(scenario())
    intervals = [b - a for a, b in itertools.pairwise(tries[:8])]
    for i, interval in enumerate(intervals, start=1):
        assert interval >= backoff.delay(i) - 0.005, (i, intervals)  # growing, then at the cap
    assert all(interval >= backoff.most - 0.005 for interval in intervals[3:]), intervals
    refused = [e for e in server.events if e[1] == triggers.REFUSED]
    assert len(refused) == 1 and refused[0][0] == "Warning", server.events
    said = "the API server refused the operator's write of NeuronModel m (its status)"
    assert refused[0][2].startswith(said)
    assert f"(403): {WEBHOOK}" in refused[0][2]
    assert len(server.events) == len(set(server.events)), server.events  # each Event once
    assert any(e[1] == "CompileStarted" for e in server.events)  # (the pass's own, said once)
    children = [w for w in server.writes if w[1] not in ("Event",) and not w[2].endswith("/status")]
    assert len(children) == len(set(children)), children  # nothing written again and again
    assert len(work.retries) == 0 and work.pending(KEY) == {}


def test_a_trigger_of_a_failing_model_waits_for_its_retry_unless_the_spec_changed():
    """While the model's retry is ahead, a child's change, a come-back time or the autoscaler's trigger adds
    no pass (the retry makes it); a new generation of the model is tried at once."""

    async def scenario() -> tuple[list[int], triggers.Triggers]:
        server = Guarded(kube.KubeError(422, 'NeuronModel.neuronfleet.dev "m" is invalid: status'))
        work = triggers.Triggers(server, server, Backoff(first=600, most=600))
        work.start()
        passes = []
        try:
            work.enqueue(KEY)
            await until(lambda: server.status_tries, "the first pass")
            await until(lambda: triggers.RETRY in work.pending(KEY), "its retry")
            child = {
                "kind": "Pod",
                "metadata": {"namespace": "ns", "name": "p", "labels": {CHILD_LABEL: "m"}},
            }
            for _ in range(20):
                work.changed("MODIFIED", child)
                work.enqueue(KEY)  # (the autoscaler's, a come-back time's, the resync's)
            work.changed("MODIFIED", copy.deepcopy(server.objects[("NeuronModel", "m")]))  # (its status)
            await work.drained()
            passes.append(len(server.status_tries))
            work.changed("MODIFIED", server.change_spec())
            await until(lambda: len(server.status_tries) > passes[0], "the changed model's pass")
            await work.drained()
            passes.append(len(server.status_tries))
            return passes, work
        finally:
            await work.stop()

    passes, work = asyncio.run(scenario())
    assert passes == [1, 2]
    assert work.retries.failures(KEY) == 2


def test_the_api_servers_retry_after_delays_the_retry():
    """A refusal whose answer says Retry-After (kube.KubeError carries the answer's headers: refused with it
    past the client's own tries, tests/e2e/test_apiserver_faults.py): the model's retry waits that long,
    where its back-off is shorter."""

    async def scenario() -> float:
        server = Guarded(kube.KubeError(429, "too many requests", {"Retry-After": "30"}))
        work = triggers.Triggers(server, server, Backoff(first=0.01, most=1))
        work.start()
        try:
            work.enqueue(KEY)
            await until(lambda: triggers.RETRY in work.pending(KEY), "its retry")
            return work.pending(KEY)[triggers.RETRY] - asyncio.get_running_loop().time()
        finally:
            await work.stop()

    assert 29 < asyncio.run(scenario()) <= 30
    # (where the client raises its own error from the one that carries the answer's headers)
    try:
        try:
            raise kube.KubeError(503, "overloaded", {"Retry-After": "7"})
        except kube.KubeError as e:
            raise kube.KubeError(503, "overloaded") from e
    except kube.KubeError as e:
        assert triggers.server_delay(e) == 7
    assert triggers.server_delay(kube.KubeError(422, "invalid")) is None


def later(seconds: float) -> str:
    at = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=seconds)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_come_back_times_do_not_stack_and_stop_with_the_operator():
    """Every pass names its come-back times again: each reason keeps one timer, the sooner of the pending
    one and the new one; stop() cancels them all."""
    compiling = {"type": "Compiled", "status": "False", "reason": "Compiling", "message": "compiling"}
    earlier = conflict("Deployment m-unified is controlled by NeuronModel m (uid 4f63c8b3); it is left")
    status = {"drainUntil": later(60), "compileRetryAt": later(120), "sourceCheckAt": later(600),
              "conditions": [compiling, *earlier["conditions"]]}  # fmt: skip

    async def scenario() -> tuple[dict, dict, dict, dict]:
        work = triggers.Triggers(None, None)
        for _ in range(100):  # (a hundred passes)
            work.come_back(KEY, status)
        first = work.pending(KEY)
        work.come_back(KEY, {**status, "drainUntil": later(3600), "compileRetryAt": later(5)})
        moved = work.pending(KEY)
        await asyncio.sleep(0)
        work.come_back(("ns", "other"), status)
        await work.stop()
        return first, moved, work.pending(KEY), work.pending(("ns", "other"))

    first, moved, after_stop, other_after_stop = asyncio.run(scenario())
    assert set(first) == {"drainUntil", "compileRetryAt", "sourceCheckAt", "progress", "earlier model"}
    assert moved["drainUntil"] == first["drainUntil"]  # (the pending one is sooner: kept)
    assert moved["compileRetryAt"] < first["compileRetryAt"] - 100  # (the new one is sooner: it replaces)
    assert after_stop == {} and other_after_stop == {}
