"""Where a decode step's time goes: one stream and 32 streams, on the real model, with torch's profiler.

The engine runs B greedy requests until every one is decoding, then profiles --steps steady decode steps.
Each step's wall time is split into:
  - weights: the matmul kernels that read the weights (linear/mm/addmm, oneDNN's packed linear, the int8/int4
    weight-only kernels);
  - attention: the kernels that read the KV cache (bmm/matmul on it, scaled_dot_product_attention, softmax);
  - other ops: every other torch op (norms, rotary, residual adds, cache writes, copies, sampling);
  - outside ops: the rest of the wall time: Python between ops (per layer and per step), the scheduler, stop
    checks and detokenization.
It also counts the torch ops a step dispatches from Python (top-level ops), which does not depend on the
machine or its load: each one costs microseconds of Python and dispatch. "engine overhead" is everything
that is not weights or attention.

    .venv/bin/python bench/decode_profile.py [--dtype auto] [--quantization none|int8|int4] [--batch 1 32]
        [--slots 64]

Not a test: the shares depend on the machine and its load (the op counts do not).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from neuronfleet.runtime.config import RuntimeConfig
from neuronfleet.runtime.engine import Engine
from neuronfleet.runtime.gguf_import import default_gguf_path, import_gguf
from neuronfleet.runtime.quantize import quantize_folder
from neuronfleet.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_OPS = {
    "aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu", "aten::embedding",
}  # fmt: skip
ATTENTION_OPS = {
    "aten::bmm", "aten::matmul", "aten::scaled_dot_product_attention", "aten::_softmax", "aten::softmax",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
}  # fmt: skip


def top_level_ops(prof) -> list:
    """The torch ops called from Python (not from inside another op)."""
    out = []
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "mkldnn::")):
            parent = parent.cpu_parent
        if parent is None and event.name.startswith(("aten::", "mkldnn::")):
            out.append(event)
    return out


def profile_batch(model_dir: Path, args, batch: int) -> dict:
    slots = max(batch, args.slots)  # as many slots as the server benchmark's: decode runs slots 0..batch-1
    config = RuntimeConfig(slots=slots, max_seq_len=512, dtype=args.dtype, quantization=args.quantization)
    engine = Engine.from_model_dir(str(model_dir), config)
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"Tell me a long story about the number {i}.", params)
    while engine.scheduler.waiting or any(not s.output_ids for s in engine.scheduler.running.values()):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    ops = top_level_ops(prof)
    n, wall = args.steps, sum(walls) / args.steps  # a profiled step: the profiler's own cost lands "outside"
    weights = sum(e.cpu_time_total for e in ops if e.name in WEIGHT_OPS) / n / 1e6
    attention = sum(e.cpu_time_total for e in ops if e.name in ATTENTION_OPS) / n / 1e6
    other = sum(e.cpu_time_total for e in ops) / n / 1e6 - weights - attention
    outside = max(0.0, wall - weights - attention - other)
    return {
        "batch": batch,
        "step_ms": wall * 1e3,
        "weights_pct": 100 * weights / wall,
        "attention_pct": 100 * attention / wall,
        "other_ops_pct": 100 * other / wall,
        "outside_ops_pct": 100 * outside / wall,
        "engine_overhead_pct": 100 * (wall - weights - attention) / wall,
        "ops_per_step": len(ops) / n,
        "threads": torch.get_num_threads(),
        "dtype": engine.runner.dtype_name,
    }


def profiled_model(quantization: str) -> Path:
    """The real model as `neuronfleet model import-gguf [--quantization]` makes it, imported once into
    models/ (kept for later runs; shared with decode_compile.py)."""
    model_dir = ROOT / "models" / f"bench-smollm2-profile-{quantization}"
    if not (model_dir / "model.safetensors").is_file():
        import_gguf(default_gguf_path(), model_dir)
        if quantization != "none":
            quantize_folder(model_dir, quantization)
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slots", type=int, default=64, help="the engine's slots (server_latency.py: 64)")
    args = parser.parse_args()
    model_dir = profiled_model(args.quantization)
    rows = [profile_batch(model_dir, args, b) for b in args.batch]
    print(
        "| streams | dtype | step | weights | attention | other ops | outside ops | engine overhead "
        "| ops/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['dtype']} {args.quantization} | {r['step_ms']:.1f} ms "
            f"| {r['weights_pct']:.0f}% "
            f"| {r['attention_pct']:.0f}% | {r['other_ops_pct']:.0f}% | {r['outside_ops_pct']:.0f}% "
            f"| {r['engine_overhead_pct']:.0f}% | {r['ops_per_step']:.0f} |"
        )
    out = ROOT / "bench" / "results" / f"decode_profile_{args.quantization}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
