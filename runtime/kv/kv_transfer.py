"""KV cache transfer between runtime pods, shaped like NIXL: agents register memory regions, a writer names a
region of a remote agent by a descriptor (region, offset, bytes), writes into it, and the remote side gets a
notification once the bytes are in place and verified; the writer polls its transfer for completion.

Two transports:
- `tcp` (`TcpAgent`): over any network. Writers are asyncio (pipelined writes, replies in order);
  each incoming connection is read by a thread with blocking reads that land each payload straight in the
  registered memory (no intermediate copy), and notifications are handed to the agent's event loop.
  Every write carries the receiver's identity (a restarted receiver refuses writes meant for its earlier
  life), the sender's model identity, the dtype and shape of what it sends, and is followed by the XXH3-64
  checksum of its bytes (hashed piece by piece as they are sent and received, while each piece is in the
  CPU's cache); the receiver checks all five before it acknowledges and notifies.
  Receive regions should be allocated once and reused: first-touch page faults cost more than the network.
  A connection starts with a mutual challenge-response (`_accept_handshake`): each side proves it holds the
  model's secret (HMAC-SHA256 over fresh nonces of both sides), so a peer without it gets no thread beyond the
  handshake's few seconds and no memory beyond its fixed-size messages; every length is checked against its
  limit before anything is allocated; a connection idle for `idle_seconds` is closed (writers stop reusing a
  link idle for half that, so no write races the close), at most `MAX_CONNECTIONS` at once.
- `nixl` (`runtime/kv/nixl_transfer.py`): NIXL (UCX on any network, LIBFABRIC on EFA), the library vLLM
  and SGLang move KV caches with; `efa` is NIXL with its LIBFABRIC backend. It never falls back to something
  slower: when NIXL, the backend's plugin or libfabric is missing, making the agent fails with a clear error.

Both agents check a write the same way (`AgentBase.check`) and deliver the same notifications. A write lands
only with its region's key: a decode pod's lease key (`leases`), which only the router that reserved the lease
gets and hands to the prefill pod it chose. The write's description carries an HMAC of itself under that key
(`mac`) and its checksum an HMAC under it too (`checksum_tag`), so a lease id seen on the wire, a replayed
description or another peer's bytes are refused. Authenticated, not encrypted: the bytes cross the network
in clear (as NIXL's do), and XXH3 is no MAC of the bytes themselves, so a peer on the path that rewrites TCP
streams is out of scope (docs/security.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import itertools
import json
import math
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

HEADER = struct.Struct("!I")  # length of the JSON header that precedes each payload
TRAILER = struct.Struct("!Q")  # the payload's XXH3-64, after it
CHUNK = 512 * 1024  # payloads are hashed and moved in pieces that stay in the CPU's cache between the two
REPLY_OK, REPLY_ERR = b"OK", b"ER"
TAG = 16  # bytes of an HMAC-SHA256 kept (128 bits)
KEY_BYTES = 32  # a lease key
MAX_HEADER = 64 * 1024  # a write's description (a few hundred bytes); longer is a protocol violation
MAX_REPLY = 64 * 1024  # a receiver's answer
MAX_NAME = 256  # an agent's name in the handshake
MAX_PAYLOAD = (
    1 << 40
)  # what a refused write's bytes may claim to be (they are read and dropped, 1 MiB at a time)
MAX_CONNECTIONS = 64  # writers connected to one receiver at once (each is a thread); more are closed at once
HANDSHAKE_SECONDS = 10.0  # to prove the model's secret, or the connection closes
IDLE_SECONDS = 120.0  # a receiver closes a connection idle this long; writers reuse links idle for half that
MAGIC = b"NFKV1"  # the protocol and its version, first on every connection, both ways
NONCE = 16


class TransferError(RuntimeError):
    """A transfer did not complete: refused by the receiver, broken connection, or past its deadline."""


class TransferTimeout(TransferError):
    """The receiver did not verify the bytes before the deadline (a stalled link or peer)."""


class IntegrityError(TransferError):
    """The bytes or their description do not match the receiving region (checksum, dtype, shape, model)."""


class TransportUnavailable(RuntimeError):
    """The requested transport cannot run here (e.g. efa without NIXL's LIBFABRIC backend)."""


@dataclass(frozen=True)
class Descriptor:
    """Where a write lands: a registered region of the remote agent, a byte offset and a length, and the
    region's key (the lease key its reservation gave out), without which the receiver refuses the write."""

    region: str
    offset: int
    nbytes: int
    key: bytes = field(default=b"", repr=False)


def derive(secret: bytes | str, purpose: str) -> bytes:
    """A key for one purpose from the model's secret (its internal token): the secret itself never crosses
    the network, and a key for one use proves nothing for another."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the KV transport needs the model's secret (its internal token); none was given")
    return hmac.new(raw, f"neuronfleet/{purpose}/v1".encode(), hashlib.sha256).digest()


def write_mac(key: bytes, header: dict[str, Any]) -> str:
    """The HMAC of a write's description under a key (its region's, for `mac`; the model's, for NIXL's
    `proof`): every field but those two."""
    signed = {k: v for k, v in header.items() if k not in ("mac", "proof")}
    body = json.dumps(signed, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).digest()[:TAG].hex()


def checksum_tag(key: bytes, mac: str, digest: int) -> bytes:
    """The HMAC, under the region's key, that binds a write's XXH3-64 to its description."""
    return hmac.new(key, bytes.fromhex(mac) + digest.to_bytes(8, "big"), hashlib.sha256).digest()[:TAG]


@dataclass(eq=False)
class Region:
    tensor: torch.Tensor
    view: memoryview  # the tensor's bytes
    key: bytes = field(default=b"", repr=False)  # what a write must prove it holds (its lease key)
    receiving: int = 0  # payloads being read into it now (its memory must not be reused until they end)

    @property
    def info(self) -> dict[str, Any]:
        return {"dtype": str(self.tensor.dtype).removeprefix("torch."), "shape": list(self.tensor.shape),
                "nbytes": self.tensor.numel() * self.tensor.element_size()}  # fmt: skip


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("transfers read and write contiguous CPU tensors")
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()) if tensor.numel() else memoryview(b"")


@dataclass
class Transfer:
    """One write in flight: NIXL's transfer handle (poll its state, or wait for it)."""

    nbytes: int
    state: str = "pending"  # pending | done | error
    error: str = ""
    integrity: bool = False  # the receiver refused the bytes or their description
    timed_out: bool = False
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self, error: str = "", integrity: bool = False) -> None:
        if self.state != "pending":
            return
        self.state, self.error, self.integrity = ("error", error, integrity) if error else ("done", "", False)
        self.seconds = time.perf_counter() - self.started
        self.done.set()

    async def wait(self, timeout: float | None = None) -> Transfer:
        """Until the receiver verified the bytes; IntegrityError or TransferError otherwise."""
        try:
            await asyncio.wait_for(self.done.wait(), timeout)
        except TimeoutError:
            self.finish(f"the transfer passed its {timeout} s deadline")
            self.timed_out = True
        if self.state == "error":
            kind = IntegrityError if self.integrity else TransferTimeout if self.timed_out else TransferError
            raise kind(self.error)
        return self


class _Link:
    """A connection to one receiver, served by two threads with blocking calls (the kernel reads each payload
    from the source tensor's memory): one sends queued writes in order, one reads the replies, which come
    back in the same order, and completes each transfer on the writer's event loop."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, on_broken) -> None:
        self.sock, self.loop, self.on_broken = sock, loop, on_broken
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: collections.deque[Transfer] = collections.deque()
        self.closed = False
        self.last_used = time.monotonic()
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def put(self, transfer: Transfer, header: dict[str, Any], payload: memoryview, key: bytes) -> None:
        self.last_used = time.monotonic()
        self.pending.append(transfer)
        self.outbox.put((header, payload, key))

    def _send(self) -> None:
        try:
            while not self.closed:
                item = self.outbox.get()
                if item is None:
                    return
                header, payload, key = item
                encoded = json.dumps(header).encode()
                parts: list = [HEADER.pack(len(encoded)) + encoded]
                hasher = xxhash.xxh3_64()
                for start in range(0, len(payload), CHUNK):  # hash a piece, then send it while it is cached
                    piece = payload[start : start + CHUNK]
                    hasher.update(piece)
                    _send_all(self.sock, [*parts, piece])
                    parts = []
                digest = hasher.intdigest()
                _send_all(self.sock, [*parts, TRAILER.pack(digest), checksum_tag(key, header["mac"], digest)])
        except OSError as e:
            self._broken(str(e))

    def _read(self) -> None:
        try:
            while not self.closed:
                ok, message = _read_reply(self.sock)
                transfer = self.pending.popleft()
                self.loop.call_soon_threadsafe(transfer.finish, "" if ok else message, not ok)
        except (OSError, ConnectionError, IndexError) as e:
            self._broken(str(e) or "closed")

    def _broken(self, reason: str) -> None:
        if not self.closed:
            self.loop.call_soon_threadsafe(self.on_broken, reason)

    def close(self, reason: str) -> None:
        """Fail what is still pending (call on the event loop)."""
        self.closed = True
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        while self.pending:
            self.pending.popleft().finish(reason)


def _send_all(sock: socket.socket, buffers: list) -> None:
    """Send the buffers in order with as few calls as the kernel allows (header and payload in one)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _recv_into(
    sock: socket.socket, view: memoryview, idle_for: float | None = None, deadline: float | None = None
) -> None:
    """Fill `view` from the socket: MSG_WAITALL lets the kernel fill it in one call (one wake-up, one turn of
    the GIL). The receive timeout (SO_RCVTIMEO) ends a read that stalls part-way; with `idle_for` a read that
    has received nothing yet waits on (an idle connection between writes) up to that many seconds in all; past
    `deadline` (monotonic) a peer that trickles bytes is cut off too."""
    got = 0
    idle_until = None if idle_for is None else time.monotonic() + idle_for
    while got < len(view):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the peer did not finish in time")
        try:
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # the receive timeout passed
            if idle_until is not None and got == 0:
                if time.monotonic() < idle_until:
                    continue
                raise TimeoutError(f"the writer stayed idle for {idle_for} s") from None
            raise TimeoutError("the writer stalled in the middle of a write") from None
        if n == 0:
            raise ConnectionError("the writer closed the connection")
        got += n


def _set_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO: a blocking read that waits this long ends (BlockingIOError, see `_recv_into`)."""
    whole = int(seconds)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6))
    )


def _read_name(sock: socket.socket, deadline: float) -> str:
    size = bytearray(2)
    _recv_into(sock, memoryview(size), deadline=deadline)
    length = int.from_bytes(size, "big")
    if not 0 < length <= MAX_NAME:
        raise ConnectionError(f"an agent name of {length} bytes (1 to {MAX_NAME})")
    name = bytearray(length)
    _recv_into(sock, memoryview(name), deadline=deadline)
    return name.decode()


def _accept_handshake(agent: TcpAgent, sock: socket.socket) -> str:
    """The receiver's side of a connection's start: a fresh nonce out; the writer's nonce, name and proof in
    (HMAC under the model's connection key over both nonces and its name); its own proof back.
    Returns the writer's name; ConnectionError (after saying why) when the writer holds no such key."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS  # all of it, however the bytes trickle in
    ours = os.urandom(NONCE)
    sock.sendall(MAGIC + ours)
    hello = bytearray(len(MAGIC) + NONCE)
    _recv_into(sock, memoryview(hello), deadline=deadline)
    if bytes(hello[: len(MAGIC)]) != MAGIC:
        raise ConnectionError("not a neuronfleet KV writer (or another version of the protocol)")
    theirs = bytes(hello[len(MAGIC) :])
    writer = _read_name(sock, deadline)
    proof = bytearray(TAG)
    _recv_into(sock, memoryview(proof), deadline=deadline)
    expected = _proof(agent.connection_key, b"writer", ours, theirs, writer)
    if not hmac.compare_digest(bytes(proof), expected):
        _reply(sock, REPLY_ERR, "unauthenticated: the writer did not prove it holds this model's secret")
        raise ConnectionError("a writer failed the handshake")
    _reply(sock, REPLY_OK, _proof(agent.connection_key, b"receiver", ours, theirs, writer).hex())
    return writer


def _offer_handshake(key: bytes, sock: socket.socket, name: str) -> None:
    """The writer's side of `_accept_handshake` (blocking, within HANDSHAKE_SECONDS); ConnectionError when
    the receiver refuses this writer or cannot prove it holds the model's secret itself."""
    _set_timeout(sock, HANDSHAKE_SECONDS)
    hello = bytearray(len(MAGIC) + NONCE)
    _recv_into(sock, memoryview(hello))
    if bytes(hello[: len(MAGIC)]) != MAGIC:
        raise ConnectionError("the address does not answer as a neuronfleet KV receiver")
    theirs, ours = bytes(hello[len(MAGIC) :]), os.urandom(NONCE)
    encoded = name.encode()
    proof = _proof(key, b"writer", theirs, ours, name)
    sock.sendall(MAGIC + ours + len(encoded).to_bytes(2, "big") + encoded + proof)
    ok, message = _read_reply(sock)
    if not ok:
        raise ConnectionError(f"the receiver refused the connection: {message}")
    expected = _proof(key, b"receiver", theirs, ours, name).hex()
    if not hmac.compare_digest(message, expected):
        raise ConnectionError("the receiver did not prove it holds this model's secret")
    _set_timeout(sock, 0)


def _proof(key: bytes, side: bytes, receiver_nonce: bytes, writer_nonce: bytes, writer: str) -> bytes:
    """One side's proof that it holds the model's key, bound to both nonces (no replay) and the writer's
    name (which life of the receiver a write is for is its description's `to`, refused in its own words)."""
    message = b"\0".join((side, receiver_nonce, writer_nonce, writer.encode()))
    return hmac.new(key, message, hashlib.sha256).digest()[:TAG]


def _parse_header(raw: bytes) -> dict[str, Any]:
    """A write's description, its types checked (ConnectionError: the writer does not speak the protocol)."""
    try:
        header = json.loads(raw)
    except ValueError:
        raise ConnectionError("a write's description is not JSON") from None
    kinds = {"agent": str, "to": str, "model": str, "region": str, "offset": int, "nbytes": int, "dtype": str,
             "shape": list, "notification": str, "mac": str}  # fmt: skip
    if not isinstance(header, dict) or any(type(header.get(k)) is not t for k, t in kinds.items()):
        raise ConnectionError("a write's description lacks a field or has one of the wrong type")
    if not 0 <= header["nbytes"] <= MAX_PAYLOAD or not all(
        type(n) is int and n >= 0 for n in header["shape"]
    ):
        raise ConnectionError("a write's description claims an impossible size")
    return header


def _receive(agent: TcpAgent, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """One connection's incoming writes, on its own thread with blocking reads: the handshake first (the
    writer proves it holds the model's secret within HANDSHAKE_SECONDS); then the kernel copies each payload
    straight into the registered memory; the thread checks it (XXH3 runs at tens of GB/s, so checking inline
    costs less than handing it to another thread), replies in order and notifies. A writer that stalls in
    the middle of a write for `stall_seconds`, or stays idle for `idle_seconds`, loses its connection: no
    region stays pinned, no thread waits forever."""
    length, trailer = bytearray(HEADER.size), bytearray(TRAILER.size + TAG)
    try:
        _set_timeout(sock, min(HANDSHAKE_SECONDS, agent.stall_seconds))
        _accept_handshake(agent, sock)
        _set_timeout(sock, min(agent.stall_seconds, agent.idle_seconds))
        while True:
            _recv_into(sock, memoryview(length), idle_for=agent.idle_seconds)
            size = HEADER.unpack(length)[0]
            if size > MAX_HEADER:
                raise ConnectionError(f"a write's description of {size} bytes (at most {MAX_HEADER})")
            raw = bytearray(size)
            _recv_into(sock, memoryview(raw))
            header = _parse_header(raw)
            with agent._lock:  # checked and pinned at once: deregistering cannot slip in between
                problem = agent.check(header)
                region = None if problem else agent.regions[header["region"]]
                if region is not None:
                    region.receiving += 1
            if region is None:  # refused: the payload (and trailer) is read into scratch memory and dropped
                left = header["nbytes"] + len(trailer)
                scratch = memoryview(bytearray(min(left, 1 << 20)))
                while left > 0:
                    step = min(left, len(scratch))
                    _recv_into(sock, scratch[:step])
                    left -= step
                _reply(sock, REPLY_ERR, problem)
                continue
            target = region.view[header["offset"] : header["offset"] + header["nbytes"]]
            hasher = xxhash.xxh3_64()
            try:
                for start in range(0, len(target), CHUNK):  # hash each piece while it is in the cache
                    piece = target[start : start + CHUNK]
                    _recv_into(sock, piece)
                    hasher.update(piece)
            finally:
                with agent._lock:
                    region.receiving -= 1
            _recv_into(sock, memoryview(trailer))
            digest = TRAILER.unpack(trailer[: TRAILER.size])[0]
            if not hmac.compare_digest(
                bytes(trailer[TRAILER.size :]), checksum_tag(region.key, header["mac"], digest)
            ):
                problem = (
                    "refused: the checksum does not carry the lease key the description was written with"
                )
            elif hasher.intdigest() != digest:
                problem = "checksum mismatch: the bytes arrived corrupted"
            elif agent.regions.get(header["region"]) is not region:
                problem = f"region {header['region']!r} was deregistered (its lease ended) meanwhile"
            if problem:
                _reply(sock, REPLY_ERR, problem)
            else:
                loop.call_soon_threadsafe(agent._notify, header["agent"], header["notification"])
                _reply(sock, REPLY_OK, "")
    except (OSError, ConnectionError, ValueError, UnicodeDecodeError):
        pass  # the writer left, stalled, idled, failed the handshake or sent garbage: its writes fail there
    finally:
        agent._accepted.discard(sock)
        sock.close()


def _read_reply(sock: socket.socket) -> tuple[bool, str]:
    """A receiver's answer (`_reply`): OK or not, and its message; its length checked before it is read."""
    head = bytearray(2 + HEADER.size)
    _recv_into(sock, memoryview(head))
    length = HEADER.unpack(head[2:])[0]
    if length > MAX_REPLY:
        raise ConnectionError(f"the receiver's answer claims {length} bytes (at most {MAX_REPLY})")
    body = bytearray(length)
    _recv_into(sock, memoryview(body))
    return bytes(head[:2]) == REPLY_OK, body.decode(errors="replace")


def _reply(sock: socket.socket, code: bytes, message: str) -> None:
    body = message.encode()
    sock.sendall(code + HEADER.pack(len(body)) + body)


class AgentBase:
    """What every transport's agent shares: named regions of memory that writes may land in, the checks a
    write passes before it is accepted (`check`), and the notifications of verified writes."""

    transport_name = ""

    def __init__(self, name: str, model_id: str, *, secret: bytes | str, stall_seconds: float = 30.0) -> None:
        """`secret`: the model's (its internal token), which every pod and router of the model holds and
        nothing else does; connections and messages between agents prove it (`derive`)."""
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"an agent's name is at most {MAX_NAME} bytes")
        self.name, self.model_id, self.stall_seconds = name, model_id, stall_seconds
        self.connection_key = derive(secret, "kv-connect")
        self.regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        self._notifications: list[tuple[str, str]] = []
        self._notified = asyncio.Condition()

    # ---- memory ----

    def prepare(self, tensors: list[torch.Tensor]) -> None:
        """Memory that regions will be carved from, told once at start-up (NIXL registers it then, not on a
        request's path)."""

    def export_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for what a prefill pod is about to write (its engine exports a request's KV into it),
        held until `release_export`; over tcp any memory serves."""
        return torch.empty(shape, dtype=dtype)

    def release_export(self, tensor: torch.Tensor) -> None:
        """The prefill pod is done with an `export_buffer` (writes of it still on their way keep it)."""

    def register_memory(self, name: str, tensor: torch.Tensor, key: bytes) -> dict[str, Any]:
        """Let writes that hold `key` (a lease key: KEY_BYTES random bytes) land in `tensor`."""
        if len(key) < KEY_BYTES:
            raise ValueError(f"a region's key is at least {KEY_BYTES} random bytes")
        with self._lock:
            self.regions[name] = Region(tensor, tensor_bytes(tensor), bytes(key))
            return self.regions[name].info

    def deregister_memory(self, name: str) -> Region | None:
        """Refuse writes to the region from now on; returns it (its `receiving` says whether a payload is
        still landing in its memory), or None when it was not registered."""
        with self._lock:
            return self.regions.pop(name, None)

    def check(self, header: dict[str, Any]) -> str:
        """Why a write described by `header` must be refused ("" when it may land): another life of this
        agent, another model, no such region (its lease ended), another dtype, out of bounds, a shape that
        does not make its bytes, a description not made with the region's key (`mac`). Call with `_lock`
        held."""
        if header.get("to", self.name) != self.name:
            return (
                f"this agent is {self.name!r}, not {header.get('to')!r}: the receiver restarted, and leases "
                "and regions of its earlier life are void"
            )
        if header.get("model") != self.model_id:
            return f"model mismatch: the writer serves {header.get('model')!r}, this agent {self.model_id!r}"
        region = self.regions.get(header.get("region", ""))
        if region is None:
            return f"no region {header.get('region')!r} is registered (its lease may have expired)"
        if not isinstance(header.get("mac"), str) or not hmac.compare_digest(
            header["mac"], write_mac(region.key, header)
        ):
            return (
                f"refused: the write to {header.get('region')!r} does not carry its lease key (only the "
                "router that reserved the lease has it, for the prefill pod it chose)"
            )
        info = region.info
        if header.get("dtype") != info["dtype"]:
            return f"dtype mismatch: sent {header.get('dtype')}, the region holds {info['dtype']}"
        end = header["offset"] + header["nbytes"]
        if header["offset"] < 0 or end > info["nbytes"]:
            return f"bytes {header['offset']}..{end} fall outside the region's {info['nbytes']}"
        shape = header.get("shape") or []
        element = region.tensor.element_size()
        if math.prod(shape) * element != header["nbytes"]:
            return f"shape {shape} of {header.get('dtype')} does not make {header['nbytes']} bytes"
        return ""

    def write_header(self, remote: dict[str, Any], src: torch.Tensor, dst: Descriptor, notification: str,
                     nbytes: int, **extra: Any) -> dict[str, Any]:  # fmt: skip
        """What a write says of itself, for the receiver's `check` (with the transport's `extra` fields), and
        its HMAC under the region's key (`write_mac`)."""
        if len(dst.key) < KEY_BYTES:
            raise ValueError("a write needs its region's key (the lease key the reservation gave out)")
        header = {
            "agent": self.name,
            "to": remote["agent"],
            "model": self.model_id,
            "region": dst.region,
            "offset": dst.offset,
            "nbytes": nbytes,
            "dtype": str(src.dtype).removeprefix("torch."),
            "shape": list(src.shape),
            "notification": notification,
            **extra,
        }
        return {**header, "mac": write_mac(dst.key, header)}

    def transport_mismatch(self, remote: dict[str, Any]) -> str:
        """Why this agent cannot write to `remote` at all: the two pods were started with different
        transports (never bridged silently)."""
        theirs = remote.get("transport")
        if theirs != self.transport_name:
            return (
                f"refused: the receiver moves KV caches over {theirs!r} and this pod over "
                f"{self.transport_name!r}; start prefill and decode pods with the same --kv-transport"
            )
        return ""

    # ---- notifications ----

    def _notify(self, agent: str, message: str) -> None:
        self._notifications.append((agent, message))

        async def wake() -> None:
            async with self._notified:
                self._notified.notify_all()

        asyncio.get_running_loop().create_task(wake())

    def get_notifications(self) -> list[tuple[str, str]]:
        """(writer agent, message) of completed, verified writes since the last call."""
        out, self._notifications = self._notifications, []
        return out

    def discard_notifications(self, prefix: str) -> None:
        """Forget notifications that start with `prefix` (a request's, once it no longer waits for them)."""
        self._notifications = [n for n in self._notifications if not n[1].startswith(prefix)]

    async def wait_notification(self, message: str, timeout: float) -> str:
        """Wait for a notification with this message; returns the writer's name (TransferError on timeout)."""
        found: list[str] = []

        def take() -> bool:
            for i, (agent, msg) in enumerate(self._notifications):
                if msg == message:
                    del self._notifications[i]
                    found.append(agent)
                    return True
            return False

        async with self._notified:
            try:
                await asyncio.wait_for(self._notified.wait_for(take), timeout)
            except TimeoutError:
                raise TransferError(f"no notification {message!r} within {timeout} s") from None
        return found[0]

    @staticmethod
    def poll(transfer: Transfer) -> str:
        """NIXL's check_xfer_state: pending | done | error."""
        return transfer.state

    def metadata(self) -> dict[str, Any]:
        """What a writer needs to reach this agent (exchanged out of band, e.g. in the reserve reply); each
        transport adds how to reach it."""
        return {
            "agent": self.name,
            "transport": self.transport_name,
            "model": self.model_id,
            "regions": {name: r.info for name, r in self.regions.items()},
        }

    # ---- writing ----

    async def write(
        self,
        remote: dict[str, Any],
        src: torch.Tensor,
        dst: Descriptor,
        notification: str,
        timeout: float = 30.0,
    ) -> Transfer:
        """Write and wait until the receiver verified it (IntegrityError, TransferError otherwise), with the
        transport's own `write_nowait` and `abandon`."""
        transfer = self.write_nowait(remote, src, dst, notification)
        try:
            return await transfer.wait(timeout)
        except TransferError:
            if not transfer.integrity:  # a stalled or broken peer: later writes must not queue behind it
                self.abandon(remote, transfer.error)
            raise


class TcpAgent(AgentBase):
    """A transfer agent over TCP: receivers `register_memory` and `start`; writers `write` to metadata."""

    transport_name = "tcp"

    def __init__(
        self,
        name: str,
        model_id: str,
        host: str = "127.0.0.1",
        advertise: tuple[str, int | None] | None = None,
        stall_seconds: float = 30.0,
        *,
        secret: bytes | str,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        """`name` identifies this agent's incarnation (a restarted process gets a new one, and writes meant
        for the old one are refused); `advertise` is the address writers are told to use, when it is not the
        listening one (a pod IP, a proxy), its port None for the listening port; a writer that stalls in the
        middle of a payload for `stall_seconds` loses its connection, so no region stays pinned, and one idle
        for `idle_seconds` too; `secret`: the model's, which both ends of a connection prove they hold."""
        super().__init__(name, model_id, secret=secret, stall_seconds=stall_seconds)
        self.host, self.advertise, self.idle_seconds = host, advertise, idle_seconds
        self.refused_connections = 0  # past MAX_CONNECTIONS
        self._listener: socket.socket | None = None
        self._accepted: set[socket.socket] = set()
        self.port = 0
        self._links: dict[tuple[str, int], _Link] = {}
        self._sending: set[asyncio.Task] = set()
        self._connecting: dict[tuple[str, int], asyncio.Task] = {}
        self._ids = itertools.count()

    # ---- receiving ----

    async def start(self, port: int = 0) -> int:
        """Listen for writers; each connection is read by its own thread."""
        loop = asyncio.get_running_loop()
        listener = self._listener = socket.create_server((self.host, port))
        self.port = listener.getsockname()[1]

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # stopped
                if len(self._accepted) >= MAX_CONNECTIONS:  # a thread each: bounded
                    self.refused_connections += 1
                    conn.close()
                    continue
                # replies are small: without this, Nagle holds each behind the writer's delayed ACK (40 ms)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._accepted.add(conn)
                threading.Thread(target=_receive, args=(self, conn, loop), daemon=True).start()

        threading.Thread(target=accept, name=f"kv-accept-{self.name}", daemon=True).start()
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self._listener.close()
            self._listener = None
        for conn in list(self._accepted):  # writers see their connection break
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for address in list(self._links):
            self._drop(address, "the agent stopped")

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "address": self.address}

    @property
    def address(self) -> list:
        if self.advertise is None:
            return [self.host, self.port]
        return [self.advertise[0], self.advertise[1] or self.port]

    # ---- writing ----

    async def _link(self, address: tuple[str, int]) -> _Link:
        """The link to a receiver, connecting once even when several writes wait for it."""
        if address in self._links:
            return self._links[address]
        if address not in self._connecting:
            connect = self._connect(address)
            self._connecting[address] = asyncio.get_running_loop().create_task(connect)
        try:
            return await asyncio.shield(self._connecting[address])
        finally:
            task = self._connecting.get(address)
            if task is not None and task.done():
                del self._connecting[address]

    async def _connect(self, address: tuple[str, int]) -> _Link:
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, socket.create_connection, address, HANDSHAKE_SECONDS)
        sock.settimeout(None)  # blocking again: SO_RCVTIMEO (the handshake's) bounds its reads
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.run_in_executor(None, _offer_handshake, self.connection_key, sock, self.name)
        except BaseException:
            sock.close()
            raise
        where = f"{address[0]}:{address[1]}"
        link = _Link(
            sock, loop, lambda reason: self._drop(address, f"the connection to {where} broke: {reason}")
        )
        self._links[address] = link
        return link

    def write_nowait(
        self, remote: dict[str, Any], src: torch.Tensor, dst: Descriptor, notification: str
    ) -> Transfer:
        """Start writing `src` into the remote region at `dst` and return its handle at once; writes to
        one receiver go out in order, and each is done when the receiver has verified it."""
        payload = tensor_bytes(src)
        transfer = Transfer(nbytes=len(payload))
        if mismatch := self.transport_mismatch(remote):
            transfer.finish(mismatch, integrity=True)
            return transfer
        header = self.write_header(remote, src, dst, notification, len(payload), id=next(self._ids))
        address = (remote["address"][0], int(remote["address"][1]))
        link = self._links.get(address)
        if (
            link is not None
            and not link.pending
            and time.monotonic() - link.last_used > self.idle_seconds / 2
        ):
            self._drop(address, "idle")  # the receiver may be closing it: a fresh one, not a race
            link = None
        if link is not None:  # the usual case: queued at once, in order
            link.put(transfer, header, payload, dst.key)
            return transfer

        async def send() -> None:
            try:
                link = await self._link(address)
            except (OSError, ConnectionError) as e:
                transfer.finish(f"the connection to {address[0]}:{address[1]} broke: {e}")
                return
            link.put(transfer, header, payload, dst.key)

        task = asyncio.get_running_loop().create_task(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return transfer

    def abandon(self, remote: dict[str, Any], reason: str) -> None:
        """Give up on a receiver that stalled: its connection closes and what is queued behind fails, so later
        writes start on a fresh connection instead of waiting behind it."""
        self._drop((remote["address"][0], int(remote["address"][1])), reason)

    def _drop(self, address: tuple[str, int], reason: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.close(reason)
