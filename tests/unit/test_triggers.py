"""The operator's triggers (operator/triggers.py): a model that found an object of an earlier model of its
name in its way (deleted, then made again: the garbage collector deletes that object) is looked at again, as
no later event may bring it back; a conflict with any other owner is left to the Conflict condition; a pass
that awaits nothing lets the operator's other tasks run between its models. (A leader whose renewal lands
late: tests/e2e/test_leader_election.py.)"""

from __future__ import annotations

import asyncio

import pytest

from neuronfleet.operator import triggers
from neuronfleet.operator.cache import Cache


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


class Quiet:
    """An API server, as the cache sees it, that holds nothing and reports no change."""

    async def list_all(self, kind: str, namespace: str | None, selector: str) -> tuple[list, str]:
        return [], "1"

    async def watch(self, kind: str, namespace: str | None, selector: str, rv: str, timeout: float):
        await asyncio.Event().wait()
        yield  # (an async generator that never yields an event)


def test_a_pass_that_awaits_nothing_lets_other_tasks_run_between_its_models():
    """Models gone from the cache (as converged ones, a pass the cache answers alone): the workers take them
    one by one, and another task (the watches, the wake endpoint) runs between them rather than after the
    whole pass."""
    models = 400

    async def scenario() -> int:
        cache = Cache(Quiet(), None, lambda event, obj: None)
        work = triggers.Triggers(None, cache)
        cache.start()
        await cache.synced()
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
        await cache.stop()
        return turns

    assert asyncio.run(scenario()) >= models // (2 * triggers.WORKERS)  # (a turn every WORKERS models)
