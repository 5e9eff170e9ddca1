"""KV transfer throughput: neuronfleet's `tcp` transport against a raw socket sending the same bytes over
loopback, in the same run.

The payload is one request's KV cache, layer by layer, as a prefill pod sends it: for SmolLM2-135M
(30 layers, 3 KV heads, head dim 64, bfloat16) at --tokens prompt tokens, each layer's K and V in one write.
Ours: `TcpAgent.write_nowait` per layer (header, payload straight into the receiver's registered memory,
XXH3-64 check on both ends, an acknowledgement per write), timed until every write is verified. Raw: one
blocking `sendall` per layer into a receiver that `recv_into`s a preallocated buffer, no header, no checksum,
one acknowledgement at the end. Each receiver runs in its own process, as a decode pod does; the sender here.
The two alternate; it prints GB/s of each, best and median, and the ratios.

    .venv/bin/python bench/kv_transfer_throughput.py [--tokens 2048] [--repeats 25]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import time

import torch

from neuronfleet.runtime.kv.kv_transfer import Descriptor, TcpAgent, tensor_bytes

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def layer_tensors(tokens: int) -> list[torch.Tensor]:
    return [torch.randn(2, KV_HEADS, tokens, HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]


def agent_receiver(tokens: int, conn) -> None:
    """A decode pod's side: one registered region, the agent's receiving threads, its event loop."""

    async def main() -> None:
        receiver = TcpAgent("decode", "m")
        receiver.register_memory(
            "lease", torch.zeros(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16)
        )
        conn.send(receiver.metadata() | {"address": ["127.0.0.1", await receiver.start()]})
        while True:  # notifications pile up otherwise
            await asyncio.sleep(0.5)
            receiver.get_notifications()

    asyncio.run(main())


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


def ours(meta: dict, layers: list[torch.Tensor]) -> float:
    per = layers[0].numel() * 2

    async def send() -> float:
        sender = TcpAgent("prefill", "m")
        await sender.write(meta, layers[0], Descriptor("lease", 0, per), "warm")  # connect outside the clock
        start = time.perf_counter()
        transfers = [
            sender.write_nowait(meta, layer, Descriptor("lease", i * per, per), f"layer-{i}")
            for i, layer in enumerate(layers)
        ]
        for t in transfers:
            await t.wait()
        seconds = time.perf_counter() - start
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
    args = parser.parse_args()
    layers = layer_tensors(args.tokens)
    nbytes = sum(t.numel() * 2 for t in layers)
    spawn = multiprocessing.get_context("spawn")
    ours_end, ours_child = spawn.Pipe()
    raw_end, raw_child = spawn.Pipe()
    receivers = [
        spawn.Process(target=agent_receiver, args=(args.tokens, ours_child), daemon=True),
        spawn.Process(target=raw_receiver, args=(nbytes, raw_child), daemon=True),
    ]
    for p in receivers:
        p.start()
    meta, port = ours_end.recv(), raw_end.recv()
    raw_s, ours_s = [], []
    for _ in range(args.repeats):  # alternating, so that the machine's moods hit both alike
        raw_s.append(raw(port, layers))
        ours_s.append(ours(meta, layers))
    for p in receivers:
        p.terminate()
    best_raw, best_ours = min(raw_s), min(ours_s)
    mid_raw, mid_ours = statistics.median(raw_s), statistics.median(ours_s)
    print(
        f"payload: {nbytes / 1e6:.1f} MB in {LAYERS} layer writes ({args.tokens} tokens of SmolLM2-135M KV)"
    )
    print("                  best     median")
    print(f"raw socket      {nbytes / best_raw / 1e9:5.2f} GB/s {nbytes / mid_raw / 1e9:5.2f} GB/s")
    print(f"neuronfleet tcp {nbytes / best_ours / 1e9:5.2f} GB/s {nbytes / mid_ours / 1e9:5.2f} GB/s")
    print(f"ratio tcp/raw   {best_raw / best_ours:5.2f}x     {mid_raw / mid_ours:5.2f}x")


if __name__ == "__main__":
    main()
