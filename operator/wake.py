"""The operator's wake endpoint: `POST /wake/{namespace}/{name}`, which the front door of a model that scales
to zero calls the moment it holds a request (`front_door`, the routers' `--wake-url`), so that the builtin
autoscaler decides at once instead of at its next tick (`AutoscaleLoop.wake`). A small aiohttp server on
the operator's event loop (the one kopf, the caches and the autoscaler's loop run on), on `--wake-port`;
`NEURONFLEET_WAKE_URL` is its base URL as the routers reach it (the chart: the operator's Service).

Answers (JSON `{"wake": ...}`):
- 202 `started`: the model's decision runs now; `running`: one runs already (debounced, at most one per
  model at once); `recent`: one started less than `autoscale_loop.WAKE_INTERVAL` ago (a router posts again
  every 5 s while it holds, so nothing is lost by not starting another);
- 404 `unknown`: no NeuronModel of that name that the builtin autoscaler scales;
- 503 `follower` with Retry-After: this replica does not lead (leader election); the router posts again,
  and the leader's next tick decides anyway;
- 429 with Retry-After: more than RATE wakes in one second over all models. The endpoint takes no
  credentials (a router has none to give, and RBAC stays as it is): the most anyone who reaches it can do
  is make the autoscaler decide early, which it does from the pods' own metrics, and this bounds how often.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from aiohttp import web

PORT_ENV = "NEURONFLEET_WAKE_PORT"  # set by `neuronfleet operator --wake-port` (kopf runs this module's host)
HOST_ENV = "NEURONFLEET_WAKE_HOST"
URL_ENV = "NEURONFLEET_WAKE_URL"  # the base URL the routers are given (builders' wake_base)
RATE = 20  # wakes a second, over all models
STATUS = {"started": 202, "running": 202, "recent": 202, "unknown": 404}

log = logging.getLogger(__name__)


def base_url() -> str | None:
    """The wake endpoint's base URL for the routers, when the operator serves one (NEURONFLEET_WAKE_URL)."""
    return os.environ.get(URL_ENV) or None


class WakeServer:
    """The HTTP side of a wake: routing, the global rate, the answer; `wake(namespace, name)` decides."""

    def __init__(self, wake: Callable[[str, str], str], leads: Callable[[], bool] = lambda: True) -> None:
        self.wake, self.leads = wake, leads
        self._second, self._count = 0, 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/wake/{namespace}/{name}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.Response:
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._count = second, 0
        self._count += 1
        if self._count > RATE:
            return web.json_response(
                {"wake": "rate-limited", "detail": f"more than {RATE} wakes a second; try again"},
                status=429,
                headers={"Retry-After": "1"},
            )
        ns, name = request.match_info["namespace"], request.match_info["name"]
        if not self.leads():
            return web.json_response(
                {"wake": "follower", "detail": "this operator replica does not lead; the leader decides"},
                status=503,
                headers={"Retry-After": "1"},
            )
        outcome = self.wake(ns, name)
        if outcome == "started":
            log.info("wake of %s/%s: deciding now", ns, name)
        body = {"wake": outcome}
        if outcome == "unknown":
            body["detail"] = f"no NeuronModel {ns}/{name} scaled by the builtin autoscaler"
        return web.json_response(body, status=STATUS[outcome])

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        log.info("wake endpoint on %s:%d (routers call %s)", host, port, base_url())

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def configured() -> tuple[str, int] | None:
    """(host, port) of the wake endpoint, when `neuronfleet operator --wake-port` asked for one."""
    port = os.environ.get(PORT_ENV)
    return (os.environ.get(HOST_ENV, "0.0.0.0"), int(port)) if port else None
