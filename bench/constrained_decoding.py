"""The cost of structured outputs: a constrained batch against a free one in our engine, same run, and the
grammar engine chosen (llguidance) against the other one vLLM and SGLang offer (xgrammar), on the same
vocabulary and schemas.

1. Grammar engines: for each schema, a valid JSON document tokenized by the model's tokenizer is walked token
   by token: each step computes the next-token mask for the whole vocabulary (49152 tokens) and consumes the
   token. It reports each engine's compile time (the schema, first use) and its mask time per token (mean and
   p99). xgrammar is not a dependency: it runs when importable (`pip install --no-deps --target DIR xgrammar
   apache-tvm-ffi`, then PYTHONPATH=DIR), else its rows say so.
2. Our engine, `--slots` rows, greedy, `--max-tokens` each: a free batch (`ignore_eos`, so every answer runs
   its whole length), a constrained batch (a JSON array of `--items` integers: longer than `--max-tokens`, so
   every answer runs its whole length too) and a mixed one (half and half), alternated for `--rounds` rounds;
   aggregate tokens/s of each, and the ratios to the free batch's.

    .venv/bin/python bench/constrained_decoding.py [--slots 16] [--max-tokens 64] [--rounds 3]

Not a test: numbers depend on the machine and its load. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
from machine import cpu_name  # bench/machine.py: the script folder is on sys.path
from prompts import QUESTIONS

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf
from neuronfleet.runtime.serving.output_constraints import JSON_OPTIONS, response_format
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {  # name -> (schema, a document it accepts, written as the engine writes JSON: JSON_OPTIONS)
    "person": (
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
         "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
         "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36},
    ),
    "order": (
        {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
            "status": {"enum": ["placed", "paid", "shipped", "delivered"]},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}}, "required": ["sku", "quantity", "price"],
                "additionalProperties": False}, "minItems": 1},
            "note": {"type": ["string", "null"]}},
         "required": ["id", "status", "items", "note"], "additionalProperties": False},
        {"id": "AB-123456", "status": "shipped", "items": [{"sku": "tea-green-100g", "quantity": 2,
         "price": 4.5}, {"sku": "cup-white", "quantity": 1, "price": 12.0}], "note": None},
    ),
    "numbers": (
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 30,
         "maxItems": 30},
        list(range(100, 400, 10)),
    ),
}  # fmt: skip


def ensure_model(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        print(f"importing SmolLM2-135M-Instruct into {path} ...", flush=True)
        import_gguf(default_gguf_path(), path, dtype="bfloat16")
    return path


def document(value: object) -> str:
    return json.dumps(value, separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]))


def walk_llguidance(vocab: llguidance.LLTokenizer, schema: dict, tokens: list[int]) -> dict:
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
    compiled = time.perf_counter() - started
    steps = []
    for token in tokens:
        t0 = time.perf_counter()
        mask = matcher.compute_bitmask()
        steps.append(time.perf_counter() - t0)
        assert mask[token // 8] >> (token % 8) & 1, "the document left the grammar"
        assert matcher.consume_token(token), matcher.get_error()
    return summary(compiled, steps)


def walk_xgrammar(tokenizer_json: Path, eos: list[int], vocab_size: int, schema: dict, tokens: list[int]):
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return {"skipped": f"xgrammar is not importable here ({e})"}
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
    started = time.perf_counter()
    compiled_grammar = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    compiled = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    steps = []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        steps.append(time.perf_counter() - t0)
        assert matcher.accept_token(token), "the document left the grammar"
    return summary(compiled, steps)


def summary(compiled: float, steps: list[float]) -> dict:
    ordered = sorted(steps)
    return {
        "compile_ms": compiled * 1e3,
        "mask_us_mean": statistics.fmean(steps) * 1e6,
        "mask_us_p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
        "tokens": len(steps),
    }


def grammar_engines(model_dir: Path) -> dict:
    tokenizer = Tokenizer(model_dir)
    eos = sorted(tokenizer.eos_token_ids)
    vocab = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    rows = {}
    for name, (schema, value) in SCHEMAS.items():
        tokens = tokenizer.encode(document(value), add_special_tokens=False)
        rows[name] = {
            "llguidance": walk_llguidance(vocab, schema, tokens),
            "xgrammar": walk_xgrammar(
                model_dir / "tokenizer.json", eos, tokenizer.vocab_size, schema, tokens
            ),
        }
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def engine_batches(model_dir: Path, slots: int, max_tokens: int, items: int, rounds: int, dtype: str) -> dict:
    engine = Engine.from_model_dir(str(model_dir), RuntimeConfig(slots=slots, max_seq_len=512, dtype=dtype))
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": items,
              "maxItems": items}  # fmt: skip
    constraint = response_format(
        {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}}
    )
    ask = [engine.tokenizer.encode_chat([{"role": "user", "content": f"{q} Answer with {items} numbers."}])
           for q in QUESTIONS]  # fmt: skip
    prompts = [ask[i % len(ask)] for i in range(slots)]
    free = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, constraint=constraint)
    batches = {
        "free": [free] * slots,
        "constrained": [constrained] * slots,
        "mixed": [constrained if i % 2 else free for i in range(slots)],
    }
    engine.generate(prompts, batches["mixed"])  # warm-up: every bucket and the grammar vocabulary
    rates: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(rounds):
        for name, params in batches.items():
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            seconds = time.perf_counter() - started
            tokens = sum(len(o.token_ids) for o in outs)
            assert tokens == slots * max_tokens, (name, [len(o.token_ids) for o in outs])
            rates[name].append(tokens / seconds)
    best = {name: max(r) for name, r in rates.items()}
    out = {
        "slots": slots, "max_tokens": max_tokens, "rounds": rates,
        "tokens_per_second": best,
        "constrained_to_free": best["constrained"] / best["free"],
        "mixed_to_free": best["mixed"] / best["free"],
        "dtype": engine.runner.dtype_name,
    }  # fmt: skip
    print(f"{slots} slots: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in best.items())
          + f"; constrained/free {out['constrained_to_free']:.3f}, mixed/free {out['mixed_to_free']:.3f}",
          flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "bench-smollm2-defaults")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--items", type=int, default=40, help="integers in the constrained answer's array")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "constrained_decoding.json")
    args = parser.parse_args()
    model_dir = ensure_model(args.model_dir)
    result = {
        "cpu": cpu_name(),
        "grammar_engines": grammar_engines(model_dir),
        "engine": [
            engine_batches(model_dir, s, args.max_tokens, args.items, args.rounds, args.dtype)
            for s in args.slots
        ],
        "command": "bench/constrained_decoding.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("model_dir", "out")
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
