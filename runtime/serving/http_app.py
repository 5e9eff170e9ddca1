"""What every neuronfleet HTTP process shares (the serving server, the router in front of an engine's own
prefill and decode servers, the front door): `GET /health` (liveness), `GET /ready` (readiness: false while
draining), `GET /metrics` (the app's Prometheus registry), every error, unexpected ones included, answered in
the API's own format (`error`), and the drain.

The drain loses nothing that reaches the process. Clients keep connections alive (every SDK's pool does), and
a Service forwards a connection as a whole, so requests keep arriving on connections opened before SIGTERM:
they are served, each answer says `Connection: close` (the client's next request opens a connection, which
the Service sends to a pod that is not draining), connections idle for `IDLE_CLOSE_SECONDS` are closed, and
only in the last `REFUSE_WITHIN` of the grace period is a new request refused (503, which our routers retry
on another pod). The drain ends when no request runs and no connection is open, or when the grace period
is spent."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web, web_log
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Hook = Callable[[web.Application], Awaitable[None]]

IDLE_CLOSE_SECONDS = 2.0  # a connection with no request for this long while draining is closed
REFUSE_WITHIN = 0.1  # the last tenth of the grace period: new requests are refused (503), so that those
# already running can finish in time


PROBES = frozenset({"/health", "/ready"})  # the kubelet's liveness and readiness probes


class QuietProbesAccessLog(web_log.AccessLogger):
    """The access log without the kubelet's probes that succeed (one line each every few seconds per pod
    would bury every request in `kubectl logs`); they are logged at DEBUG, and a failed probe (503 while
    draining or before the model is ready) at INFO like every other request."""

    def log(self, request, response, time: float) -> None:
        if request.path in PROBES and response.status < 400:
            if self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug("%s %s %d", request.method, request.path, response.status)
            return
        super().log(request, response, time)


class HttpApp:
    """The base of the three apps: `routes()` are the app's own; `not_alive()` and `not_ready()` say why it is
    not (None: it is); `error()` answers an error in the format of the API a path belongs to."""

    def __init__(self, model_name: str, max_body_bytes: int, registry: CollectorRegistry) -> None:
        self.model_name, self.max_body_bytes, self.registry = model_name, max_body_bytes, registry
        self.draining = False
        self.in_flight = 0  # requests whose handlers run: a drain waits for them
        self._refuse_from = float("inf")  # (monotonic) when a drain starts refusing new requests
        self._drain_started = 0.0
        self._connections: dict[object, list] = {}  # a connection -> [its requests running, its last start]
        self.on_startup: list[Hook] = []
        self.on_cleanup: list[Hook] = []

    def routes(self) -> list[web.RouteDef]:
        raise NotImplementedError

    def not_alive(self) -> str | None:
        return None

    def not_ready(self) -> str | None:
        return None

    def error(self, path: str, status: int, message: str) -> web.Response:
        raise NotImplementedError

    # ---- the drain ----

    def start_drain(self, grace_period: float) -> None:
        """SIGTERM: /ready turns false, answers close their connections, new requests are served until the
        last `REFUSE_WITHIN` of `grace_period`."""
        now = time.monotonic()
        self.draining, self._drain_started = True, now
        self._refuse_from = now + grace_period * (1 - REFUSE_WITHIN)

    def refusing(self) -> bool:
        """A new request is refused now: the grace period is nearly spent."""
        return self.draining and time.monotonic() >= self._refuse_from

    def close_idle(self, connections: list) -> None:
        """While draining: close each of `connections` (the server's, aiohttp's `RequestHandler`s) that runs
        no request and has had none for IDLE_CLOSE_SECONDS (since the drain began, at least). One that runs
        a request closes after its answer (`Connection: close`)."""
        now = time.monotonic()
        for connection in connections:
            running, last = self._connections.get(connection, (0, 0.0))
            if not running and now - max(last, self._drain_started) >= IDLE_CLOSE_SECONDS:
                # (its `close()` would only cancel the wait for a next request, leaving the socket open)
                connection.force_close()
        open_now = set(connections)
        for gone in [c for c in self._connections if c not in open_now]:
            del self._connections[gone]

    async def _close_while_draining(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.draining:  # the client's next request opens a new connection, to a pod that is not draining
            response.force_close()
            response.headers["Connection"] = "close"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", self.metrics),
            ]
        )
        app.add_routes(self.routes())
        app.on_response_prepare.append(self._close_while_draining)
        app.on_startup.extend(self.on_startup)
        app.on_cleanup.extend(self.on_cleanup)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves in the API's own format: unknown routes and methods, a body over the limit, and
        anything unexpected (logged, answered 500, and the app goes on)."""
        self.in_flight += 1
        connection = self._connections.setdefault(request.protocol, [0, 0.0])
        connection[0] += 1
        connection[1] = time.monotonic()
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self.error(request.path, e.status, e.reason)
        except ConnectionResetError:  # the client left; nothing to answer
            raise
        except Exception as e:
            log.exception("unexpected error serving %s", request.path)
            return self.error(request.path, 500, f"internal error: {type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1
            connection[0] -= 1
            connection[1] = time.monotonic()

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process can serve (also while draining); 503 with why once it cannot, so
        that a liveness probe restarts the pod."""
        why = self.not_alive()
        return web.json_response({"status": why or "ok"}, status=503 if why else 200)

    def advertised(self) -> dict:
        """What a ready answer tells the router that probes it, beside readiness (an app's own: where its
        KV-cache events are published)."""
        return {}

    async def ready(self, request: web.Request) -> web.Response:
        why = "draining" if self.draining else self.not_ready()
        body = {"ready": not why, "status": why or "ready", **({} if why else self.advertised())}
        return web.json_response(body, status=503 if why else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
