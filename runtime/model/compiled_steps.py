"""The model's passes as compiled graphs of static shapes (`torch.compile`, torch 2.13.0): a prefill-only pass
per (rows, length, context) bucket and a decode-only pass per (batch, length) bucket, each one whole graph
(`fullgraph=True`: a break is an error, not a fallback to Python) specialized to its shapes (`dynamic=False`),
the KV cache written in place, nothing read back to the host inside (a prefill after a cached prefix reads the
cache up to its context bucket, a size given, not the positions' largest, read from them). The functions are
the ones the runtime runs op by op (`LlamaModel.prefill_logits`, `decode_logits`); a backend compiles them:
Inductor on CPU, `aot_eager` (traced through AOTAutograd and run as traced: the graphs a device backend would
be given, without a compiler), or any `torch.compile` backend given as a callable (the tests' recorder).

The model must hold plain float weights (`LlamaModel(pack=False)`): oneDNN's packed weights, fbgemm's float16
weights and the int8/int4 kernels are operators of torch's CPU only, which a device graph cannot hold and
Inductor does not need; a model without them is refused saying so (`refusal`).

torch.compile keeps one compiled entry per input signature of a function, at most `recompile_limit` (8 by
default in torch 2.13.0) before it stops compiling: the limit is raised to the graphs the bucket tables make.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from neuronfleet.runtime.model.llama import DecodeBatch, Linear, LlamaModel, PrefillBatch

BACKENDS = ("inductor", "aot_eager")  # by name; "off" runs the passes op by op

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
        self.buckets: set[tuple] = set()  # the buckets compiled so far: ("decode", batch, length) and
        # ("prefill", rows, length, context or 0[, last tokens a row])

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
        if bucket in self.buckets:
            return graph(*inputs)
        start = time.monotonic()
        out = graph(*inputs)
        self.buckets.add(bucket)
        log.info("compiled the %s graph of bucket %s in %.1f s (%d graphs so far)", bucket[0],
                 bucket[1:], time.monotonic() - start, len(self.buckets))  # fmt: skip
        return out

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
