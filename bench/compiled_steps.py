"""The compiled passes (`--compiled-steps inductor`, runtime/model/compiled_steps.py) against the engine's
default CPU path (oneDNN's packed weights, the decode pass replayed from its recorded graph), same run, same
model, same bucket tables, same requests.

For each concurrency C (default 1 and 8): C chat requests together, greedy, `--max-tokens` each (`ignore_eos`:
every answer runs its whole length), on an engine of C slots; the first round compiles (or records) every
bucket the workload uses and is timed apart; then `--rounds` rounds alternate the two engines. It prints each
path's decode tokens/s (median of the rounds), the ratio compiled/default, the compile time, and whether the
greedy answers agree (bfloat16 rounds differently in fused kernels: they may part after some tokens). With
--ahead, a third engine serves the same graphs compiled ahead as the compile Job does (`compiled_ahead`: an
AOTInductor package per bucket of its tables, every bucket, timed) and loaded at its start (timed).

    .venv/bin/python bench/compiled_steps.py [--dtype auto] [--concurrency 1 8] [--max-tokens 64] [--rounds 3]
        [--ahead]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine; Inductor needs
g++ and Python's headers, and compiles each bucket for seconds to a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py: the script folder is on sys.path
from prompts import QUESTIONS

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf
from neuronfleet.runtime.serving.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = {"max_seq_len": 512, "prefill_buckets": [128], "decode_buckets": [512]}  # few graphs: 2 + 2 per C


def model_dir() -> Path:
    out = ROOT / "models" / "smollm2-bench-float32"
    if not (out / "model.safetensors").is_file():
        import_gguf(default_gguf_path(), out, dtype="float32")
    return out


def ahead_folder(folder: Path, config: RuntimeConfig) -> tuple[Path, float]:
    """A folder of the model's files (linked) and the packages of every bucket of `config`'s tables, compiled
    as the compile Job compiles them; the seconds it took (0 when they were there)."""
    from neuronfleet.contract import compiled_buckets
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model.compiled_ahead import GRAPHS_DIR, GRAPHS_MANIFEST, compile_ahead

    out = folder.with_name(f"{folder.name}-ahead-{config.dtype}-{config.slots}")
    out.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    if (out / GRAPHS_DIR / GRAPHS_MANIFEST).is_file():
        return out, 0.0
    start = time.perf_counter()
    model = ModelRunner(out, config).model
    table = compiled_buckets(config.slots, config.prefill_buckets, config.decode_buckets)
    compile_ahead(model, out, table, out)
    return out, time.perf_counter() - start


def timed(engine: Engine, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ahead", action="store_true", help="also serve the graphs compiled ahead")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compiled_steps.json")
    args = parser.parse_args()
    folder = model_dir()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = {"cpu": cpu_name(), "dtype": args.dtype, "max_tokens": args.max_tokens, "runs": []}
    for c in args.concurrency:
        engines, warm = {}, {}
        probe = Engine.from_model_dir(str(folder), RuntimeConfig(slots=c, dtype=args.dtype, **BUCKETS))
        prompts = [probe.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:c]]
        del probe
        for name, steps in (("default", "off"), ("inductor", "inductor"), ("ahead", "inductor")):
            config = RuntimeConfig(slots=c, dtype=args.dtype, compiled_steps=steps, **BUCKETS)
            where = folder
            if name == "ahead":
                if not args.ahead:
                    continue
                where, seconds = ahead_folder(folder, config)
                results.setdefault("ahead_compile_s", {})[str(c)] = seconds
                start = time.perf_counter()
                engines[name] = Engine.from_model_dir(str(where), config)
                results.setdefault("ahead_start_s", {})[str(c)] = time.perf_counter() - start
                print(f"C={c}: compiled ahead in {seconds:.1f} s; the engine started in "
                      f"{results['ahead_start_s'][str(c)]:.1f} s", flush=True)  # fmt: skip
            else:
                engines[name] = Engine.from_model_dir(str(where), config)
            start = time.perf_counter()
            engines[name].generate(prompts, params)  # every bucket of the workload compiled or recorded
            warm[name] = time.perf_counter() - start
        rates: dict[str, list[float]] = {name: [] for name in engines}
        answers: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rate, answers[name] = timed(engine, prompts, params)
                rates[name].append(rate)
        median = {name: statistics.median(r) for name, r in rates.items()}
        same = sum(a == b for a, b in zip(answers["default"], answers["inductor"], strict=True))
        run = {"concurrency": c, "tokens_per_s": median, "ratio": median["inductor"] / median["default"],
               "first_round_s": warm, "rounds": rates, "same_answers": f"{same}/{c}"}  # fmt: skip
        results["runs"].append(run)
        ahead = ""
        if "ahead" in median:
            run["ahead_ratio"] = median["ahead"] / median["default"]
            ahead = f", ahead {median['ahead']:.1f} tok/s (x{run['ahead_ratio']:.2f})"
        print(f"C={c}: default {median['default']:.1f} tok/s, inductor {median['inductor']:.1f} tok/s "
              f"(x{run['ratio']:.2f}){ahead}; first round default {warm['default']:.1f} s, inductor "
              f"{warm['inductor']:.1f} s; same greedy answers {same}/{c}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
