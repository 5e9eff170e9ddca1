"""Holding requests at zero (the front door of a model that may scale to zero): when no pod of the role a
request needs is ready, the request waits here until one is, instead of failing. Used by every router: the
front door in front of unified pods (`front_door`), ours (`router.RemoteBackend`) and the one in front of an
engine's own P/D servers (`pd_proxy.EngineRouter`).

Bounded in number and in time: at most `limit` requests held at once (one more gets 429), none longer than
`seconds` (then 503), both with Retry-After (the cold start measured so far, else the hold bound); never
forever. While anything is held the peers are probed every `PROBE_EVERY` seconds and a held request goes on
at the first probe round that finds a pod really ready (its probe answered). The autoscaler is told at once:
a POST to the wake URL when the first request is held, again every `WAKE_EVERY` seconds while any stays held,
with the model's internal token (`Authorization: Bearer`) where the router has one: the operator's wake
endpoint acts on no other (operator/wake.py). `limit` 0 turns holding off: requests are never held (today's
behaviour).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuronfleet.runtime.serving.errors import ServingError

log = logging.getLogger(__name__)

PROBE_EVERY = 0.5  # seconds between probe rounds while requests are held
WAKE_EVERY = 5.0  # seconds between wake calls while requests stay held
WAKE_TIMEOUT = 2.0
HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600, 1200)


class HoldRejected(ServingError):
    """A request that could not be held (`full`: 429) or was held past the bound (`timeout`: 503), with the
    seconds after which a retry should find a pod."""

    def __init__(self, message: str, why: str, retry_after: int) -> None:
        super().__init__(message)
        self.why, self.retry_after = why, retry_after
        self.status = self.tgi_status = 429 if why == "full" else 503  # timeout, draining
        self.reason = f"hold_{why}"


class Hold:
    """The held requests of one router, its probe rounds while they wait, its wake calls and its metrics."""

    def __init__(
        self,
        limit: int,
        seconds: float,
        *,
        ready: Callable[[], bool],
        refresh: Callable[[], Awaitable[None]],
        wake_url: str | None = None,
        wake_token: str | None = None,
        role: str = "serving",
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        """`ready()`: some pod of the role requests need is ready now (its last probe answered); `refresh()`:
        one round of resolving and probing the peers (the router's own); `wake_token`: the model's internal
        token, sent with each wake; `role`: the pods waited for, named in the errors; `draining()`: the router
        is shutting down (held requests then get 503 at the next probe round, not at the end of the grace
        period)."""
        if limit < 0:
            raise ValueError(f"--hold-requests {limit}: the most requests held at once, 0 (off) or more")
        if seconds <= 0:
            raise ValueError(f"--hold-seconds {seconds}: the longest a request is held, in seconds, over 0")
        if wake_url is not None and not wake_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--wake-url {wake_url!r}: an http:// or https:// URL, POSTed when a request is held"
            )
        self.limit, self.seconds, self.wake_url, self.role = limit, seconds, wake_url, role
        self._wake_headers = {"Authorization": f"Bearer {wake_token}"} if wake_token else {}
        self.ready, self.refresh, self.draining = ready, refresh, draining
        self.held = 0
        self.cold_start: float | None = None  # seconds from the first request held to its release, last seen
        self._since: float | None = None  # when the current wait for a pod began (the first request held)
        self._round = asyncio.Event()  # set at the end of each probe round, then replaced
        self._watcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._woken_at = -1e9
        self._session: aiohttp.ClientSession | None = None
        self._held_seconds: Histogram | None = None
        self._rejected: Counter | None = None
        self._labels: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = self._labels = {"model_name": model_name}
        Gauge("neuronfleet:router_requests_held", "Requests held now, waiting for a pod to be ready.",
              ["model_name"], registry=registry).labels(**labels).set_function(lambda: self.held)  # fmt: skip
        Gauge(
            "neuronfleet:router_cold_start_seconds",
            "Seconds from the first request held to its release, last measured (0: none yet).",
            ["model_name"], registry=registry,
        ).labels(**labels).set_function(lambda: self.cold_start or 0.0)  # fmt: skip
        self._held_seconds = Histogram(
            "neuronfleet:router_hold_seconds", "How long released requests were held.", ["model_name"],
            buckets=HOLD_BUCKETS, registry=registry,
        ).labels(**labels)  # fmt: skip
        self._rejected = Counter(
            "neuronfleet:router_hold_rejected", "Requests refused by the hold (full: too many held; timeout: "
            "held past the bound).", ["model_name", "reason"], registry=registry,
        )  # fmt: skip

    def retry_after(self) -> int:
        """Seconds a client should wait before a retry: the cold start measured so far, else the bound."""
        return max(1, math.ceil(self.cold_start if self.cold_start is not None else self.seconds))

    def request(self) -> Held:
        """One request's hold: its deadline is shared by all its waits (a retry held again keeps it)."""
        return Held(self)

    def shutdown(self) -> None:
        """Stop probing and waking (the router is stopping)."""
        for task in [self._watcher, *self._tasks]:
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        self.shutdown()
        if self._session is not None:
            await self._session.close()

    # ---- inside ----

    def _reject(self, why: str, message: str) -> HoldRejected:
        if self._rejected is not None:
            self._rejected.labels(**self._labels, reason=why).inc()
        return HoldRejected(f"{message}; retry after {self.retry_after()} s", why, self.retry_after())

    def _enter(self) -> None:
        if self.held >= self.limit:
            raise self._reject(
                "full", f"no {self.role} pod is ready and {self.held} requests are already held waiting for "
                f"one (the bound, --hold-requests {self.limit})",
            )  # fmt: skip
        self.held += 1
        if self._since is None:
            self._since = time.monotonic()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        self._wake()

    def _leave(self, released: bool, held_for: float) -> None:
        self.held -= 1
        if released:
            if self._held_seconds is not None:
                self._held_seconds.observe(held_for)
            if self._since is not None:  # the first release since a pod was missing: the cold start
                self.cold_start, self._since = time.monotonic() - self._since, None
                log.info(
                    "a %s pod is ready after %.1f s: releasing the held requests", self.role, self.cold_start
                )
        if self.held == 0:
            self._since = None

    async def _watch(self) -> None:
        """Probe rounds while anything is held; wake calls every WAKE_EVERY seconds."""
        while self.held:
            try:
                await self.refresh()
            except Exception:  # a failed round must not end the watch
                log.exception("probing the peers for held requests failed")
            self._round.set()
            self._round = asyncio.Event()
            if self.held:
                self._wake()
                await asyncio.sleep(PROBE_EVERY)

    def _wake(self) -> None:
        if self.wake_url is None or time.monotonic() - self._woken_at < WAKE_EVERY:
            return
        self._woken_at = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._post_wake())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_wake(self) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            timeout = aiohttp.ClientTimeout(total=WAKE_TIMEOUT)
            url: str = self.wake_url  # type: ignore[assignment]
            async with self._session.post(url, headers=self._wake_headers, timeout=timeout) as r:
                if r.status >= 400:
                    log.warning("the wake URL %s answered %d", self.wake_url, r.status)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("the wake URL %s failed: %s", self.wake_url, e or type(e).__name__)


class Held:
    """One request's waits for a ready pod (`await held.wait()` before each attempt)."""

    def __init__(self, hold: Hold) -> None:
        self.hold = hold
        self.deadline: float | None = None  # set by its first wait that holds it

    async def wait(self) -> None:
        """Return at once when holding is off or a pod is ready; otherwise hold the request until one is
        (HoldRejected when too many are held, or once it was held for the bound)."""
        hold = self.hold
        if not hold.enabled or hold.ready():
            return
        hold._enter()
        started = time.monotonic()
        if self.deadline is None:
            self.deadline = started + hold.seconds
        released = False
        try:
            while not hold.ready():
                if hold.draining():
                    raise HoldRejected("the router is shutting down; send the request again", "draining", 1)
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise hold._reject(
                        "timeout", f"no {hold.role} pod became ready within {hold.seconds:g} s while the "
                        "request was held (--hold-seconds)",
                    )  # fmt: skip
                round_done = hold._round
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(round_done.wait(), remaining)
            released = True
        finally:
            hold._leave(released, time.monotonic() - started)
