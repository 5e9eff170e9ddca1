"""KV staging leases: regions are registered only while leased; expiry and release deregister them, so a
late write is refused and nothing stays pinned; a full pool refuses clearly."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from support import wait_until_async

from neuronfleet.runtime.kv.kv_transfer import Descriptor, IntegrityError, TcpAgent
from neuronfleet.runtime.kv.leases import LeasePool, NoRegionFree

SECRET, KEY = "test-model-secret", bytes(range(32))  # the model's secret and a lease's key


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
        clock, receiver, sender = (
            Clock(),
            TcpAgent("decode", "m", secret=SECRET),
            TcpAgent("prefill", "m", secret=SECRET),
        )
        leases = pool(receiver, clock)
        await receiver.start()
        lease = leases.reserve("r1", tokens=5)
        kv = torch.randn(2, 2, 3, 5, 4).to(torch.bfloat16)  # [layers, 2, kv_heads, tokens, head_dim]
        per_layer = kv[0].numel() * 2
        for layer in range(2):
            where = Descriptor(lease.region, layer * per_layer, per_layer, lease.key)
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
                receiver.metadata(), kv[0].contiguous(), Descriptor(late.region, 0, per_layer, late.key), "x"
            )
        with pytest.raises(KeyError, match="unknown or expired"):
            leases.kv(late.lease_id)
        await sender.stop()
        await receiver.stop()

    asyncio.run(main())


def test_a_full_pool_and_an_oversized_request_are_refused():
    leases = pool(TcpAgent("decode", "m", secret=SECRET), Clock(), count=1)
    leases.reserve("r1", tokens=16)
    with pytest.raises(NoRegionFree, match="all 1 KV staging regions are leased"):
        leases.reserve("r2", tokens=4)
    with pytest.raises(ValueError, match="1 to 16 prompt tokens, not 17"):
        leases.reserve("r3", tokens=17)


def test_a_region_whose_payload_is_still_landing_is_not_leased_again_until_it_ends():
    """A writer stalls mid-payload and the lease ends: the region is refused to writers at once, but its
    memory is handed out again only once the receiver gave up on that payload (after its stall limit)."""
    import json
    import socket
    import time

    from neuronfleet.runtime.kv.kv_transfer import HEADER, _offer_handshake, derive, write_mac

    async def main():
        clock, receiver = Clock(), TcpAgent("decode", "m", stall_seconds=0.5, secret=SECRET)
        leases = pool(receiver, clock, count=1)
        await receiver.start()
        lease = leases.reserve("r1", tokens=5)
        header = dict(agent="prefill", to="decode", model="m", region=lease.region, offset=0, nbytes=96,
                      dtype="bfloat16", shape=[48], notification="r1:0")  # fmt: skip
        raw = json.dumps({**header, "mac": write_mac(lease.key, header)}).encode()
        stalled = socket.create_connection(("127.0.0.1", receiver.port))
        await asyncio.to_thread(_offer_handshake, derive(SECRET, "kv-connect"), stalled, "prefill")
        stalled.sendall(HEADER.pack(len(raw)) + raw + b"\0" * 40)  # 40 of the 96 bytes, then nothing
        await wait_until_async(lambda: receiver.regions[lease.region].receiving, "the payload to arrive")
        leases.release(lease.lease_id)
        assert lease.region not in receiver.regions  # refused to writers from now on
        with pytest.raises(NoRegionFree):  # but its memory is still being written into
            leases.reserve("r2", tokens=5)
        started = time.monotonic()

        def reserve_again():
            with contextlib.suppress(NoRegionFree):
                return leases.reserve("r2", tokens=5)

        again = await wait_until_async(
            reserve_again, "the region to come back after the stalled writer was cut off"
        )
        assert again.lease_id != lease.lease_id and time.monotonic() - started >= 0.3
        stalled.close()
        await receiver.stop()

    asyncio.run(main())


def test_a_restarted_receiver_refuses_writes_meant_for_its_earlier_life():
    """Same address, new identity: a prefill pod still holding the old metadata (and a lease name that the
    new process happens to use too) is refused instead of writing into someone else's region."""

    async def main():
        old = TcpAgent("decode-aaaa", "m", secret=SECRET)
        port = await old.start()
        stale = old.metadata()
        await old.stop()
        new = TcpAgent("decode-bbbb", "m", secret=SECRET)
        new.register_memory("lease-1", torch.zeros(48, dtype=torch.bfloat16), KEY)
        await new.start(port)
        sender = TcpAgent("prefill", "m", secret=SECRET)
        with pytest.raises(IntegrityError, match="the receiver restarted"):
            await sender.write(
                stale, torch.ones(48, dtype=torch.bfloat16), Descriptor("lease-1", 0, 96, KEY), "x"
            )
        assert not new.get_notifications() and torch.count_nonzero(new.regions["lease-1"].tensor) == 0
        await sender.write(
            new.metadata(), torch.ones(48, dtype=torch.bfloat16), Descriptor("lease-1", 0, 96, KEY), "y"
        )
        assert torch.count_nonzero(new.regions["lease-1"].tensor) == 48
        await new.stop()
        await sender.stop()

    asyncio.run(main())
