"""The model's passes as compiled graphs of static shapes (`torch.compile`, torch 2.13.0): a prefill-only pass
per (rows, length, context) bucket and a decode-only pass per (batch, length) bucket, each one whole graph
(`fullgraph=True`: a break is an error, not a fallback to Python) specialized to its shapes (`dynamic=False`),
the KV cache written in place, nothing read back to the host inside (a prefill after a cached prefix reads the
cache up to its context bucket, a size given, not the positions' largest, read from them). The functions are
the ones the runtime runs op by op (`LlamaModel.prefill_logits`, `decode_logits`); a backend compiles them:
Inductor on CPU, `neuron` on a Trainium device (TorchNeuron: `neuron_device`), `aot_eager` (traced through
AOTAutograd and run as traced: the graphs a device backend is given, without a compiler), or any
`torch.compile` backend given as a callable (the tests' recorder).

A server that must not compile (a Neuron pod, whose compile Job warmed every bucket into the NEFF cache) runs
every bucket once as it starts (`warm`) and then holds still (`freeze`): a bucket not warmed runs op by op,
said once, and a warmed bucket whose graph would be compiled again raises instead (torch's
`fail_on_recompile` stance), so nothing is ever compiled while serving.

The model must hold plain float weights (`LlamaModel(pack=False)`): oneDNN's packed weights, fbgemm's float16
weights and the int8/int4 kernels are operators of torch's CPU only, which a device graph cannot hold and
Inductor does not need; a model without them is refused saying so (`refusal`).

torch.compile keeps one compiled entry per input signature of a function, at most `recompile_limit` (8 by
default in torch 2.13.0) before it stops compiling: the limit is raised to the graphs the bucket tables make.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from neuronfleet.runtime.model.llama import DecodeBatch, Linear, LlamaModel, PrefillBatch

BACKENDS = ("inductor", "aot_eager", "neuron")  # by name; "off" runs the passes op by op

Bucket = tuple  # ("decode", batch, length) or ("prefill", rows, length, context[, last tokens a row])

log = logging.getLogger(__name__)


def refusal(model: LlamaModel) -> str | None:
    """Why this model's passes cannot be compiled, saying what works; None when they can."""
    w = model.weights
    if w.quantization != "none":
        return (
            f"the compiled passes take float weights; {w.quantization} weights run on torch's CPU kernels "
            "only: serve this model with --compiled-steps off, or its float weights"
        )
    linears = [*model._linears(), w.lm_head]
    if any(not isinstance(x, Linear) or x.packed is not None for x in linears):
        return (
            "the compiled passes take plain float weights (loaded with pack=False); float16 weights under "
            "float32 activations run on fbgemm's CPU kernels only: serve with --dtype bfloat16 or float32 "
            "weights, or with --compiled-steps off"
        )
    return None


class CompiledSteps:
    """A model's prefill-only and decode-only passes compiled by `backend` (a name of BACKENDS, or a
    `torch.compile` backend), a graph per bucket as each bucket is first run; `graphs`: how many the bucket
    tables can make (each function's compile limit)."""

    def __init__(
        self, model: LlamaModel, backend: str | Callable[..., Any], graphs: int = 64, ahead: Any = None
    ) -> None:
        """`ahead`: the packages the compile Job made (`compiled_ahead.AheadGraphs`); with them nothing is
        compiled here, and a bucket without one runs op by op."""
        why = refusal(model)
        if why is not None:
            raise ValueError(why)
        if isinstance(backend, str) and backend not in BACKENDS:
            raise ValueError(f"compiled steps' backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.model = model
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, graphs)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * graphs)
        options: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": backend}
        self._decode = torch.compile(model.decode_logits, **options)
        self._prefill = torch.compile(model.prefill_logits, **options)
        self.ahead = ahead
        self.buckets: set[Bucket] = set()  # the buckets compiled so far (`Bucket`)
        self.frozen = False  # compiles nothing more (`freeze`)
        self.unwarmed: set[Bucket] = set()  # buckets run op by op once frozen (each said once)

    def _run(
        self,
        bucket: tuple,
        graph: Callable[..., torch.Tensor],
        op_by_op: Callable[..., torch.Tensor],
        *inputs: Any,
    ) -> torch.Tensor:
        """A bucket's graph on its inputs; its first run compiles it, said in the log with its time. With
        packages made ahead: the bucket's package, or the pass op by op where there is none."""
        if self.ahead is not None:
            out = self.ahead.run(bucket, inputs)
            return op_by_op(*inputs) if out is None else out
        if self.frozen:
            if bucket in self.buckets:
                with torch.compiler.set_stance("fail_on_recompile"):  # a graph made again raises
                    return graph(*inputs)
            if bucket not in self.unwarmed:
                self.unwarmed.add(bucket)
                log.warning("no graph was warmed for the %s bucket %s: it runs op by op (this server "
                            "compiles nothing)", bucket[0], bucket[1:])  # fmt: skip
            return op_by_op(*inputs)
        if bucket in self.buckets:
            return graph(*inputs)
        start = time.monotonic()
        out = graph(*inputs)
        self.buckets.add(bucket)
        log.info("compiled the %s graph of bucket %s in %.1f s (%d graphs so far)", bucket[0],
                 bucket[1:], time.monotonic() - start, len(self.buckets))  # fmt: skip
        return out

    def warm(self, table: Iterable[Bucket], progress: Callable[[int, int], None] | None = None) -> None:
        """Run every bucket of `table` once on inputs of its shapes (`sample_inputs`: they write only the
        cache's scratch column), compiling its graph, or loading it from the backend's cache (TorchNeuron's
        NEFF cache); `progress(done, total)` after each. The inputs are made as the runner makes a step's,
        outside inference mode (an inference tensor would make the graph's guards expect one, and the
        runner's first step of each bucket compile it again), and run in it, as `decode` and `prefill` do."""
        table = list(table)
        for done, bucket in enumerate(table, 1):
            with torch.inference_mode(False):
                inputs = sample_inputs(self.model, bucket)
            with torch.inference_mode():
                if bucket[0] == "decode":
                    self._run(bucket, self._decode, self.model.decode_logits, *inputs)
                else:
                    self._run(bucket, self._prefill, self.model.prefill_logits, *inputs)
            if progress is not None:
                progress(done, len(table))

    def freeze(self) -> None:
        """Compile nothing from now on (`_run`)."""
        self.frozen = True

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """The logits of the batch's wanted rows (all when `rows` is None), float32: the graph computes
        every row of its batch bucket (a static shape), the rows are picked after it."""
        bucket = ("decode", batch.tokens.shape[0], batch.mask.shape[-1])
        logits = self._run(bucket, self._decode, self.model.decode_logits, *batch.inputs())
        return logits if batch.rows is None else logits.index_select(0, batch.rows)

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        """The logits of each prompt's last tokens, float32 (`LlamaModel.prefill_logits`); a group after a
        cached prefix names its context bucket (`PrefillBatch.context`)."""
        if batch.positions is not None and batch.context is None:
            raise ValueError("a compiled prefill after a cached prefix needs its context bucket")
        bucket = ("prefill", *batch.tokens.shape, batch.context or 0, *batch.last_index.shape[1:])
        inputs = (batch.tokens, batch.last_index, batch.slot_ids, batch.positions, batch.context)
        return self._run(bucket, self._prefill, self.model.prefill_logits, *inputs)


def sample_inputs(model: LlamaModel, bucket: Bucket) -> tuple[Any, ...]:
    """A pass's inputs of a bucket's shapes (their values do not matter to a graph specialized to shapes):
    every position the scratch column, so running it writes no slot's keys and values."""
    dev, scratch = model.device, model.max_seq_len
    if bucket[0] == "decode":
        _, batch, length = bucket
        positions = torch.full((batch,), scratch, dtype=torch.long, device=dev)
        return model.decode_batch(torch.zeros(batch, dtype=torch.long, device=dev), positions, length,
                                  None).inputs()  # fmt: skip
    _, rows, length, context = bucket[:4]
    zeros = torch.zeros(rows, dtype=torch.long, device=dev)
    tokens = torch.zeros((rows, length), dtype=torch.long, device=dev)
    positions = torch.full((rows, length), scratch, dtype=torch.long, device=dev)
    return tokens, zeros, zeros.clone(), positions, context
