"""Offline generation throughput: our engine against transformers' `generate` on the real model, same run.

For each concurrency C (default 1, 4, 16, 32) the same N chat requests (greedy, natural end of answer, at most
--max-tokens new tokens) are run by:
  - our engine with C slots (continuous batching: a finished request's slot is refilled at once);
  - transformers' `generate` on padded static batches of C requests (each batch runs until its longest
    answer ends);
and, once, transformers one request at a time. Both sides run the same weights in the same dtype and count
the same tokens (every generated token up to and including the end-of-sequence token). It prints aggregate
tokens/s and the ratios, then the engine's own per-step overhead: the time a step spends outside the model
runner (scheduling, stop checks, detokenization) against the model call of a decode step.

    .venv/bin/python bench/engine_throughput.py [--dtype bfloat16] [--concurrency 1 4 16 32]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from prompts import QUESTIONS  # bench/prompts.py: the script folder is on sys.path
from transformers import AutoModelForCausalLM

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf
from neuronfleet.runtime.serving.sampling_params import SamplingParams


def ensure_model(path: Path, dtype: str) -> Path:
    if not (path / "model.safetensors").is_file():
        print(f"importing SmolLM2-135M-Instruct into {path} ...", flush=True)
        import_gguf(default_gguf_path(), path, dtype=dtype)
    return path


def count_until_eos(tokens: list[int], eos: set[int]) -> int:
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_ours(model_dir: Path, dtype: str, prompts: list[list[int]], c: int, max_tokens: int, max_len: int):
    engine = Engine.from_model_dir(str(model_dir), RuntimeConfig(slots=c, max_seq_len=max_len, dtype=dtype))
    engine.generate(prompts[:c], SamplingParams(max_tokens=4))  # warm-up
    engine.stats.__init__()
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    elapsed = time.perf_counter() - start
    s = engine.stats
    overhead = (s.step_seconds - s.model_seconds) / s.steps
    return {
        "tokens": sum(len(o.token_ids) for o in outs),
        "seconds": elapsed,
        "outputs": [o.token_ids for o in outs],
        "steps": s.steps,
        "overhead_ms_per_step": overhead * 1e3,
        "model_ms_per_step": s.model_seconds / s.steps * 1e3,
    }


def run_transformers(model, prompts: list[list[int]], batch: int, max_tokens: int, eos: set[int], pad: int):
    tokens, outputs = 0, []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=pad,
            )
        for row in out[:, width:].tolist():
            n = count_until_eos(row, eos)
            tokens += n
            outputs.append(row[:n])
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "outputs": outputs}


def fastest(runs: list[dict]) -> dict:
    """The fastest of repeated runs (these machines are shared; both sides get the same treatment)."""
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4C, 8))")
    ap.add_argument("--single-requests", type=int, default=8, help="requests for transformers one at a time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side and level; the fastest counts")
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine_throughput.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    # Both sides read the same float32 folder and cast to the benchmark dtype in memory.
    model_dir = ensure_model(args.model, "float32")
    engine_probe = Engine.from_model_dir(str(model_dir), RuntimeConfig(slots=1, max_seq_len=64))
    tok = engine_probe.tokenizer
    eos = set(engine_probe.eos_ids)
    del engine_probe
    prompts_all = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    max_len = 64 * -(-(max(len(p) for p in prompts_all) + args.max_tokens) // 64)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    pad = hf.generation_config.pad_token_id or 0
    run_transformers(hf, prompts_all[:1], 1, 4, eos, pad)  # warm-up
    single = fastest(
        [
            run_transformers(hf, prompts_all[: args.single_requests], 1, args.max_tokens, eos, pad)
            for _ in range(args.repeats)
        ]
    )
    single_tps = single["tokens"] / single["seconds"]
    print(
        f"dtype {args.dtype}, torch threads {torch.get_num_threads()}, max_tokens {args.max_tokens}, "
        f"fastest of {args.repeats} runs per side"
    )
    took = f"{single['tokens']} tokens in {single['seconds']:.1f}s"
    print(f"transformers one at a time: {took} = {single_tps:.1f} tok/s")

    rows = []
    header = (
        f"{'C':>3} {'N':>4} {'ours tok/s':>11} {'hf batch tok/s':>15} {'x hf batch':>11} {'x hf single':>12}"
        f" {'same text':>10} {'overhead':>9}"
    )
    lines = [header]
    for c in args.concurrency:
        n = args.requests or max(4 * c, 8)
        prompts = [prompts_all[i % len(prompts_all)] for i in range(n)]
        ours_runs, batch_runs = [], []
        for _ in range(args.repeats):  # interleaved, so that a slow spell of the machine hits both sides
            ours_runs.append(run_ours(model_dir, args.dtype, prompts, c, args.max_tokens, max_len))
            batch_runs.append(run_transformers(hf, prompts, c, args.max_tokens, eos, pad))
        ours, batch = fastest(ours_runs), fastest(batch_runs)
        ours_tps = ours["tokens"] / ours["seconds"]
        batch_tps = batch["tokens"] / batch["seconds"]
        same = sum(a == b for a, b in zip(ours["outputs"], batch["outputs"], strict=True))
        overhead_pct = 100 * ours["overhead_ms_per_step"] / ours["model_ms_per_step"]
        row = {
            "concurrency": c,
            "requests": n,
            "ours_tokens": ours["tokens"],
            "ours_tok_s": ours_tps,
            "hf_batch_tokens": batch["tokens"],
            "hf_batch_tok_s": batch_tps,
            "hf_single_tok_s": single_tps,
            "ratio_vs_hf_batch": ours_tps / batch_tps,
            "ratio_vs_hf_single": ours_tps / single_tps,
            "identical_outputs": same,
            "engine_overhead_ms_per_step": ours["overhead_ms_per_step"],
            "model_ms_per_step": ours["model_ms_per_step"],
            "engine_overhead_pct": overhead_pct,
        }
        rows.append(row)
        line = (
            f"{c:>3} {n:>4} {ours_tps:>11.1f} {batch_tps:>15.1f} {row['ratio_vs_hf_batch']:>10.2f}x"
            f" {row['ratio_vs_hf_single']:>11.2f}x {same:>5}/{n:<4} {overhead_pct:>8.2f}%"
        )
        lines.append(line)
        print(line if len(lines) > 2 else f"{header}\n{line}", flush=True)
    print("\n".join(lines))
    print(
        "overhead = engine time per step outside the model runner (scheduling, stops, detokenization) "
        "as a share of the model runner's time per step"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "single": single_tps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
