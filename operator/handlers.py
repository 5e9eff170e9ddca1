"""The operator's triggers of the one reconcile path (`reconcile.reconcile`), all from its own watch-backed
caches (`cache.Cache`); kopf runs the process (start-up, signals, clean-up, liveness) and watches nothing.

A NeuronModel is reconciled when it is added or changed by anyone but the operator itself, and when one of
its children (labelled neuronfleet.dev/model) is added, changed or deleted (a deleted Service comes back as
soon as the watch reports it); every model once when this replica starts to lead (at start-up, or on
taking over). Reconciles read the caches, not the API server; a rare cache-only pass over every model
(RESYNC_SECONDS) is the safety net for a change no watch reported. The caches list again the moment the API
server answers after an outage, and a NeuronModel CRD that is missing (not installed yet, or being
replaced) is waited for: the operator never exits for it.

No finalizer: deletion never needs the operator. Every child carries an ownerReference to its NeuronModel
(controller, blockOwnerDeletion), so the API server's garbage collector deletes them when the model goes;
nothing outside the owner references (no external resource, no shared file) needs cleaning, so a model is
deleted at once even with the operator stopped or uninstalled.

The builtin autoscaler's tick loop (`autoscale_loop.AutoscaleLoop`) starts when this replica leads and
queues a model's reconcile through the triggers when it has changed the model's replicas; it hears of every
pod the caches report (a cold start ends when a new pod is ready), and with `--wake-port` the wake endpoint
(`wake.py`) runs its decision for a model whose front door holds a request.

Several replicas (leader election, `leader.py`): every replica keeps its caches warm; only the leader
reconciles, runs the autoscaler's loop and answers wake calls, and `kube.Kube` refuses any other replica's
write, so a follower writes nothing at all. A leader that may not act for a while (its renewal late: the
process was starved) keeps every model it takes meanwhile, and every model whose pass a refused write cut
off, and queues them again once it acts (`Triggers.resume`, after each renewal): none waits for the resync.

Shutdown: on SIGTERM the cleanup handler stops the wake endpoint, the autoscaler's loop and the trigger
workers, then releases the Lease (a follower leads at once) and stops the caches before it closes the HTTP
session.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import aiohttp
import kopf

from . import kube, leader, names, rollout, spec, wake
from .autoscale_loop import AutoscaleLoop
from .cache import CHILD_LABEL, Cache, watch_namespaces
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


_client: kube.Kube | None = None
_triggers: Triggers | None = None


def client() -> kube.Kube:
    global _client
    if _client is None:
        _client = kube.Kube(kube.load_credentials())
    return _client


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


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _triggers
    # kopf watches nothing (the caches do): no scanning of CRDs and namespaces either, so the operator needs
    # no cluster-wide permission beyond its own resources (RBAC_RULES)
    settings.scanning.disabled = True
    election = leader.settings()
    cache = Cache(client(), watch_namespaces(sys.argv), lambda event, obj: triggers.changed(event, obj))
    _triggers = triggers = Triggers(client(), cache)
    client().cache = cache
    cache.start()
    _triggers.start()
    triggers.autoscaler = AutoscaleLoop(client(), triggers.enqueue, cache.models)
    triggers.elector = leader.LeaderElector(client(), election, triggers.lead, triggers.resume)
    client().may_write = triggers.elector.acting
    if (where := wake.configured()) is not None:

        async def known(namespace: str, name: str) -> bool:  # from the cache alone: no call for a name
            if not cache.watches(spec.KIND, namespace):
                return False
            return await cache.get(spec.KIND, namespace, name) is not None

        async def secret(namespace: str, name: str) -> dict[str, Any] | None:  # (Secrets are never cached)
            return await client().get("Secret", namespace, names.internal(name), live=True)

        tokens = wake.Tokens(known, secret)
        triggers.wake = wake.WakeServer(triggers.autoscaler.wake, tokens, triggers.acting)
        await triggers.wake.start(*where)
    triggers.elector.start()


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _triggers is not None:
        if _triggers.wake is not None:
            await _triggers.wake.stop()
        if _triggers.autoscaler is not None:
            await _triggers.autoscaler.stop()
        await _triggers.stop()  # (a reconcile in flight finishes, while this replica still leads)
        if _triggers.elector is not None:
            await _triggers.elector.stop()  # then the Lease is released: a follower leads at once
        await _triggers.cache.stop()
    if _client is not None:
        await _client.close()
