"""The model runner: executes a planned step on the device (torch).

It loads the model (`llama.LlamaModel`: weights and the static KV cache) for a `RuntimeConfig`, and runs what
the engine planned: one pass that prefills a group of prompts, padded to a length bucket, into their slots
(after copying the cached prefixes they reuse from other slots) and decodes one token for the slots
`0..batch-1` (a batch bucket) over a length bucket of the cache, a prompt with one token left to prefill
counting as a decode row; then samples the next tokens (`sampler`). It
also moves running requests between slots and exports or imports a slot's keys and values (a KV handoff).
Which slot holds which tokens is the scheduler's bookkeeping (`prefix_cache`), not the runner's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from . import cpu_threads, heap_returns
from .config import RuntimeConfig, pick_bucket
from .dtypes import resolve_dtype, resolve_weights_dtype
from .llama import LlamaModel, PrefillBatch, stored_quantization
from .model_config import load_model_config
from .sampler import Sampler


def model_dtype(model_dir: Path, config: RuntimeConfig) -> str:
    """The dtype the runner serves the folder's model in (activations and KV cache): --dtype, where `auto`
    depends on the CPU and on whether the layers are weight-only quantized (`dtypes.resolve_dtype`)."""
    return resolve_dtype(config.dtype, config.device, _quantized(model_dir, config))


def _quantized(model_dir: Path, config: RuntimeConfig) -> bool:
    return (config.quantization or stored_quantization(model_dir)) != "none"


class ModelRunner:
    """Holds the model and the slots' samplers; runs bucketed prefill and decode, samples the next tokens."""

    def __init__(self, model_dir: str | Path, config: RuntimeConfig) -> None:
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        self.config = config.check_model(self.model_config)
        # `auto`, decided once: the activations' and KV cache's dtype, and the float layers' weights'
        quantized = _quantized(self.model_dir, config)
        self.dtype_name = resolve_dtype(config.dtype, config.device, quantized)
        self.weights_dtype_name = resolve_weights_dtype(config.dtype, config.device, quantized)
        # torch's threads within the container's CPU quota and affinity (None off the CPU)
        self.cpu_threads = cpu_threads.configure() if config.device == "cpu" else None
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.device = torch.device(config.device)
        with heap_returns.loading():  # what loading frees goes back to the system
            self.model = LlamaModel(
                self.model_dir, self.model_config, config.slots, config.max_seq_len, self.dtype, self.device,
                config.quantization, config.decode_graph, getattr(torch, self.weights_dtype_name),
            )  # fmt: skip
        self.quantization = self.model.weights.quantization
        self.sampler = Sampler()

    def step(
        self,
        prefill_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        decode_slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        prefixes: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Prefill prompts into their slots and decode one token for other slots, in one pass.

        `prefixes` (per prompt: the slot whose cache holds its first tokens and how many; default none) says
        what each prompt reuses: it prefills only the rest, after those positions are copied from that slot
        when it is another one (a rest of one token is decoded). Returns the prompts' first new tokens and the
        decode slots' next tokens.
        """
        prefixes = prefixes or [(slot, 0) for slot in prefill_slots]
        for slot, (source, n) in zip(prefill_slots, prefixes, strict=True):
            if source != slot and n:
                self.copy_prefix(source, slot, n)
        # A prompt whose every token but the last is now in its slot's cache is one decode row: its last token
        # at its position, as a running request's next one (the same arithmetic as prefilling one token after
        # a prefix). A step that admits only such prompts is then a decode-only pass, replayed from the
        # recorded graph on CPU, and none pays for a prefill pass's own ops and padded rows.
        left = [len(ids) - n for ids, (_, n) in zip(prompts, prefixes, strict=True)]
        one_left = [i for i, k in enumerate(left) if k == 1]
        rest = [i for i, k in enumerate(left) if k != 1]
        first_rest, next_tokens = self._pass(
            [prefill_slots[i] for i in rest], [prompts[i] for i in rest], [prefixes[i][1] for i in rest],
            [*decode_slots, *(prefill_slots[i] for i in one_left)],
            [*tokens, *(prompts[i][-1] for i in one_left)],
            [*positions, *(len(prompts[i]) - 1 for i in one_left)],
        )  # fmt: skip
        first = dict(zip(rest, first_rest, strict=True)) | dict(
            zip(one_left, next_tokens[len(decode_slots) :], strict=True)
        )
        return [first[i] for i in range(len(prompts))], next_tokens[: len(decode_slots)]

    def _pass(
        self, prefill_slots: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int],
        decode_slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
    ) -> tuple[list[int], list[int]]:  # fmt: skip
        """One pass: prompts prefilled from position `starts` (what their slots hold before it) into their
        slots, one token decoded for each decode slot; the sampled tokens of both."""
        c, model = self.config, self.model
        prefill = decode = None
        if prompts:
            bucket = pick_bucket(
                c.prefill_buckets, max(len(p) - a for p, a in zip(prompts, starts, strict=True))
            )
            padded = torch.zeros((len(prompts), bucket), dtype=torch.long)
            at = torch.full((len(prompts), bucket), c.max_seq_len, dtype=torch.long)
            for row, (ids, a) in enumerate(zip(prompts, starts, strict=True)):
                padded[row, : len(ids) - a] = torch.tensor(ids[a:], dtype=torch.long)
                at[row, : len(ids) - a] = torch.arange(a, len(ids))
            prefill = PrefillBatch(
                tokens=padded.to(self.device),
                last_index=torch.tensor(
                    [len(p) - a - 1 for p, a in zip(prompts, starts, strict=True)], device=self.device
                ),
                slot_ids=torch.tensor(list(prefill_slots), dtype=torch.long, device=self.device),
                positions=at.to(self.device) if any(starts) else None,
            )
        if decode_slots:
            batch = pick_bucket(c.batch_buckets, max(decode_slots) + 1)
            length = pick_bucket(c.decode_buckets, max(positions) + 1)
            tok = [0] * batch
            pos = [c.max_seq_len] * batch  # idle rows write the scratch column
            for s, t, p in zip(decode_slots, tokens, positions, strict=True):
                tok[s], pos[s] = t, p
            decode = model.decode_batch(
                torch.tensor(tok, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
                length,
                torch.tensor(list(decode_slots), dtype=torch.long, device=self.device),
            )
        if prefill is None and decode is None:
            return [], []
        prefill_logits, decode_logits = model.forward(prefill, decode)
        logits = [t for t in (prefill_logits, decode_logits) if t is not None]
        sampled = self.sampler.sample(
            torch.cat(logits) if len(logits) > 1 else logits[0], [*prefill_slots, *decode_slots]
        )
        return sampled[: len(prompts)], sampled[len(prompts) :]

    # ---- moving keys and values ----------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy cache positions [0, length) of slot src into slot dst."""
        cache = self.model.kv_cache  # [layers, 2, slots, kv_heads, positions, head_dim]
        cache[:, :, dst, :, :length] = cache[:, :, src, :, :length]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a running request from slot src to slot dst: its cache positions [0, length) and its sampler.
        src keeps its copy of the cache for prefix reuse."""
        self.copy_prefix(src, dst, length)
        self.sampler.move(src, dst)

    @torch.inference_mode()
    def export_kv(self, slot: int, length: int, layer: int | None = None) -> torch.Tensor:
        """Keys and values of positions [0, length) of a slot, contiguous: [layers, 2, kv_heads, length,
        head_dim], or one layer's [2, kv_heads, length, head_dim] (to send layer by layer)."""
        kv = self.model.kv_cache
        return (kv[:, :, slot] if layer is None else kv[layer, :, slot])[..., :length, :].contiguous()

    @torch.inference_mode()
    def import_kv(self, slot: int, kv: torch.Tensor, length: int) -> None:
        """Place keys and values computed elsewhere ([layers, 2, kv_heads, length, head_dim]) into a slot's
        positions [0, length)."""
        c = self.model_config
        expected = (c.num_layers, 2, c.num_kv_heads, length, c.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit: expected {expected} {self.dtype}"
            )
        self.model.kv_cache[:, :, slot, :, :length] = kv.to(self.device)
