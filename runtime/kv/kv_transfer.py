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
- `nixl` (`runtime/kv/nixl_transfer.py`): NIXL (UCX on any network, LIBFABRIC on EFA), the library vLLM
  and SGLang move KV caches with; `efa` is NIXL with its LIBFABRIC backend. It never falls back to something
  slower: when NIXL, the backend's plugin or libfabric is missing, making the agent fails with a clear error.

Both agents check a write the same way (`AgentBase.check`) and deliver the same notifications.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import math
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
    """Where a write lands: a registered region of the remote agent, a byte offset and a length."""

    region: str
    offset: int
    nbytes: int


@dataclass(eq=False)
class Region:
    tensor: torch.Tensor
    view: memoryview  # the tensor's bytes
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
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def put(self, transfer: Transfer, header: dict[str, Any], payload: memoryview) -> None:
        self.pending.append(transfer)
        self.outbox.put((header, payload))

    def _send(self) -> None:
        try:
            while not self.closed:
                item = self.outbox.get()
                if item is None:
                    return
                header, payload = item
                encoded = json.dumps(header).encode()
                parts: list = [HEADER.pack(len(encoded)) + encoded]
                hasher = xxhash.xxh3_64()
                for start in range(0, len(payload), CHUNK):  # hash a piece, then send it while it is cached
                    piece = payload[start : start + CHUNK]
                    hasher.update(piece)
                    _send_all(self.sock, [*parts, piece])
                    parts = []
                _send_all(self.sock, [*parts, TRAILER.pack(hasher.intdigest())])
        except OSError as e:
            self._broken(str(e))

    def _read(self) -> None:
        try:
            while not self.closed:
                head = bytearray(2 + HEADER.size)
                _recv_into(self.sock, memoryview(head))
                body = bytearray(HEADER.unpack(head[2:])[0])
                _recv_into(self.sock, memoryview(body))
                ok, message = bytes(head[:2]) == REPLY_OK, body.decode()
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


def _recv_into(sock: socket.socket, view: memoryview, idle_ok: bool = False) -> None:
    """Fill `view` from the socket: MSG_WAITALL lets the kernel fill it in one call (one wake-up, one turn of
    the GIL). The receive timeout (SO_RCVTIMEO) ends a read that stalls part-way; with `idle_ok` a read that
    has received nothing yet just waits on (an idle connection between writes)."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # the receive timeout passed
            if idle_ok and got == 0:
                continue
            raise TimeoutError("the writer stalled in the middle of a write") from None
        if n == 0:
            raise ConnectionError("the writer closed the connection")
        got += n


def _receive(agent: TcpAgent, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """One connection's incoming writes, on its own thread with blocking reads: the kernel copies each
    payload straight into the registered memory; the thread then checks it (XXH3 runs at tens of GB/s, so
    checking inline costs less than handing it to another thread), replies in order and notifies. A
    writer that stalls in the middle of a write for `stall_seconds` loses its connection: no region stays
    pinned."""
    whole = int(agent.stall_seconds)
    timeout = struct.pack("ll", whole, int((agent.stall_seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
    length, trailer = bytearray(HEADER.size), bytearray(TRAILER.size)
    try:
        while True:
            _recv_into(sock, memoryview(length), idle_ok=True)
            raw = bytearray(HEADER.unpack(length)[0])
            _recv_into(sock, memoryview(raw))
            header = json.loads(raw)
            with agent._lock:  # checked and pinned at once: deregistering cannot slip in between
                problem = agent.check(header)
                region = None if problem else agent.regions[header["region"]]
                if region is not None:
                    region.receiving += 1
            if region is None:  # refused: the payload (and trailer) is read into scratch memory and dropped
                scratch = memoryview(bytearray(min(int(header.get("nbytes", 0)) + TRAILER.size, 1 << 20)))
                left = int(header.get("nbytes", 0)) + TRAILER.size
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
            if hasher.intdigest() != TRAILER.unpack(trailer)[0]:
                problem = "checksum mismatch: the bytes arrived corrupted"
            elif agent.regions.get(header["region"]) is not region:
                problem = f"region {header['region']!r} was deregistered (its lease ended) meanwhile"
            if problem:
                _reply(sock, REPLY_ERR, problem)
            else:
                loop.call_soon_threadsafe(agent._notify, header["agent"], header["notification"])
                _reply(sock, REPLY_OK, "")
    except (OSError, ConnectionError, ValueError):
        pass  # the writer left, stalled, or sent garbage: its pending transfers fail on its side
    finally:
        agent._accepted.discard(sock)
        sock.close()


def _reply(sock: socket.socket, code: bytes, message: str) -> None:
    body = message.encode()
    sock.sendall(code + HEADER.pack(len(body)) + body)


class AgentBase:
    """What every transport's agent shares: named regions of memory that writes may land in, the checks a
    write passes before it is accepted (`check`), and the notifications of verified writes."""

    transport_name = ""

    def __init__(self, name: str, model_id: str, stall_seconds: float = 30.0) -> None:
        self.name, self.model_id, self.stall_seconds = name, model_id, stall_seconds
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

    def register_memory(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        with self._lock:
            self.regions[name] = Region(tensor, tensor_bytes(tensor))
            return self.regions[name].info

    def deregister_memory(self, name: str) -> Region | None:
        """Refuse writes to the region from now on; returns it (its `receiving` says whether a payload is
        still landing in its memory), or None when it was not registered."""
        with self._lock:
            return self.regions.pop(name, None)

    def check(self, header: dict[str, Any]) -> str:
        """Why a write described by `header` must be refused ("" when it may land): another life of this
        agent, another model, no such region (its lease ended), another dtype, out of bounds, a shape that
        does not make its bytes. Call with `_lock` held."""
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
                     nbytes: int) -> dict[str, Any]:  # fmt: skip
        """What a write says of itself, for the receiver's `check`."""
        return {
            "agent": self.name,
            "to": remote["agent"],
            "model": self.model_id,
            "region": dst.region,
            "offset": dst.offset,
            "nbytes": nbytes,
            "dtype": str(src.dtype).removeprefix("torch."),
            "shape": list(src.shape),
            "notification": notification,
        }

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
    ) -> None:
        """`name` identifies this agent's incarnation (a restarted process gets a new one, and writes meant
        for the old one are refused); `advertise` is the address writers are told to use, when it is not the
        listening one (a pod IP, a proxy), its port None for the listening port; a writer that stalls in the
        middle of a payload for `stall_seconds` loses its connection, so no region stays pinned."""
        super().__init__(name, model_id, stall_seconds)
        self.host, self.advertise = host, advertise
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
            self._connecting[address] = asyncio.get_running_loop().create_task(self._connect(address))
        try:
            return await asyncio.shield(self._connecting[address])
        finally:
            task = self._connecting.get(address)
            if task is not None and task.done():
                del self._connecting[address]

    async def _connect(self, address: tuple[str, int]) -> _Link:
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, socket.create_connection, address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        header = {**self.write_header(remote, src, dst, notification, len(payload)), "id": next(self._ids)}
        address = (remote["address"][0], int(remote["address"][1]))
        link = self._links.get(address)
        if link is not None:  # the usual case: queued at once, in order
            link.put(transfer, header, payload)
            return transfer

        async def send() -> None:
            try:
                link = await self._link(address)
            except OSError as e:
                transfer.finish(f"the connection to {address[0]}:{address[1]} broke: {e}")
                return
            link.put(transfer, header, payload)

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
