"""What every neuronfleet HTTP process shares (the serving server, the router in front of an engine's own
prefill and decode servers, the front door): `GET /health` (liveness), `GET /ready` (readiness: false while
draining), `GET /metrics` (the app's Prometheus registry), the count of requests in flight that a drain waits
for, and every error, unexpected ones included, answered in the API's own format (`error`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Hook = Callable[[web.Application], Awaitable[None]]


class HttpApp:
    """The base of the three apps: `routes()` are the app's own; `not_alive()` and `not_ready()` say why it is
    not (None: it is); `error()` answers an error in the format of the API a path belongs to."""

    def __init__(self, model_name: str, max_body_bytes: int, registry: CollectorRegistry) -> None:
        self.model_name, self.max_body_bytes, self.registry = model_name, max_body_bytes, registry
        self.draining = False
        self.in_flight = 0  # requests whose handlers run: a drain waits for them
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
        app.on_startup.extend(self.on_startup)
        app.on_cleanup.extend(self.on_cleanup)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves in the API's own format: unknown routes and methods, a body over the limit, and
        anything unexpected (logged, answered 500, and the app goes on)."""
        self.in_flight += 1
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

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process can serve (also while draining); 503 with why once it cannot, so
        that a liveness probe restarts the pod."""
        why = self.not_alive()
        return web.json_response({"status": why or "ok"}, status=503 if why else 200)

    async def ready(self, request: web.Request) -> web.Response:
        why = "draining" if self.draining else self.not_ready()
        return web.json_response({"ready": not why, "status": why or "ready"}, status=503 if why else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
