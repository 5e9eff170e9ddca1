"""What capturing the decode step as a graph would give: the model's decode pass run eagerly (as the engine
runs it today) against the same pass compiled by torch.compile (inductor, which needs a C compiler: gcc here),
on the real model, in one run. It prints both times per pass, their ratio, the compile time, and the largest
logit difference between the two (the compiled pass must compute the same thing).

    .venv/bin/python bench/decode_compile.py [--quantization none|int8|int4] [--batch 1 32] [--length 128]

Not a test, and not (yet) how the engine runs: a compiled pass is fixed to one (batch, length) bucket and
takes about a minute to compile on a 2-core CPU, so serving with it needs its compiled buckets kept in the
compile artifacts. This measures whether that is worth building.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from decode_profile import profiled_model  # bench/ is the script's folder, first on sys.path

from neuronfleet.runtime.config import RuntimeConfig
from neuronfleet.runtime.engine import Engine


def median_ms(run, repeats: int) -> float:
    for _ in range(5):  # warm
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def measure(model_dir: Path, batch: int, length: int, repeats: int) -> dict:
    engine = Engine.from_model_dir(str(model_dir), RuntimeConfig(slots=batch, max_seq_len=512, dtype="auto"))
    model = engine.runner.model
    tokens = torch.full((batch,), 42, dtype=torch.long)
    positions = torch.arange(batch) + length - 40  # every row well inside the length bucket
    step = model.decode_batch(tokens, positions, length, None)
    eager_ms = median_ms(lambda: model.forward(None, step), repeats)
    # The pass without its inference_mode wrapper (inductor cannot trace inference tensors), under no_grad.
    compiled = torch.compile(functools.partial(type(model).forward.__wrapped__, model), dynamic=False)

    def run_compiled():
        with torch.no_grad():
            return compiled(None, step)

    start = time.perf_counter()
    logits = run_compiled()[1]
    compile_s = time.perf_counter() - start
    difference = float((logits - model.forward(None, step)[1]).abs().max())
    compiled_ms = median_ms(run_compiled, repeats)
    return {
        "batch": batch,
        "dtype": engine.runner.dtype_name,
        "eager_ms": eager_ms,
        "compiled_ms": compiled_ms,
        "ratio": compiled_ms / eager_ms,
        "compile_s": compile_s,
        "max_logit_difference": difference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="int4")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--length", type=int, default=128, help="the cache length bucket")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model_dir = profiled_model(args.quantization)
    rows = [measure(model_dir, b, args.length, args.repeats) for b in args.batch]
    print("| streams | model | eager | compiled | compiled / eager | compile | max logit difference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['dtype']} {args.quantization} | {r['eager_ms']:.1f} ms "
            f"| {r['compiled_ms']:.1f} ms | {r['ratio']:.2f}x | {r['compile_s']:.0f} s "
            f"| {r['max_logit_difference']:.3g} |"
        )


if __name__ == "__main__":
    main()
