"""The operator's work queue of models to reconcile (per-model serialization: a model is queued at most once
and one worker reconciles it at a time): fed by the watches (a model's own change, a child's change enqueues
its owner), by the passes' come-back times, by taking the lead and by the rare resync; a leader that may not
act keeps what it takes for when it acts again (`resume`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from . import kube, leader, rollout, spec, wake
from .autoscale_loop import AutoscaleLoop
from .cache import CHILD_LABEL, Cache
from .reconcile import PROGRESS_READ, now, reconcile

RESYNC_SECONDS = 600.0  # a cache-only pass over every model (no reads; writes only where something drifted)
WORKERS = 4  # reconciles triggered by children at once (each model's passes are serialized anyway)
RETRY_SECONDS = 10.0  # a failed child-triggered reconcile is tried again after this long

log = logging.getLogger(__name__)


def _left_by_an_earlier_model(key: tuple[str, str], status: dict[str, Any]) -> bool:
    """Whether the model's Conflict is an object of an earlier model of its name (deleted, then made again):
    the garbage collector deletes such an object, and its deletion may reach this replica before the new
    model does, so no later event would bring the model back."""
    conflict = next((c for c in status.get("conditions") or [] if c.get("type") == "Conflict"), None)
    return bool(
        conflict
        and conflict.get("status") == "True"
        and f"controlled by {spec.KIND} {key[1]} (uid" in (conflict.get("message") or "")
    )


class Triggers:
    """Models to reconcile because a child changed: a queue of (namespace, name), each at most once in it,
    worked by WORKERS tasks; and the periodic cache-only pass."""

    def __init__(self, client: kube.Kube, cache: Cache) -> None:
        self.client, self.cache = client, cache
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._queued: set[tuple[str, str]] = set()
        # models a child of which was deleted: read live before the pass (the garbage collector deletes the
        # children of a deleted model, and the cache may report that before the model's own deletion)
        self._check: set[tuple[str, str]] = set()
        self._tasks: list[asyncio.Task] = []
        self.autoscaler: AutoscaleLoop | None = None  # provider builtin's tick loop (autoscale_loop.py)
        self.wake: wake.WakeServer | None = None  # its wake endpoint (wake.py), with --wake-port
        self.elector: leader.LeaderElector | None = None
        # models taken while this leader could not act (its renewal late: the process starved), or whose
        # pass a write refused for that (NotLeading): queued again once it acts (`resume`), never dropped
        self._parked: set[tuple[str, str]] = set()
        self._resumed = asyncio.Event()  # set whenever nothing is parked
        self._resumed.set()
        self._progress: set[tuple[str, str]] = set()  # compiling models whose next progress read is timed

    def changed(self, event: str, obj: dict[str, Any]) -> None:
        """A watched object changed (not by this operator's own write): a model added or changed is
        reconciled; a child's change reconciles its model."""
        meta = obj.get("metadata") or {}
        if obj.get("kind") == spec.KIND:
            if event != "DELETED":  # (its children go with it: the garbage collector's)
                self.enqueue((meta.get("namespace", ""), meta.get("name", "")))
            return
        model = (meta.get("labels") or {}).get(CHILD_LABEL)
        if model:
            if self.autoscaler is not None:
                self.autoscaler.pod_changed(obj)
            if event == "DELETED" and obj.get("kind") != "Pod":  # pods go in every roll: no live read
                self._check.add((meta.get("namespace", ""), model))
            self.enqueue((meta.get("namespace", ""), model))

    def enqueue(self, key: tuple[str, str]) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def come_back(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        """A model whose retired pods are draining is reconciled again once they have (status.drainUntil),
        one whose compile waits to be tried again, then (status.compileRetryAt), and one whose failed
        compile's source is fingerprinted again, then (status.sourceCheckAt), a compiling one every
        PROGRESS_READ seconds (its compile pod's progress), and one that found an earlier model's object
        in its way after RETRY_SECONDS; through the queue, so that pass reports its events and stops with
        the operator."""
        for field in ("drainUntil", "compileRetryAt", "sourceCheckAt"):
            if status.get(field):
                delay = rollout.seconds_until(status[field], now()) + 1
                asyncio.get_running_loop().call_later(delay, self.enqueue, key)
        if _left_by_an_earlier_model(key, status):  # the garbage collector deletes it: look again soon
            asyncio.get_running_loop().call_later(RETRY_SECONDS, self.enqueue, key)
        compiling = any(c.get("reason") == "Compiling" for c in status.get("conditions") or [])
        if compiling and key not in self._progress:  # its compile pod's progress is read again then
            self._progress.add(key)
            asyncio.get_running_loop().call_later(PROGRESS_READ, self._progress_due, key)

    def _progress_due(self, key: tuple[str, str]) -> None:
        self._progress.discard(key)
        self.enqueue(key)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(), name=f"trigger worker {i}") for i in range(WORKERS)]
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            try:
                await self._one(key)
            finally:
                self._queue.task_done()
            # a pass the caches answer alone (most, once the models are converged) awaits nothing that
            # waits, nor does taking a key from a full queue: without this, the workers would go through a
            # whole pass over every model without letting any other task (the watches, the wake endpoint)
            # run: seconds at 1000 models (docs/benchmarks.md)
            await asyncio.sleep(0)

    async def _one(self, key: tuple[str, str]) -> None:
        self._queued.discard(key)
        if not self.acting():
            self._park(key)
            return
        try:
            if key in self._check:
                self._check.discard(key)
                body = await self.client.get(spec.KIND, *key, live=True)
            else:
                body = await self.cache.get(spec.KIND, *key)
            if body is None:
                return  # the model is gone; its children go with it
            status = await reconcile_and_report(self.client, body, log)
            self.come_back(key, status)
        except asyncio.CancelledError:
            raise
        except kube.NotLeading:
            log.info("reconciling %s/%s stopped: this replica does not act now", *key)
            self._park(key)
        except Exception as e:
            if isinstance(e, kube.KubeError) or kube.unreachable(e):  # refused after the client's own tries,
                # or a write cut off (an API-server restart; not sent again: it may have been applied)
                log.warning("reconciling %s/%s failed: %s; trying again in %.0f s", *key, e, RETRY_SECONDS)
            else:
                log.exception("reconciling %s/%s failed; trying again in %.0f s", *key, RETRY_SECONDS)
            asyncio.get_running_loop().call_later(RETRY_SECONDS, self.enqueue, key)

    def acting(self) -> bool:
        return self.elector is None or self.elector.acting()

    def _park(self, key: tuple[str, str]) -> None:
        """A model this replica could not reconcile because it did not act: a leader whose renewal is late
        keeps it for when it acts again (`resume`); a follower drops it (a new leader reconciles every model,
        and one that lost the Lease exits)."""
        if self.elector is not None and self.elector.lead:
            self._parked.add(key)
            self._resumed.clear()

    def resume(self) -> None:
        """This replica acts (it has just taken or renewed the Lease): what it put off is queued again."""
        if self._parked:
            log.info("acting again: %d model(s) put off meanwhile are queued again", len(self._parked))
            for key in sorted(self._parked):
                self.enqueue(key)
            self._parked.clear()
        self._resumed.set()

    async def drained(self) -> None:
        """Until every model queued has been taken: reconciled, or put off until this replica acts again."""
        await self._queue.join()

    async def settled(self) -> None:
        """Until every model queued has been taken and reconciled, none put off (models queued meanwhile
        included)."""
        await self.drained()
        while not self._resumed.is_set():
            await self._resumed.wait()
            await self.drained()

    async def lead(self) -> None:
        """This replica leads now: once its caches are whole, the autoscaler's loop starts and every model
        is reconciled (what it saw as a follower, it did not act on)."""
        await self.cache.synced()
        if self.autoscaler is not None:
            self.autoscaler.start()
        models = self.cache.models()
        for model in models:
            self.enqueue((model["metadata"]["namespace"], model["metadata"]["name"]))
        await self.settled()
        log.info("leading: every model reconciled once (%d)", len(models))

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            for model in self.cache.models():
                self.enqueue((model["metadata"]["namespace"], model["metadata"]["name"]))


async def reconcile_and_report(
    client: kube.Kube, body: dict[str, Any], logger: logging.Logger
) -> dict[str, Any]:
    """One pass; the events it reports are posted once it is done. Returns the model's status."""
    events: list[tuple[str, str, str]] = []
    try:
        return await reconcile(client, body, lambda *event: events.append(event))
    finally:
        for type_, reason, message in events:
            logger.info("%s %s: %s", type_, reason, message)
            try:
                await client.post_event(body, type_, reason, message)
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                logger.warning("the event %s could not be posted: %r", reason, e)  # only the event is lost
