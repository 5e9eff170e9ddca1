"""Loopback ports for local mode's processes (pods' mapped ports, the operator's own): taken from a pool below
the kernel's ephemeral range, so that no outgoing connection's source port can take one between the pick and
the process's bind (a port from `bind(0)` is an ephemeral one, and the next `connect()` of any process may
reuse it once the picker closes its socket). `NEURONFLEET_LOCAL_PORTS=LOW-HIGH` sets the pool (say, to keep
two local clusters on one machine apart)."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

POOL_ENV = "NEURONFLEET_LOCAL_PORTS"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
POOL_SIZE = 12000  # ports below the ephemeral range, by default
LOWEST = 1024  # never a privileged port

_handed_out: set[int] = set()  # by this process: picked again only once the pool is spent


def pool(environ: os._Environ | dict[str, str] = os.environ) -> range:
    """The ports to pick from: the setting, else the POOL_SIZE ports below the ephemeral range (else those
    above it); ValueError for a setting that is not LOW-HIGH within 1024..65535."""
    value = environ.get(POOL_ENV, "").strip()
    if value:
        low, sep, high = value.partition("-")
        if not (sep and low.strip().isdigit() and high.strip().isdigit()):
            raise ValueError(f"{POOL_ENV}={value!r}: expected LOW-HIGH, e.g. 20000-24000")
        lo, hi = int(low), int(high)
        if not LOWEST <= lo < hi <= 65535:
            raise ValueError(f"{POOL_ENV}={value!r}: expected {LOWEST} <= LOW < HIGH <= 65535")
        return range(lo, hi + 1)
    try:
        start, end = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        start, end = 32768, 60999  # Linux's default
    if start - LOWEST >= 1000:
        return range(max(LOWEST, start - POOL_SIZE), start)
    return range(end + 1, 65536)


def loopback_port(environ: os._Environ | dict[str, str] = os.environ) -> int:
    """A 127.0.0.1 port from the pool that is free now and that this process has not handed out before."""
    ports = pool(environ)
    fresh_only = sum(1 for p in _handed_out if p in ports) < len(ports) // 2  # this pool's, not another's
    for _ in range(200):
        port = random.choice(ports)
        if fresh_only and port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free loopback port in {ports.start}-{ports.stop - 1} ({POOL_ENV})")
