"""The operator's work queue of models to reconcile (per-model serialization: a model is queued at most once
and one worker reconciles it at a time): fed by the watches (a model's own change, a child's change enqueues
its owner), by the passes' come-back times, by taking the lead and by the rare resync; a leader that may not
act keeps what it takes for when it acts again (`resume`).

A pass that fails is tried again after a growing delay (`retries.Backoff`: 1 s doubling up to 300 s, never
sooner than the API server's Retry-After), and meanwhile only a new generation of the model (the user changed
it), or another model of its name (made anew), is tried at once; every other trigger of it waits for that
retry. A write the API server refuses (a webhook's or a quota's 403, a 422) is named (`WriteRefused`) and said
once in a Warning Event `ApplyRefused` with the server's words: once per distinct message until a pass
succeeds, and a failing pass's other Events once too, so nothing is written again and again. Each model has
at most one timer per reason (a come-back time, a compile's progress read, the retry), all cancelled by
`stop`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp

from . import kube, leader, rollout, spec, wake
from .autoscale_loop import AutoscaleLoop
from .reconcile import PROGRESS_READ, now, reconcile
from .retries import Backoff, Retries, Said, retry_after_seconds
from .watching import CHILD_LABEL, Observed

RESYNC_SECONDS = 600.0  # a cache-only pass over every model (no reads; writes only where something drifted)
CHECK_SECONDS = 15.0  # a leader compares the models and their Jobs with a live list this often (two LISTs)
WORKERS = 4  # reconciles triggered by children at once (each model's passes are serialized anyway)
EARLIER_MODEL_SECONDS = 10.0  # a model in the way of an earlier model's object looks again after this long
REFUSED = "ApplyRefused"  # the Warning Event's reason for a write the API server refused
RETRY = "retry"  # the timer of a failing model's next pass (come_back's timers are named by their field)

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


class WriteRefused(kube.KubeError):
    """A write of the pass that the API server refused, with what was written (`kind`, `name`) and the
    server's words (`words`); its status is the answer's."""

    def __init__(self, error: kube.KubeError, kind: str, name: str) -> None:
        words = str(error).removeprefix(f"{error.status}: ")
        super().__init__(error.status, words)
        self.kind, self.name, self.words = kind, name, words


def refusal_event(refused: WriteRefused, backoff: Backoff) -> Said:
    """The Warning Event that says a write was refused: what, the answer's status and the server's words."""
    message = (
        f"the API server refused the operator's write of {refused.kind} {refused.name} ({refused.status}): "
        f"{refused.words}. It is tried again at growing intervals, up to every {backoff.most:g} s, and at "
        "once when the model changes"
    )
    return "Warning", REFUSED, message


def server_delay(error: BaseException) -> float | None:
    """The API server's Retry-After for the request that failed, in seconds, where the error or one it was
    raised from carries the answer's headers (`headers`, as the official client's ApiException does)."""
    cause: BaseException | None = error
    while cause is not None:
        headers = getattr(cause, "headers", None)
        if headers:
            return retry_after_seconds(headers.get("Retry-After"))
        cause = cause.__cause__
    return None


@contextlib.contextmanager
def _naming(kind: str, name: str) -> Iterator[None]:
    try:
        yield
    except kube.NotLeading:  # (not refused by the API server: retried by whoever leads)
        raise
    except WriteRefused:
        raise
    except kube.KubeError as e:
        raise WriteRefused(e, kind, name) from e


class _NamingWrites:
    """The client as a pass writes through it: a write the API server refuses is raised as `WriteRefused`,
    which names what was written (a 409 on create stays a KubeError of status 409, as `reconcile.apply`
    expects); everything else is the client's own."""

    def __init__(self, client: kube.Kube) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        with _naming(obj["kind"], obj["metadata"]["name"]):
            return await self._client.create(obj)

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        with _naming(kind, name):
            return await self._client.patch(kind, namespace, name, patch)

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        with _naming(kind, name):
            return await self._client.delete(kind, namespace, name)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        with _naming(spec.KIND, f"{name} (its status)"):
            return await self._client.patch_status(namespace, name, status)


class Triggers:
    """Models to reconcile because a child changed: a queue of (namespace, name), each at most once in it,
    worked by WORKERS tasks; failing models' retries (`backoff`: their schedule); and the periodic cache-only
    pass."""

    def __init__(self, client: kube.Kube, cache: Observed, backoff: Backoff | None = None) -> None:
        self.client, self.cache = client, cache
        self.retries = Retries(backoff)
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._queued: set[tuple[str, str]] = set()
        # models a child of which was deleted: read live before the pass (the garbage collector deletes the
        # children of a deleted model, and the cache may report that before the model's own deletion)
        self._check: set[tuple[str, str]] = set()
        self._tasks: list[asyncio.Task] = []
        self.wake_url: str | None = None  # the wake endpoint as routers reach it (--wake-url)
        self.autoscaler: AutoscaleLoop | None = None  # provider builtin's tick loop (autoscale_loop.py)
        self.wake: wake.WakeServer | None = None  # its wake endpoint (wake.py), with --wake-port
        self.elector: leader.LeaderElector | None = None
        # models taken while this leader could not act (its renewal late: the process starved), or whose
        # pass a write refused for that (NotLeading): queued again once it acts (`resume`), never dropped
        self._parked: set[tuple[str, str]] = set()
        self._resumed = asyncio.Event()  # set whenever nothing is parked
        self._resumed.set()
        # (model, reason) -> its one pending timer: a come-back field, "progress", "earlier model" or RETRY
        self._timers: dict[tuple[tuple[str, str], str], asyncio.TimerHandle] = {}

    def changed(self, event: str, obj: dict[str, Any]) -> None:
        """A watched object changed (not by this operator's own write): a model added or changed is
        reconciled (at once where it is a new generation of a failing model); a child's change reconciles
        its model."""
        meta = obj.get("metadata") or {}
        if obj.get("kind") == spec.KIND:
            if event != "DELETED":  # (its children go with it: the garbage collector's)
                key = (meta.get("namespace", ""), meta.get("name", ""))
                if self.retries.changed_by_user(key, meta.get("generation", 1), meta.get("uid")):
                    self._put(key)  # the user changed the spec (or made it anew): no waiting out the back-off
                else:
                    self.enqueue(key)
            return
        model = (meta.get("labels") or {}).get(CHILD_LABEL)
        if model:
            if self.autoscaler is not None:
                self.autoscaler.pod_changed(obj)
            if event == "DELETED" and obj.get("kind") != "Pod":  # pods go in every roll: no live read
                self._check.add((meta.get("namespace", ""), model))
            self.enqueue((meta.get("namespace", ""), model))

    def offers_changed(self, instance_types: set[str] | None) -> None:
        """What the nodes of `instance_types` (None: any) offer changed (`node_watch`): their models are
        reconciled (their Schedulable condition)."""
        for model in self.cache.models():
            neuron = (model.get("spec") or {}).get("neuron") or {}
            if instance_types is None or neuron.get("instanceType") in instance_types:
                self.enqueue((model["metadata"]["namespace"], model["metadata"]["name"]))

    def enqueue(self, key: tuple[str, str]) -> None:
        """Reconcile the model: at once, unless its passes are failing and its retry is still ahead (that
        retry then reconciles it, with whatever changed meanwhile)."""
        if self.retries.waiting(key, asyncio.get_running_loop().time()):
            return
        self._put(key)

    def _put(self, key: tuple[str, str]) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def come_back(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        """A model whose retired pods are draining is reconciled again once they have (status.drainUntil),
        one whose compile waits to be tried again, then (status.compileRetryAt), and one whose failed
        compile's source is fingerprinted again, then (status.sourceCheckAt), a compiling one every
        PROGRESS_READ seconds (its compile pod's progress), and one that found an earlier model's object
        in its way after EARLIER_MODEL_SECONDS; through the queue, so that pass reports its events and stops
        with the operator. One timer per model and reason: a pending one that is due sooner is kept."""
        for field in ("drainUntil", "compileRetryAt", "sourceCheckAt"):
            if status.get(field):
                self._later(key, field, rollout.seconds_until(status[field], now()) + 1)
        if _left_by_an_earlier_model(key, status):  # the garbage collector deletes it: look again soon
            self._later(key, "earlier model", EARLIER_MODEL_SECONDS)
        if any(c.get("reason") == "Compiling" for c in status.get("conditions") or []):
            self._later(key, "progress", PROGRESS_READ)  # its compile pod's progress is read again then

    def _later(self, key: tuple[str, str], reason: str, delay: float, keep_sooner: bool = True) -> None:
        """The model's timer for `reason`, due in `delay` seconds: it replaces the pending one, unless
        `keep_sooner` and that one is due no later."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(delay, 0.0)
        pending = self._timers.get((key, reason))
        if pending is not None:
            if keep_sooner and pending.when() <= when:
                return
            pending.cancel()
        self._timers[(key, reason)] = loop.call_at(when, self._due, key, reason)

    def _due(self, key: tuple[str, str], reason: str) -> None:
        self._timers.pop((key, reason), None)
        if reason == RETRY:
            self._put(key)  # (its back-off is over: a timer may run a moment before its time)
        else:
            self.enqueue(key)

    def pending(self, key: tuple[str, str]) -> dict[str, float]:
        """The model's timers: reason -> when it is due, in the event loop's time."""
        return {reason: timer.when() for (k, reason), timer in self._timers.items() if k == key}

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(), name=f"trigger worker {i}") for i in range(WORKERS)]
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))
        self._tasks.append(asyncio.create_task(self._check_live(), name="check the watch"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

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
        body: dict[str, Any] | None = None
        try:
            if key in self._check:
                self._check.discard(key)
                body = await self.client.get(spec.KIND, *key, live=True)
            else:
                body = await self.cache.get(spec.KIND, *key)
            if body is None:
                self._succeeded(key)
                return  # the model is gone; its children go with it
            status = await reconcile_and_report(
                _NamingWrites(self.client), body, log, self.retries, self.wake_url
            )
            self._succeeded(key)
            self.come_back(key, status)
        except asyncio.CancelledError:
            raise
        except kube.NotLeading:
            log.info("reconciling %s/%s stopped: this replica does not act now", *key)
            self._park(key)
        except Exception as e:
            await self._failed(key, body, e)

    def _succeeded(self, key: tuple[str, str]) -> None:
        """The model's pass succeeded (or found it gone): its back-off and what its failures said are
        forgotten, and its retry is not needed."""
        self.retries.succeeded(key)
        timer = self._timers.pop((key, RETRY), None)
        if timer is not None:
            timer.cancel()

    async def _failed(self, key: tuple[str, str], body: dict[str, Any] | None, error: Exception) -> None:
        """The model's pass failed: it is tried again after its back-off; a write the API server refused is
        said in a Warning Event, once per distinct message until a pass succeeds."""
        meta = (body or {}).get("metadata") or {}
        loop = asyncio.get_running_loop()
        delay = self.retries.failed(
            key, loop.time(), meta.get("generation", 1), server_delay(error), meta.get("uid")
        )
        failures = self.retries.failures(key)
        if isinstance(error, kube.KubeError) or kube.unreachable(error):  # refused after the client's own
            # tries, or a write cut off (an API-server restart; not sent again: it may have been applied)
            log.warning("reconciling %s/%s failed (%d in a row): %s; trying again in %.3g s",
                        *key, failures, error, delay)  # fmt: skip
        else:
            log.exception("reconciling %s/%s failed (%d in a row); trying again in %.3g s",
                          *key, failures, delay)  # fmt: skip
        self._later(key, RETRY, delay, keep_sooner=False)
        if isinstance(error, WriteRefused) and body is not None:
            event = refusal_event(error, self.retries.backoff)
            if self.retries.first_said(key, event):
                try:
                    await self.client.post_event(body, *event)
                except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                    self.retries.unsay(key, event)  # (said with the next failure)
                    log.warning("the event %s could not be posted: %r", REFUSED, e)

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
                self._put(key)
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
        for key in takeover_order(models):
            self._put(key)
        await self.settled()
        log.info("leading: every model reconciled once (%d)", len(models))

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            for model in self.cache.models():
                self.enqueue((model["metadata"]["namespace"], model["metadata"]["name"]))

    async def _check_live(self) -> None:
        """While this replica acts, the watch's view of the models and their Jobs is checked against a live
        list every CHECK_SECONDS (`Observed.check_live`): a change it never delivered is reconciled."""
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            if self.acting():
                await self.cache.check_live()


def takeover_order(models: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The models a new leader reconciles, as queue keys: first those whose spec changed since a pass last
    reported on them (no status yet, or its observedGeneration behind the generation: a change made while no
    replica led), then the rest, each part in name order. The rest are converged, or nearly: their passes
    mostly find nothing to write, and a change queued behind a few hundred of them would wait for the client's
    rate limit to get through them."""

    def behind(model: dict[str, Any]) -> bool:
        observed = (model.get("status") or {}).get("observedGeneration")
        return observed is None or observed < (model["metadata"].get("generation") or 0)

    keys = sorted((not behind(m), m["metadata"]["namespace"], m["metadata"]["name"]) for m in models)
    return [(ns, name) for _, ns, name in keys]


async def reconcile_and_report(
    client: kube.Kube,
    body: dict[str, Any],
    logger: logging.Logger,
    retries: Retries | None = None,
    wake_url: str | None = None,
) -> dict[str, Any]:
    """One pass; the events it reports are posted once it is done, each once while the model fails where
    `retries` remembers what was said (one whose status write is refused would otherwise say the same
    transitions every retry, and the pass that writes that status at last, once more); an event that could
    not be posted is not remembered. Returns the model's status."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    events: list[Said] = []
    try:
        return await reconcile(client, body, lambda *event: events.append(event), wake_url)
    finally:
        for event in events:
            if retries is not None and not retries.first_said(key, event):
                continue
            type_, reason, message = event
            logger.info("%s %s: %s", type_, reason, message)
            try:
                await client.post_event(body, type_, reason, message)
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                logger.warning("the event %s could not be posted: %r", reason, e)  # only the event is lost
                if retries is not None:
                    retries.unsay(key, event)  # (said by the next pass that reports it)
