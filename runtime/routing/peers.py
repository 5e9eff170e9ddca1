"""The peers of a router as it knows them: `resolve_peers` turns URLs and DNS names of headless Services (or a
static map, where there is no cluster DNS) into pod URLs; a `PeerSet` holds one role's pods, healthy or not by
probes and request outcomes, ranked by load (pure bookkeeping); a `PeerWatch` keeps a router's sets fresh
(resolved and probed now and every few seconds, with the router's own probe) and holds its HTTP session to
them. Shared by the three routers: ours (`router`), the one in front of an engine's own prefill and decode
servers (`pd_proxy`) and the front door of unified pods (`front_door`); it loads no model code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Gauge

from neuronfleet.contract import PEER_HOSTS_FILE_ENV

log = logging.getLogger(__name__)

FAILS_TO_DROP = 3  # consecutive failed probes or requests that take a peer out of rotation


def _static_hosts() -> dict[str, list[str]]:
    """The static peer map, for environments without cluster DNS: a JSON file ("name:port" -> ["host:port",
    ...]) named by $NEURONFLEET_PEER_HOSTS_FILE, read at each resolution (it may change)."""
    path = os.environ.get(PEER_HOSTS_FILE_ENV)
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def resolve_peers(specs: Sequence[str]) -> list[str]:
    """Peer URLs: http://host:port as given; dns://name:port becomes one URL per address the name resolves to
    (every pod behind a headless Service), the static peer map first. A name that does not resolve
    contributes none."""
    out: list[str] = []
    static = _static_hosts()
    for spec in specs:
        if spec.startswith("dns://") and spec.removeprefix("dns://") in static:
            out += [f"http://{a}" for a in static[spec.removeprefix("dns://")] if f"http://{a}" not in out]
        elif spec.startswith("dns://"):
            host, _, port = spec.removeprefix("dns://").rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (socket.gaierror, ValueError):
                continue
            for family, _, _, _, address in infos:
                ip = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                url = f"http://{ip}:{address[1]}"
                if url not in out:
                    out.append(url)
        elif spec.startswith(("http://", "https://")):
            out.append(spec.rstrip("/"))
        else:
            raise ValueError(f"peer {spec!r}: use http://host:port or dns://name:port")
    return out


@dataclass
class Peer:
    """What the router knows of one pod."""

    url: str
    identity: str | None = None  # its transfer agent's name: new at every start
    healthy: bool = True  # until probes or requests say otherwise
    failures: int = 0  # in a row
    answered: bool = False  # a probe or request of it succeeded at least once
    load: int = 0  # running + waiting requests at the last probe
    slots: int = 0
    kv_usage: float = 0.0  # share of its KV cache in use at the last probe
    in_flight: int = 0  # this router's requests on it now
    in_flight_at_probe: int = 0

    @property
    def ready(self) -> bool:
        """Really ready: in rotation, and its last probe or request succeeded (not merely not yet failed)."""
        return self.healthy and self.answered and self.failures == 0

    @property
    def score(self) -> int:
        """Its load now: the last probe's, corrected by what this router sent or finished since."""
        return max(0, self.load + self.in_flight - self.in_flight_at_probe)


class PeerSet:
    """The pods of one role (pure bookkeeping; the router does the I/O): resolved from the specs, healthy or
    not by probes and request outcomes, ranked by load."""

    def __init__(self, role: str, specs: Sequence[str]) -> None:
        self.role, self.specs = role, list(specs)
        self.peers: dict[str, Peer] = {}
        self.restarts = 0
        self._turn = itertools.count()

    def update(self, urls: Sequence[str]) -> None:
        """The pods the specs resolve to now; a pod no longer listed is forgotten once idle."""
        for url in urls:
            self.peers.setdefault(url, Peer(url))
        for url in [u for u, p in self.peers.items() if u not in urls and p.in_flight == 0]:
            del self.peers[url]

    def probed(self, url: str, status: dict | None) -> None:
        """A probe's outcome: the pod's /internal/status, or None when it failed."""
        peer = self.peers.get(url)
        if peer is None:
            return
        if status is None or not status.get("ready", True):
            self.failed(url, "its status probe failed" if status is None else "it is not ready")
            return
        identity = str(status.get("identity"))
        if peer.identity is not None and identity != peer.identity:
            self.restarts += 1
            log.warning("%s pod %s restarted (identity %s, was %s): its earlier leases are void",
                        self.role, url, identity, peer.identity)  # fmt: skip
        peer.identity = identity
        peer.load = int(status.get("running", 0)) + int(status.get("waiting", 0))
        peer.slots = int(status.get("slots", 0))
        peer.kv_usage = float(status.get("kv_usage", 0.0))
        peer.in_flight_at_probe = peer.in_flight
        self.succeeded(url)

    def kv_usage(self) -> float:
        """The mean share of KV cache in use over the pods in rotation at their last probes (0 with none)."""
        ready = [p.kv_usage for p in self.peers.values() if p.ready]
        return sum(ready) / len(ready) if ready else 0.0

    def succeeded(self, url: str) -> None:
        peer = self.peers.get(url)
        if peer is None:
            return
        if not peer.healthy:
            log.info("%s pod %s answers again: back in rotation", self.role, url)
        peer.healthy, peer.failures, peer.answered = True, 0, True

    def failed(self, url: str, why: str) -> None:
        peer = self.peers.get(url)
        if peer is None:
            return
        peer.failures += 1
        if peer.healthy and peer.failures >= FAILS_TO_DROP:
            peer.healthy = False
            log.warning("%s pod %s is out of rotation after %d failures (last: %s)",
                        self.role, url, peer.failures, why)  # fmt: skip

    def ranked(self, exclude: Sequence[str] = ()) -> list[Peer]:
        """Healthy pods first, those with free slots before full ones, least loaded first (ties taken in
        turn); pods out of rotation last, as a last resort."""
        peers = [p for p in self.peers.values() if p.url not in exclude]
        if not peers:
            return []
        shift = next(self._turn) % len(peers)
        order = {p.url: (i - shift) % len(peers) for i, p in enumerate(peers)}
        return sorted(
            peers,
            key=lambda p: (not p.healthy, p.slots > 0 and p.score >= p.slots, p.score, order[p.url]),
        )

    @property
    def healthy(self) -> int:
        return sum(p.healthy for p in self.peers.values())

    @property
    def ready(self) -> int:
        """Pods really ready now (what a held request waits for)."""
        return sum(p.ready for p in self.peers.values())


class PeerWatch:
    """A router's peer sets kept fresh, and the one HTTP session it talks to them with.

    `start()` resolves the sets' specs again (DNS off the event loop) and probes every peer once, all at once,
    then does so again every `interval` seconds until `stop()`; `probe(peers, url)` is the router's own
    probe, which records its outcome in `peers`. A failed round is logged, never the end of the loop.
    `refresh_if_stale()` runs a round now when the last is older than `interval` or a set has no pod yet (a
    router whose loop has not run, or a role not found yet). `session_options` are aiohttp.ClientSession's
    (headers, ...); the session has no overall timeout: each call sets its own."""

    def __init__(
        self, peer_sets: Sequence[PeerSet], probe: Callable[[PeerSet, str], Awaitable[None]], interval: float,
        **session_options: Any,
    ) -> None:  # fmt: skip
        self.peer_sets, self.probe, self.interval = tuple(peer_sets), probe, interval
        self.session_options = session_options
        self.running = True
        self._session: aiohttp.ClientSession | None = None
        self._refreshed_at = -1e9
        self._rounds: asyncio.Task | None = None

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """`neuronfleet:router_peers_healthy`: the peers in rotation, by role."""
        healthy = Gauge("neuronfleet:router_peers_healthy", "Peers in rotation, by role.",
                        ["model_name", "role"], registry=registry)  # fmt: skip
        for peers in self.peer_sets:
            healthy.labels(model_name=model_name, role=peers.role).set_function(lambda p=peers: p.healthy)

    def client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), **self.session_options
            )
        return self._session

    async def refresh(self) -> None:
        """One round: resolve every set's specs again, then probe every peer."""
        loop = asyncio.get_running_loop()
        for peers in self.peer_sets:
            peers.update(await loop.run_in_executor(None, resolve_peers, peers.specs))
        self._refreshed_at = time.monotonic()
        urls = [(peers, url) for peers in self.peer_sets for url in list(peers.peers)]
        await asyncio.gather(*(self.probe(peers, url) for peers, url in urls))

    async def refresh_if_stale(self) -> None:
        stale = time.monotonic() - self._refreshed_at > self.interval
        if stale or any(not peers.peers for peers in self.peer_sets):
            await self.refresh()

    async def start(self) -> None:
        """A round now, then one every `interval` seconds on a task of this loop."""
        await self.refresh()
        self._rounds = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while self.running:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a probe round must never end the loop
                log.exception("probing the peers failed")

    def stop(self) -> None:
        self.running = False
        if self._rounds is not None:
            self._rounds.cancel()

    async def close(self) -> None:
        """Stop the rounds and close the session."""
        self.stop()
        if self._session is not None:
            await self._session.close()
