"""The embedded runtime's KV-cache event publisher (`neuronfleet serve --kv-events-config`): the engine's
events, in batches, on a ZeroMQ PUB socket as vLLM's publisher sends them (vllm-project/vllm,
`vllm/distributed/kv_events.py`): three frames per batch, the topic, an 8-byte big-endian sequence number
(0, 1, 2, ... from the publisher's start) and the msgpack batch; an endpoint with `*` (or `::`, `ipc://`,
`inproc://`) is bound, as vLLM's is, and so is one on a loopback address (local mode runs pods on
127.0.0.1), another connected. With a replay endpoint (a ROUTER socket) a subscriber that missed
batches sends the first sequence number it lacks (8 bytes, big-endian) and gets every buffered batch from
there as (sequence, payload), then (-1, empty): the replay framing of vLLM before vllm-project/vllm#45177
(0.26.0 added the topic frame), so that of the pinned plugin image's vLLM 0.24.0. One thread owns the
sockets; the engine only queues.

The events name every cached block's token ids, so they carry every client's prompts. With the model's secret
(`secret`: its internal token, which the model's pods and routers hold) both sockets are CurveZMQ servers
(RFC 26, libzmq's CURVE mechanism, which the pinned pyzmq's bundled libzmq has: `zmq.has("curve")`): the
keys are derived from the secret (`curve_keys`), the traffic is encrypted, and a ZAP handler admits only
subscribers that hold the model's client key, so anyone else who reaches the port receives nothing. A
wildcard host is bound to the pod's own address where it is known (`bind_host`: POD_IP). Without a secret
the publisher binds only this machine's loopback or ipc:// endpoints (local runs) and refuses anything else.
vLLM's own publisher has no such option: its pods' ports are fenced by the model's NetworkPolicy only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85

from neuronfleet.contract import KvEventsConfig
from neuronfleet.runtime.engine.kv_events import Event, EventBatch, encode_batch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


AUTH = "curve"  # what a pod's status says (`kv_events_auth`) when its events need the model's client key


@dataclass(frozen=True)
class CurveKeys:
    """A model's CURVE key pairs (z85): its pods' publishers are servers, its routers clients."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(secret: str) -> CurveKeys:
    """The model's key pairs, derived from its secret: every pod and router of the model derives the same,
    nothing else can (a CURVE secret key is 32 bytes; its public key follows from it, `zmq.curve_public`)."""
    if not secret:
        raise ValueError("KV event keys need the model's secret (its internal token)")

    def pair(purpose: str) -> tuple[bytes, bytes]:
        raw = hmac.new(
            secret.encode(), f"neuronfleet/kv-events-{purpose}/v1".encode(), hashlib.sha256
        ).digest()
        private = z85.encode(raw)
        return zmq.curve_public(private), private

    return CurveKeys(*pair("server"), *pair("client"))


class _ModelClients:
    """The ZAP handler's check: only the model's client key (z85) subscribes."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


class KvEventPublisher:
    def __init__(
        self, config: KvEventsConfig, secret: str | None = None, bind_host: str | None = None
    ) -> None:
        """`secret`: the model's (CURVE, above); `bind_host`: the pod's own address, which a wildcard
        endpoint binds instead of every address. ValueError for an endpoint that would publish beyond this
        machine without a secret."""
        self.topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        endpoints = [config.endpoint, *([config.replay_endpoint] if config.replay_endpoint else [])]
        if not secret and (open_ := [e for e in endpoints if not _this_machine(e)]):
            raise ValueError(
                f"--kv-events-config would publish every client's prompt tokens at {', '.join(open_)} with "
                "no authentication: give the model's secret (--internal-token-file), or publish on 127.0.0.1 "
                "or ipc:// only"
            )
        self._ctx = zmq.Context()  # its own: the ZAP handler serves every socket of a context
        self._auth = None
        self.auth = AUTH if secret else None
        keys = curve_keys(secret) if secret else None
        if keys is not None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _ModelClients(keys.client_public))
        self._pub = self._socket(zmq.PUB, keys)
        self._pub.set_hwm(config.hwm)
        endpoint = _on_host(config.endpoint, bind_host)
        if _binds(config.endpoint):  # (as given: a wildcard is bound, on bind_host where there is one)
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # the port bound
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint:
            self._replay = self._socket(zmq.ROUTER, keys)
            self._replay.bind(_on_host(config.replay_endpoint, bind_host))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="neuronfleet-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue a batch (from the engine's thread); a full queue drops it, counted (the subscribers see a
        gap in the sequence numbers and start over)."""
        try:
            self._queue.put_nowait(EventBatch(time.time(), events))
        except queue.Full:
            self.dropped += 1

    def _socket(self, kind: int, keys: CurveKeys | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if keys is not None:
            sock.curve_server = True
            sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
        return sock

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:  # the socket's trouble, not the engine's: said, and the batch counted
                log.warning("KV event batch %d not sent: %s", seq, e)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("a KV event replay request is (identity, empty, 8-byte sequence), got %d frames",
                        len(frames))  # fmt: skip
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _this_machine(endpoint: str) -> bool:
    """The endpoint reaches only this machine (loopback, ipc://, inproc://)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))


def _on_host(endpoint: str, host: str | None) -> str:
    """A wildcard tcp endpoint (`*`, 0.0.0.0, ::) bound on `host` instead, where one is given."""
    scheme, _, rest = endpoint.partition("://")
    address, _, port = rest.rpartition(":")
    if host is None or scheme != "tcp" or address not in ("*", "0.0.0.0", "[::]", "::"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def _binds(endpoint: str) -> bool:
    local = endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))
    return local or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
