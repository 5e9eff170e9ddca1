"""The KV transfer layer, over tcp and over NIXL (UCX): writes land in registered memory, verified (checksum,
dtype, shape, model) before the receiver is notified; refusals, corruption, broken peers and deadlines are
errors, never silent."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import struct
import time

import pytest
import torch
import xxhash
from support import CEILING, LIBFABRIC_HERE

from neuronfleet.runtime.kv import kv_transfer
from neuronfleet.runtime.kv.kv_transfer import (
    HEADER,
    Descriptor,
    IntegrityError,
    TcpAgent,
    TransferError,
    TransportUnavailable,
    _offer_handshake,
    checksum_tag,
    derive,
    write_mac,
)
from neuronfleet.runtime.kv.transports import make_agent

SECRET, KEY = "test-model-secret", bytes(range(32))  # the model's secret and a lease's key


def run(coro):
    return asyncio.run(coro)


TRANSPORTS = ["tcp", "nixl", pytest.param("efa", marks=LIBFABRIC_HERE)]


async def pair(region_shape=(2, 3, 8, 4), dtype=torch.bfloat16, transport="tcp"):
    receiver = make_agent(transport, "decode-0", "smollm2@abc", secret=SECRET)
    target = torch.zeros(region_shape, dtype=dtype)
    receiver.register_memory("lease-1", target, KEY)
    await receiver.start()
    sender = make_agent(transport, "prefill-0", "smollm2@abc", secret=SECRET)
    return sender, receiver, target


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_write_lands_in_place_and_notifies_after_verification(transport):
    async def main():
        sender, receiver, target = await pair(transport=transport)
        layer = torch.randn(3, 8, 4, dtype=torch.bfloat16)
        nbytes = layer.numel() * 2
        t = await sender.write(
            receiver.metadata(), layer, Descriptor("lease-1", nbytes, nbytes, KEY), "req-7:layer-1"
        )
        assert sender.poll(t) == "done" and t.nbytes == nbytes
        assert await receiver.wait_notification("req-7:layer-1", timeout=CEILING) == "prefill-0"
        assert torch.equal(target[1], layer) and torch.count_nonzero(target[0]) == 0
        # many writes over one connection, each notified once
        for i in range(20):
            await sender.write(receiver.metadata(), layer, Descriptor("lease-1", 0, nbytes, KEY), f"n{i}")
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
                receiver.metadata(), src, Descriptor("lease-1", 0, src.numel() * src.element_size(), KEY), "x"
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
            await sender.write(meta, layer, Descriptor("lease-1", 10_000, 192, KEY), "x")
        receiver.deregister_memory("lease-1")  # the lease expired
        with pytest.raises(IntegrityError, match="no region 'lease-1' is registered"):
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192, KEY), "x")
        await sender.stop()
        await receiver.stop()

    run(main())


def authenticated(port: int, secret: str = SECRET) -> socket.socket:
    """A raw connection that has passed the handshake with `secret`: a faulty or hostile peer of the model."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=CEILING)
    _offer_handshake(derive(secret, "kv-connect"), sock, "prefill-raw")
    sock.settimeout(CEILING)
    return sock


def raw_write(sock: socket.socket, fields: dict, payload: bytes, trailer: bytes) -> tuple[bytes, str]:
    header = json.dumps(fields).encode()
    sock.sendall(HEADER.pack(len(header)) + header + payload + trailer)
    reply = sock.recv(2 + HEADER.size, socket.MSG_WAITALL)
    (size,) = struct.unpack("!I", reply[2:])
    return reply[:2], sock.recv(size, socket.MSG_WAITALL).decode()


def layer_fields(key: bytes = KEY, **changes) -> dict:
    fields = {"agent": "prefill-raw", "model": "smollm2@abc", "region": "lease-1", "offset": 0, "nbytes": 192}
    fields |= {
        "dtype": "bfloat16",
        "shape": [3, 8, 4],
        "to": "decode-0",
        "notification": "x",
        "id": 0,
        **changes,
    }
    return {**fields, "mac": write_mac(key, fields)}


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed the connection (or reset it) before CEILING."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True


def test_corrupted_bytes_are_detected_by_the_checksum():
    async def main():
        _, receiver, _ = await pair()
        with authenticated(receiver.port) as sock:
            fields = layer_fields()
            wrong = 12345  # not the payload's XXH3-64, but signed with the lease key
            trailer = struct.pack("!Q", wrong) + checksum_tag(KEY, fields["mac"], wrong)
            code, message = await asyncio.to_thread(raw_write, sock, fields, bytes(range(192)), trailer)
        assert code == b"ER" and "checksum mismatch" in message
        assert receiver.get_notifications() == []
        await receiver.stop()

    run(main())


def test_a_peer_without_the_model_secret_gets_no_connection_and_no_memory():
    """The attacks a security probe made on the tcp receiver: a 4-byte message claiming a 4 GiB header, and
    random bytes; then a writer with another model's secret. Nothing is allocated, nothing lands, the receiver
    closes each connection, and its memory does not grow."""

    async def main():
        sender, receiver, target = await pair()
        before = resident_bytes()

        def attack(data: bytes) -> bool:
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=CEILING) as sock:
                sock.sendall(data)
                return closed_by_peer(sock)

        attacks = [struct.pack("!I", 0xFFFFFFFF), *(random.randbytes(1024) for _ in range(20))]
        assert all(await asyncio.gather(*(asyncio.to_thread(attack, data) for data in attacks)))
        assert resident_bytes() - before < 64 << 20  # (the unauthenticated receiver grew by 1.5 GB)
        stranger = make_agent("tcp", "prefill-1", "smollm2@abc", secret="another model's secret")
        with pytest.raises(TransferError, match="unauthenticated"):
            await stranger.write(receiver.metadata(), torch.ones(3, 8, 4, dtype=torch.bfloat16),
                                 Descriptor("lease-1", 0, 192, KEY), "x")  # fmt: skip
        assert receiver.get_notifications() == [] and torch.count_nonzero(target) == 0
        # and the receiver still serves the model's own writers
        await sender.write(receiver.metadata(), torch.ones(3, 8, 4, dtype=torch.bfloat16),
                           Descriptor("lease-1", 0, 192, KEY), "y")  # fmt: skip
        assert [n for _, n in receiver.get_notifications()] == ["y"]
        await stranger.stop()
        await sender.stop()
        await receiver.stop()

    run(main())


def test_a_receiver_that_cannot_prove_the_secret_gets_no_bytes():
    async def main():
        sender, _, _ = await pair()
        impostor = make_agent("tcp", "decode-0", "smollm2@abc", secret="not the model's")
        impostor.register_memory("lease-1", torch.zeros(2, 3, 8, 4, dtype=torch.bfloat16), KEY)
        await impostor.start()
        with pytest.raises(TransferError, match="unauthenticated"):
            await sender.write(impostor.metadata(), torch.ones(3, 8, 4, dtype=torch.bfloat16),
                               Descriptor("lease-1", 0, 192, KEY), "x")  # fmt: skip
        assert impostor.get_notifications() == []
        await sender.stop()
        await impostor.stop()

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_write_without_its_lease_key_is_refused(transport):
    """A member of the model that knows a lease id (writes carry it in clear) but not the lease's key."""

    async def main():
        sender, receiver, target = await pair(transport=transport)
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        with pytest.raises(IntegrityError, match="does not carry its lease key"):
            await sender.write(receiver.metadata(), layer, Descriptor("lease-1", 0, 192, bytes(32)), "x",
                               timeout=CEILING)  # fmt: skip
        assert receiver.get_notifications() == [] and torch.count_nonzero(target) == 0
        await sender.write(
            receiver.metadata(), layer, Descriptor("lease-1", 0, 192, KEY), "y", timeout=CEILING
        )
        assert [n for _, n in receiver.get_notifications()] == ["y"]
        await sender.stop()
        await receiver.stop()

    run(main())


def test_a_replayed_description_with_other_bytes_is_refused():
    """A description signed with the lease key, sent again with other bytes: the checksum's tag needs it."""

    async def main():
        _, receiver, _ = await pair()
        with authenticated(receiver.port) as sock:
            fields = layer_fields()
            payload = bytes(range(192))
            digest = xxhash.xxh3_64_intdigest(payload)
            trailer = struct.pack("!Q", digest) + bytes(16)  # the right checksum, no key to sign it with
            code, message = await asyncio.to_thread(raw_write, sock, fields, payload, trailer)
            assert code == b"ER" and "does not carry the lease key" in message
            changed = {**fields, "offset": 192}  # a field changed under the old signature
            code, message = await asyncio.to_thread(raw_write, sock, changed, payload, trailer)
            assert code == b"ER" and "does not carry its lease key" in message
        assert receiver.get_notifications() == []
        await receiver.stop()

    run(main())


def test_lengths_are_checked_before_allocation_and_idle_or_slow_connections_close(monkeypatch):
    async def main():
        receiver = make_agent("tcp", "decode-0", "smollm2@abc", secret=SECRET, stall_seconds=0.5,
                              idle_seconds=0.5)  # fmt: skip
        receiver.register_memory("lease-1", torch.zeros(2, 3, 8, 4, dtype=torch.bfloat16), KEY)
        await receiver.start()
        with authenticated(receiver.port) as sock:  # a member claiming a 4 GiB description
            sock.sendall(struct.pack("!I", 0xFFFFFFFF))
            assert await asyncio.to_thread(closed_by_peer, sock)
        with authenticated(receiver.port) as sock:  # idle after the handshake: closed after idle_seconds
            assert await asyncio.to_thread(closed_by_peer, sock)
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=CEILING) as sock:
            sock.sendall(b"NFKV1")  # a handshake begun and never finished
            assert await asyncio.to_thread(closed_by_peer, sock)
        await receiver.stop()
        # a handshake that trickles in, each byte within the stall limit, is cut off at its deadline
        monkeypatch.setattr(kv_transfer, "HANDSHAKE_SECONDS", 1.0)
        patient = make_agent("tcp", "decode-2", "smollm2@abc", secret=SECRET, stall_seconds=60.0)
        await patient.start()

        def trickle() -> int:
            with socket.create_connection(("127.0.0.1", patient.port), timeout=CEILING) as sock:
                hello = b"NFKV1" + bytes(16) + (256).to_bytes(2, "big") + b"a" * 256 + bytes(16)
                for sent, byte in enumerate(hello):
                    try:
                        sock.sendall(bytes([byte]))
                        if sent > 5 and not sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                            return sent  # closed by the receiver
                    except BlockingIOError:
                        pass
                    except OSError:
                        return sent
                    time.sleep(0.1)
            return -1

        assert 0 < await asyncio.to_thread(trickle) < 100  # about 1 s of 0.1 s steps, not 30 s
        await patient.stop()
        # at most MAX_CONNECTIONS at once: the next one is closed at once
        monkeypatch.setattr(kv_transfer, "MAX_CONNECTIONS", 2)
        busy = make_agent("tcp", "decode-1", "smollm2@abc", secret=SECRET)
        await busy.start()
        held = [socket.create_connection(("127.0.0.1", busy.port), timeout=CEILING) for _ in range(2)]
        for sock in held:
            sock.recv(10, socket.MSG_WAITALL)  # the hello: accepted
        with socket.create_connection(("127.0.0.1", busy.port), timeout=CEILING) as extra:
            assert await asyncio.to_thread(closed_by_peer, extra)
        assert busy.refused_connections == 1
        for sock in held:
            sock.close()
        await busy.stop()

    run(main())


def resident_bytes() -> int:
    """This process's resident memory now (Linux)."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_dead_receiver_and_a_stalled_one_fail_the_transfer():
    async def main():
        sender, receiver, _ = await pair()
        meta = receiver.metadata()
        await receiver.stop()
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        with pytest.raises(TransferError, match="broke"):
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192, KEY), "x")
        # a peer that accepts and never answers: the deadline fails the transfer
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        stalled = {**meta, "address": ["127.0.0.1", silent.getsockname()[1]]}
        with pytest.raises(TransferError, match="deadline"):
            await sender.write(stalled, layer, Descriptor("lease-1", 0, 192, KEY), "x", timeout=0.5)
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
            await sender.write(meta, layer, Descriptor("lease-1", 0, 192, KEY), "x", timeout=CEILING)
        assert not fault.exists() and receiver.get_notifications() == []
        with pytest.raises(IntegrityError, match="the receiver restarted"):
            earlier = {**meta, "agent": "decode-earlier"}
            await sender.write(earlier, layer, Descriptor("lease-1", 0, 192, KEY), "x", timeout=CEILING)
        await sender.write(meta, layer, Descriptor("lease-1", 192, 192, KEY), "y", timeout=CEILING)
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
        receiver = make_agent(transport, "decode-0", "smollm2@abc", secret=SECRET)
        target = torch.zeros((4, 2, 3, 64, 4), dtype=torch.bfloat16)
        receiver.register_memory("lease-1", target, KEY)
        await receiver.start()
        sender = make_agent(transport, "prefill-0", "smollm2@abc", secret=SECRET)
        per, seen = target[0].numel() * 2, set()
        for i in range(6):
            if i % 2:  # as the prefill role does: the engine exports into the agent's memory
                kv = sender.export_buffer(tuple(target.shape), torch.bfloat16)
                kv.copy_(torch.randn(target.shape))
            else:
                kv = torch.randn(target.shape).to(torch.bfloat16)
            meta = receiver.metadata()
            layers = [sender.write_nowait(meta, kv[n], Descriptor("lease-1", n * per, per, KEY), f"r{i}:{n}")
                      for n in range(4)]  # fmt: skip
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
        receiver = make_agent("nixl", "decode-0", "smollm2@abc", stall_seconds=1.0, secret=SECRET)
        target = torch.zeros((2, 3, 8, 4), dtype=torch.bfloat16)
        receiver.register_memory("lease-1", target, KEY)
        await receiver.start()
        sender = make_agent("nixl", "prefill-0", "smollm2@abc", secret=SECRET)
        layer = torch.ones(3, 8, 4, dtype=torch.bfloat16)
        monkeypatch.setenv("NEURONFLEET_KV_FAULT_FILE", str(tmp_path / "fault"))
        (tmp_path / "fault").write_text(json.dumps({"kind": fault}))
        with pytest.raises(TransferError) as e:
            await sender.write(
                receiver.metadata(), layer, Descriptor("lease-1", 0, 192, KEY), "x", timeout=CEILING
            )
        assert ("passed its 1.0 s" if fault == "stall" else "read from prefill-0 failed") in str(e.value)
        assert receiver.regions["lease-1"].receiving == 0 and receiver.get_notifications() == []
        await sender.write(
            receiver.metadata(), layer, Descriptor("lease-1", 0, 192, KEY), "y", timeout=CEILING
        )
        assert torch.equal(target[0], layer)
        await sender.stop()
        await receiver.stop()

    run(main())


def test_transports_never_bridge_and_a_missing_backend_says_what_is_missing():
    async def main():
        tcp, nixl = (
            make_agent("tcp", "decode-0", "m", secret=SECRET),
            make_agent("nixl", "decode-1", "m", secret=SECRET),
        )
        tcp.register_memory("lease-1", torch.zeros(96, dtype=torch.bfloat16), KEY)
        await tcp.start()
        with pytest.raises(IntegrityError, match="over 'tcp' and this pod over 'nixl'"):
            src = torch.ones(96, dtype=torch.bfloat16)
            await nixl.write(tcp.metadata(), src, Descriptor("lease-1", 0, 192, KEY), "x")
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
            make_agent("efa", "decode-0", "m", secret=SECRET)
        with pytest.raises(TransportUnavailable, match=r"EFA installer 1\.51\.0 or later"):
            make_agent("nixl", "decode-0", "m", backend="libfabric", secret=SECRET)
    with pytest.raises(ValueError, match="choose one of tcp, nixl, efa"):
        make_agent("udp", "decode-0", "m", secret=SECRET)
    with pytest.raises(ValueError, match="efa is NIXL over LIBFABRIC, not ucx"):
        make_agent("efa", "decode-0", "m", backend="ucx", secret=SECRET)
    assert isinstance(make_agent("tcp", "d", "m", secret=SECRET), TcpAgent)
