"""What running the decode step from a graph gives: the model's decode pass run op by op from Python, replayed
from the graph the engine records (`llama.DecodeGraph`, TorchScript's tracer: the engine's default on CPU),
and compiled by torch.compile (inductor, which needs a C compiler: gcc here), on the real model, in one run.
It prints the times per pass (op by op and recorded alternate step by step, the machine's drift falls on
both), their ratios, the compile time, and the largest logit difference from the op-by-op pass (the recorded
one must be 0). To tell a difference that is rounding from one that is an error, the passes are also
compared with a float64 pass over the very same weights (int8/int4 dequantized exactly as the kernels read
them): the model's own rounding (float32, and the bfloat16 activations the weight-only kernels take) is the
yardstick the compiled pass must stay within.

    .venv/bin/python bench/decode_compile.py [--quantization none|int8|int4] [--dtype auto] [--batch 1 32]
        [--no-compile]

Not a test. A compiled pass is fixed to one (batch, length) bucket and takes about a minute to compile on a
2-core CPU, so serving with it would need its compiled buckets kept in the compile artifacts; the recorded
graph serves every bucket and is recorded in under a second.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from decode_profile import ROOT, profiled_model, runner_dtypes  # bench/ is the script's folder, on sys.path
from prompts import QUESTIONS
from safetensors.torch import load_file, save_file

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.model import quantize
from neuronfleet.runtime.model.llama import LlamaModel, PrefillBatch
from neuronfleet.runtime.model.model_config import load_model_config


def dequantized(model_dir: Path) -> Path:
    """The folder's weights in float32 as the weight-only kernels read them (int4: (q - 8) * scale + zero
    with scale and zero in bfloat16; int8: q * scale, the layers' scales in bfloat16, the embedding's in
    float32, which a tied LM head shares here), for a float64 reference pass; a float folder as it is."""
    raw = json.loads((model_dir / "config.json").read_text())
    if not raw.get(quantize.CONFIG_KEY):
        return model_dir
    out = ROOT / "models" / f"{model_dir.name}-dequantized"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors, weights = load_file(str(model_dir / "model.safetensors")), {}
    for name in [k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")]:
        q = tensors[name + ".qweight"]
        if name + ".scales_zeros" in tensors:  # int4
            sz = tensors[name + ".scales_zeros"].to(quantize.KERNEL_DTYPE).double()  # [N, K/g, 2]
            groups = quantize.unpack_int4(q).double().view(q.shape[0], sz.shape[1], -1)
            w = ((groups - 8) * sz[..., :1] + sz[..., 1:]).view(q.shape[0], -1)
        else:
            scales = tensors[name + ".scales"]
            if name != quantize.EMBED:
                scales = scales.to(quantize.KERNEL_DTYPE)
            w = q.double() * scales.double()[:, None]
        weights[name + ".weight"] = w.float().contiguous()
    weights.update(
        {
            k: v
            for k, v in tensors.items()
            if k.rsplit(".", 1)[-1] not in ("qweight", "scales", "scales_zeros")
        }
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del raw[quantize.CONFIG_KEY]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def alternating_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Median ms of each run, called in turn, step after step (after 5 warm calls each)."""
    for run in runs.values():
        for _ in range(5):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * sorted(t)[repeats // 2] for name, t in times.items()}


def median_ms(run, repeats: int) -> float:
    for _ in range(5):  # warm
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def prefilled(model: LlamaModel, prompts: list[list[int]]) -> torch.Tensor:
    """Each slot's cache filled with its prompt (one prefill pass); the prompts' next tokens, greedy."""
    longest = max(map(len, prompts))
    tokens = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = torch.tensor(ids)
    batch = PrefillBatch(
        tokens=tokens,
        last_index=torch.tensor([len(ids) - 1 for ids in prompts]),
        slot_ids=torch.arange(len(prompts)),
    )
    return model.forward(batch, None)[0].argmax(-1)


def measure(
    model_dir: Path, reference_dir: Path, batch: int, repeats: int, dtype: str, compile_too: bool
) -> dict:
    engine = Engine.from_model_dir(str(model_dir), RuntimeConfig(slots=batch, max_seq_len=512, dtype=dtype))
    model = engine.runner.model
    # a real state: each slot holds a chat prompt, and the step decodes the token after it
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(batch)
    ]
    tokens = prefilled(model, prompts)
    positions = torch.tensor([len(ids) for ids in prompts])
    length = int(positions.max()) + 1
    step = model.decode_batch(tokens, positions, length, None)
    recorded_logits = model.forward(None, step)[1]  # records the graph (the engine's default)
    graph = model.decode_graph

    def op_by_op():
        model.decode_graph, model.capture_decode = None, False
        try:
            return model.forward(None, step)
        finally:
            model.decode_graph, model.capture_decode = graph, True

    eager_logits = op_by_op()[1]
    times = alternating_ms({"eager": op_by_op, "recorded": lambda: model.forward(None, step)}, repeats)
    row = {
        "batch": batch,
        "dtype": runner_dtypes(engine.runner),
        "eager_ms": times["eager"],
        "recorded_ms": times["recorded"],
        "recorded_ratio": times["recorded"] / times["eager"],
        "recorded_difference": float((recorded_logits - eager_logits).abs().max()),
    }
    if not compile_too:
        return row
    model.decode_graph, model.capture_decode = None, False  # torch.compile takes the op-by-op pass
    # The pass without its inference_mode wrapper (inductor cannot trace inference tensors), under no_grad.
    compiled = torch.compile(functools.partial(type(model).forward.__wrapped__, model), dynamic=False)

    def run_compiled():
        with torch.no_grad():
            return compiled(None, step)

    start = time.perf_counter()
    logits = run_compiled()[1]
    compile_s = time.perf_counter() - start
    difference = float((logits - eager_logits).abs().max())
    compiled_ms = median_ms(run_compiled, repeats)
    eager_ms = times["eager"]
    exact = LlamaModel(
        reference_dir, load_model_config(reference_dir), batch, 512, torch.float64, model.device
    )
    prefilled(exact, prompts)
    truth = exact.forward(None, exact.decode_batch(tokens, positions, length, None))[1]
    return row | {
        "compiled_ms": compiled_ms,
        "ratio": compiled_ms / eager_ms,
        "compile_s": compile_s,
        "max_logit_difference": difference,
        "eager_vs_float64": float((eager_logits - truth).abs().max()),
        "compiled_vs_float64": float((logits - truth).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="int4")
    parser.add_argument("--dtype", default="auto", help="the activations' dtype (auto, float32, bfloat16)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-compile", action="store_true", help="op by op and recorded only")
    args = parser.parse_args()
    model_dir = profiled_model(args.quantization)
    reference_dir = dequantized(model_dir)
    rows = [
        measure(model_dir, reference_dir, b, args.repeats, args.dtype, not args.no_compile)
        for b in args.batch
    ]
    print("| streams | model | op by op | recorded | recorded / op by op | recorded vs op by op |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['dtype']} {args.quantization} | {r['eager_ms']:.1f} ms "
            f"| {r['recorded_ms']:.1f} ms | {r['recorded_ratio']:.2f}x | {r['recorded_difference']:.3g} |"
        )
    if args.no_compile:
        return
    print(
        "| streams | model | op by op | compiled | compiled / op by op | compile | max logit difference "
        "| op by op vs float64 | compiled vs float64 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['dtype']} {args.quantization} | {r['eager_ms']:.1f} ms "
            f"| {r['compiled_ms']:.1f} ms | {r['ratio']:.2f}x | {r['compile_s']:.0f} s "
            f"| {r['max_logit_difference']:.3g} | {r['eager_vs_float64']:.3g} "
            f"| {r['compiled_vs_float64']:.3g} |"
        )


if __name__ == "__main__":
    main()
