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
is spent.

Slow and malformed requests (the limits docs/command-line.md lists): a client has `header_timeout` seconds to
send a request's headers, counted from a new connection or from the first byte of the next request on a
kept-alive one (an idle kept-alive connection waits for aiohttp's keepalive_timeout, 3630 s, longer than the
proxies' in front keep theirs), and `body_timeout` seconds for its whole body; past either the answer is 408
(where some bytes came) and the connection is closed (`HeaderDeadline`, the middleware's `_read_body`). A
body is read before the handler runs: over `max_body_bytes` 413, with a `Content-Encoding` other than
identity 415 (aiohttp would inflate gzip and deflate itself; no client of these APIs compresses requests, and
an inflated body could not be forwarded as it came). Malformed HTTP (header lines over 8190 bytes, more than
128 headers, a bad Content-Length) is refused by aiohttp's parser with 400 and a plain-text reason, before any
route is known (aiohttp 3.14 `web_protocol.RequestHandler`: max_line_size, max_field_size, max_headers)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web, web_log
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from neuronfleet.contract import BODY_TIMEOUT, HEADER_TIMEOUT
from neuronfleet.runtime.serving.errors import (
    BodyTooLarge,
    RequestTimeout,
    ServingError,
    UnsupportedEncoding,
)

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
        self.header_timeout, self.body_timeout = HEADER_TIMEOUT, BODY_TIMEOUT  # (serve() sets the process's)
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

    def refusal(self, path: str, error: ServingError) -> web.Response:
        """A request refused before its handler ran (its body: too large, too slow, encoded), in the API's
        format (an app that counts its refusals counts these)."""
        return self.error(path, error.status, str(error))

    def _refused(self, path: str, error: ServingError) -> web.Response:
        response = self.refusal(path, error)
        if isinstance(error, UnsupportedEncoding):  # what it would take (RFC 9110 section 15.5.16)
            response.headers["Accept-Encoding"] = "identity"
        response.force_close()  # the rest of the body is never read
        return response

    def header_refusal(self, start: bytes) -> bytes:
        """The whole 408 answer (status line, headers, body) to a client whose request headers did not come
        in time, `start` being the first bytes it sent (its request line, for the API's format)."""
        target = start.split(b"\r\n", 1)[0].split(b" ")
        path = target[1].decode("latin-1").split("?", 1)[0] if len(target) > 1 else "/"
        message = (f"the request's headers did not arrive within {self.header_timeout:g} s "
                   "(--header-timeout); send the whole request at once")  # fmt: skip
        response = self.error(path, 408, message)
        body = response.body if isinstance(response.body, bytes) else b""
        ctype = response.content_type + (f"; charset={response.charset}" if response.charset else "")
        head = (f"HTTP/1.1 408 {HTTPStatus(408).phrase}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
        return head.encode("latin-1") + body

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

    async def _read_body(self, request: web.Request) -> None:
        """The request's body, read before its handler within the limits (`request.read()` then answers from
        memory): RequestTimeout past `body_timeout`, BodyTooLarge over `max_body_bytes`,
        UnsupportedEncoding for a content coding other than identity."""
        coding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise UnsupportedEncoding(
                f"Content-Encoding {coding[:40]!r} is not accepted; send the body as it is (identity)", "body"
            )
        if not request.body_exists:
            return
        try:
            async with asyncio.timeout(self.body_timeout):
                await request.read()
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout); send it "
                "at once"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            limit = self.max_body_bytes
            raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes", "body") from None

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves in the API's own format: unknown routes and methods, a body refused before the
        handler (`_read_body`), and anything unexpected (logged, answered 500, and the app goes on)."""
        self.in_flight += 1
        connection = self._connections.setdefault(request.protocol, [0, 0.0])
        connection[0] += 1
        connection[1] = time.monotonic()
        deadline = HeaderDeadline.of(request)
        if deadline is not None:
            deadline.request_started()
        try:
            try:
                await self._read_body(request)
            except ServingError as e:
                return self._refused(request.path, e)
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
            if deadline is not None:
                deadline.request_finished()

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


class HeaderDeadline(asyncio.Protocol):
    """One connection's protocol around aiohttp's (`handler`, a `RequestHandler`, which does all the HTTP):
    it closes the connection when a request's headers are not in within `seconds`, counted from the
    connection's start, or from the first byte that comes while no request runs on it (the next request of a
    kept-alive connection). aiohttp 3.14 has no such limit: its RequestHandler closes a connection only after
    `keepalive_timeout` without a request (web_protocol.py `_process_keepalive`), however slowly the headers
    of one trickle in. The app's middleware says when a request starts and ends (`of(request)`: its
    transport's protocol); past the deadline with bytes received the client gets `refusal(first bytes)`, a
    408, before the close."""

    LINGER = 2.0  # seconds the refused client's further bytes are read and dropped before the close

    def __init__(self, handler: asyncio.Protocol, seconds: float, refusal: Callable[[bytes], bytes]) -> None:
        self.handler, self.seconds, self.refusal = handler, seconds, refusal
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._running = 0  # requests whose handlers run
        self._start = b""  # the first bytes since the deadline was set
        self._refused = False  # the 408 is sent: what comes now is dropped until the close

    @staticmethod
    def of(request: web.Request) -> HeaderDeadline | None:
        protocol = request.transport.get_protocol() if request.transport is not None else None
        return protocol if isinstance(protocol, HeaderDeadline) else None

    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._expired)
        self._start = b""

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._running or self.transport is None or self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():  # the last answer is still being sent: not now
            self._arm()
            return
        log.info("closing a connection whose request headers did not arrive within %g s", self.seconds)
        if not self._start:  # a connection that sent nothing is closed without an answer
            self.transport.close()
            return
        # the answer, then a lingering close (the client's next bytes are read and dropped a while): a close
        # with unread bytes would reset the connection, and the client would lose the answer
        self.transport.write(self.refusal(self._start))
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(self.LINGER, self.transport.close)

    def request_started(self) -> None:
        self._running += 1
        self._disarm()

    def request_finished(self) -> None:
        self._running -= 1

    # ---- asyncio.Protocol, passed on to aiohttp's ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._arm()
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._running:
            if self._timer is None:
                self._arm()
            if len(self._start) < 1024:
                self._start += data[: 1024 - len(self._start)]
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:  # the client is done too: close now
            return False
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class Site(web.BaseSite):
    """A TCP site like aiohttp's `web.TCPSite` whose connections keep `HeaderDeadline`s: aiohttp's `Server`
    is the protocol factory `loop.create_server` takes (aiohttp 3.14 web_runner.py TCPSite.start); each
    protocol it makes is wrapped."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, app: HttpApp) -> None:
        super().__init__(runner)
        self.host, self.port, self.http_app = host, port, app

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server, app = self._runner.server, self.http_app
        assert server is not None

        def protocol() -> HeaderDeadline:
            return HeaderDeadline(server(), app.header_timeout, app.header_refusal)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(protocol, self.host, self.port, backlog=self._backlog)
