"""KV staging leases: regions are registered only while leased; expiry and release deregister them, so a
late write is refused and nothing stays pinned; a full pool refuses clearly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from neuronfleet.runtime.kv_transfer import Descriptor, IntegrityError, TcpAgent
from neuronfleet.runtime.leases import LeasePool, NoRegionFree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool(agent, clock, count=2):
    shape = {"layers": 2, "kv_heads": 3, "head_dim": 4, "max_tokens": 16}
    return LeasePool(agent, count=count, **shape, dtype=torch.bfloat16, ttl=10.0, clock=clock)


def test_a_leased_region_receives_writes_and_an_expired_one_refuses_them():
    async def main():
        clock, receiver, sender = Clock(), TcpAgent("decode", "m"), TcpAgent("prefill", "m")
        leases = pool(receiver, clock)
        await receiver.start()
        lease = leases.reserve("r1", tokens=5)
        kv = torch.randn(2, 2, 3, 5, 4).to(torch.bfloat16)  # [layers, 2, kv_heads, tokens, head_dim]
        per_layer = kv[0].numel() * 2
        for layer in range(2):
            where = Descriptor(lease.region, layer * per_layer, per_layer)
            await sender.write(receiver.metadata(), kv[layer].contiguous(), where, f"r1:{layer}")
        assert torch.equal(leases.kv(lease.lease_id), kv)
        leases.release(lease.lease_id)
        assert lease.region not in receiver.regions and len(leases.free) == 2
        # a lease that expires is swept: its region is gone and a late write is refused
        late = leases.reserve("r2", tokens=5)
        clock.now = 11.0
        assert [x.lease_id for x in leases.sweep()] == [late.lease_id] and leases.expired == 1
        with pytest.raises(IntegrityError, match="is registered"):
            await sender.write(
                receiver.metadata(), kv[0].contiguous(), Descriptor(late.region, 0, per_layer), "x"
            )
        with pytest.raises(KeyError, match="unknown or expired"):
            leases.kv(late.lease_id)
        await sender.stop()
        await receiver.stop()

    asyncio.run(main())


def test_a_full_pool_and_an_oversized_request_are_refused():
    leases = pool(TcpAgent("decode", "m"), Clock(), count=1)
    leases.reserve("r1", tokens=16)
    with pytest.raises(NoRegionFree, match="all 1 KV staging regions are leased"):
        leases.reserve("r2", tokens=4)
    with pytest.raises(ValueError, match="1 to 16 prompt tokens, not 17"):
        leases.reserve("r3", tokens=17)
