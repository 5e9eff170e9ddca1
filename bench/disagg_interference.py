"""Long-prompt interference: the inter-token latency of streams that are decoding while long prompts keep
arriving, unified serving against disaggregated serving, same load, same machine, same run.

Setups (the same cores in total):
  - unified: one `neuronfleet serve` using every core;
  - disaggregated: `--role router` + one `--role prefill` pod + one `--role decode` pod, the cores split
    between the prefill and the decode pod (OMP_NUM_THREADS), the KV cache handed over by the tcp transport.
Load, identical for both: --streams clients each send short chat requests (--max-tokens new tokens, streamed,
greedy) back to back, and one more client sends a long prompt (--long-tokens tokens of random words, so no
prefix is reused; max_tokens 1) every --long-interval seconds. After --warmup seconds, --duration seconds are
measured. It reports, per setup, the streams' inter-token latency p50/p99 (gaps between streamed tokens),
their tokens/s, the long prompts' time to first token, and the ratio of the p99s (target: disaggregated at
most half of unified's). Results go to bench/results/disagg_interference.json.

    .venv/bin/python bench/disagg_interference.py [--streams 4] [--long-tokens 1000] [--long-interval 4]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from pathlib import Path

import aiohttp
from prompts import QUESTIONS
from server_latency import RequestResult, free_port, one_request, percentile, wait_ready

ROOT = Path(__file__).resolve().parent.parent
CLI = str(ROOT / ".venv" / "bin" / "neuronfleet")
MODEL = ROOT / "models" / "smollm2-135m-instruct"
RESULTS = ROOT / "bench" / "results"
TOKEN = "bench-internal-token"


def long_prompts(count: int, tokens: int, seed: int = 0) -> list[str]:
    """Prompts of random words, each about `tokens` tokens long and unlike any other."""
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer(MODEL)
    words = [w for q in QUESTIONS for w in q.lower().strip("?.!").split()] or ["word"]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = f"Document {i}: " + " ".join(rng.choice(words) for _ in range(tokens))
        ids = tokenizer.encode(text)[:tokens]
        out.append(tokenizer.decode(ids) + "\nSummarize the document in one word.")
    return out


def spawn(args: list[str], log: str, threads: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, NEURONFLEET_INTERNAL_TOKEN=TOKEN)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen(
        [CLI, "serve", "--model", str(MODEL), "--served-model-name", "smollm2", *args],
        stdout=open(RESULTS / log, "w"),  # lives as long as the server
        stderr=subprocess.STDOUT,
        env=env,
    )


async def start(setup: str, opts: argparse.Namespace) -> tuple[str, list[subprocess.Popen]]:
    common = ["--dtype", opts.dtype, "--max-seq-len", str(opts.max_seq_len), "--slots", str(opts.streams + 2)]
    cores = os.cpu_count() or 2
    if setup == "unified":
        port = free_port()
        procs = [spawn(["--port", str(port), *common], "interference_unified.log")]
        await wait_ready(f"http://127.0.0.1:{port}/ready", procs[0])
        return f"http://127.0.0.1:{port}", procs
    prefill, decode, router = free_port(), free_port(), free_port()
    half = max(1, cores // 2)
    procs = [
        spawn(["--role", "prefill", "--port", str(prefill), *common], "interference_prefill.log", half),
        spawn(["--role", "decode", "--port", str(decode), *common], "interference_decode.log", cores - half),
    ]
    for port, proc in zip((prefill, decode), procs, strict=True):
        await wait_ready(f"http://127.0.0.1:{port}/ready", proc)
    peers = ["--prefill", f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}"]
    router_args = ["--role", "router", "--port", str(router), *common, *peers]
    router_args += ["--local-prefill-below", str(opts.local_prefill_below)]
    procs.append(spawn(router_args, "interference_router.log"))
    await wait_ready(f"http://127.0.0.1:{router}/ready", procs[-1])
    return f"http://127.0.0.1:{router}", procs


async def long_request(session: aiohttp.ClientSession, base: str, prompt: str) -> float:
    sent = time.perf_counter()
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"long prompt: HTTP {r.status}: {await r.text()}")
        await r.read()
    return time.perf_counter() - sent


async def measure(base: str, opts: argparse.Namespace, prompts: list[str]) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    streams: list[tuple[float, RequestResult]] = []
    longs: list[tuple[float, float]] = []
    begin = time.perf_counter()
    stop_at = begin + opts.warmup + opts.duration
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def stream_client(k: int) -> None:
            i = k
            while time.perf_counter() < stop_at:
                q = QUESTIONS[i % len(QUESTIONS)]
                started = time.perf_counter()
                result = await one_request(session, base, "smollm2", q, opts.max_tokens, True)
                streams.append((started, result))
                i += opts.streams

        async def long_client() -> None:
            pending = []
            for prompt in prompts:
                due = begin + opts.warmup / 2 + len(pending) * opts.long_interval
                if due >= stop_at:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))

                async def one(p: str = prompt, at: float = due) -> None:
                    longs.append((at, await long_request(session, base, p)))

                pending.append(asyncio.create_task(one()))
            await asyncio.gather(*pending)

        await asyncio.gather(long_client(), *(stream_client(k) for k in range(opts.streams)))
    measured = [r for started, r in streams if started >= begin + opts.warmup]
    gaps = sorted(g for r in measured for g in r.gaps)
    ttfts = sorted(t for at, t in longs if at >= begin + opts.warmup)
    wall = time.perf_counter() - begin - opts.warmup
    return {
        "stream_requests": len(measured),
        "stream_tokens_per_s": sum(r.tokens for r in measured) / wall,
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_max_ms": 1000 * (gaps[-1] if gaps else float("nan")),
        "stream_ttft_p50_ms": 1000 * percentile(sorted(r.ttft for r in measured), 50),
        "long_prompts": len(ttfts),
        "long_ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "long_ttft_max_ms": 1000 * (ttfts[-1] if ttfts else float("nan")),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--long-interval", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=6.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument(
        "--local-prefill-below", type=int, default=256, help="the router's: short prompts prefill on decode"
    )
    ap.add_argument("--dtype", default="bfloat16")
    opts = ap.parse_args()
    if not (MODEL / "model.safetensors").is_file():
        subprocess.check_call([CLI, "model", "import-gguf", "--out", str(MODEL)])
    RESULTS.mkdir(parents=True, exist_ok=True)
    count = int((opts.warmup + opts.duration) / opts.long_interval) + 2
    prompts = long_prompts(count, opts.long_tokens)
    results = {}
    for setup in ("unified", "disaggregated"):
        base, procs = await start(setup, opts)
        try:
            results[setup] = await measure(base, opts, prompts)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
        print(setup, json.dumps(results[setup]), flush=True)
    ratio = results["disaggregated"]["itl_p99_ms"] / results["unified"]["itl_p99_ms"]
    results["itl_p99_ratio_disaggregated_over_unified"] = ratio
    results["settings"] = vars(opts) | {"cores": os.cpu_count()}
    (RESULTS / "disagg_interference.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"ITL p99: unified {results['unified']['itl_p99_ms']:.1f} ms, disaggregated "
          f"{results['disaggregated']['itl_p99_ms']:.1f} ms: ratio {ratio:.2f} (target <= 0.5)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
