"""Routing benchmark on a workload we did not write: a replay of Mooncake's public conversation trace
(bench/data/mooncake_conversation_excerpt.jsonl, an excerpt: its README says which and from where) against
replicas of our runtime serving SmolLM2-135M-Instruct, at three regimes, under round-robin, least-loaded,
kv-aware and kv-aware following the pods' KV-cache events.

The trace has no text: each request is its arrival time, its input and output lengths, and `hash_ids`, the
ids of its 512-token blocks (requests sharing an id share that block: a conversation's next turn starts with
the ids of its earlier turns; every request starts with block 0). Replayed here (`Scaling`):
  - each block becomes B tokens of text of its own (words our tokenizer reads as one token each, drawn from a
    generator seeded by the run and the block's id), so requests sharing an id share its text, and a prompt
    is its blocks' texts in order; the request's last block is cut as its input length says (512 tokens
    scaled by B/512, at least one); a prompt is cut at the whole blocks that fit the pods' --max-seq-len less
    the answer (prefixes kept, so what requests share stays shared);
  - the answer: output_length scaled by 16/512 (at least 1, at most --max-output-tokens), sent with vLLM's
    `ignore_eos`, so every policy generates the same tokens;
  - arrivals keep the trace's own gaps between requests, scaled so the run's offered rate is the regime's.
Each policy's run starts its pods and its front door afresh (`--same-pods`: one set for every run), so no
run finds what an earlier one left in the pods' caches (their host KV stores keep a finished conversation's
blocks until idle 10 minutes), nor a router what it learnt; every policy of a pass replays the same texts
(with `--same-pods` each run draws its own, which a warm cache must not hold already).
Regimes, each the excerpt's first --requests requests (80: about the trace's first 18 minutes, thinned):
  - under-capacity: offered well below what the pods serve; the prefixes' working set (the distinct blocks'
    tokens) 0.8x what the pods hold (pods x slots x max-seq-len tokens): B = 6 with the defaults;
  - saturation: the same requests offered above what the pods serve (slots full, requests waiting);
  - cache-pressure: the working set 1.75x what the pods hold (B = 16 with the defaults: prompts twice as
    long), offered below what the pods serve.
B follows from the working set asked (`block_tokens_for`); the occupancy measured says what the load was.
The load: open loop (each request sent when its time comes, whatever is still running), the official
`openai` client (AsyncOpenAI, max_retries=0), streamed completions; TTFT is the request sent to its first
text. Measured per regime and policy: TTFT p50 and p90, output tokens/s (over the time from the first request
sent to the last answer's end), errors, the pods' own prefix cache hit rate (prompt tokens found in a cache
over prompt tokens, from their `vllm:prefix_cache_*` counters, all pods together), and the pods' occupancy
(requests in slots over slots, requests waiting: their `vllm:num_requests_*` gauges sampled every 0.5 s).
The front doors are run as the operator runs them (`--routing-pod-slots`, `--routing-cache-tokens`; the
events one given the model's tokenizer). Policies run in turn, alternated from one run of a regime to the next
(A B C D, D C B A, A B C D, ...: with --repeats 2 each regime runs both ways, each policy's requests pooled);
ratios to least-loaded and to round-robin are printed and written with the CPU
to bench/results/routing_trace.json.

    .venv/bin/python bench/routing_trace.py [--pods 3] [--slots 4] [--max-seq-len 1024] [--requests 80]
        [--rates 2 7 1.5] [--repeats 1] [--routing-cache-tokens N] [--regimes ...] [--policies ...]
        [--out routing_trace.json]

--rates: the offered requests/s of under-capacity, saturation and cache-pressure, in that order; the defaults
suit the 2-core machine of docs/benchmarks.md while shared (its pods served about 4.8 requests/s with B = 6
and 2.8 with B = 16; quiet, 7.3 with B = 6: saturation then needs 10): check the occupancy printed. Not a
test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "bench" / "data" / "mooncake_conversation_excerpt.jsonl"
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids name blocks of 512 tokens (its FAST25-release/README.md)
POLICIES = ("round-robin", "least-loaded", "kv-aware", "kv-aware-events")
# Words of one token each for SmolLM2's tokenizer with a space before them (checked when the run starts).
VOCABULARY = ("river", "stone", "lantern", "harbor", "orchard", "meadow", "copper", "signal", "valley",
              "ember", "granite", "willow", "beacon", "thunder", "canyon", "falcon", "cedar", "marble",
              "compass", "anchor", "garden", "window", "silver", "yellow", "purple", "orange", "summer",
              "winter", "spring", "autumn", "morning", "evening", "bridge", "castle", "forest", "island",
              "mountain", "ocean", "desert", "village", "market", "school", "letter", "number", "answer",
              "question", "reason", "season", "paper", "pencil", "table", "chair", "kitchen", "bottle",
              "basket", "mirror", "candle", "engine", "rocket", "planet", "circle", "square", "bread",
              "butter", "cheese", "apple", "lemon", "cherry", "tiger", "horse", "rabbit", "eagle", "whale",
              "dragon", "doctor", "farmer", "driver", "singer", "painter", "teacher", "student", "friend",
              "mother", "father", "brother", "sister", "family")  # fmt: skip


# ---- the trace: pure -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """A Mooncake trace's line: arrival (ms from its start), lengths (tokens), its 512-token blocks' ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """A Mooncake trace's JSON lines (blank lines skipped), in order; a line that is not one: which, why."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace line {number}: not JSON ({e.msg})") from None
        fields = ("timestamp", "input_length", "output_length", "hash_ids")
        if not isinstance(row, dict) or any(k not in row for k in fields):
            raise ValueError(
                f"trace line {number}: expected an object with {', '.join(fields)}; got {line[:80]!r}"
            )
        ids = row["hash_ids"]
        numbers = (
            row["timestamp"],
            row["input_length"],
            row["output_length"],
            *(ids if isinstance(ids, list) else ()),
        )
        if not isinstance(ids, list) or not ids or any(type(n) is not int or n < 0 for n in numbers):
            raise ValueError(f"trace line {number}: timestamp, input_length, output_length and each of "
                             f"hash_ids must be whole numbers >= 0, hash_ids a list of at least one; "
                             f"got {line[:80]!r}")  # fmt: skip
        if (
            row["input_length"] > len(ids) * TRACE_BLOCK_TOKENS
            or row["input_length"] <= (len(ids) - 1) * TRACE_BLOCK_TOKENS
        ):
            raise ValueError(f"trace line {number}: input_length {row['input_length']} does not fit "
                             f"{len(ids)} blocks of {TRACE_BLOCK_TOKENS} tokens (the last one partly "
                             f"filled)")  # fmt: skip
        out.append(TraceRequest(row["timestamp"], row["input_length"], row["output_length"], tuple(ids)))
    if any(b.timestamp_ms < a.timestamp_ms for a, b in itertools.pairwise(out)):
        raise ValueError("trace: timestamps must not go back (a trace is in arrival order)")
    return out


def conversations(requests: Sequence[TraceRequest]) -> list[int]:
    """Each request's conversation: the index of the request that opened it. A request continues the latest
    earlier request that shares the longest prefix of at least two blocks with it (every request of the
    conversation trace shares block 0, its system prompt); else it opens one."""
    last_with: dict[tuple[int, ...], int] = {}
    opened = []
    for i, r in enumerate(requests):
        parent = next((last_with[r.hash_ids[:k]] for k in range(len(r.hash_ids), 1, -1)
                       if r.hash_ids[:k] in last_with), None)  # fmt: skip
        opened.append(i if parent is None else opened[parent])
        for k in range(1, len(r.hash_ids) + 1):
            last_with[r.hash_ids[:k]] = i
    return opened


def excerpt(requests: Sequence[TraceRequest], every: int) -> list[int]:
    """The indexes of every request of one conversation in `every` (the 0th, every-th, ... by opening order):
    the whole trace's arrivals thinned, each kept conversation whole (how the shipped excerpt was made)."""
    opened = conversations(requests)
    order = {first: n for n, first in enumerate(sorted(set(opened)))}
    return [i for i, first in enumerate(opened) if order[first] % every == 0]


@dataclass(frozen=True)
class Scaling:
    """How a trace request becomes ours: each 512-token block of its prompt `block_tokens` tokens, the prompt
    at most `max_input_tokens` (whole blocks); its answer `output_block_tokens` tokens per 512, at most
    `max_output_tokens` (the answers' scale is the same in every regime)."""

    block_tokens: int
    max_input_tokens: int
    max_output_tokens: int
    output_block_tokens: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= self.max_input_tokens or self.max_output_tokens < 1:
            raise ValueError(f"scaling: need 1 <= block_tokens ({self.block_tokens}) <= max_input_tokens "
                             f"({self.max_input_tokens}) and max_output_tokens >= 1 "
                             f"({self.max_output_tokens})")  # fmt: skip

    def scaled(self, tokens: int, block_tokens: int | None = None) -> int:
        return max(1, math.ceil(tokens * (block_tokens or self.block_tokens) / TRACE_BLOCK_TOKENS))

    def blocks(self, request: TraceRequest) -> list[tuple[int, int]]:
        """The request's prompt as (block id, tokens) in order: whole blocks, the last as long as the input
        length leaves it, cut at the blocks that fit max_input_tokens."""
        last = request.input_length - (len(request.hash_ids) - 1) * TRACE_BLOCK_TOKENS
        out = [(h, self.block_tokens) for h in request.hash_ids[:-1]] + [
            (request.hash_ids[-1], self.scaled(last))
        ]
        fit, total = [], 0
        for block in out:
            if total + block[1] > self.max_input_tokens:
                break
            fit.append(block)
            total += block[1]
        return fit

    def output_tokens(self, request: TraceRequest) -> int:
        return min(self.max_output_tokens, self.scaled(request.output_length, self.output_block_tokens))


def block_text(seed: int, block_id: int, tokens: int, vocabulary: Sequence[str]) -> str:
    """A block's text: `tokens` words with a space before each, the same for the same seed and block (and a
    shorter cut of a block its beginning)."""
    rng = random.Random(f"{seed}:{block_id}")
    return "".join(" " + rng.choice(vocabulary) for _ in range(tokens))


def prompt(request: TraceRequest, scaling: Scaling, seed: int, vocabulary: Sequence[str]) -> str:
    return "".join(block_text(seed, h, n, vocabulary) for h, n in scaling.blocks(request))


def working_set_tokens(requests: Iterable[TraceRequest], scaling: Scaling) -> int:
    """Tokens of the distinct blocks the requests' prompts hold (a block counted at its longest)."""
    longest: dict[int, int] = {}
    for r in requests:
        for h, n in scaling.blocks(r):
            longest[h] = max(n, longest.get(h, 0))
    return sum(longest.values())


def block_tokens_for(requests: Sequence[TraceRequest], held_tokens: int, ratio: float, max_input_tokens: int,
                     max_output_tokens: int) -> int:  # fmt: skip
    """The block tokens whose working set comes nearest `ratio` x what the pods hold (`held_tokens`)."""
    if ratio <= 0 or held_tokens <= 0:
        raise ValueError(
            f"working set: ratio ({ratio}) and the tokens the pods hold ({held_tokens}) must be > 0"
        )

    def off(block_tokens: int) -> float:
        scaling = Scaling(block_tokens, max_input_tokens, max_output_tokens)
        return abs(working_set_tokens(requests, scaling) / held_tokens - ratio)

    return min(range(1, max_input_tokens // 4 + 1), key=off)


def arrivals(requests: Sequence[TraceRequest], rate: float) -> list[float]:
    """Seconds from the run's start at which each request is sent: the trace's own gaps, scaled so the
    offered rate (requests after the first over the span) is `rate` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s; got {rate}")
    if not requests:
        return []
    start, span = requests[0].timestamp_ms, requests[-1].timestamp_ms - requests[0].timestamp_ms
    if span == 0:
        return [0.0] * len(requests)
    scale = (len(requests) - 1) / rate / span
    return [(r.timestamp_ms - start) * scale for r in requests]


def quantile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


# ---- the run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regime:
    name: str
    working_set: float  # x what the pods hold
    rate_index: int  # into --rates


EACH_RUN = (
    "ttft_p50_s",
    "ttft_p90_s",
    "tokens_per_s",
    "hit_rate",
    "slots_in_use_mean",
    "waiting_mean",
    "failed",
)
REGIMES = (Regime("under-capacity", 0.8, 0), Regime("saturation", 0.8, 1), Regime("cache-pressure", 1.75, 2))


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    occupancy: list[tuple[float, float]] = field(default_factory=list)  # (in slots / slots, waiting) samples


async def replay(targets: list[str], texts: list[str], outputs: list[int], times: list[float],
                 pods: list[str], slots: int, result: Result) -> None:  # fmt: skip
    """Each request sent when its time comes, to the targets in turn (the pods: round-robin; else one front
    door), its stream read to the end; the pods' gauges sampled meanwhile; all of it into `result`."""
    import aiohttp
    import openai

    done = asyncio.Event()
    clients = [
        openai.AsyncOpenAI(base_url=t + "/v1", api_key="unused", max_retries=0, timeout=600) for t in targets
    ]
    turn = itertools.cycle(clients)

    async def one(text: str, max_tokens: int, at: float, started: float) -> None:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        client = next(turn)
        sent, first = time.perf_counter(), None
        try:
            stream = await client.completions.create(
                model="smollm2", prompt=text, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.usage:
                    result.tokens += chunk.usage.completion_tokens
                if first is None and any(c.text for c in chunk.choices):
                    first = time.perf_counter()
        except openai.APIError as e:
            result.failed.append(f"{type(e).__name__}: {str(e)[:200]}")
            return
        if first is not None:
            result.ttft.append(first - sent)

    async def sample(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            running = waiting = 0.0
            for url in [*pods, *(set(targets) - set(pods))]:  # the pods, and a front door's own queue
                async with session.get(url + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if url in pods and line.startswith("vllm:num_requests_running"):
                            running += float(line.rsplit(" ", 1)[1])
                        elif line.startswith("vllm:num_requests_waiting"):
                            waiting += float(line.rsplit(" ", 1)[1])
            result.occupancy.append((running / (slots * len(pods)), waiting))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)

    async with aiohttp.ClientSession() as session:
        sampler = asyncio.create_task(sample(session))
        started = time.perf_counter()
        await asyncio.gather(*(one(t, n, a, started) for t, n, a in zip(texts, outputs, times, strict=True)))
        result.seconds += time.perf_counter() - started
        done.set()
        await sampler
    for client in clients:
        await client.close()


def summary(result: Result, before: list[dict], after: list[dict]) -> dict:
    delta = lambda name: sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))  # noqa: E731
    queries, hits = delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")
    in_slots = [o for o, _ in result.occupancy]
    waiting = [w for _, w in result.occupancy]
    return {"requests": len(result.ttft), "failed": len(result.failed), "errors": result.failed[:3],
            "ttft_p50_s": quantile(result.ttft, 0.5), "ttft_p90_s": quantile(result.ttft, 0.9),
            "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
            "seconds": result.seconds,
            "hit_rate": hits / queries if queries else 0.0,
            "slots_in_use_mean": statistics.mean(in_slots) if in_slots else 0.0,
            "waiting_mean": statistics.mean(waiting) if waiting else 0.0}  # fmt: skip


def commit() -> str:
    """The commit the pods run: HEAD, with "+changes" where its runtime files differ from HEAD's; where the
    runtime is imported from elsewhere (an export of a commit on the path), where."""
    import neuronfleet.runtime

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head, runtime = git("rev-parse", "--short", "HEAD"), Path(neuronfleet.runtime.__file__).resolve().parent
    if runtime != ROOT / "runtime":
        return f"runtime from {runtime}"
    return head + ("+changes" if git("status", "--porcelain", "runtime") else "")


def checked_vocabulary(model: Path) -> list[str]:
    """The words our tokenizer reads as one token each with a space before them; refused if too few."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = [w for w in VOCABULARY if len(tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1]
    if len(words) < 50:
        raise SystemExit(f"only {len(words)} of the vocabulary's words are one token for {model}: need 50")
    return words


def main() -> None:
    from machine import cpu_name  # bench/machine.py
    from routing import (  # bench/routing.py
        DOOR_OPTIONS,
        Processes,
        counters,
        decisions,
        fresh_fleet,
        model_dir,
        operator_cache_tokens,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--routing-cache-tokens", type=int, default=None,
                        help="what a front door counts a pod as holding (default 2 x slots x max-seq-len, "
                        "as the operator counts a pod of our runtime: its slots and its host KV store at its "
                        "default size)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=80, help="the excerpt's first N requests, each run")
    parser.add_argument("--rates", type=float, nargs=3, default=[2.0, 7.0, 1.5],
                        metavar=("UNDER", "SATURATION", "PRESSURE"),
                        help="offered requests/s per regime")  # fmt: skip
    parser.add_argument(
        "--regimes", nargs="+", choices=[r.name for r in REGIMES], default=[r.name for r in REGIMES]
    )
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=1, help="the regimes again, in turn (the orders go on "
                        "alternating); each policy's requests pooled")  # fmt: skip
    parser.add_argument("--no-router-queue", dest="router_queue", action="store_false",
                        help="the front doors send every request at once, also while every pod's slots are "
                        "taken")  # fmt: skip
    parser.add_argument("--same-pods", action="store_true", help="every run on the same pods and front doors "
                        "(by default each run starts its own afresh)")  # fmt: skip
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument(
        "--out", default="routing_trace.json", help="the results' file name in bench/results/"
    )
    args = parser.parse_args()
    requests = parse_trace(args.trace.read_text().splitlines())[: args.requests]
    held = args.pods * args.slots * args.max_seq_len
    max_input = args.max_seq_len - args.max_output_tokens - 1
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    vocabulary = checked_vocabulary(model)
    report: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "commit": commit(),
                    "args": {**vars(args), "trace": str(args.trace)}, "pods_hold_tokens": held,
                    "regimes": {}, "results": {}}  # fmt: skip
    procs = Processes(results_dir)
    serve = ["--model", str(model), "--served-model-name", "smollm2", "--slots", str(args.slots),
             "--max-seq-len", str(args.max_seq_len), "--max-input-len", str(max_input)]  # fmt: skip
    cache_tokens = args.routing_cache_tokens or operator_cache_tokens(args.slots, args.max_seq_len)
    pods: list[str] = []
    routers: dict[str, str] = {}
    warm = Scaling(16, max_input, 4)
    warm_texts = [prompt(r, warm, -1, vocabulary) for r in requests[:6]]

    def start(policies) -> None:
        """`fresh_fleet`, its pods warmed (a first request compiles nothing but pays the allocator's first
        touches)."""
        nonlocal pods, routers
        pods, routers = fresh_fleet(procs, serve, args.pods, policies, args.slots, cache_tokens, model,
                                    "trace_", DOOR_OPTIONS[args.router_queue])  # fmt: skip
        asyncio.run(replay(pods, warm_texts, [4] * 6, [0.0] * 6, pods, args.slots, Result()))

    try:
        if args.same_pods:
            start(POLICIES)
        regimes = [r for r in REGIMES if r.name in args.regimes]
        pooled: dict[tuple[str, str], tuple[Result, list, list, Counter]] = {}
        for n, regime in enumerate(regimes * args.repeats):
            block_tokens = block_tokens_for(
                requests, held, regime.working_set, max_input, args.max_output_tokens
            )
            scaling = Scaling(block_tokens, max_input, args.max_output_tokens)
            rate = args.rates[regime.rate_index]
            times, outputs = arrivals(requests, rate), [scaling.output_tokens(r) for r in requests]
            report["regimes"][regime.name] = {
                "block_tokens": block_tokens, "rate_per_s": rate,
                "working_set_tokens": working_set_tokens(requests, scaling),
                "working_set_vs_held": working_set_tokens(requests, scaling) / held,
                "prompt_tokens_mean": statistics.mean(sum(t for _, t in scaling.blocks(r)) for r in requests),
                "output_tokens_mean": statistics.mean(outputs)}  # fmt: skip
            print(regime.name, report["regimes"][regime.name], flush=True)
            for i, policy in enumerate(POLICIES if n % 2 == 0 else POLICIES[::-1]):
                if policy not in args.policies:
                    continue
                if not args.same_pods:
                    start([policy])
                seed = 1000 * n + (i if args.same_pods else 0)
                texts = [prompt(r, scaling, seed, vocabulary) for r in requests]
                run, before, after, decided = pooled.setdefault(
                    (regime.name, policy), (Result(), [], [], Counter())
                )
                before.append([counters(p) for p in pods])
                first = decisions(routers.get(policy))
                targets = pods if policy == "round-robin" else [routers[policy]]
                asyncio.run(replay(targets, texts, outputs, times, pods, args.slots, one := Result()))
                after.append([counters(p) for p in pods])
                each = summary(one, before[-1], after[-1])
                decided.update(decisions(routers.get(policy)) - first)
                for name in ("ttft", "failed", "occupancy"):
                    getattr(run, name).extend(getattr(one, name))
                run.tokens, run.seconds = run.tokens + one.tokens, run.seconds + one.seconds
                out = summary(run, [c for b in before for c in b], [c for a in after for c in a])
                if policy in routers:
                    out["decisions"] = dict(decided)
                earlier = report["results"].get(regime.name, {}).get(policy, {}).get("each_run", [])
                out["each_run"] = [*earlier, {k: each[k] for k in EACH_RUN}]
                report["results"].setdefault(regime.name, {})[policy] = out
                print(f"{regime.name:14s} {policy:15s} TTFT p50 {out['ttft_p50_s']:.3f} s p90 "
                      f"{out['ttft_p90_s']:.3f} s  {out['tokens_per_s']:.1f} tok/s  hit rate "
                      f"{out['hit_rate']:.2f}  slots in use {out['slots_in_use_mean']:.2f} waiting "
                      f"{out['waiting_mean']:.1f}  failed {out['failed']}  {out.get('decisions', '')}",
                      flush=True)  # fmt: skip
    finally:
        procs.stop()
    for regime, by_policy in report["results"].items():
        for base in ("least-loaded", "round-robin"):
            b = by_policy.get(base)
            for policy, r in by_policy.items():
                if b is None or policy == base or not b["ttft_p50_s"] or not b["tokens_per_s"]:
                    continue
                key = base.replace("-", "_")
                r[f"ttft_p50_vs_{key}"] = r["ttft_p50_s"] / b["ttft_p50_s"]
                r[f"tokens_per_s_vs_{key}"] = r["tokens_per_s"] / b["tokens_per_s"]
                print(f"{regime}: {policy} TTFT p50 {r[f'ttft_p50_vs_{key}']:.2f}x {base}'s, throughput "
                      f"{r[f'tokens_per_s_vs_{key}']:.2f}x")  # fmt: skip
    (results_dir / args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
