"""The KV transfer layer, over tcp and over NIXL (UCX): writes land in registered memory, verified (checksum,
dtype, shape, model) before the receiver is notified; refusals, corruption, broken peers and deadlines are
errors, never silent."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest
import torch
from support import CEILING, LIBFABRIC_HERE

from neuronfleet.runtime.kv.kv_transfer import (
    HEADER,
    Descriptor,
    IntegrityError,
    TcpAgent,
    TransferError,
    TransportUnavailable,
)
from neuronfleet.runtime.kv.transports import make_agent


def run(coro):
    return asyncio.run(coro)


TRANSPORTS = ["tcp", "nixl", pytest.param("efa", marks=LIBFABRIC_HERE)]


async def pair(region_shape=(2, 3, 8, 4), dtype=torch.bfloat16, transport="tcp"):
    receiver = make_agent(transport, "decode-0", "smollm2@abc")
    target = torch.zeros(region_shape, dtype=dtype)
    receiver.register_memory("lease-1", target)
    await receiver.start()
    sender = make_agent(transport, "prefill-0", "smollm2@abc")
    return sender, receiver, target


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_write_lands_in_place_and_notifies_after_verification(transport):
    async def main():
        sender, receiver, target = await pair(transport=transport)
        layer = torch.randn(3, 8, 4, dtype=torch.bfloat16)
        nbytes = layer.numel() * 2
        t = await sender.write(
            receiver.metadata(), layer, Descriptor("lease-1", nbytes, nbytes), "req-7:layer-1"
        )
        assert sender.poll(t) == "done" and t.nbytes == nbytes
        assert await receiver.wait_notification("req-7:layer-1", timeout=CEILING) == "prefill-0"
        assert torch.equal(target[1], layer) and torch.count_nonzero(target[0]) == 0
        # many writes over one connection, each notified once
        for i in range(20):
            await sender.write(receiver.metadata(), layer, Descriptor("lease-1", 0, nbytes), f"n{i}")
        assert [m for _, m in receiver.get_notifications()] == [f"n{i}" for i in range(20)]
        await sender.stop()
        await receiver.stop()

    run(main())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: setattr(s, "model_id", "llama@zzz"), "model mismatch"),
        (lambda s: None, "dtype mismatch"),
    ],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_writes_that_do_not_match_the_region_are_refused(change, message, transport):
    async def main():
        sender, receiver, target = await pair(transport=transport)
        change(sender)
        src = torch.ones(3, 8, 4, dtype=torch.float32 if message == "dtype mismatch" else torch.bfloat16)
        with pytest.raises(IntegrityError, match=message):
            await sender.write(
                receiver.metadata(), src, Descriptor("lease-1", 0, src.numel() * src.element_size()), "x"
            )
        assert receiver.get_notifications() == [] and torch.count_nonzero(target) == 0
        await sender.stop()
        await receiver.stop()

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_expired_region_and_an_out_of_bounds_write_are_refused(transport):
    async def main():
        sender, receiver, _ = await pair(transport=transport)
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        meta = receiver.metadata()
        with pytest.raises(IntegrityError, match="fall outside the region"):
            await sender.write(meta, layer, Descriptor("lease-1", 10_000, 192), "x")
        receiver.deregister_memory("lease-1")  # the lease expired
        with pytest.raises(IntegrityError, match="no region 'lease-1' is registered"):
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192), "x")
        await sender.stop()
        await receiver.stop()

    run(main())


def test_corrupted_bytes_are_detected_by_the_checksum():
    async def main():
        _, receiver, _ = await pair()
        payload = bytes(192)
        fields = {"agent": "evil", "model": "smollm2@abc", "region": "lease-1", "offset": 0, "nbytes": 192}
        fields |= {"dtype": "bfloat16", "shape": [3, 8, 4], "to": "decode-0", "notification": "x", "id": 0}
        header = json.dumps(fields).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        wrong = struct.pack("!Q", 12345)  # the trailer: not the payload's XXH3-64
        writer.write(HEADER.pack(len(header)) + header + payload + wrong)
        reply = await reader.readexactly(2 + HEADER.size)
        (size,) = struct.unpack("!I", reply[2:])
        message = (await reader.readexactly(size)).decode()
        assert reply[:2] == b"ER" and "checksum mismatch" in message
        assert receiver.get_notifications() == []
        writer.close()
        await receiver.stop()

    run(main())


def test_a_dead_receiver_and_a_stalled_one_fail_the_transfer():
    async def main():
        sender, receiver, _ = await pair()
        meta = receiver.metadata()
        await receiver.stop()
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        with pytest.raises(TransferError, match="broke"):
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192), "x")
        # a peer that accepts and never answers: the deadline fails the transfer
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        stalled = {**meta, "address": ["127.0.0.1", silent.getsockname()[1]]}
        with pytest.raises(TransferError, match="deadline"):
            await sender.write(stalled, layer, Descriptor("lease-1", 0, 192), "x", timeout=0.5)
        silent.close()
        with pytest.raises(TransferError, match=r"within 0\.2 s"):
            await receiver.wait_notification("never", timeout=0.2)
        await sender.stop()

    run(main())


def test_nixl_bytes_corrupted_after_hashing_are_refused_and_a_restarted_receiver_too(tmp_path, monkeypatch):
    """Over NIXL the receiver reads and hashes: a byte flipped after the writer hashed it is refused as
    corrupt; a write naming an earlier life of the receiver is refused; the next write lands."""

    async def main():
        sender, receiver, target = await pair(transport="nixl")
        layer = torch.randn(3, 8, 4, dtype=torch.bfloat16)
        meta = receiver.metadata()
        fault = tmp_path / "fault"
        monkeypatch.setenv("NEURONFLEET_KV_FAULT_FILE", str(fault))
        fault.write_text('{"kind": "flip"}')
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192), "x", timeout=CEILING)
        assert not fault.exists() and receiver.get_notifications() == []
        with pytest.raises(IntegrityError, match="the receiver restarted"):
            await sender.write({**meta, "agent": "decode-earlier"}, layer, Descriptor("lease-1", 0, 192), "x",
                               timeout=CEILING)  # fmt: skip
        await sender.write(meta, layer, Descriptor("lease-1", 192, 192), "y", timeout=CEILING)
        assert torch.equal(target[1], layer) and receiver.get_notifications() == [("prefill-0", "y")]
        await sender.stop()
        await receiver.stop()

    run(main())


@pytest.mark.parametrize("transport", ["nixl", pytest.param("efa", marks=LIBFABRIC_HERE)])
def test_a_nixl_writer_registers_its_memory_once_so_readers_never_hold_a_stale_registration(transport):
    """Request after request (exports made and freed, their memory allocated again at the same addresses),
    the writer's NIXL metadata stays what its first request made it: NIXL's peers keep the first
    registration they loaded at an address, so memory registered anew there would be read with a stale one
    (over LIBFABRIC: reads canceled). Exports the prefill role fills (`export_buffer`) and tensors from
    anywhere (copied) alike; every request lands."""

    async def main():
        receiver = make_agent(transport, "decode-0", "smollm2@abc")
        target = torch.zeros((4, 2, 3, 64, 4), dtype=torch.bfloat16)
        receiver.register_memory("lease-1", target)
        await receiver.start()
        sender = make_agent(transport, "prefill-0", "smollm2@abc")
        per, seen = target[0].numel() * 2, set()
        for i in range(6):
            if i % 2:  # as the prefill role does: the engine exports into the agent's memory
                kv = sender.export_buffer(tuple(target.shape), torch.bfloat16)
                kv.copy_(torch.randn(target.shape))
            else:
                kv = torch.randn(target.shape).to(torch.bfloat16)
            layers = [sender.write_nowait(receiver.metadata(), kv[n], Descriptor("lease-1", n * per, per),
                                          f"r{i}:{n}") for n in range(4)]  # fmt: skip
            for t in layers:
                await t.wait(CEILING)
            assert torch.equal(target, kv)
            sender.release_export(kv)
            seen.add(sender.metadata()["nixl"])
            del kv
        assert len(seen) == 1
        await sender.stop()
        await receiver.stop()

    run(main())


@pytest.mark.parametrize("fault", ["stall", "cut"])
def test_a_nixl_read_that_stalls_or_breaks_fails_the_write_and_frees_the_region(tmp_path, monkeypatch, fault):
    async def main():
        receiver = make_agent("nixl", "decode-0", "smollm2@abc", stall_seconds=1.0)
        target = torch.zeros((2, 3, 8, 4), dtype=torch.bfloat16)
        receiver.register_memory("lease-1", target)
        await receiver.start()
        sender = make_agent("nixl", "prefill-0", "smollm2@abc")
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        monkeypatch.setenv("NEURONFLEET_KV_FAULT_FILE", str(tmp_path / "fault"))
        (tmp_path / "fault").write_text(json.dumps({"kind": fault}))
        with pytest.raises(TransferError) as e:
            await sender.write(
                receiver.metadata(), layer, Descriptor("lease-1", 0, 192), "x", timeout=CEILING
            )
        assert ("passed its 1.0 s" if fault == "stall" else "read from prefill-0 failed") in str(e.value)
        assert receiver.regions["lease-1"].receiving == 0 and receiver.get_notifications() == []
        await sender.write(receiver.metadata(), layer, Descriptor("lease-1", 0, 192), "y", timeout=CEILING)
        assert torch.equal(target[0], layer)
        await sender.stop()
        await receiver.stop()

    run(main())


def test_transports_never_bridge_and_a_missing_backend_says_what_is_missing():
    async def main():
        tcp, nixl = make_agent("tcp", "decode-0", "m"), make_agent("nixl", "decode-1", "m")
        tcp.register_memory("lease-1", torch.zeros(96, dtype=torch.bfloat16))
        await tcp.start()
        with pytest.raises(IntegrityError, match="over 'tcp' and this pod over 'nixl'"):
            src = torch.ones(96, dtype=torch.bfloat16)
            await nixl.write(tcp.metadata(), src, Descriptor("lease-1", 0, 192), "x")
        await tcp.stop()
        await nixl.stop()

    run(main())


def test_a_libfabric_plugin_that_does_not_load_is_explained():
    """The loader's own words (glibc's, as seen here with libfabric 2.1 and without a CUDA driver) are turned
    into what to install."""
    from neuronfleet.runtime.kv.nixl_transfer import plugin_load_hint

    too_old = ("/opt/amazon/efa/lib/libfabric.so.1: version `FABRIC_1.10' not found (required by "
               "/x/nixl_cu12.libs/nixl/libplugin_LIBFABRIC.so)")  # fmt: skip
    assert "2.1, is too old" in plugin_load_hint(too_old, (2, 1))
    assert "EFA installer 1.51.0 or later" in plugin_load_hint(too_old, (2, 1))
    missing = "{}: cannot open shared object file: No such file or directory"
    assert "a stub where there is no CUDA driver" in plugin_load_hint(missing.format("libcuda.so.1"), (2, 7))
    assert "libhwloc15" in plugin_load_hint(missing.format("libhwloc.so.15"), (2, 7))
    assert "nvidia-cuda-runtime-cu12" in plugin_load_hint(missing.format("libcudart.so.12"), (2, 7))
    assert plugin_load_hint(missing.format("libsomething.so.3"), (2, 7)) == ""


def test_efa_never_falls_back_silently():
    from neuronfleet.runtime.kv.nixl_transfer import libfabric_version

    if libfabric_version() is None:  # this machine (Debian 12's libfabric is 1.17 and not installed)
        with pytest.raises(TransportUnavailable, match=r"needs libfabric \(libfabric\.so\.1\): none is"):
            make_agent("efa", "decode-0", "m")
        with pytest.raises(TransportUnavailable, match=r"EFA installer 1\.51\.0 or later"):
            make_agent("nixl", "decode-0", "m", backend="libfabric")
    with pytest.raises(ValueError, match="choose one of tcp, nixl, efa"):
        make_agent("udp", "decode-0", "m")
    with pytest.raises(ValueError, match="efa is NIXL over LIBFABRIC, not ucx"):
        make_agent("efa", "decode-0", "m", backend="ucx")
    assert isinstance(make_agent("tcp", "d", "m"), TcpAgent)
