"""The pure parts of the operator's ownership rule and of what it observes (operator/watching.py, fed here as
kopf feeds it: each object indexed, then delivered): who controls an object (never patch another owner's),
the Conflict condition, the label selectors answered from the indexes, read-your-writes, a re-list told
from changes, and objects deleted while no watch ran found out."""

from __future__ import annotations

import asyncio
import time

from support import wait_until_async

from neuronfleet.operator import spec, watching
from neuronfleet.operator.planner import foreign_owner
from neuronfleet.operator.status import transitions, with_conflicts
from neuronfleet.operator.watching import Observed, selector_matcher


def owned(uid: str | None, controller: bool = True, name: str = "col") -> dict:
    refs = (
        [] if uid is None else [{"kind": "NeuronModel", "name": name, "uid": uid, "controller": controller}]
    )
    return {"kind": "Service", "metadata": {"name": "col-prefill", "ownerReferences": refs}}


def test_an_object_controlled_by_another_model_or_by_nobody_is_foreign():
    ours = owned("u-1", name="col-prefill")
    assert foreign_owner(ours, owned("u-1", name="col-prefill")) is None
    assert foreign_owner(ours, owned("u-2", name="col")) == "NeuronModel col (uid u-2)"
    assert "no NeuronModel" in foreign_owner(ours, owned(None))
    # our reference without the controller flag (e.g. added by hand) is still ours
    assert foreign_owner(ours, owned("u-1", controller=False, name="col-prefill")) is None
    # an object built without an owner (neuronfleet render, no cluster) has no one to conflict with
    assert foreign_owner(owned(None), owned("u-2")) is None


def test_the_conflict_condition_names_the_objects_and_keeps_its_transition_time():
    status = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}
    first = with_conflicts(status, {}, ["Service a is controlled by NeuronModel b"], 3, "t1")
    conflict = first["conditions"][-1]
    assert conflict["type"] == "Conflict" and conflict["status"] == "True"
    assert conflict["message"] == "Service a is controlled by NeuronModel b"
    assert conflict["lastTransitionTime"] == "t1" and conflict["observedGeneration"] == 3
    again = with_conflicts(status, first, ["Service a is controlled by NeuronModel b"], 3, "t2")
    assert again["conditions"][-1]["lastTransitionTime"] == "t1"
    assert [c["type"] for c in with_conflicts(first, first, [], 3, "t3")["conditions"]] == ["Ready"]
    assert status["conditions"] == [{"type": "Ready", "status": "True"}]  # the input is not changed


def test_a_conflict_is_a_warning_once_and_its_end_a_normal_event():
    status = {
        "phase": "Ready",
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}],
    }
    found = with_conflicts(status, status, ["Service a is controlled by NeuronModel b"], 3, "t1")
    assert transitions(status, found) == [("Warning", "Conflict", "Service a is controlled by NeuronModel b")]
    assert (
        transitions(
            found, with_conflicts(status, found, ["Service a is controlled by NeuronModel b"], 3, "t2")
        )
        == []
    )
    worse = with_conflicts(
        status,
        found,
        ["Service a is controlled by NeuronModel b", "PodDisruptionBudget c is controlled by NeuronModel b"],
        3,
        "t3",
    )
    assert [e[:2] for e in transitions(found, worse)] == [("Warning", "Conflict")]
    assert transitions(found, with_conflicts(status, found, [], 3, "t4")) == [
        ("Normal", "ConflictResolved", "no object of this model is controlled by another owner")
    ]


def test_equality_selectors_are_answered_from_the_cache_and_set_based_ones_are_not():
    labels = {"neuronfleet.dev/model": "m1", "job-name": "m1-compile-abc"}
    assert selector_matcher("neuronfleet.dev/model")(labels)
    assert not selector_matcher("!neuronfleet.dev/model")(labels)
    assert selector_matcher("neuronfleet.dev/model=m1,job-name==m1-compile-abc")(labels)
    assert not selector_matcher("neuronfleet.dev/model=m2")(labels)
    assert selector_matcher("neuronfleet.dev/model!=m2")(labels)
    assert selector_matcher("")(labels)
    assert selector_matcher("env in (a,b)") is None and selector_matcher("a notin (b)") is None


class Kopf:
    """kopf's side as Observed meets it: each object put into its kind's index under the keys
    `watching.index_keys` gives (as kopf's index handler returns them), then delivered to the event
    handler."""

    def __init__(self, observed: Observed) -> None:
        self.observed, self.indexes = observed, {kind: {} for kind in watching.WATCHED}
        observed.attach({watching.index_id(kind): index for kind, index in self.indexes.items()})
        observed.synced_event().set()

    def event(self, kind: str, event: str | None, obj: dict) -> None:
        index = self.indexes[kind]
        for key in [k for k, objs in index.items() if any(o["metadata"]["name"] == obj["metadata"]["name"]
                                                          for o in objs)]:  # fmt: skip
            index[key] = [o for o in index[key] if o["metadata"]["name"] != obj["metadata"]["name"]]
            if not index[key]:
                del index[key]
        if event != "DELETED":
            for key in watching.index_keys(kind, obj):
                index.setdefault(key, []).append(obj)
        self.observed.delivered(kind, event, obj)


def _service(rv: str, ingress: str | None = None, name: str = "m") -> dict:
    status = {"loadBalancer": {"ingress": [{"ip": ingress}]}} if ingress else {}
    return {"kind": "Service", "status": status,
            "metadata": {"name": name, "namespace": "d", "resourceVersion": rv,
                         "labels": {"neuronfleet.dev/model": "m"}}}  # fmt: skip


def _read(observed: Observed, name: str = "m") -> dict | None:
    return asyncio.run(observed.get("Service", "d", name))


def test_a_writes_answer_never_puts_an_older_object_over_what_the_watch_delivered_since():
    """The answer to the operator's write and the watch travel apart: when another writer's change (here a
    load balancer's status) was delivered before the answer arrived, the newer object is read (else the
    model's endpoint would stay stale with no event to correct it)."""
    changes: list[tuple[str, str]] = []
    observed = Observed(None, lambda event, obj: changes.append((event, obj["metadata"]["resourceVersion"])))
    kopf = Kopf(observed)
    kopf.event("Service", "ADDED", _service("1"))
    kopf.event("Service", "MODIFIED", _service("2"))  # the operator's write, seen by the watch first
    kopf.event("Service", "MODIFIED", _service("3", "10.0.0.7"))  # the load balancer's
    observed.stored(_service("2"))  # the write's answer comes last
    assert _read(observed)["metadata"]["resourceVersion"] == "3"
    assert changes[-1] == ("MODIFIED", "3")
    # the usual order: the answer first is read at once, and its echo is not reported as a change
    observed.stored(_service("4"))
    assert _read(observed)["metadata"]["resourceVersion"] == "4"
    kopf.event("Service", "MODIFIED", _service("4"))
    assert changes[-1] == ("MODIFIED", "3")
    # deleted by the operator: hidden at once; made again (the watch's ADDED): read again
    observed.forget(_service("4"))
    assert _read(observed) is None
    assert asyncio.run(observed.list("Service", "d", "neuronfleet.dev/model=m")) == []
    kopf.event("Service", "DELETED", _service("4"))
    kopf.event("Service", "ADDED", _service("5"))
    assert _read(observed)["metadata"]["resourceVersion"] == "5"


def test_reads_look_objects_up_by_model_by_name_and_a_pod_by_its_job():
    observed = Observed(["d"])
    kopf = Kopf(observed)
    kopf.event("Service", None, _service("1", name="m"))
    kopf.event("Service", None, _service("2", name="m-prefill"))
    other = _service("3", name="x")
    other["metadata"]["labels"] = {"neuronfleet.dev/model": "x", "neuronfleet.dev/role": "router"}
    kopf.event("Service", None, other)
    labels = {"neuronfleet.dev/model": "m", "job-name": "m-compile-1"}
    pod = {"kind": "Pod", "metadata": {"name": "m-compile-1-abc", "namespace": "d", "resourceVersion": "4"}}
    pod["metadata"]["labels"] = labels
    kopf.event("Pod", None, pod)
    names = lambda objs: [o["metadata"]["name"] for o in objs]  # noqa: E731
    assert names(asyncio.run(observed.list("Service", "d", "neuronfleet.dev/model=m"))) == ["m", "m-prefill"]
    both = "neuronfleet.dev/model=x,neuronfleet.dev/role=router"
    assert names(asyncio.run(observed.list("Service", "d", both))) == ["x"]
    assert names(asyncio.run(observed.list("Service", "d", "neuronfleet.dev/role=router"))) == ["x"]
    assert names(asyncio.run(observed.list("Pod", "d", "job-name=m-compile-1"))) == ["m-compile-1-abc"]
    assert asyncio.run(observed.list("Pod", "d", "job-name=m-compile-2")) == []
    assert asyncio.run(observed.list("Service", "d", "a in (b)")) is None  # asked of the API server
    assert observed.watches("Service", "d") and not observed.watches("Service", "e")
    assert not observed.watches("Secret", "d") and not observed.watches("EndpointSlice", "d")
    # what is read is a copy: a reconcile that changes it changes nothing observed
    asyncio.run(observed.get("Service", "d", "m"))["metadata"]["name"] = "changed"
    assert _read(observed)["metadata"]["name"] == "m"


def test_a_relisted_object_is_a_change_only_at_a_new_version():
    changes: list[tuple[str, str]] = []

    async def scenario() -> None:
        observed = Observed(
            None, lambda event, obj: changes.append((event, obj["metadata"]["resourceVersion"]))
        )
        observed.live_list = lambda kind, ns: asyncio.sleep(0, result=[])
        kopf = Kopf(observed)
        kopf.event("Service", None, _service("1"))  # the first list
        kopf.event("Service", None, _service("1"))  # a re-list (after 410 Gone): nothing changed
        assert changes == [("ADDED", "1")]
        kopf.event("Service", None, _service("7"))  # a re-list: changed meanwhile
        assert changes[-1] == ("MODIFIED", "7")
        await observed.stop()

    asyncio.run(scenario())


def test_after_a_relist_every_kind_is_listed_live_and_what_it_lacks_is_forgotten(monkeypatch):
    """kopf's indexes keep an object deleted while no watch ran (a re-list cannot report it): once kopf's
    re-lists are over (one re-delivered object says they happened), every watched kind is listed live once;
    what a list lacks is hidden and reported deleted, a kind that re-listed nothing included (its only
    object went); what the lists hold stays, and one delivered after its list began is not forgotten."""
    monkeypatch.setattr(watching, "RELIST_QUIET", 0.05)
    changes: list[tuple[str, str]] = []
    job = {"kind": "Job", "metadata": {"name": "m-compile", "namespace": "d", "resourceVersion": "3",
                                       "labels": {"neuronfleet.dev/model": "m"}}}  # fmt: skip
    live = {"Service": [_service("1", name="m"), _service("2", name="kept")], "Job": []}
    listed: list[str] = []

    async def live_list(kind: str, ns: str | None) -> list[dict]:
        listed.append(kind)
        return live.get(kind, [])

    async def live_get(kind: str, ns: str, name: str) -> dict | None:  # a name made anew as the list ran
        return _service("5", name="crossed") if name == "crossed" else None

    async def scenario() -> None:
        observed = Observed(None, lambda event, obj: changes.append((event, obj["metadata"]["name"])))
        observed.live_list, observed.live_get = live_list, live_get
        kopf = Kopf(observed)
        for name in ("m", "gone", "kept", "crossed"):
            kopf.event("Service", None, _service("1" if name != "kept" else "2", name=name))
        kopf.event("Job", None, job)
        await asyncio.sleep(0.1)
        kopf.event("Service", None, _service("1", name="m"))  # a re-list: "gone", "kept", the Job not in it
        for _ in range(500):
            if set(watching.WATCHED) <= set(listed):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert sorted(listed) == sorted(watching.WATCHED)  # each kind once
        assert await observed.get("Service", "d", "gone") is None
        assert await observed.get("Job", "d", "m-compile") is None  # its kind re-listed nothing
        assert (await observed.get("Service", "d", "kept"))["metadata"]["name"] == "kept"
        names = [o["metadata"]["name"] for o in await observed.list("Service", "d", "")]
        assert names == ["crossed", "kept", "m"]  # (the list lacked "crossed", its read by name found it)
        assert sorted(changes[-2:]) == [("DELETED", "gone"), ("DELETED", "m-compile")]
        # made again later: delivered, read again
        kopf.event("Job", "ADDED", {**job, "metadata": {**job["metadata"], "resourceVersion": "9"}})
        assert (await observed.get("Job", "d", "m-compile"))["metadata"]["resourceVersion"] == "9"
        await observed.stop()

    asyncio.run(scenario())


def test_a_kind_the_cluster_does_not_serve_is_passed_over_by_the_sweep(monkeypatch):
    """A kind the API server answers 404 for (ResourceClaimTemplates before Kubernetes 1.34: kopf leaves it
    unwatched) does not stop the sweep after a re-list: the kinds after it are still listed and swept."""
    monkeypatch.setattr(watching, "RELIST_QUIET", 0.05)
    listed: list[str] = []

    class NotServed(Exception):
        status = 404

    async def live_list(kind: str, ns: str | None) -> list[dict]:
        listed.append(kind)
        if kind == "Pod":  # (the second kind swept: every kind after it must still be)
            raise NotServed(kind)
        return [_service("1", name="m")] if kind == "Service" else []

    async def scenario() -> None:
        observed = Observed(None, lambda event, obj: None)
        observed.live_list, observed.live_get = (
            live_list,
            lambda kind, ns, name: asyncio.sleep(0, result=None),
        )
        kopf = Kopf(observed)
        for name in ("m", "gone"):
            kopf.event("Service", None, _service("1", name=name))
        await asyncio.sleep(0.1)
        kopf.event("Service", None, _service("1", name="m"))  # a re-list
        for _ in range(500):
            if set(watching.WATCHED) <= set(listed):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert sorted(listed) == sorted(watching.WATCHED)
        assert await observed.get("Service", "d", "gone") is None  # swept after the kind not served
        await observed.stop()

    asyncio.run(scenario())


def test_objects_are_kept_without_their_managed_fields():
    """kopf's index handler and the operator's own writes keep an object without metadata.managedFields (no
    reconcile reads them; on a real cluster they are a large part of every object), the rest as delivered;
    the delivered object itself is left as it was."""
    managed = [{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {"f:replicas": {}}}}]
    delivered = _service("1")
    delivered["metadata"]["managedFields"] = managed
    indexed = asyncio.run(Observed._index(body=delivered, param="Service"))
    assert indexed and all("managedFields" not in obj["metadata"] for obj in indexed.values())
    assert all(obj["metadata"]["labels"] == {"neuronfleet.dev/model": "m"} for obj in indexed.values())
    assert delivered["metadata"]["managedFields"] == managed
    observed = Observed(None)
    Kopf(observed)
    written = _service("2")
    written["metadata"]["managedFields"] = managed
    observed.stored(written)
    read = _read(observed)
    assert read["metadata"]["resourceVersion"] == "2" and "managedFields" not in read["metadata"]


def test_objects_are_kept_without_kubectls_copy_and_share_their_strings():
    """kubectl's last-applied annotation (a second copy of the spec) is not kept, the other annotations are;
    two objects parsed apart share the keys and values they have in common once kept (a model's uid in each
    child's ownerReferences), and a kept object equals the delivered one less what is dropped."""
    import json

    owner = {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "m", "uid": "u-1234"}

    def child(name: str) -> dict:
        obj = _service("1", name=name)
        obj["metadata"]["ownerReferences"] = [owner]
        obj["metadata"]["annotations"] = {
            "kubectl.kubernetes.io/last-applied-configuration": json.dumps(obj),
            "neuronfleet.dev/spec-hash": "abc",
        }
        return json.loads(json.dumps(obj))  # parsed apart, as two watch events are

    first, second = (watching.kept(child(name)) for name in ("a", "b"))
    assert first["metadata"]["annotations"] == {"neuronfleet.dev/spec-hash": "abc"}
    expected = child("a")
    del expected["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
    assert first == expected
    ((key_a, uid_a),) = ((k, v) for k, v in first["metadata"]["ownerReferences"][0].items() if k == "uid")
    ((key_b, uid_b),) = ((k, v) for k, v in second["metadata"]["ownerReferences"][0].items() if k == "uid")
    assert uid_a is uid_b and key_a is key_b


def test_a_name_deleted_and_made_again_while_no_watch_ran_reads_as_the_new_object():
    """kopf keys its indexes by uid (namespace, name, uid): a model deleted and made again while no watch ran
    reaches it as the new object's re-list, with no DELETED for the old one, and its index holds both under
    the name. Reads (by name, by list, the models a new leader reconciles) give the one delivered last, not
    the old one (whose status, current, had made the new model's pass write nothing: CI's chaos run, a
    re-created model left without a status). Driven through kopf's own indexers."""
    from kopf._core.engines.indexing import OperatorIndexer, OperatorIndexers

    indexers = OperatorIndexers()
    for kind in watching.WATCHED:
        indexers[watching.index_id(kind)] = OperatorIndexer()
    observed = Observed(None)
    observed.attach(
        {watching.index_id(kind): indexers[watching.index_id(kind)].index for kind in watching.WATCHED}
    )
    observed.synced_event().set()

    def deliver(kind: str, event: str | None, obj: dict) -> None:
        indexer = indexers[watching.index_id(kind)]
        obj = watching._snapshot(kind, obj)
        if event == "DELETED":
            indexer.discard(indexers.make_key(obj))
        else:
            indexer.replace(indexers.make_key(obj), dict.fromkeys(watching.index_keys(kind, obj), obj))
        observed.delivered(kind, event, obj)

    def model(uid: str, rv: str, generation: int, status: dict) -> dict:
        meta = {"name": "m", "namespace": "d", "uid": uid, "resourceVersion": rv, "generation": generation}
        return {"kind": spec.KIND, "metadata": meta, "status": status}

    def service(uid: str, rv: str) -> dict:
        return {**_service(rv), "metadata": {**_service(rv)["metadata"], "uid": uid}}

    async def scenario() -> None:
        deliver(spec.KIND, None, model("old", "3", 2, {"observedGeneration": 2}))
        deliver("Service", None, service("s-old", "4"))
        # (the watch expired; the model and its Service deleted and made again; kopf lists anew)
        deliver(spec.KIND, None, model("new", "9", 1, {}))
        deliver("Service", None, service("s-new", "10"))
        kept = indexers[watching.index_id(spec.KIND)].index[("name", "d", "m")]
        assert len(list(kept)) == 2  # (kopf keeps both)
        read = await observed.get(spec.KIND, "d", "m")
        assert (read["metadata"]["uid"], read.get("status")) == ("new", {})
        assert [m["metadata"]["uid"] for m in observed.models()] == ["new"]
        services = await observed.list("Service", "d", "neuronfleet.dev/model=m")
        assert [s["metadata"]["uid"] for s in services] == ["s-new"]
        assert [s["metadata"]["uid"] for s in await observed.list("Service", "d", "")] == ["s-new"]
        # the new one changed by the watch: still the one read
        deliver(spec.KIND, "MODIFIED", model("new", "12", 1, {"observedGeneration": 1}))
        assert (await observed.get(spec.KIND, "d", "m"))["status"] == {"observedGeneration": 1}
        # the new one deleted (its DELETED seen): the old one, still in kopf's index, is not read either
        deliver(spec.KIND, "DELETED", model("new", "13", 1, {}))
        assert await observed.get(spec.KIND, "d", "m") is None and observed.models() == []
        await observed.stop()  # (the re-list's sweep: no live list here)

    asyncio.run(scenario())


def test_a_writes_answer_that_crossed_a_later_delivery_is_checked_live_and_dropped_when_past():
    """A Job the operator creates and the Job controller completes at once: kopf, batching the two events,
    delivers only the completion, and the create's answer (the Job not yet complete) arrives after it. Which
    is newer cannot be told from their versions: the answer is read, the Job is read live once, and the
    answer, which the cluster is past, is dropped: the completion is read (no later event would have
    corrected it: CI's chaos run, a model left compiling with its Job complete). A deletion whose answer
    crossed a delivery of the object made again shows it again."""
    job = lambda rv, done: {"kind": "Job", "status": {"succeeded": 1} if done else {},  # noqa: E731
                            "metadata": {"name": "m-compile", "namespace": "d", "resourceVersion": rv,
                                         "labels": {"neuronfleet.dev/model": "m"}}}  # fmt: skip
    live: dict[str, dict] = {"m-compile": job("2", True)}
    reads: list[str] = []

    async def live_get(kind: str, ns: str, name: str) -> dict | None:
        reads.append(name)
        return live.get(name)

    async def scenario() -> None:
        observed = Observed(None)
        observed.live_get = live_get
        kopf = Kopf(observed)
        sent = time.monotonic()
        kopf.event("Job", "MODIFIED", job("2", True))  # (kopf folded the ADDED into this)
        observed.stored(job("1", False), sent)  # the create's answer, come after
        await asyncio.sleep(0.05)
        assert reads == ["m-compile"]
        assert (await observed.get("Job", "d", "m-compile"))["status"] == {"succeeded": 1}
        # an answer no delivery crossed is read at once, without a live read
        observed.stored(job("3", True), time.monotonic())
        assert (await observed.get("Job", "d", "m-compile"))["metadata"]["resourceVersion"] == "3"
        # deleted by the operator, and made again (delivered) before the deletion's answer came: shown
        sent = time.monotonic()
        kopf.event("Job", "ADDED", job("5", False))
        live["m-compile"] = job("5", False)
        observed.forget(job("4", True), sent)
        await asyncio.sleep(0.05)
        assert (await observed.get("Job", "d", "m-compile"))["metadata"]["resourceVersion"] == "5"
        await observed.stop()

    asyncio.run(scenario())


def test_a_crossed_writes_live_read_is_tried_again_while_the_api_server_is_away(monkeypatch):
    """The live read that settles a crossed write fails while the API server restarts: it is tried again
    until it answers (no later event may come: a Job completed at once is delivered once; CI's chaos run left
    a model compiling 600 s with its Job complete when the one read failed), and stops once a delivery has
    settled it."""
    monkeypatch.setattr(watching, "CONFIRM_RETRY", 0.01)
    job = lambda rv, done: {"kind": "Job", "status": {"succeeded": 1} if done else {},  # noqa: E731
                            "metadata": {"name": "m-compile", "namespace": "d", "resourceVersion": rv,
                                         "labels": {"neuronfleet.dev/model": "m"}}}  # fmt: skip
    away = {"reads": 3}
    reads: list[str] = []

    async def live_get(kind: str, ns: str, name: str) -> dict | None:
        reads.append(name)
        if away["reads"] > 0:
            away["reads"] -= 1
            raise ConnectionRefusedError("the API server is restarting")
        return job("2", True)

    async def scenario() -> None:
        observed = Observed(None)
        observed.live_get = live_get
        kopf = Kopf(observed)
        sent = time.monotonic()
        kopf.event("Job", "MODIFIED", job("2", True))
        observed.stored(job("1", False), sent)
        await wait_until_async(lambda: len(reads) == 4, "the fourth live read")
        await asyncio.sleep(0.05)
        assert (await observed.get("Job", "d", "m-compile"))["status"] == {"succeeded": 1}
        assert len(reads) == 4  # (settled: no more reads)
        # a delivery settles it while the API server is away: the reads stop
        away["reads"], before = 10**6, len(reads)
        sent = time.monotonic()
        kopf.event("Job", "MODIFIED", job("4", True))
        observed.stored(job("3", False), sent)
        await wait_until_async(lambda: len(reads) > before + 1, "a read that fails")
        kopf.event("Job", "MODIFIED", job("5", True))
        await asyncio.sleep(0.1)
        settled = len(reads)
        await asyncio.sleep(0.1)
        assert len(reads) == settled
        assert (await observed.get("Job", "d", "m-compile"))["metadata"]["resourceVersion"] == "5"
        await observed.stop()

    asyncio.run(scenario())


def test_a_change_the_watch_never_delivered_is_found_by_the_live_check_and_reported():
    """The leader's check of the watch (`Observed.check_live`): a model made anew whose delivery never came
    (kopf's index still holding the old one) and a Job whose completion never came are found in the live list,
    read as listed and reported as changes; an object as the watch delivered it, or one the operator wrote
    while the list was on its way, is left alone; a live list that fails finds nothing more (the next check
    tries again)."""
    model = lambda uid, rv, status=None: {"kind": "NeuronModel", "status": status or {},  # noqa: E731
                                          "metadata": {"name": "m", "namespace": "d", "uid": uid,
                                                       "resourceVersion": rv, "generation": 1}}  # fmt: skip
    owner = {"neuronfleet.dev/model": "m"}
    job = lambda rv, done: {"kind": "Job", "status": {"succeeded": 1} if done else {},  # noqa: E731
                            "metadata": {"name": "m-compile", "namespace": "d", "uid": "j",
                                         "resourceVersion": rv, "labels": owner}}  # fmt: skip
    other = {
        "kind": "NeuronModel",
        "metadata": {"name": "n", "namespace": "d", "uid": "n1", "resourceVersion": "7"},
    }
    live: dict[str, list[dict]] = {"NeuronModel": [model("new", "20"), other], "Job": [job("21", True)]}
    during: list = []  # what happens while a list is on its way
    changes: list[tuple[str, str, str]] = []

    async def live_list(kind: str, ns: str | None) -> list[dict]:
        for happen in during:
            happen()
        if kind not in live:
            raise ConnectionRefusedError("the API server is restarting")
        return [{k: v for k, v in o.items() if k != "kind"} for o in live[kind]]  # (list items carry no kind)

    def changed(event: str, obj: dict) -> None:
        changes.append((event, obj["kind"], obj["metadata"]["resourceVersion"]))

    async def scenario() -> None:
        observed = Observed(None, changed)
        observed.live_list = live_list
        kopf = Kopf(observed)
        kopf.event("NeuronModel", "ADDED", model("old", "3", {"observedGeneration": 1}))
        kopf.event("NeuronModel", "ADDED", other)
        kopf.event("Job", "ADDED", job("5", False))
        changes.clear()
        assert await observed.check_live() == 2
        assert changes == [("MODIFIED", "NeuronModel", "20"), ("MODIFIED", "Job", "21")]
        assert (await observed.get("NeuronModel", "d", "m"))["metadata"]["uid"] == "new"
        assert (await observed.get("Job", "d", "m-compile"))["status"] == {"succeeded": 1}
        changes.clear()
        assert await observed.check_live() == 0 and changes == []  # (read as listed now: nothing differs)
        # the operator's write answered while the list was on its way is as new as the list: left alone
        live["Job"] = [job("22", False)]
        during.append(lambda: observed.stored(job("23", True), time.monotonic()))
        assert await observed.check_live() == 0
        assert (await observed.get("Job", "d", "m-compile"))["metadata"]["resourceVersion"] == "23"
        during.clear()
        del live["Job"]
        live["NeuronModel"] = [model("new", "30")]
        assert await observed.check_live() == 1 and changes == [("MODIFIED", "NeuronModel", "30")]
        await observed.stop()

    asyncio.run(scenario())
