"""The runtime's serving configuration, decided once (pure; no torch): slots, lengths, buckets, dtype, prefix
reuse and queue bounds (the waiting queue's length, and the longest expected wait admitted: `admission`).
`RuntimeConfig` validates the settings in its constructor and derives what is left unset (the length buckets,
the prefill token budget); `check_model` checks it against the model it serves.
The scheduler and the model runner both take it as it is, and read nothing back from each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuronfleet.contract import MAX_COMPILED_GRAPHS, batch_buckets, compiled_buckets
from neuronfleet.runtime.model.model_config import ModelConfig

if TYPE_CHECKING:
    from neuronfleet.contract import ServeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 where the CPU has it natively
QUANTIZATIONS = ("none", "int8", "int4")
COMPILED_STEPS = ("off", "inductor", "aot_eager", "neuron")  # the contract's; compiled_steps.BACKENDS and off
DEFAULT_PREFILL_TOKENS = 2048  # token budget of one prefill group, unless the largest prompt bucket is more


def default_length_buckets(max_len: int, smallest: int = 64, per_octave: int = 2) -> list[int]:
    """`per_octave` evenly spaced lengths per doubling from `smallest`, up to `max_len` (the last bucket).

    With 2 per octave (64, 96, 128, 192, ...) padding wastes under a third; with 4 (16, 20, 24, 28, 32, 40,
    ...) under a fifth. The number of shapes (graphs to compile on Neuron) stays logarithmic in `max_len`.
    """
    buckets, b = set(), smallest
    while b < max_len:
        buckets.update(n for n in (b + b * k // per_octave for k in range(per_octave)) if n < max_len)
        b *= 2
    return [*sorted(buckets), max_len]  # (below per_octave the steps round to the same lengths)


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket that holds `n`."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How one engine serves: built once from the command line (or a test), validated, then handed down.

    Unset buckets (empty) are derived: prefill is compute-bound, so padding costs in proportion and its
    buckets are fine (4 per octave, up to `max_input_len`, from 16 on a compiling device and from 1 on CPU,
    where a shape costs nothing to add: a prompt whose cache prefix is reused prefills a few tokens, and
    padding them to 16 rows slows the step it shares with the decoding requests; docs/benchmarks.md); decode
    reads the cache, coarser is fine (2 per
    octave from 64, up to `max_seq_len`). The largest decode bucket is `max_seq_len`; the largest prefill
    bucket is the longest prompt accepted, `max_input_len` when it is set (0: `max_seq_len`, or the largest
    prefill bucket given).
    """

    slots: int = 8
    max_seq_len: int = 2048
    max_input_len: int = 0  # the longest prompt; 0: the largest prefill bucket given, else max_seq_len
    prefill_buckets: Sequence[int] = ()  # as given (empty: derived); a sorted tuple once constructed
    decode_buckets: Sequence[int] = ()
    dtype: str = "auto"  # resolved once by the model runner (runtime/model/dtypes.py)
    device: str = "cpu"  # "neuron" with compiled_steps neuron (TorchNeuron)
    quantization: str | None = None  # None: what the model folder holds (float, or quantized by compile)
    prefix_reuse: bool = True
    decode_graph: bool = True  # on CPU, decode-only steps replay a recorded graph of the layers
    compiled_steps: str = (
        "off"  # the passes compiled per bucket by this torch.compile backend (compiled_steps)
    )
    tensor_parallel: int = 1  # ranks the model is split over, processes of this server (`tp_ranks`)
    max_prefill_tokens: int = 0  # 0: DEFAULT_PREFILL_TOKENS; never below the largest prefill bucket
    max_waiting: int = 1024
    max_queue_wait: float = 60.0  # seconds a request may be expected to wait for a slot (0: no bound)
    # bytes of host memory the host KV store may hold (`host_kv_store`): None, as many as the slots' own KV
    # cache (slots x max_seq_len tokens, `host_kv_bytes`); 0, no store
    host_kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots} (--slots)")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1, got {self.max_seq_len} (--max-seq-len)")
        if not 0 <= self.max_input_len <= self.max_seq_len:
            raise ValueError(
                f"max_input_len must be between 1 and max_seq_len ({self.max_seq_len}), got "
                f"{self.max_input_len} (--max-input-len)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; choose one of "
                f"{', '.join(QUANTIZATIONS)} (--quantization)"
            )
        if self.compiled_steps not in COMPILED_STEPS:
            raise ValueError(f"compiled_steps {self.compiled_steps!r} is not supported; choose one of "
                             f"{', '.join(COMPILED_STEPS)} (--compiled-steps)")  # fmt: skip
        if self.compiled_steps == "neuron":  # (TorchNeuron's passes run on its device)
            object.__setattr__(self, "device", "neuron")
        if self.compiled_steps != "off" and self.quantization not in (None, "none"):
            raise ValueError(
                f"--compiled-steps {self.compiled_steps} takes float weights; --quantization "
                f"{self.quantization} runs on torch's CPU kernels only: leave one out"
            )
        if self.tensor_parallel < 1:
            raise ValueError(
                f"tensor_parallel must be at least 1, got {self.tensor_parallel} (--tensor-parallel)"
            )
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be at least 0, got {self.max_waiting} (--max-waiting)")
        if not self.max_queue_wait >= 0:
            raise ValueError(
                f"max_queue_wait must be 0 (no bound) or more seconds, got {self.max_queue_wait} "
                "(--max-queue-wait)"
            )
        if self.host_kv_cache_bytes is not None and self.host_kv_cache_bytes < 0:
            raise ValueError(
                "host_kv_cache_bytes must be 0 (no host KV store) or more bytes, got "
                f"{self.host_kv_cache_bytes} (--host-kv-cache-bytes)"
            )
        smallest_prefill = 1 if self.device == "cpu" else 16
        prefill = self._buckets(
            self.prefill_buckets, "prefill", smallest_prefill, 4, self.max_input_len or self.max_seq_len
        )
        decode = self._buckets(self.decode_buckets, "decode", 64, 2, self.max_seq_len)
        if decode[-1] != self.max_seq_len:
            raise ValueError(
                f"the largest decode bucket must equal max_seq_len ({self.max_seq_len}), got {decode[-1]} "
                "(--decode-buckets)"
            )
        if self.max_input_len and prefill[-1] != self.max_input_len:
            raise ValueError(
                f"the largest prefill bucket must equal max_input_len ({self.max_input_len}), got "
                f"{prefill[-1]} (--prefill-buckets), or prompts it accepts would fit no bucket"
            )
        object.__setattr__(self, "prefill_buckets", prefill)
        object.__setattr__(self, "decode_buckets", decode)
        budget = max(self.max_prefill_tokens or DEFAULT_PREFILL_TOKENS, prefill[-1])
        object.__setattr__(self, "max_prefill_tokens", budget)
        if self.compiled_steps != "off" and self.compiled_graphs > MAX_COMPILED_GRAPHS:
            raise ValueError(
                f"--compiled-steps compiles a graph per bucket: these buckets make up to "
                f"{self.compiled_graphs} (prefill: {len(self.batch_buckets)} row counts x the prompt "
                f"buckets {list(prefill)} x the context buckets {list(decode)} that can follow each; decode: "
                f"{len(self.batch_buckets)} batch sizes x {len(decode)} lengths), more than "
                f"{MAX_COMPILED_GRAPHS}: give fewer --prefill-buckets and --decode-buckets (e.g. "
                f"--prefill-buckets {min(128, self.max_seq_len)},{prefill[-1]} --decode-buckets "
                f"{self.max_seq_len}), or fewer --slots"
            )

    def _buckets(
        self, given: Sequence[int], kind: str, smallest: int, per_octave: int, limit: int
    ) -> tuple[int, ...]:
        if not given:
            return tuple(default_length_buckets(limit, smallest, per_octave))
        out = tuple(sorted({int(b) for b in given}))
        if out[0] < 1 or out[-1] > self.max_seq_len:
            raise ValueError(
                f"{kind} buckets {list(given)} must be between 1 and max_seq_len ({self.max_seq_len}) "
                f"(--{kind}-buckets)"
            )
        return out

    @classmethod
    def from_serve(cls, args: ServeConfig) -> RuntimeConfig:
        """The one RuntimeConfig of `neuronfleet serve`'s settings (the contract's `ServeConfig`), validated
        here: a bad setting fails before anything loads."""
        return cls(
            slots=args.slots, max_seq_len=args.max_seq_len, max_input_len=args.max_input_len or 0,
            prefill_buckets=args.prefill_buckets or (), decode_buckets=args.decode_buckets or (),
            dtype=args.dtype, prefix_reuse=args.prefix_reuse, max_waiting=args.max_waiting,
            max_queue_wait=args.max_queue_wait, host_kv_cache_bytes=args.host_kv_cache_bytes,
            quantization=args.quantization, decode_graph=args.decode_graph,
            compiled_steps=args.compiled_steps, tensor_parallel=args.tensor_parallel,
        )  # fmt: skip

    def check_model(self, model: ModelConfig) -> RuntimeConfig:
        """Refuse settings the model cannot serve; returns self."""
        if self.max_seq_len > model.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} must be between 1 and the model's "
                f"max_position_embeddings ({model.max_position_embeddings}) (--max-seq-len)"
            )
        return self

    def host_kv_bytes(self, kv_bytes_per_token: int) -> int:
        """The host KV store's bytes, for a model whose KV cache takes `kv_bytes_per_token`: as set, or by
        default as many as the slots' own cache (it doubles the prefixes a pod keeps: the issue's cache
        pressure regime is a working set 1.5-2x what the slots hold)."""
        if self.host_kv_cache_bytes is not None:
            return self.host_kv_cache_bytes
        return self.slots * self.max_seq_len * kv_bytes_per_token

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt accepted: the largest prefill bucket."""
        return self.prefill_buckets[-1]

    @property
    def compiled_graphs(self) -> int:
        """The graphs `--compiled-steps` may compile for these buckets, at most (`compiled_buckets`)."""
        return len(compiled_buckets(self.slots, self.prefill_buckets, self.decode_buckets))

    @property
    def batch_buckets(self) -> list[int]:
        """Decode batch sizes: powers of two below the slot count, and the slot count."""
        return batch_buckets(self.slots)
