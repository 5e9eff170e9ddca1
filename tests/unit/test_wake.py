"""The operator's wake endpoint (operator/wake.py) over real HTTP (aiohttp's test server), with the clock the
test moves: a wake acts only with the model's own token; every other wake (an unknown model, a known one
without its token or with another's, bytes that are not ASCII) gets the very answer a good one gets and does
nothing; the rate is per model, and a flood without the token holds back neither another model nor the
model's own routers; the buckets and the tokens kept are bounded. (The real operator, its autoscaler and
the model's Secret: tests/e2e/test_operator_wake.py.)"""

from __future__ import annotations

import asyncio
import base64
import socket
import time

from aiohttp.test_utils import TestClient, TestServer
from support import free_port

from neuronfleet.operator import wake
from neuronfleet.operator.wake import BURST, MISSING_SECONDS, RATE, TOKEN_SECONDS, Buckets, Tokens, WakeServer

TOKENS = {("default", "a"): "token-of-a", ("default", "b"): "token-of-b", ("other", "c"): "token-of-c"}
MODELS = {*TOKENS, ("default", "no-secret")}


class Cluster:
    """What the endpoint reads, as the operator has it: the models its cache holds, each model's Secret (read
    by name; counted), and the decisions the autoscaler was asked for."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self.woken: list[tuple[str, str]] = []
        self.leading = True
        self.now = 1000.0

    async def exists(self, namespace: str, name: str) -> bool:
        return (namespace, name) in MODELS

    async def secret(self, namespace: str, name: str) -> dict | None:
        self.reads.append((namespace, name))
        token = TOKENS.get((namespace, name))
        return {"data": {"token": base64.b64encode(token.encode()).decode()}} if token else None

    def wake(self, namespace: str, name: str) -> str:
        self.woken.append((namespace, name))
        return "started"


def run(scenario) -> Cluster:
    cluster = Cluster()
    clock = lambda: cluster.now  # noqa: E731
    server = WakeServer(cluster.wake, Tokens(cluster.exists, cluster.secret, clock), lambda: cluster.leading,
                        clock)  # fmt: skip

    async def main():
        async with TestClient(TestServer(server.app())) as client:

            async def post(model: str, token: str | bytes | None = None) -> tuple[int, dict, dict]:
                headers = {}
                if token is not None:
                    headers["Authorization"] = token if isinstance(token, str) else token.decode("latin-1")
                r = await client.post(f"/wake/{model}", headers=headers)
                return r.status, await r.json(), dict(r.headers)

            await scenario(cluster, post)

    asyncio.run(main())
    return cluster


def bearer(model: tuple[str, str]) -> str:
    return f"Bearer {TOKENS[model]}"


def test_only_the_models_own_token_wakes_it_and_every_other_wake_is_answered_alike():
    async def scenario(cluster, post):
        accepted = (202, {"wake": "accepted"})
        assert (await post("default/a", bearer(("default", "a"))))[:2] == accepted
        assert cluster.woken == [("default", "a")]
        others = [
            await post("default/nosuchmodel"),  # unknown
            await post("default/nosuchmodel", bearer(("default", "a"))),  # unknown, a real token
            await post("default/a"),  # known, no token
            await post("default/a", bearer(("default", "b"))),  # known, another model's token
            await post("default/b", "Bearer token-of-b2"),  # almost
            await post("default/a", "token-of-a"),  # not a bearer
            await post("default/a", "Bearer tøken-of-a".encode()),  # not ASCII (latin-1 on the wire)
            await post("default/a", "Bearer ток".encode()),  # not latin-1 either: UTF-8 bytes
            await post("default/no-secret", "Bearer "),  # a model without a Secret: no wake at all
            await post("other/a", bearer(("default", "a"))),  # the same name in another namespace
        ]
        assert [o[:2] for o in others] == [accepted] * len(others)
        assert cluster.woken == [("default", "a")]  # none of them did anything
        # the answers do not differ in their headers either (but the date)
        shapes = {tuple(sorted((k, v) for k, v in o[2].items() if k != "Date")) for o in others}
        assert len(shapes) == 1
        # a name that is no model costs no read of the API server
        assert ("default", "nosuchmodel") not in cluster.reads and ("other", "a") not in cluster.reads

    run(scenario)


def test_the_rate_is_per_model_and_a_flood_without_the_token_holds_back_no_router():
    async def scenario(cluster, post):
        a, b = ("default", "a"), ("default", "b")
        answers = [await post("default/a", bearer(a)) for _ in range(BURST + 3)]
        assert [s for s, _, _ in answers] == [202] * BURST + [429] * 3
        assert answers[-1][2]["Retry-After"] == "1" and "default/a" in answers[-1][1]["detail"]
        assert cluster.woken == [a] * BURST
        assert (await post("default/b", bearer(b)))[0] == 202  # another model is not held back
        assert cluster.woken[-1] == b
        # a flood without the token: limited alike for a known model and for a name that is none...
        flood = [(await post("default/b"))[0] for _ in range(BURST + 3)]
        unknown = [(await post("default/nosuchmodel"))[0] for _ in range(BURST + 3)]
        assert flood == unknown == [202] * BURST + [429] * 3
        # ... and the model's own router still wakes it
        assert (await post("default/b", bearer(b)))[0] == 202 and cluster.woken[-1] == b
        cluster.now += 1 / RATE  # a second later: one more wake of a
        assert [(await post("default/a", bearer(a)))[0] for _ in range(2)] == [202, 429]

    run(scenario)


def test_a_follower_answers_503_to_every_wake():
    async def scenario(cluster, post):
        cluster.leading = False
        for model, token in (("default/a", bearer(("default", "a"))), ("default/nosuchmodel", None)):
            status, body, headers = await post(model, token)
            assert (status, body["wake"], headers["Retry-After"]) == (503, "follower", "1")
        assert cluster.woken == []

    run(scenario)


def test_a_models_token_is_read_once_and_kept_and_a_missing_secret_looked_at_again_soon():
    cluster = Cluster()
    tokens = Tokens(cluster.exists, cluster.secret, lambda: cluster.now)

    async def main():
        assert await tokens.get("default", "a") == b"token-of-a"
        assert await tokens.get("default", "a") == b"token-of-a"
        assert await tokens.get("default", "nosuchmodel") is None
        assert cluster.reads == [("default", "a")]  # once; never for a name that is no model
        assert await tokens.get("default", "no-secret") is None
        cluster.now += MISSING_SECONDS
        assert await tokens.get("default", "no-secret") is None
        assert cluster.reads.count(("default", "no-secret")) == 2
        cluster.now += TOKEN_SECONDS - MISSING_SECONDS
        assert await tokens.get("default", "a") == b"token-of-a"
        assert cluster.reads.count(("default", "a")) == 2  # read again after TOKEN_SECONDS

    asyncio.run(main())
    assert wake.secret_token({"data": {"token": "not base64!"}}) is None
    assert wake.secret_token({"data": {}}) is None and wake.secret_token(None) is None


def test_the_buckets_forget_full_ones_and_follow_at_most_max_keys():
    buckets = Buckets(rate=1.0, burst=2, max_keys=100)
    now = 0.0
    assert [buckets.take("x", now) for _ in range(3)] == [True, True, False]
    for i in range(10_000):  # a flood of names, each woken once
        buckets.take(("ns", f"name-{i}"), now)
    assert len(buckets) <= 100
    assert not buckets.take("new", now)  # full: a new key waits for some refill
    now += 2.0  # every bucket refilled: all forgotten at the next take
    assert buckets.take("new", now) and len(buckets) == 1
    assert [buckets.take("x", now) for _ in range(3)] == [True, True, False]  # "x" starts full again


def test_a_connection_whose_headers_trickle_is_closed(monkeypatch):
    monkeypatch.setattr(wake, "IDLE_SECONDS", 1.0)
    cluster = Cluster()
    server = WakeServer(cluster.wake, Tokens(cluster.exists, cluster.secret))
    port = free_port()

    def trickle() -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            started = time.monotonic()
            for byte in b"POST /wake/default/a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n":
                s.sendall(bytes([byte]))
                s.settimeout(0.4)  # the next byte unless the server closed meanwhile
                try:
                    if s.recv(1) == b"":
                        return time.monotonic() - started
                except TimeoutError:
                    continue
        raise AssertionError("the whole request went in, a byte every 0.4 s")

    async def main():
        await server.start("127.0.0.1", port)
        try:
            took = await asyncio.get_running_loop().run_in_executor(None, trickle)
        finally:
            await server.stop()
        assert 1.0 <= took < 4.0 and cluster.woken == []

    asyncio.run(main())
