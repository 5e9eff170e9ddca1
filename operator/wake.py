"""The operator's wake endpoint: `POST /wake/{namespace}/{name}`, which the front door of a model that scales
to zero calls the moment it holds a request (`front_door`, the routers' `--wake-url`), so that the builtin
autoscaler decides at once instead of at its next tick (`AutoscaleLoop.wake`). A small aiohttp server on
the operator's event loop (the one kopf, the caches and the autoscaler's loop run on), on `--wake-port`;
`NEURONFLEET_WAKE_URL` is its base URL as the routers reach it (the chart: the operator's Service).

A wake acts only with the model's own internal token (`Authorization: Bearer TOKEN`: the token of the model's
Secret `NAME-internal`, which its routers mount and send, `holding.Hold`), compared in constant time. The
token is read by name from the Secret (`Tokens`: only for a NeuronModel the operator's cache holds, so a name
that is none costs no API call) and kept TOKEN_SECONDS; no Secret means no wake.

Answers (JSON `{"wake": ...}`), the same whether the model exists, whether the token was its own and whether a
decision started, so that they tell nobody which models exist:
- 202 `accepted`: a wake with the model's token ran its decision, or one runs already, or one ran less than
  `autoscale_loop.WAKE_INTERVAL` ago (a router posts again every 5 s while it holds); any other did nothing;
- 429 with Retry-After: past the model's rate (`Buckets`: RATE a second, BURST at once, per namespace and
  name), counted apart for the wakes that carried the model's token and for the rest, so that a flood
  without the token never holds back the model's own routers (and the rest behave alike for every name);
- 503 `follower` with Retry-After: this replica does not lead (leader election); the router posts again,
  and the leader's next tick decides anyway.

A connection that has not sent a whole request within IDLE_SECONDS (slow headers included) is closed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

URL_ENV = "NEURONFLEET_WAKE_URL"  # `neuronfleet operator --wake-url`s default: the URL routers are given
RATE = 1.0  # wakes a second per model (a router posts every 5 s while it holds; a few replicas post)
BURST = 5  # wakes at once per model
MAX_KEYS = 10_000  # models (namespace, name) whose rate is followed at once, in each of the two counts
TOKEN_SECONDS = 60.0  # a model's token, read from its Secret, is used this long before it is read again
MISSING_SECONDS = 5.0  # a model found without a Secret (or whose read failed) is looked at again after this
SECRET_KEY = "token"  # the Secret's key (builders.build_internal_secret; the file the pods mount)
# a connection without a whole request for this long is closed, headers half sent included (aiohttp 3.14's
# keepalive_timeout: web_protocol.RequestHandler._process_keepalive closes a connection still waiting for a
# request's headers, counted from its start or its last answer); routers post once every 5 s at most
IDLE_SECONDS = 10.0

log = logging.getLogger(__name__)


class Buckets:
    """Token buckets by key, pure: each holds up to `burst` wakes and refills `rate` a second. A bucket full
    again is the same as none, so the keys whose buckets refilled are forgotten (at most every refill time);
    at most `max_keys` are followed at once, and a new key past that is refused until some refill."""

    def __init__(self, rate: float = RATE, burst: int = BURST, max_keys: int = MAX_KEYS) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[Any, tuple[float, float]] = {}  # key -> (wakes left, when counted)
        self._swept = 0.0

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: Any, now: float) -> float:
        left, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, left + (now - at) * self.rate)

    def take(self, key: Any, now: float) -> bool:
        """One wake of `key` at `now` (seconds, monotonic): True when its bucket has one."""
        if now - self._swept >= self.burst / self.rate or len(self._buckets) >= self.max_keys:
            self._sweep(now)
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            return False
        level = self._level(key, now)
        if level < 1:
            self._buckets[key] = (level, now)
            return False
        self._buckets[key] = (level - 1, now)
        return True

    def _sweep(self, now: float) -> None:
        self._swept = now
        for key in [k for k in self._buckets if self._level(k, now) >= self.burst]:
            del self._buckets[key]


def secret_token(secret: dict[str, Any] | None) -> bytes | None:
    """The token a model's Secret holds (`data.token`, base64), or None."""
    data = (secret or {}).get("data") or {}
    try:
        token = base64.b64decode(data.get(SECRET_KEY) or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        return None
    return token or None


class Tokens:
    """The models' internal tokens: read from each model's Secret (`read_secret(namespace, name)`, by name)
    only for a model `exists(namespace, name)` says the operator knows, kept TOKEN_SECONDS (MISSING_SECONDS
    where there was none), and only for models that exist (bounded by them)."""

    def __init__(
        self,
        exists: Callable[[str, str], Awaitable[bool]],
        read_secret: Callable[[str, str], Awaitable[dict[str, Any] | None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exists, self.read_secret, self.clock = exists, read_secret, clock
        self._kept: dict[tuple[str, str], tuple[bytes | None, float]] = {}  # -> (token, until)

    async def get(self, namespace: str, name: str) -> bytes | None:
        key, now = (namespace, name), self.clock()
        if not await self.exists(namespace, name):
            self._kept.pop(key, None)
            return None
        kept = self._kept.get(key)
        if kept is not None and now < kept[1]:
            return kept[0]
        try:
            token = secret_token(await self.read_secret(namespace, name))
        except Exception as e:  # (an API server that fails: no wake now, the next one reads again)
            log.warning("reading the internal token of %s/%s for a wake failed: %s", namespace, name, e)
            token = None
        self._kept = {k: v for k, v in self._kept.items() if now < v[1]}
        self._kept[key] = (token, now + (TOKEN_SECONDS if token else MISSING_SECONDS))
        return token


def bearer(request: web.Request) -> bytes:
    """The request's Authorization header as the bytes that came (aiohttp keeps bytes that are not UTF-8 as
    surrogates)."""
    return request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")


class WakeServer:
    """The HTTP side of a wake: leadership, the token, the rate per model, the answer; `wake(namespace,
    name)` decides (its outcome is logged, never answered)."""

    def __init__(
        self, wake: Callable[[str, str], str], tokens: Tokens, leads: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.wake, self.tokens, self.leads, self.clock = wake, tokens, leads, clock
        self.proven, self.unproven = Buckets(), Buckets()  # wakes with the model's token, and the rest
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024)  # a wake has no body
        app.router.add_post("/wake/{namespace}/{name}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        if not self.leads():
            return web.json_response(
                {"wake": "follower", "detail": "this operator replica does not lead; the leader decides"},
                status=503,
                headers={"Retry-After": "1"},
            )
        token = await self.tokens.get(ns, name)
        # compared even without a token (against one no header can match), so both take alike
        expected = b"Bearer " + (token or b"\0")
        proven = hmac.compare_digest(bearer(request), expected) and token is not None
        if not (self.proven if proven else self.unproven).take((ns, name), self.clock()):
            detail = f"more than {BURST} wakes of {ns}/{name} at once, then {RATE:g} a second; try again"
            return web.json_response(
                {"wake": "rate-limited", "detail": detail}, status=429, headers={"Retry-After": "1"}
            )
        if proven:
            outcome = self.wake(ns, name)
            log.info("wake of %s/%s: %s", ns, name, outcome)
        elif token is not None:  # (the model exists: a router with a stale token, or someone without it)
            log.warning("a wake of %s/%s without the model's token: ignored", ns, name)
        return web.json_response({"wake": "accepted"}, status=202)

    async def start(self, host: str, port: int, base_url: str | None = None) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=IDLE_SECONDS)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        log.info("wake endpoint on %s:%d (routers call %s)", host, port, base_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
