"""Where a decode step's time goes: one stream and 32 streams, on the real model, with torch's profiler.

The engine runs B greedy requests until every one is decoding, then profiles --steps steady decode steps.
Each step's wall time is split into:
  - weights: the matmul kernels that read the weights (linear/mm/addmm, oneDNN's packed linear, the int8/int4
    weight-only kernels);
  - attention: the kernels that read the KV cache (bmm/matmul on it, scaled_dot_product_attention, softmax);
  - other ops: every other torch op (norms, rotary, residual adds, cache writes, copies, sampling);
  - outside ops: the rest of the wall time: Python between ops (per layer and per step), the scheduler, stop
    checks and detokenization.
Before that, --steps unprofiled steps give the step time without the profiler's cost, and the share of it
spent outside the model call (the engine's own clock, EngineStats: the scheduler, detokenization and stop
checks; the model call is the input tensors, the pass and sampling).
It also counts the torch ops a step dispatches from Python (top-level ops), which does not depend on the
machine or its load: each one costs microseconds of Python and dispatch. "engine overhead" is everything
that is not weights or attention. Last, what those ops cost with almost no arithmetic: the same decode
step's model call on a random model with the real one's layers and heads but tiny widths (`narrow_model`),
alternating with the real one, unprofiled (the per-op floor: Python, dispatch and each kernel's fixed cost).

    .venv/bin/python bench/decode_profile.py [--dtype auto] [--quantization none|int8|int4] [--batch 1 32]
        [--slots 64]

Not a test: the shares depend on the machine and its load (the op counts do not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.scheduler import Row, Sequence, StepPlan
from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf
from neuronfleet.runtime.model.quantize import quantize_folder
from neuronfleet.runtime.serving.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_OPS = {
    "aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu", "aten::embedding", "quantized::linear_dynamic_fp16",
}  # fmt: skip
ATTENTION_OPS = {
    "aten::bmm", "aten::matmul", "aten::scaled_dot_product_attention", "aten::_softmax", "aten::softmax",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
}  # fmt: skip


OP_NAMESPACES = ("aten::", "mkldnn::", "quantized::")


def top_level_ops(prof) -> list:
    """The torch ops called from Python or a recorded graph (not from inside another op)."""
    out = []
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(OP_NAMESPACES):
            parent = parent.cpu_parent
        if parent is None and event.name.startswith(OP_NAMESPACES):
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
    # Unprofiled first: the engine's own clock (EngineStats) splits each step into the model call (tensors in,
    # the pass, sampling) and the rest of the step: the scheduler, detokenization and stop checks.
    stats = engine.stats
    steps0, step_s0, model_s0 = stats.steps, stats.step_seconds, stats.model_seconds
    for _ in range(args.steps):
        engine.step()
    steps = stats.steps - steps0
    unprofiled = (stats.step_seconds - step_s0) / steps
    outside_model = unprofiled - (stats.model_seconds - model_s0) / steps
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
        "unprofiled_step_ms": unprofiled * 1e3,
        "outside_model_call_pct": 100 * outside_model / unprofiled,
        "ops_per_step": len(ops) / n,
        "threads": torch.get_num_threads(),
        "dtype": runner_dtypes(engine.runner),
    }


def runner_dtypes(runner) -> str:
    """The activations' dtype, and the weights' where they are held in another (auto on an AVX2 CPU)."""
    weights = runner.weights_dtype_name
    return runner.dtype_name + ("" if weights == runner.dtype_name else f" ({weights} weights)")


def narrow_model(real: Path, quantization: str) -> Path:
    """A random model with the real one's layers, heads and KV heads but tiny widths (head_dim 32, 64
    intermediate, a 256-token vocabulary; transformers saves it), quantized like the real one: its pass
    dispatches the same ops as the real one's with almost no arithmetic."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neuronfleet.runtime.model.model_config import load_model_config

    out = ROOT / "models" / f"bench-narrow-{quantization}"
    if (out / "model.safetensors").is_file():
        return out
    c = load_model_config(real)
    head_dim = 32  # the int4 kernel's smallest group: every width stays a multiple of it
    config = LlamaConfig(
        vocab_size=256, hidden_size=c.num_heads * head_dim, intermediate_size=64, head_dim=head_dim,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    if quantization != "none":
        quantize_folder(out, quantization)
    return out


def dispatch_floor(real: Path, args, batch: int) -> dict:
    """Unprofiled model calls (`ModelRunner.step`: input tensors, the pass, sampling) of one decode step over
    `batch` slots, on the real model and on its narrow twin (`narrow_model`), alternating, medians."""
    from neuronfleet.runtime.engine.model_runner import ModelRunner

    slots = max(batch, args.slots)
    times: dict[str, list[float]] = {}
    runners = {}
    for name, folder in (("real", real), ("narrow", narrow_model(real, args.quantization))):
        config = RuntimeConfig(slots=slots, max_seq_len=512, dtype=args.dtype, quantization=args.quantization)
        runners[name] = runner = ModelRunner(folder, config)
        prompt = list(range(3, 40))  # within both vocabularies
        greedy = SamplingParams(temperature=0.0)
        seqs = [Sequence(f"r{s}", prompt, greedy, max_tokens=1, slot=s) for s in range(batch)]
        runner.run(StepPlan(admitted=seqs, prefill=[Row(seq, prompt, 0) for seq in seqs]))
        times[name] = []
    position = 37
    for i in range(args.steps + 3):
        for name, runner in runners.items():
            t = time.perf_counter()
            runner.run(StepPlan(decode=[Row(seq, [5], position) for seq in seqs]))
            if i >= 3:
                times[name].append(time.perf_counter() - t)
        position += 1
    real_ms, narrow_ms = (1e3 * statistics.median(times[k]) for k in ("real", "narrow"))
    return {"batch": batch, "model_call_ms": real_ms, "narrow_model_call_ms": narrow_ms}


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
        "| ops/step | step unprofiled | outside the model call |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['dtype']} {args.quantization} | {r['step_ms']:.1f} ms "
            f"| {r['weights_pct']:.0f}% "
            f"| {r['attention_pct']:.0f}% | {r['other_ops_pct']:.0f}% | {r['outside_ops_pct']:.0f}% "
            f"| {r['engine_overhead_pct']:.0f}% | {r['ops_per_step']:.0f} | {r['unprofiled_step_ms']:.1f} ms "
            f"| {r['outside_model_call_pct']:.1f}% |"
        )
    floors = [dispatch_floor(model_dir, args, b) for b in args.batch]
    print("\n| streams | model call | the same pass, narrow widths | share of the call |")
    print("|---|---|---|---|")
    for f in floors:
        call, narrow = f["model_call_ms"], f["narrow_model_call_ms"]
        print(f"| {f['batch']} | {call:.1f} ms | {narrow:.1f} ms | {100 * narrow / call:.0f}% |")
        next(r for r in rows if r["batch"] == f["batch"]).update(f)
    out = ROOT / "bench" / "results" / f"decode_profile_{args.quantization}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
