"""Fault injection for the KV handoff: a TCP proxy that sits between prefill pods and a decode pod's KV
receiver (the decode pod advertises the proxy's address) and, once armed, breaks the stream of bytes the way
networks and pods do — cuts the connection, stalls it, flips a byte, or runs a callback (killing a process)
— when the bytes sent since arming cross a threshold. One `FaultPlan` can arm several proxies; the first to
cross the threshold takes the fault, once.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tcp_proxy import TcpProxy


@dataclass
class Fault:
    kind: str  # cut | stall | flip | call
    at: int  # bytes written towards the receiver after arming
    call: Callable[[str], None] | None = None  # kind "call": gets the proxy's name; the link then stalls
    sent: int = 0


class FaultPlan:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fault: Fault | None = None
        self.taken: list[tuple[str, str]] = []  # (proxy, kind) of faults that happened

    def arm(self, kind: str, at: int, call: Callable[[str], None] | None = None) -> None:
        with self.lock:
            self.fault = Fault(kind, at, call)

    def take(self, name: str, chunk: bytes) -> tuple[bytes, str | None]:
        """The part of `chunk` to forward and the fault that strikes after it (None: none)."""
        with self.lock:
            f = self.fault
            if f is None:
                return chunk, None
            if f.sent + len(chunk) <= f.at:
                f.sent += len(chunk)
                return chunk, None
            self.fault = None
            self.taken.append((name, f.kind))
        keep = f.at - f.sent
        if f.kind == "flip":
            flipped = bytearray(chunk)
            flipped[keep] ^= 0xFF
            return bytes(flipped), None
        if f.kind == "call":
            assert f.call is not None
            f.call(name)
            return chunk[:keep], "stall"
        return chunk[:keep], f.kind


class FaultyProxy(TcpProxy):
    """Listens on 127.0.0.1 and forwards each connection to `upstream`, subject to the plan."""

    def __init__(self, name: str, upstream: int, plan: FaultPlan) -> None:
        self.name, self.plan = name, plan
        self.stalled = threading.Event()
        super().__init__(upstream)

    def pump(self, src: socket.socket, dst: socket.socket, upstream_bound: bool, state: None) -> None:
        while data := src.recv(1 << 16):
            fault = None
            if upstream_bound:  # towards the KV receiver
                data, fault = self.plan.take(self.name, data)
            dst.sendall(data)
            if fault == "cut":
                return
            if fault == "stall":  # hold the connection open and forward nothing more
                self.stalled.wait()
                return

    def release(self) -> None:
        """End stalled connections (both sides see them close)."""
        self.stalled.set()
        self.stalled = threading.Event()

    def close(self) -> None:
        self.release()
        super().close()
