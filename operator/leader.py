"""The operator's leader election (the shell of `leadership`): every replica runs a `LeaderElector` that
reads and writes the `coordination.k8s.io/v1` Lease in the operator's namespace every retry period. The
leader reconciles, autoscales and answers wake calls; followers keep their caches warm and do none of it
(`kube.Kube` refuses their writes). Becoming leader starts `on_lead`; a leader that could not renew within
the renew deadline has lost: it stops (SIGTERM to itself, as controller-runtime exits) before anyone may
take the Lease, and its pod starts again as a follower. A clean stop releases the Lease.

Settings (flags of `neuronfleet operator`, the chart's `leaderElection` values): NEURONFLEET_LEADER_ELECT
(default on), NEURONFLEET_LEASE_NAME, NEURONFLEET_LEASE_NAMESPACE (default: the pod's namespace),
NEURONFLEET_LEASE_DURATION_SECONDS, NEURONFLEET_RENEW_DEADLINE_SECONDS, NEURONFLEET_RETRY_PERIOD_SECONDS.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import signal
import socket
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
    """One replica's candidacy. `acting()` says whether it may act now (always, with election off)."""

    def __init__(
        self, client: kube.Kube, config: Settings, on_lead: Callable[[], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.client, self.config, self.on_lead = client, config, on_lead
        self.seen, self.leading = Seen(), Leading()
        self.lead = False  # it leads (became leader and has not lost)
        self.holder = ""  # who leads, as last read
        self._task: asyncio.Task | None = None
        self._leading_task: asyncio.Task | None = None  # on_lead, running
        self._lease: dict | None = None  # as last written or read

    def acting(self) -> bool:
        if not self.config.enabled:
            return True
        return self.lead and self.leading.acting(time.monotonic(), self.config.timing)

    def start(self) -> None:
        if not self.config.enabled:
            log.info("leader election off: this replica acts alone")
            metrics.leader(True)
            self._leading_task = asyncio.create_task(self.on_lead(), name="lead")
            return
        metrics.leader(False)
        self._task = asyncio.create_task(self._run(), name="leader election")

    async def stop(self) -> None:
        """Stop trying and leading; a leader releases the Lease, so that a follower takes it at its next
        try."""
        tasks = [t for t in (self._task, self._leading_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.config.enabled and self.lead and self._lease is not None:
            self.lead = False
            try:
                await self.client.replace_lease(released(self._lease))
                log.info("released the lease %s/%s", self.config.namespace, self.config.name)
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("the lease could not be released (a follower takes it once it lapses): %r", e)
        metrics.leader(False)

    async def _run(self) -> None:
        c, timing = self.config, self.config.timing
        log.info("leader election: %s is a candidate for the lease %s/%s", c.identity, c.namespace, c.name)
        while True:
            sent = time.monotonic()
            try:
                await self._try(sent)
            except asyncio.CancelledError:
                raise
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("leader election: the lease could not be read or written: %r", e)
            if self.lead and not self.leading.acting(time.monotonic(), timing):
                log.error(
                    "leader election: %s could not renew the lease within %.0f s; it stops acting and exits",
                    c.identity, timing.renew_deadline,
                )  # fmt: skip
                self.lead = False
                metrics.leader(False)
                os.kill(os.getpid(), signal.SIGTERM)  # (kopf stops; the pod starts again, a follower)
                return
            pause = timing.retry_period if self.lead else timing.retry_period * random.uniform(1, JITTER)
            await asyncio.sleep(pause)

    async def _try(self, sent: float) -> None:
        c = self.config
        lease = await self.client.get("Lease", c.namespace, c.name, live=True)
        move = step(lease, c.identity, self.seen, sent, datetime.datetime.now(datetime.UTC), c.timing,
                    namespace=c.namespace, name=c.name)  # fmt: skip
        self._lease = lease
        if move.write is None:
            self._holder(move.holder)
            return
        try:
            write = self.client.create if move.create else self.client.replace_lease
            written = await write(move.write)
        except kube.KubeError as e:
            if e.status in (409, 422):  # another candidate wrote first: read again next time
                return
            raise
        self._lease = written
        self.leading.renewed_at = sent
        self._holder(c.identity)
        if not self.lead:
            self.lead = True
            metrics.leader(True)
            log.info("leader election: %s leads (lease %s/%s)", c.identity, c.namespace, c.name)
            await self.client.post_event(written, "Normal", "LeaderElection", f"{c.identity} became leader")
            self._leading_task = asyncio.create_task(self.on_lead(), name="lead")

    def _holder(self, holder: str) -> None:
        if holder != self.holder:
            self.holder = holder
            if holder and holder != self.config.identity:
                log.info("leader election: %s leads; this replica follows", holder)
