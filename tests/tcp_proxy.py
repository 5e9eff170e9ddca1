"""A TCP proxy on 127.0.0.1 for fault-injecting tests: each connection to it opens one to the upstream port,
and two threads pump the bytes, one per direction, through `pump` (which subclasses shape: cut, stall,
corrupt). What it owns: the listener, the connections, and closing them."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any


class TcpProxy:
    """Listens on a free loopback port (`port`, `url`) and forwards to `upstream` through `pump`."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def connection(self) -> Any:
        """State shared by one connection's two directions (none by default)."""
        return None

    def pump(self, src: socket.socket, dst: socket.socket, upstream_bound: bool, state: Any) -> None:
        """Carry bytes from src to dst until src ends; an OSError ends the connection quietly."""
        while data := src.recv(1 << 16):
            dst.sendall(data)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            self.sockets += [client, server]
            state = self.connection()
            for src, dst, upstream_bound in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._run, args=(src, dst, upstream_bound, state), daemon=True
                ).start()

    def _run(self, src: socket.socket, dst: socket.socket, upstream_bound: bool, state: Any) -> None:
        with contextlib.suppress(OSError):
            self.pump(src, dst, upstream_bound, state)
        for s in (src, dst):  # both ends see the connection end
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()
