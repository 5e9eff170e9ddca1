"""KV transfer throughput: neuronfleet's two transports, `tcp` and `nixl` (over NIXL's UCX backend), against
a raw socket sending the same bytes over loopback and against NIXL's own WRITE and READ (ai-dynamo/nixl, the
library vLLM's NixlConnector and SGLang use), in the same run.

The payload is one request's KV cache, layer by layer, as a prefill pod sends it: for SmolLM2-135M
(30 layers, 3 KV heads, head dim 64, bfloat16) at --tokens prompt tokens, each layer's K and V in one write.
Ours: `TcpAgent.write_nowait` per layer (header, payload straight into the receiver's registered memory,
XXH3-64 check on both ends, an acknowledgement per write), timed until every write is verified. Raw: one
blocking `sendall` per layer into a receiver that `recv_into`s a preallocated buffer, no header, no checksum,
one acknowledgement at the end. Ours over NIXL: `NixlAgent.write_nowait` per layer (the request's layers in
the agent's registered export memory, as a prefill pod's engine puts them; a notification each, then their
checksums; the decode side checks each, READs it, hashes it and answers), timed until every layer is
verified. NIXL (with `pip install 'neuronfleet[nixl]'`; skipped without it): the decode side's agent
registers its region, the prefill side's its layers; `nixl write` is one WRITE of the 30 layers from the
prefill side with a notification, timed until the decode side has seen it; `nixl read` is one READ of the 30
layers by the decode side, timed until it is done; each side polls NIXL itself, as ours does (NIXL's progress
thread, which spins a core, is off everywhere). UCX chooses its transport (on one machine, shared memory);
`--ucx-tls tcp` makes it use TCP, as between two nodes without RDMA. Each receiver runs in its own process,
as a decode pod does; the sender here. They alternate; it prints GB/s of each, best and median, and the
ratios.

    .venv/bin/python bench/kv_transfer_throughput.py [--tokens 2048] [--repeats 25] [--ucx-tls tcp]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import os
import socket
import statistics
import time

import torch
import xxhash

from neuronfleet.runtime.kv.kv_transfer import Descriptor, TcpAgent, tensor_bytes

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
SECRET, KEY = (
    "bench-model-secret",
    bytes(range(32)),
)  # the model's secret and a lease's key, as pods hold them


def layer_tensors(tokens: int) -> list[torch.Tensor]:
    """One request's KV as a prefill pod exports it (one tensor: `prefill_and_export`), layer by layer."""
    return list(torch.randn(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM).to(torch.bfloat16).unbind(0))


def agent_receiver(transport: str, tokens: int, conn) -> None:
    """A decode pod's side over one of our transports: a registered region, the agent's threads, its loop."""
    from neuronfleet.runtime.kv.transports import make_agent

    async def main() -> None:
        receiver = make_agent(transport, f"decode-{transport}", "m", secret=SECRET)
        receiver.register_memory(
            "lease", torch.zeros(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16), KEY
        )
        await receiver.start()
        conn.send(receiver.metadata())
        while True:  # notifications pile up otherwise
            await asyncio.sleep(0.5)
            receiver.get_notifications()

    asyncio.run(main())


class OursOverNixl:
    """The prefill side over our NIXL transport: one agent and one event loop for the whole run (as a pod)."""

    def __init__(self, meta: dict, layers: list[torch.Tensor]) -> None:
        from neuronfleet.runtime.kv.transports import make_agent

        self.meta, self.loop = meta, asyncio.new_event_loop()
        self.sender = make_agent("nixl", "prefill-nf", "m", secret=SECRET)
        # a prefill pod's engine exports a request's KV into the agent's registered memory (outside the clock)
        self.export = self.sender.export_buffer((len(layers), *layers[0].shape), layers[0].dtype)
        self.export.copy_(torch.stack(layers))

    def write(self) -> float:
        return self.loop.run_until_complete(timed_writes(self.sender, self.meta, list(self.export.unbind(0))))


async def timed_writes(sender, meta: dict, layers: list[torch.Tensor]) -> float:
    """Seconds from the first layer's `write_nowait` until every layer is verified (a prefill pod's push)."""
    per = layers[0].numel() * 2
    start = time.perf_counter()
    transfers = [
        sender.write_nowait(meta, layer, Descriptor("lease", i * per, per, KEY), f"layer-{i}")
        for i, layer in enumerate(layers)
    ]
    for t in transfers:
        await t.wait()
    return time.perf_counter() - start


def raw_receiver(total: int, conn) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    buffer = memoryview(bytearray(total))
    while True:
        peer, _ = server.accept()
        got = 0
        while got < total:
            got += peer.recv_into(buffer[got:])
        peer.sendall(b"k")
        peer.close()


def nixl_receiver(tokens: int, conn) -> None:
    """A decode pod's side with a NIXL agent: its region registered; then, per command from the pipe, it
    waits for the prefill side's WRITE notification, or READs the prefill side's layers itself."""
    from nixl_cu12 import nixl_agent, nixl_agent_config

    agent = nixl_agent("decode", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    region = torch.zeros(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16)
    agent.register_memory(region)
    per = region[0].numel() * 2
    mine = [(region.data_ptr() + i * per, per, 0) for i in range(LAYERS)]
    conn.send((agent.get_agent_metadata(), mine))
    prefill, theirs = conn.recv()
    remote = agent.add_remote_agent(prefill)
    remote = remote.decode() if isinstance(remote, bytes) else remote  # (the binding answers bytes)
    local_descs = agent.get_xfer_descs(mine, "DRAM")
    remote_descs = agent.get_xfer_descs(theirs, "DRAM")
    while True:
        command, tag = conn.recv()
        if command == "write":  # the prefill side writes: done when its notification is here
            while not agent.check_remote_xfer_done(remote, tag):
                pass
        else:  # the decode side reads
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            agent.transfer(handle)
            while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
                pass
            agent.release_xfer_handle(handle)
            assert state == "DONE", state
        conn.send(True)


class Nixl:
    """The prefill side's NIXL agent, its layers registered, connected to the decode side's."""

    def __init__(self, layers: list[torch.Tensor], conn) -> None:
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("prefill", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        nbytes = sum(t.numel() * 2 for t in layers)  # the layers are views of one tensor: one registration
        self.agent.register_memory([(layers[0].data_ptr(), nbytes, 0, "")], "DRAM")
        self.conn = conn
        metadata, theirs = conn.recv()
        self.remote = self.agent.add_remote_agent(metadata)
        mine = [(t.data_ptr(), t.numel() * 2, 0) for t in layers]
        conn.send((self.agent.get_agent_metadata(), mine))
        self.local = self.agent.get_xfer_descs(mine, "DRAM")
        self.theirs = self.agent.get_xfer_descs(theirs, "DRAM")
        self.n = 0

    def write(self) -> float:
        self.n += 1
        tag = f"kv-{self.n}".encode()
        start = time.perf_counter()
        self.conn.send(("write", tag))
        handle = self.agent.initialize_xfer("WRITE", self.local, self.theirs, self.remote, tag)
        self.agent.transfer(handle)
        while (state := self.agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
            pass
        self.conn.recv()  # the decode side has the notification: the bytes are there
        seconds = time.perf_counter() - start
        self.agent.release_xfer_handle(handle)
        assert state == "DONE", state
        return seconds

    def read(self) -> float:
        start = time.perf_counter()
        self.conn.send(("read", b""))
        # NIXL's progress thread is off: a read over TCP needs this side to serve it
        while not self.conn.poll():
            self.agent.get_new_notifs()
        self.conn.recv()
        return time.perf_counter() - start


def ours(meta: dict, layers: list[torch.Tensor]) -> float:
    per = layers[0].numel() * 2

    async def send() -> float:
        sender = TcpAgent("prefill", "m", secret=SECRET)
        await sender.write(
            meta, layers[0], Descriptor("lease", 0, per, KEY), "warm"
        )  # connect outside the clock
        seconds = await timed_writes(sender, meta, layers)
        await sender.stop()
        return seconds

    return asyncio.run(send())


def raw(port: int, layers: list[torch.Tensor]) -> float:
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    for layer in layers:
        client.sendall(tensor_bytes(layer))
    client.recv(1)  # the receiver has everything
    seconds = time.perf_counter() - start
    client.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument(
        "--ucx-tls", help="UCX_TLS for NIXL's UCX backend (tcp: TCP only; default: UCX chooses)"
    )
    args = parser.parse_args()
    if args.ucx_tls:  # for NIXL's agents here and in the receivers, which inherit it
        os.environ["UCX_TLS"] = args.ucx_tls
    layers = layer_tensors(args.tokens)
    nbytes = sum(t.numel() * 2 for t in layers)
    spawn = multiprocessing.get_context("spawn")
    ours_end, ours_child = spawn.Pipe()
    raw_end, raw_child = spawn.Pipe()
    receivers = [
        spawn.Process(target=agent_receiver, args=("tcp", args.tokens, ours_child), daemon=True),
        spawn.Process(target=raw_receiver, args=(nbytes, raw_child), daemon=True),
    ]
    nixl = ours_nixl = None
    if importlib.util.find_spec("nixl_cu12") is not None:
        nixl_end, nixl_child = spawn.Pipe()
        nf_end, nf_child = spawn.Pipe()
        receivers.append(spawn.Process(target=nixl_receiver, args=(args.tokens, nixl_child), daemon=True))
        receivers.append(
            spawn.Process(target=agent_receiver, args=("nixl", args.tokens, nf_child), daemon=True)
        )
    for p in receivers:
        p.start()
    meta, port = ours_end.recv(), raw_end.recv()
    if len(receivers) == 4:
        nixl = Nixl(layers, nixl_end)
        ours_nixl = OursOverNixl(nf_end.recv(), layers)
        ours_nixl.write()  # NIXL connects on the first transfer: outside the clock, as ours() does
    times: dict[str, list[float]] = {"raw socket": [], "neuronfleet tcp": []}
    if nixl is not None:
        times |= {"neuronfleet nixl": [], "nixl write": [], "nixl read": []}
    for _ in range(args.repeats):  # alternating, so that the machine's moods hit all alike
        times["raw socket"].append(raw(port, layers))
        times["neuronfleet tcp"].append(ours(meta, layers))
        if nixl is not None:
            times["neuronfleet nixl"].append(ours_nixl.write())
            times["nixl write"].append(nixl.write())
            times["nixl read"].append(nixl.read())
    for p in receivers:
        p.terminate()
    print(
        f"payload: {nbytes / 1e6:.1f} MB in {LAYERS} layer writes ({args.tokens} tokens of SmolLM2-135M KV)"
        + (f"; NIXL UCX_TLS={args.ucx_tls or 'UCX chooses'}" if nixl is not None else "; NIXL not installed")
    )
    print("                   best       median     median vs raw")
    mid_raw = statistics.median(times["raw socket"])
    for name, seconds in times.items():
        best, mid = min(seconds), statistics.median(seconds)
        rates = f"{nbytes / best / 1e9:5.2f} GB/s {nbytes / mid / 1e9:5.2f} GB/s"
        print(f"{name:16s} {rates}   {mid_raw / mid:5.2f}x")
    if nixl is not None:
        mid_tcp, mid_nf = (
            statistics.median(times["neuronfleet tcp"]),
            statistics.median(times["neuronfleet nixl"]),
        )
        print(f"neuronfleet nixl / neuronfleet tcp (median throughput): {mid_tcp / mid_nf:.2f}x")
    # what the checksum costs: XXH3-64 of each layer, as each end hashes it
    hashing = []
    for _ in range(5):
        start = time.perf_counter()
        for layer in layers:
            xxhash.xxh3_64_intdigest(tensor_bytes(layer))
        hashing.append(time.perf_counter() - start)
    mid_hash, mid_nf = statistics.median(hashing), statistics.median(times.get("neuronfleet nixl", [0]))
    print(
        f"XXH3-64 of the payload: {nbytes / mid_hash / 1e9:.1f} GB/s, {mid_hash * 1e3:.1f} ms per end "
        f"(the median neuronfleet nixl transfer: {mid_nf * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
