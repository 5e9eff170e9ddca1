"""What each pod's prefix cache holds, precisely, from the KV-cache events it publishes (vLLM's
`--kv-events-config` ZeroMQ publisher, or ours: `engine/kv_events.py` has the format), for routers that
tokenize (block names are of token ids).

`PodBlocks` (pure) applies a pod's events: a stored block is named as the router names a prompt's blocks
(`prefix_routing.token_blocks`: a chained hash of BLOCK_TOKENS token ids), re-derived from the event's token
ids and its parent's name, so the engine's own hash (sha256, or Python's hash with a seed) never needs to be
reproduced; an engine block of a multiple of BLOCK_TOKENS tokens is several of our blocks. A block whose
parent the router never saw stored cannot be named and is skipped (its prefix is not held as far as the
router knows). Removal and AllBlocksCleared drop names.

`Subscriptions` (the shell) keeps a SUB socket per pod that advertises an endpoint (`kv_events` in its
`/internal/status` or ready answer, or the router's `--peer-kv-events`: `tcp://*:PORT` means the pod's own
host). Batches carry sequence numbers from 0. Batches missed (a gap: dropped by a high-water mark, or a
reconnection; a first batch past 0: the router joined late; a sequence started again: the pod restarted) are
asked of the pod's replay endpoint where it has one (vLLM's protocol), so a router started after its pods
knows what they hold at once; what cannot be replayed whole means the router no longer knows what the pod
holds, so it forgets it and starts again from the next batch (a pod is then routed by what this router sent
it, as for engines that publish nothing, until its events name blocks again). Every router replica subscribes
to every pod, so replicas agree on what pods hold, whatever each one sent. A pod that says its events need
the model's key (`kv_events_auth: curve`: ours, given the model's secret) is subscribed to as a CurveZMQ
client with the model's client keys (`kv_event_publisher.curve_keys`); a router without the secret follows
no such pod (it says so once) and routes it by what it sent there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from neuronfleet.contract import KvEventsConfig
from neuronfleet.runtime.engine.kv_event_publisher import AUTH, CurveKeys, curve_keys
from neuronfleet.runtime.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    decode_batch,
)
from neuronfleet.runtime.routing.prefix_routing import BLOCK_TOKENS, token_blocks

log = logging.getLogger(__name__)
REPLAY_TIMEOUT = 2.0  # seconds a pod's replay endpoint may take to answer


class PodBlocks:
    """One pod's cache as its events say: the names of the blocks it holds."""

    def __init__(self) -> None:
        self.names: Counter[int] = Counter()  # our block name -> engine blocks that hold it
        self.by_hash: dict[Any, list[int]] = {}  # the engine's block hash -> our names of its tokens
        self.next_seq = 0
        self.batches = 0
        self.unnamed = 0  # blocks skipped: their parent was never seen stored
        self.refused = 0  # events of a block size that is not a multiple of ours

    def apply(self, batch: EventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    for name in self.by_hash.pop(_key(block), ()):
                        self.names[name] -= 1
                        if self.names[name] <= 0:
                            del self.names[name]
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def _stored(self, event: BlockStored) -> None:
        if event.block_size % BLOCK_TOKENS:
            self.refused += 1
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            names = self.by_hash.get(_key(event.parent_block_hash))
            if not names:
                self.unnamed += len(event.block_hashes)
                return
            parent = names[-1]
        size = event.block_size
        for i, block in enumerate(event.block_hashes):
            names = token_blocks(event.token_ids[i * size : (i + 1) * size], BLOCK_TOKENS, parent)
            previous = self.by_hash.get(_key(block))
            if previous is None:  # a hash stored again (another medium) counts once
                self.by_hash[_key(block)] = names
                self.names.update(names)
            parent = names[-1]

    def clear(self) -> None:
        self.names.clear()
        self.by_hash.clear()

    def held(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of a prompt the pod holds."""
        n = 0
        for name in blocks:
            if name not in self.names:
                break
            n += 1
        return n


def _key(block: Any) -> Any:
    return bytes(block) if isinstance(block, bytearray | list) else block


class Subscriptions:
    """A SUB socket per publishing pod; what each holds, in `pods` (by the pod's URL)."""

    def __init__(self, replay_timeout: float = REPLAY_TIMEOUT, secret: str | None = None) -> None:
        """`secret`: the model's, for pods whose events need its key."""
        self.keys: CurveKeys | None = curve_keys(secret) if secret else None
        self._unfollowed: set[str] = set()  # pods whose events need a key this router lacks (said once)
        self.pods: dict[str, PodBlocks] = {}
        self._tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task]] = {}
        self.gaps = 0  # batches missed that no replay brought back: the pod was learnt again
        self.replayed = 0  # batches brought back by a pod's replay endpoint
        self.replay_timeout = replay_timeout

    def follow(
        self, url: str, advertised: str | None, replay: str | None = None, auth: str | None = None
    ) -> None:
        """Subscribe to the pod at `url` publishing at `advertised` (from its status; None: it publishes
        nothing, and anything known of it goes), asking `replay` (its replay endpoint) for what it missed;
        `auth` what its events need (None, or AUTH: the model's key)."""
        if auth is not None and (auth != AUTH or self.keys is None):
            if url not in self._unfollowed:
                self._unfollowed.add(url)
                why = "this router has not the model's secret" if auth == AUTH else f"unknown kind {auth!r}"
                log.warning("pod %s: its KV-cache events need a key (%s); not following them", url, why)
            advertised = None
        endpoint = _endpoint(url, advertised) if advertised else None
        where = (endpoint, _endpoint(url, replay) if endpoint and replay else None)
        current = self._tasks.get(url)
        if current is not None and current[0] == where:
            return
        if current is not None:
            current[1].cancel()
            del self._tasks[url]
            self.pods.pop(url, None)
        if endpoint is not None:
            self.pods[url] = PodBlocks()
            self._tasks[url] = (
                where,
                asyncio.get_running_loop().create_task(self._listen(url, *where, auth)),
            )

    def forget(self, url: str) -> None:
        """The pod restarted or left: what it held is gone; a new subscription starts from its next status."""
        entry = self._tasks.pop(url, None)
        if entry is not None:
            entry[1].cancel()
        self.pods.pop(url, None)

    def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    def _socket(self, kind: int, auth: str | None):
        """A socket to a pod: a CurveZMQ client with the model's keys where its events need them."""
        import zmq.asyncio

        socket = zmq.asyncio.Context.instance().socket(kind)
        if auth is not None and self.keys is not None:
            socket.curve_serverkey = self.keys.server_public
            socket.curve_publickey, socket.curve_secretkey = self.keys.client_public, self.keys.client_secret
        return socket

    async def _listen(self, url: str, endpoint: str, replay: str | None, auth: str | None = None) -> None:
        import zmq

        socket = self._socket(zmq.SUB, auth)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                pod = self.pods.get(url)
                if pod is None:
                    return
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("pod %s: a KV event message is (topic, sequence, batch), not %d frames",
                                url, len(frames))  # fmt: skip
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq != pod.next_seq and (pod.batches or seq > 0):  # missed some, or joined late
                    await self._catch_up(url, pod, seq, replay, auth)
                pod.next_seq = seq + 1
                self._apply(url, pod, seq, frames[2])
        finally:
            socket.close(linger=0)

    async def _catch_up(
        self, url: str, pod: PodBlocks, seq: int, replay: str | None, auth: str | None
    ) -> None:
        """Before batch `seq`: the batches missed since the last one applied (since 0 when the pod's
        sequence started again: it restarted), from the pod's replay endpoint; where they cannot all be had,
        what the pod holds is learnt again from here."""
        restarted = seq < pod.next_seq
        if restarted:
            pod.clear()
        start = 0 if restarted else pod.next_seq
        missed = await self._replayed(replay, start, seq, auth) if replay else None
        if missed is not None:
            for number, payload in missed:
                self._apply(url, pod, number, payload)
            self.replayed += len(missed)
            return
        if pod.batches:
            self.gaps += 1
            log.warning("pod %s: KV event batch %d after %d (missed or restarted, and not replayed): what it "
                        "holds is learnt again from here", url, seq, pod.next_seq - 1)  # fmt: skip
            pod.clear()

    async def _replayed(
        self, endpoint: str, start: int, end: int, auth: str | None = None
    ) -> list[tuple[int, bytes]] | None:
        """Batches start..end-1 from a replay endpoint (vLLM's protocol: the first sequence number asked,
        then (sequence, payload) for every buffered batch from there and (-1, empty)); None when the pod no
        longer holds them all, or does not answer in time."""
        import zmq

        socket = self._socket(zmq.DEALER, auth)
        socket.connect(endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await socket.poll(int(self.replay_timeout * 1000)):
                    return None
                frames = await socket.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    return None
                number = int.from_bytes(frames[1], "big", signed=True)
                if number < 0:
                    break
                if start <= number < end:
                    got.append((number, frames[2]))
        finally:
            socket.close(linger=0)
        return got if [n for n, _ in got] == list(range(start, end)) else None

    def _apply(self, url: str, pod: PodBlocks, seq: int, payload: bytes) -> None:
        try:
            pod.apply(decode_batch(payload))
        except KvEventError as e:
            log.warning("pod %s: KV event batch %d refused: %s", url, seq, e)


def advertised(status: object) -> tuple[str | None, str | None, str | None]:
    """Where a pod says it publishes its KV-cache events and answers replays, and what they need (`kv_events`,
    `kv_events_replay`, `kv_events_auth` in its status or ready answer), Nones where it says nothing."""
    if not isinstance(status, dict):
        return None, None, None
    said = status.get("kv_events"), status.get("kv_events_replay"), status.get("kv_events_auth")
    return tuple(value if isinstance(value, str) else None for value in said)  # type: ignore[return-value]


def peers_publish(config: str | None) -> tuple[str | None, str | None, None]:
    """Where peers that do not say publish and answer replays: their `--kv-events-config` JSON (a router's
    `--peer-kv-events`: vLLM's pods, whose publisher takes no key), its endpoint and replay_endpoint; Nones
    without one."""
    if config is None:
        return None, None, None
    parsed = KvEventsConfig.parse(config)
    return parsed.endpoint, parsed.replay_endpoint, None


def _endpoint(url: str, advertised: str) -> str:
    """The endpoint to connect to: a wildcard host (`*`, 0.0.0.0, ::) is the pod's own (its URL's); ipc://
    and inproc:// endpoints are as advertised (the same machine, the same process)."""
    scheme, _, rest = advertised.partition("://")
    if scheme != "tcp":
        return advertised
    host, _, port = rest.rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = urlsplit(url).hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}"
