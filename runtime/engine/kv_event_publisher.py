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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from neuronfleet.contract import KvEventsConfig
from neuronfleet.runtime.engine.kv_events import Event, EventBatch, encode_batch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig) -> None:
        self.topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint  # the port bound
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
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

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

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


def _binds(endpoint: str) -> bool:
    local = endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))
    return local or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
