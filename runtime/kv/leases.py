"""Leases on a decode pod's KV staging regions: a prefill pod may write a request's KV cache into a region
only while the decode pod holds a lease for that request. The regions are allocated (and touched) once at
start-up, since first-touch page faults cost more than the network; a lease registers its region with the
transfer agent and an expired or released lease deregisters it, so late writes are refused, never pinned.
A region whose memory a payload is still landing in when its lease ends waits (draining) until that payload
ends before another lease may use it. Lease ids are random, so a restarted pod never honours an old one.
Each lease has a key of its own (random, KEY_BYTES), given only in the answer to the reservation: a write
lands only with it (`kv_transfer.AgentBase.check`), so knowing a lease id, which writes carry in clear, is not
enough to write into its region.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neuronfleet.runtime.kv.kv_transfer import KEY_BYTES


class NoRegionFree(RuntimeError):
    """Every staging region is leased; retry later or on another decode pod."""


@dataclass
class Lease:
    lease_id: str
    request_id: str
    region: str  # the registered region's name
    tokens: int  # prompt tokens the region holds for this request
    expires_at: float
    key: bytes = field(default=b"", repr=False)  # what writes into its region must prove they hold


class LeasePool:
    """Staging regions for `count` concurrent handoffs of up to `max_tokens` tokens each."""

    def __init__(
        self,
        agent,
        *,
        count: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype,
        ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent, self.ttl, self.clock = agent, ttl, clock
        self.shape = (layers, 2, kv_heads, head_dim)
        self.max_tokens = max_tokens
        per_region = layers * 2 * kv_heads * max_tokens * head_dim
        # zeros, not empty: every page is touched now rather than during a transfer
        self.regions = [torch.zeros(per_region, dtype=dtype) for _ in range(count)]
        agent.prepare(self.regions)
        self.free = list(range(count))
        self.leases: dict[str, tuple[Lease, int]] = {}
        self.draining: list[tuple[int, object]] = []  # (index, the agent's Region) still receiving
        self.expired = 0

    def reserve(self, request_id: str, tokens: int) -> Lease:
        self.sweep()
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"a lease holds 1 to {self.max_tokens} prompt tokens, not {tokens}")
        if not self.free:
            raise NoRegionFree(f"all {len(self.regions)} KV staging regions are leased")
        index = self.free.pop()
        lease_id = f"lease-{secrets.token_hex(8)}"
        key = secrets.token_bytes(KEY_BYTES)
        lease = Lease(lease_id, request_id, lease_id, tokens, self.clock() + self.ttl, key)
        view = self.regions[index][: self.elements(tokens)]
        self.agent.register_memory(lease.region, view, key)
        self.leases[lease.lease_id] = (lease, index)
        return lease

    def elements(self, tokens: int) -> int:
        layers, two, kv_heads, head_dim = self.shape
        return layers * two * kv_heads * tokens * head_dim

    def kv(self, lease_id: str) -> torch.Tensor:
        """The lease's region as [layers, 2, kv_heads, tokens, head_dim] (layer-major, as written)."""
        lease, index = self._live(lease_id)
        layers, two, kv_heads, head_dim = self.shape
        flat = self.regions[index][: self.elements(lease.tokens)]
        return flat.view(layers, two, kv_heads, lease.tokens, head_dim)

    def release(self, lease_id: str) -> None:
        entry = self.leases.pop(lease_id, None)
        if entry is not None:
            lease, index = entry
            region = self.agent.deregister_memory(lease.region)
            if region is not None and region.receiving:
                self.draining.append((index, region))
            else:
                self.free.append(index)

    def sweep(self) -> list[Lease]:
        """Release every lease past its expiry (late writes to them are refused from now on)."""
        for item in [d for d in self.draining if not d[1].receiving]:
            self.draining.remove(item)
            self.free.append(item[0])
        now = self.clock()
        gone = [lease for lease, _ in self.leases.values() if lease.expires_at <= now]
        for lease in gone:
            self.release(lease.lease_id)
            self.expired += 1
        return gone

    def _live(self, lease_id: str) -> tuple[Lease, int]:
        self.sweep()
        entry = self.leases.get(lease_id)
        if entry is None:
            raise KeyError(f"lease {lease_id} is unknown or expired")
        return entry
