"""The model runner: executes a planned step on the device (torch).

It loads the model (`llama.LlamaModel`: weights and the static KV cache) for a `RuntimeConfig`, and runs the
scheduler's `StepPlan` as it is: releases and starts the slots' sampling state (its own `sampler`), moves
requests between slots, copies cached prefixes, then one pass that prefills the prefill rows, padded to a
length bucket, and decodes one token for the decode rows over slots `0..batch-1` (a batch bucket) and a
length bucket of the cache; then samples each row's next token. It also exports or imports a slot's keys and
values (a KV handoff), and holds the host KV store's pool (`host_kv`: blocks of keys and values in host
memory), into which a step saves a slot's blocks before overwriting them and from which it fetches a prompt's
cached prefix. Which slot holds which tokens, and which block sits where in the pool, is the scheduler's
bookkeeping (`prefix_cache`, `host_kv_store`), not the runner's. With tensor parallelism, rank 0's runner
tells the other ranks each step's tensor work (`StepWork`) and every rank executes it on its share
(`tp_ranks`); rank 0 alone samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neuronfleet.contract import compiled_buckets
from neuronfleet.runtime.engine.config import RuntimeConfig, pick_bucket
from neuronfleet.runtime.engine.kv_events import BLOCK_SIZE
from neuronfleet.runtime.engine.sampler import Sampler
from neuronfleet.runtime.engine.scheduler import Row, StepPlan
from neuronfleet.runtime.engine.scheduler import Sequence as Seq
from neuronfleet.runtime.engine.tp_ranks import Ranks
from neuronfleet.runtime.model import cpu_threads, heap_returns, neuron_device, tensor_parallel
from neuronfleet.runtime.model.compiled_ahead import AheadGraphs
from neuronfleet.runtime.model.compiled_steps import CompiledSteps
from neuronfleet.runtime.model.dtypes import resolve_dtype, resolve_weights_dtype
from neuronfleet.runtime.model.llama import DecodeBatch, LlamaModel, PrefillBatch, stored_quantization
from neuronfleet.runtime.model.model_config import load_model_config
from neuronfleet.runtime.model.tensor_parallel import Shard
from neuronfleet.runtime.serving.backend import TokenLogprobs

log = logging.getLogger(__name__)

ExportMemory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> memory to fill


def _quantized(model_dir: Path, config: RuntimeConfig) -> bool:
    return (config.quantization or stored_quantization(model_dir)) != "none"


@dataclass
class StepWork:
    """What every rank of a step does with tensors, in order: exchange slots' caches (src, dst, length), save
    slots' blocks to the host pool (slot, blocks, places), copy cached prefixes (src, dst, length), fetch
    blocks from the pool (slot, places), then one pass over these batches. Rank 0 makes it from a StepPlan;
    the other ranks get it by broadcast (`tp_ranks`)."""

    moves: list[tuple[int, int, int]] = field(default_factory=list)
    saves: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    fetches: list[tuple[int, list[int]]] = field(default_factory=list)
    prefill: PrefillBatch | None = None
    decode: DecodeBatch | None = None
    prefill_rows: int = 0  # the prefill group's real rows (a compiled group is padded to a batch bucket)


@dataclass
class StepResult:
    """What a step produced: each row's next token, by sequence; and the admitted requests that did not run,
    with why."""

    tokens: dict[Seq, int] = field(default_factory=dict)
    failed: list[tuple[Seq, Exception]] = field(default_factory=list)
    logprobs: dict[Seq, TokenLogprobs] = field(default_factory=dict)  # of the rows whose request asked


class ModelRunner:
    """Holds the model and the slots' samplers; runs bucketed prefill and decode, samples the next tokens."""

    def __init__(self, model_dir: str | Path, config: RuntimeConfig, rank: int = 0) -> None:
        """`rank`: this process's rank of a tensor-parallel server (`config.tensor_parallel` > 1); rank 0
        starts the others (`tp_ranks.Ranks`) before it loads its share."""
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        self.config = config.check_model(self.model_config)
        self.ranks: Ranks | None = None
        shard = None
        warmed = None  # on a Neuron device: the compile Job's NEFF cache, copied to this pod's disk first
        if config.device == "neuron":  # (by rank 0, before the other ranks start: they read its copy)
            warmed = neuron_device.use_local_cache(self.model_dir, copy=rank == 0)
        if config.tensor_parallel > 1:
            if (why := tensor_parallel.refusal(self.model_config, config.tensor_parallel)) is not None:
                raise ValueError(f"{why} (--tensor-parallel)")  # (before any other rank starts)
            shard = Shard(rank, config.tensor_parallel)
            if rank == 0:
                self.ranks = Ranks.start(self.model_dir, config, type(self))
        # `auto`, decided once: the activations' and KV cache's dtype, and the float layers' weights'
        quantized = _quantized(self.model_dir, config)
        self.dtype_name = resolve_dtype(config.dtype, config.device, quantized)
        # compiled passes: plain float weights in the activations' dtype (fbgemm's float16 weights are
        # operators of the CPU only), no recorded decode graph
        compiled = config.compiled_steps != "off"
        self.weights_dtype_name = (
            self.dtype_name if compiled else resolve_weights_dtype(config.dtype, config.device, quantized)
        )
        # torch's threads within the container's CPU quota and affinity (None off the CPU)
        self.cpu_threads = cpu_threads.configure() if config.device == "cpu" else None
        if self.cpu_threads is not None and shard is not None:  # the ranks share the pod's CPUs
            torch.set_num_threads(max(1, torch.get_num_threads() // shard.world))
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        if config.device == "neuron":
            why = neuron_device.import_backend()
            if why is not None:
                raise RuntimeError(why)
        self.device = torch.device(config.device)
        with heap_returns.loading():  # what loading frees goes back to the system
            self.model = LlamaModel(
                self.model_dir, self.model_config, config.slots, config.max_seq_len, self.dtype, self.device,
                config.quantization, config.decode_graph and not compiled,
                getattr(torch, self.weights_dtype_name), pack=not compiled, shard=shard,
            )  # fmt: skip
        # the passes as compiled graphs, one per bucket (`RuntimeConfig.compiled_graphs`: a prefill group's
        # rows padded to a batch bucket, every group read through its positions up to a context bucket)
        # (Inductor: the compile Job's packages where the artifacts have them; packages made for another pod:
        # op by op, said why; none: compiled here as each bucket is first run; TorchNeuron: the buckets the
        # compile Job warmed, loaded from its NEFF cache, and nothing compiled here)
        self.compiled: CompiledSteps | None = None
        why = None
        if config.compiled_steps == "neuron":
            table = compiled_buckets(config.slots, config.prefill_buckets, config.decode_buckets)
            self.compiled, why = neuron_device.warmed_steps(
                self.model, self.model_dir, warmed, table, graphs=config.compiled_graphs
            )
        elif compiled:
            ahead = None
            if config.compiled_steps == "inductor":
                ahead, why = AheadGraphs.load(self.model, self.model_dir)
            if why is None:
                self.compiled = CompiledSteps(
                    self.model, config.compiled_steps, config.compiled_graphs, ahead
                )
        if why is not None:
            log.warning("%s", why)
        self.quantization = self.model.weights.quantization
        self.sampler = Sampler()  # (the engine gives it the tokenizer's vocabulary for grammars)
        c = self.model_config
        self.kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        # the host KV store's pool: [blocks, layers, 2, kv_heads, BLOCK_SIZE, head_dim] in host memory (pages
        # are taken as blocks are first written); its blocks counted over the whole model's KV, so that each
        # rank of a tensor-parallel server holds the same blocks of its own key and value heads
        block_bytes = BLOCK_SIZE * self.kv_bytes_per_token
        self.host_blocks = config.host_kv_bytes(self.kv_bytes_per_token) // block_bytes
        self.host_kv: torch.Tensor | None = None
        if self.host_blocks:
            kv_heads = self.model.config.num_kv_heads  # (this rank's)
            shape = (self.host_blocks, c.num_layers, 2, kv_heads, BLOCK_SIZE, c.head_dim)
            self.host_kv = torch.empty(shape, dtype=self.dtype, device="cpu")

    def run(self, plan: StepPlan) -> StepResult:
        """Run one planned step: each row's next token, and the admitted requests whose sampling state could
        not be set up (they do not run; the others do)."""
        for slot in plan.released:
            self.sampler.release(slot)
        for move in plan.moves:
            self.sampler.move(move.src, move.dst)
        result = StepResult()
        for seq in plan.admitted:
            try:
                self.sampler.start(seq.slot, seq.params, seq.prompt_ids)
            except Exception as e:  # this request's failure (its seed, its penalty's history), not the step's
                result.failed.append((seq, e))
        failed = {id(seq) for seq, _ in result.failed}
        prefill = [r for r in plan.prefill if id(r.seq) not in failed]
        decode = [r for r in plan.decode if id(r.seq) not in failed]
        work = StepWork(
            moves=[(m.src, m.dst, m.length) for m in plan.moves],
            saves=[(s.slot, list(s.blocks), list(s.places)) for s in plan.saves],
            copies=[(c.src, c.dst, c.length) for c in plan.copies if id(c.seq) not in failed],
            fetches=[(f.dst, list(f.places)) for f in plan.fetches if id(f.seq) not in failed],
        )
        work.prefill, work.decode = self._batches(prefill, decode)
        work.prefill_rows = len(prefill)
        if self.ranks is not None:  # every rank runs the same work on its share
            self.ranks.broadcast(work)
        logits = self.execute(work)
        rows = [*prefill, *decode]
        tokens, logprobs = self.sampler.sample(logits, [r.slot for r in rows]) if rows else ([], [])
        void = self.sampler.take_failures()  # constrained rows whose grammar failed: their requests end
        result.failed += [(r.seq, void[r.slot]) for r in rows if r.slot in void]
        result.tokens = {r.seq: t for r, t in zip(rows, tokens, strict=True) if r.slot not in void}
        result.logprobs = {r.seq: lp for r, lp in zip(rows, logprobs, strict=True)
                           if lp is not None and r.slot not in void}  # fmt: skip
        return result

    def execute(self, work: StepWork) -> torch.Tensor | None:
        """A step's tensor work on this rank (`StepWork`, in its order); the logits of the pass's rows,
        prefill rows first (None without rows)."""
        for src, dst, length in work.moves:
            self.swap_slots(src, dst, length)
        for slot, blocks, places in work.saves:
            self.save_blocks(slot, blocks, places)
        for src, dst, length in work.copies:
            self.copy_prefix(src, dst, length)
        for dst, places in work.fetches:
            self.fetch_blocks(dst, places)
        return self._logits(work.prefill, work.decode, work.prefill_rows)

    def _batches(
        self, prefill: Sequence[Row], decode: Sequence[Row]
    ) -> tuple[PrefillBatch | None, DecodeBatch | None]:
        """A pass's batches: the prefill rows' tokens padded to a length bucket, written into their slots
        from their start positions, and one token decoded for each decode row over slots `0..batch-1` (a
        batch bucket) and a length bucket of the cache."""
        c, model = self.config, self.model
        prefill_batch = decode_batch = None
        if prefill:
            bucket = pick_bucket(c.prefill_buckets, max(len(r.tokens) for r in prefill))
            # compiled: the rows padded to a batch bucket (a padding row writes only the scratch column, as
            # an idle decode row does) and read through their positions up to a context bucket, static sizes
            rows = len(prefill) if self.compiled is None else pick_bucket(c.batch_buckets, len(prefill))
            padded = torch.zeros((rows, bucket), dtype=torch.long)
            at = torch.full((rows, bucket), c.max_seq_len, dtype=torch.long)
            last, slots = [0] * rows, [prefill[0].slot] * rows
            for i, r in enumerate(prefill):
                padded[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
                at[i, : len(r.tokens)] = torch.arange(r.start, r.start + len(r.tokens))
                last[i], slots[i] = len(r.tokens) - 1, r.slot
            by_positions = self.compiled is not None or any(r.start for r in prefill)
            prefill_batch = PrefillBatch(
                tokens=padded.to(self.device),
                last_index=torch.tensor(last, device=self.device),
                slot_ids=torch.tensor(slots, dtype=torch.long, device=self.device),
                positions=at.to(self.device) if by_positions else None,
            )
            if self.compiled is not None:
                end = max(r.start + len(r.tokens) for r in prefill)
                prefill_batch.context = pick_bucket(c.decode_buckets, end)
        if decode:
            batch = pick_bucket(c.batch_buckets, max(r.slot for r in decode) + 1)
            length = pick_bucket(c.decode_buckets, max(r.start for r in decode) + 1)
            tok = [0] * batch
            pos = [c.max_seq_len] * batch  # idle rows write the scratch column
            for r in decode:
                tok[r.slot], pos[r.slot] = r.tokens[0], r.start
            decode_batch = model.decode_batch(
                torch.tensor(tok, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
                length,
                torch.tensor([r.slot for r in decode], dtype=torch.long, device=self.device),
            )
        return prefill_batch, decode_batch

    def _logits(
        self, prefill_batch: PrefillBatch | None, decode_batch: DecodeBatch | None, prefill_rows: int
    ) -> torch.Tensor | None:
        """One pass's logits, prefill rows first."""
        if prefill_batch is None and decode_batch is None:
            return None
        if self.compiled is not None:  # a graph each (the weights read twice in a step of both)
            prefill_logits = (
                self.compiled.prefill(prefill_batch)[:prefill_rows] if prefill_batch is not None else None
            )
            decode_logits = self.compiled.decode(decode_batch) if decode_batch is not None else None
        else:
            prefill_logits, decode_logits = self.model.forward(prefill_batch, decode_batch)
        logits = [t for t in (prefill_logits, decode_logits) if t is not None]
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel server (nothing otherwise)."""
        if self.ranks is not None:
            self.ranks.stop()

    # ---- moving keys and values ----------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy cache positions [0, length) of slot src into slot dst."""
        cache = self.model.kv_cache  # [layers, 2, slots, kv_heads, positions, head_dim]
        cache[:, :, dst, :, :length] = cache[:, :, src, :, :length]

    @torch.inference_mode()
    def save_blocks(self, slot: int, blocks: Sequence[int], places: Sequence[int]) -> None:
        """Copy whole blocks of a slot's cache (block i: positions [i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))
        into the host pool's places."""
        assert self.host_kv is not None, "a save planned without a host KV store"
        end = (max(blocks) + 1) * BLOCK_SIZE
        # [layers, 2, kv_heads, blocks, BLOCK_SIZE, head_dim], a view of the slot's cache
        by_block = self.model.kv_cache[:, :, slot, :, :end].unflatten(3, (end // BLOCK_SIZE, BLOCK_SIZE))
        chosen = by_block[:, :, :, list(blocks)].permute(3, 0, 1, 2, 4, 5)
        self.host_kv[list(places)] = chosen.to("cpu")

    @torch.inference_mode()
    def fetch_blocks(self, slot: int, places: Sequence[int]) -> None:
        """Copy the host pool's places into blocks 0, 1, ... of a slot's cache."""
        assert self.host_kv is not None, "a fetch planned without a host KV store"
        end = len(places) * BLOCK_SIZE
        by_block = self.model.kv_cache[:, :, slot, :, :end].unflatten(3, (len(places), BLOCK_SIZE))
        by_block.copy_(self.host_kv[list(places)].permute(1, 2, 3, 0, 4, 5).to(self.device))

    @torch.inference_mode()
    def swap_slots(self, a: int, b: int, length: int) -> None:
        """Exchange cache positions [0, length) of slots a and b."""
        cache = self.model.kv_cache
        cache[:, :, [a, b], :, :length] = cache[:, :, [b, a], :, :length]

    @torch.inference_mode()
    def export_kv(
        self, slot: int, length: int, layer: int | None = None, into: ExportMemory | None = None
    ) -> torch.Tensor:
        """Keys and values of positions [0, length) of a slot, contiguous: [layers, 2, kv_heads, length,
        head_dim], or one layer's [2, kv_heads, length, head_dim] (to send layer by layer); copied into the
        memory `into(shape, dtype)` gives where given (a transfer agent's, registered for sending)."""
        kv = self.model.kv_cache
        part = (kv[:, :, slot] if layer is None else kv[layer, :, slot])[..., :length, :]
        if into is None:
            return part.contiguous()
        out = into(tuple(part.shape), part.dtype)
        out.copy_(part)
        return out

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
