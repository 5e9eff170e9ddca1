"""The pure parts of the operator's ownership rule and caches: who controls an object (never patch
another owner's), the Conflict condition, the label selectors the cache answers itself, the namespaces it
watches."""

from __future__ import annotations

import asyncio

from neuronfleet.operator.cache import Cache, selector_matcher, watch_namespaces
from neuronfleet.operator.planner import foreign_owner
from neuronfleet.operator.status import transitions, with_conflicts


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


def test_the_cache_watches_the_namespaces_kopf_was_given_or_the_whole_cluster():
    assert watch_namespaces(["neuronfleet", "operator", "--all-namespaces"]) is None
    assert watch_namespaces(["x", "--standalone", "-A"]) is None
    assert watch_namespaces(["x", "--standalone"]) is None
    assert watch_namespaces(["x", "--namespace=team-a", "--namespace", "team-b", "-n", "c", "-nd"]) == [
        "team-a", "team-b", "c", "d",
    ]  # fmt: skip
    assert watch_namespaces(["x", "--namespace=team-*"]) is None  # a glob: no single watch follows it


def _service(rv: str, ingress: str | None = None) -> dict:
    status = {"loadBalancer": {"ingress": [{"ip": ingress}]}} if ingress else {}
    return {"kind": "Service", "metadata": {"name": "m", "namespace": "d", "resourceVersion": rv},
            "status": status}  # fmt: skip


def _cached_service(cache: Cache) -> dict:
    async def read() -> dict:
        cache._synced[("Service", None)] = event = asyncio.Event()
        event.set()
        return await cache.get("Service", "d", "m")

    return asyncio.run(read())


def test_a_writes_answer_never_puts_an_older_object_over_what_the_watch_delivered_since():
    """The answer to the operator's write and the watch travel apart: when another writer's change (here a
    load balancer's status) was delivered before the answer arrived, the cache keeps the newer object (else
    the model's endpoint would stay stale with no event to correct it)."""
    changes: list[tuple[str, str]] = []
    cache = Cache(None, None, lambda event, obj: changes.append((event, obj["metadata"]["resourceVersion"])))
    cache._apply("Service", "ADDED", _service("1"))
    cache._apply("Service", "MODIFIED", _service("2"))  # the operator's write, seen by the watch first
    cache._apply("Service", "MODIFIED", _service("3", "10.0.0.7"))  # the load balancer's
    cache.stored(_service("2"))  # the write's answer comes last
    assert _cached_service(cache)["metadata"]["resourceVersion"] == "3"
    assert changes[-1] == ("MODIFIED", "3")
    # the usual order: the answer first is cached at once, and its echo is not reported as a change
    cache.stored(_service("4"))
    assert _cached_service(cache)["metadata"]["resourceVersion"] == "4"
    cache._apply("Service", "MODIFIED", _service("4"))
    assert changes[-1] == ("MODIFIED", "3")
