"""The operator's leader election (the shell of `leadership`): every replica runs a `LeaderElector` that
reads and writes the `coordination.k8s.io/v1` Lease in the operator's namespace every retry period, on a
thread of its own (the operator's own work cannot hold a renewal back). The leader reconciles, autoscales
and answers wake calls; followers keep kopf's indexes warm and do none of it (`kube.Kube` refuses their
writes). Becoming leader starts `on_lead`; a leader that could not renew within the renew deadline has
lost: it stops (SIGTERM to itself, as controller-runtime exits) before anyone may take the Lease, and its
pod starts again as a follower. A renewal that lands late but finds the Lease still its own (the whole
process was starved: no one could take the Lease yet) lets the leader act again, and `on_renewed` takes up
what it put off meanwhile. A clean stop releases the Lease.

Settings (flags of `neuronfleet operator`, the chart's `leaderElection` values): NEURONFLEET_LEADER_ELECT
(default on), NEURONFLEET_LEASE_NAME, NEURONFLEET_LEASE_NAMESPACE (default: the pod's namespace),
NEURONFLEET_LEASE_DURATION_SECONDS, NEURONFLEET_RENEW_DEADLINE_SECONDS, NEURONFLEET_RETRY_PERIOD_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from . import kube, metrics
from .leadership import JITTER, Leading, Seen, Timing, released, step

log = logging.getLogger(__name__)

ELECT_ENV = "NEURONFLEET_LEADER_ELECT"
NAME_ENV, NAMESPACE_ENV = "NEURONFLEET_LEASE_NAME", "NEURONFLEET_LEASE_NAMESPACE"
TIMING_ENVS = {
    "lease_duration": "NEURONFLEET_LEASE_DURATION_SECONDS",
    "renew_deadline": "NEURONFLEET_RENEW_DEADLINE_SECONDS",
    "retry_period": "NEURONFLEET_RETRY_PERIOD_SECONDS",
}
LEASE_NAME = "neuronfleet-operator"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class Settings:
    enabled: bool
    name: str
    namespace: str
    identity: str
    timing: Timing


def settings(environ: Mapping[str, str] = os.environ) -> Settings:
    """The election's settings from the environment; ValueError naming the setting that is wrong."""
    enabled = environ.get(ELECT_ENV, "true").strip().lower()
    if enabled not in ("true", "false", "1", "0"):
        raise ValueError(f"{ELECT_ENV}={enabled!r}: expected true or false")
    values = {}
    for key, env in TIMING_ENVS.items():
        raw = environ.get(env)
        if raw is None or raw == "":
            continue
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r}: expected seconds, e.g. 15") from None
    timing = Timing(**values)
    if problems := timing.problems():
        raise ValueError("leader election: " + "; ".join(problems))
    namespace = environ.get(NAMESPACE_ENV) or environ.get("POD_NAMESPACE") or _own_namespace()
    # client-go's identity: the host name and a unique suffix (two processes on one host stay apart)
    identity = f"{environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    name = environ.get(NAME_ENV) or LEASE_NAME
    return Settings(enabled in ("true", "1"), name, namespace, identity, timing)


def _own_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


class LeaderElector:
    """One replica's candidacy. `acting()` says whether it may act now (always, with election off).

    Its tries run on a thread of their own, with their own event loop and HTTP connection: the replica's own
    work (a pass over every model that the indexes answer alone, a re-list of every object) can keep the
    operator's event loop from running any other task for seconds (measured: docs/benchmarks.md), and a
    renewal waiting behind it would lose the lead though nothing else is wrong. Becoming leader, and each
    renewal, are handed to the operator's loop (`on_lead`, `on_renewed`)."""

    def __init__(
        self, client: kube.Kube, config: Settings, on_lead: Callable[[], Awaitable[None]],
        on_renewed: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """`on_lead` runs when this replica becomes leader; `on_renewed` after every Lease write of its that
        succeeded (it may act from then: what it put off while it could not is taken up again); `clock`:
        monotonic seconds."""
        self.client, self.config, self.on_lead, self.on_renewed = client, config, on_lead, on_renewed
        self.clock = clock
        self.seen, self.leading = Seen(), Leading()
        self.lead = False  # it leads (became leader and has not lost)
        self.holder = ""  # who leads, as last read
        self._loop: asyncio.AbstractEventLoop | None = None  # the operator's: on_lead, on_renewed run there
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._tries: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None  # the thread's loop, task
        self._leading_task: asyncio.Task | None = None  # on_lead, running
        self._lease: dict | None = None  # as last written or read
        self._late = 0.0  # how late (seconds) this try started after its retry period

    def acting(self) -> bool:
        if not self.config.enabled:
            return True
        return self.lead and self.leading.acting(self.clock(), self.config.timing)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.config.enabled:
            log.info("leader election off: this replica acts alone")
            metrics.leader(True)
            self._leading_task = asyncio.create_task(self.on_lead(), name="lead")
            return
        metrics.leader(False)
        self._thread = threading.Thread(target=self._elect, name="leader election", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop trying and leading; a leader releases the Lease, so that a follower takes it at its next
        try."""
        if self._thread is not None:
            self._stopped.set()
            if self._tries is not None:
                loop, task = self._tries
                with contextlib.suppress(RuntimeError):  # (its loop has closed: it had stopped)
                    loop.call_soon_threadsafe(task.cancel)  # (a call under way included)
            await asyncio.to_thread(self._thread.join)
        if self._leading_task is not None:
            self._leading_task.cancel()
            await asyncio.gather(self._leading_task, return_exceptions=True)
        if self.config.enabled and self.lead and self._lease is not None:
            self.lead = False
            try:
                await self._release()
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("the lease could not be released (a follower takes it once it lapses): %r", e)
        metrics.leader(False)

    async def _release(self) -> None:
        """Give the Lease up. The copy last seen may be stale: a renewal cancelled by the stop may have been
        applied with its answer never read. On a conflict the Lease is read again and given up only while it
        is still this replica's (a follower that took it meanwhile keeps it)."""
        c, lease = self.config, self._lease
        for _ in range(3):
            try:
                await self.client.replace_lease(released(lease))
                log.info("released the lease %s/%s", c.namespace, c.name)
                return
            except kube.KubeError as e:
                if e.status != 409:
                    raise
            lease = await self.client.get("Lease", c.namespace, c.name, live=True)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != c.identity:
                log.info(
                    "the lease %s/%s is no longer this replica's: nothing to release", c.namespace, c.name
                )
                return
        raise kube.KubeError(
            409, f"the lease {c.namespace}/{c.name} kept changing while it was being released"
        )

    def _elect(self) -> None:
        """The election thread: tries every retry period until this replica loses the lead or stops."""
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(self._run())

    async def _run(self) -> None:
        c, timing = self.config, self.config.timing
        self._tries = (asyncio.get_running_loop(), asyncio.current_task())
        log.info("leader election: %s is a candidate for the lease %s/%s", c.identity, c.namespace, c.name)
        client = kube.Kube(self.client.login)  # (its own ApiClient on this thread's loop: its own connection)
        try:
            while not self._stopped.is_set() and await self.tick(client):
                pause = timing.retry_period if self.lead else timing.retry_period * random.uniform(1, JITTER)
                due = self.clock() + pause
                await asyncio.sleep(pause)
                self._late = max(0.0, self.clock() - due)
        finally:
            await client.close()

    async def tick(self, client: kube.Kube | None = None) -> bool:
        """One try (every retry period) through `client` (its thread passes its own; by default, the one it
        was given): read the Lease, and take or renew it where this replica may. False once this replica has
        lost the lead (it could not renew within the renew deadline): it has stopped acting and exits
        (SIGTERM to itself, as controller-runtime's manager exits; kopf stops, and the pod starts again as a
        follower)."""
        c, timing = self.config, self.config.timing
        try:
            await self._try(client or self.client)
        except asyncio.CancelledError:
            raise
        except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("leader election: the lease could not be read or written: %r", e)
        if self.lead and not self.acting():
            log.error(
                "leader election: %s could not renew the lease within %g s; it stops acting and exits",
                c.identity, timing.renew_deadline,
            )  # fmt: skip
            self.lead = False
            metrics.leader(False)
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        return True

    async def _try(self, client: kube.Kube) -> None:
        c, timing = self.config, self.config.timing
        sent = self.clock()
        lease = await client.get("Lease", c.namespace, c.name, live=True)
        move = step(lease, c.identity, self.seen, sent, datetime.datetime.now(datetime.UTC), timing,
                    namespace=c.namespace, name=c.name)  # fmt: skip
        self._lease = lease
        if move.write is None:
            self._holder(move.holder)
            return
        # no later than the API server applies the write, so no earlier than any other candidate sees it:
        # acting until `renew_deadline` after it ends before anyone may take the Lease
        writing = self.clock()
        try:
            write = client.create if move.create else client.replace_lease
            written = await write(move.write)
        except kube.KubeError as e:
            if e.status in (409, 422):  # another candidate wrote first: read again next time
                return
            raise
        last, self.leading.renewed_at = self.leading.renewed_at, writing
        self._lease = written
        self._holder(c.identity)
        if self.lead and last is not None and writing - last >= timing.renew_deadline:
            # the Lease was still this replica's (the write's resourceVersion proves no one took it), so it
            # leads on; meanwhile it acted on nothing, and `on_renewed` takes up what it put off
            log.warning(
                "leader election: %s renewed the lease %.1f s after its last renewal, past the %g s renew "
                "deadline (this try started %.1f s late, its calls took %.1f s): it did not act meanwhile, "
                "and leads on", c.identity, writing - last, timing.renew_deadline, self._late,
                self.clock() - sent,
            )  # fmt: skip
        loop = self._loop or asyncio.get_running_loop()
        if not self.lead:
            self.lead = True
            metrics.leader(True)
            log.info("leader election: %s leads (lease %s/%s)", c.identity, c.namespace, c.name)
            loop.call_soon_threadsafe(self._begin)
            try:
                await client.post_event(written, "Normal", "LeaderElection", f"{c.identity} became leader")
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("the LeaderElection event could not be posted: %r", e)  # (only the event is lost)
        loop.call_soon_threadsafe(self.on_renewed)

    def _begin(self) -> None:
        """(On the operator's loop) this replica leads: `on_lead` runs."""
        self._leading_task = asyncio.create_task(self.on_lead(), name="lead")

    def _holder(self, holder: str) -> None:
        if holder != self.holder:
            self.holder = holder
            if holder and holder != self.config.identity:
                log.info("leader election: %s leads; this replica follows", holder)
