"""Sampling the next token of each slot's request (torch): greedy, or temperature with top-k and top-p from
the request's own seeded generator, and the repetition penalty over its prompt and output; the sampled
token's log probabilities where its request asks for them; a constrained request's tokens masked to what its
grammar allows (`grammar_masks`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from neuronfleet.runtime.engine.grammar_masks import GrammarVocabulary
from neuronfleet.runtime.serving.backend import TokenLogprobs
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance


@dataclass
class SlotSampler:
    """Per-slot sampling state: the request's parameters and its own (seeded, reproducible) generator."""

    params: SamplingParams
    generator: torch.Generator | None = None
    history: list[int] = field(default_factory=list)  # prompt + output ids, for the repetition penalty
    matcher: llguidance.LLMatcher | None = None  # where a constrained request's answer stands in its grammar


class Sampler:
    """The sampling state of every slot that holds a request."""

    def __init__(self, grammar: GrammarVocabulary | None = None) -> None:
        self.slots: dict[int, SlotSampler] = {}
        self.grammar = grammar  # the vocabulary constrained requests' grammars read (None: none can run)
        self.failures: dict[int, Exception] = {}  # slot -> why its last sample is void (`take_failures`)

    def start(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """Set up a slot's sampler before its prefill."""
        generator = None
        if not params.greedy:
            generator = torch.Generator(device="cpu")
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        history = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        matcher = None
        if params.constraint is not None:
            if self.grammar is None:
                raise InvalidRequest("this engine was started without a grammar vocabulary: constrained "
                                     "output is not available", params.constraint.field)  # fmt: skip
            matcher = self.grammar.matcher(params.constraint)
        self.slots[slot] = SlotSampler(params=params, generator=generator, history=history, matcher=matcher)

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self.failures.pop(slot, None)

    def take_failures(self) -> dict[int, Exception]:
        """The slots whose last sample is void, and why (then forgotten)."""
        failures, self.failures = self.failures, {}
        return failures

    def move(self, src: int, dst: int) -> None:
        """A running request moved from slot src to slot dst."""
        sampler = self.slots.pop(src, None)
        if sampler is not None:
            self.slots[dst] = sampler

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, slots: Sequence[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One next token per row of `logits` [N, vocab], row i belonging to `slots[i]`; and, for each row
        whose request asked for them, the token's log probabilities (`TokenLogprobs`, from the raw logits:
        before the penalty and the sampling settings change them, after a grammar's mask, as vLLM's
        `raw_logprobs`), else None. A constrained row whose grammar fails (it allows no token, or refuses the
        token) is void: its slot's error waits in `failures`."""
        samplers = [self.slots[s] for s in slots]
        constrained = [i for i, s in enumerate(samplers) if s.matcher is not None]
        if constrained:
            for i in constrained:
                matcher = samplers[i].matcher
                assert matcher is not None
                if matcher.is_error():
                    self.failures[slots[i]] = RuntimeError(f"the grammar failed: {matcher.get_error()}")
            live = [i for i in constrained if slots[i] not in self.failures]
            assert self.grammar is not None
            if live:
                self.grammar.mask(logits, live, [samplers[i].matcher for i in live])  # type: ignore[misc]
        asked = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
        raw = logits[asked].float().log_softmax(-1) if asked else None
        for row, s in enumerate(samplers):
            if s.params.repetition_penalty != 1.0 and s.history:
                ids = torch.tensor(sorted(set(s.history)), dtype=torch.long, device=logits.device)
                seen = logits[row, ids]
                pen = s.params.repetition_penalty
                logits[row, ids] = torch.where(seen > 0, seen / pen, seen * pen)
        out = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(samplers) if not s.params.greedy]
        if rows:
            out[rows] = self._sample_rows(logits[rows], [samplers[i] for i in rows])
        tokens = out.tolist()
        for row, s in enumerate(samplers):
            if s.params.repetition_penalty != 1.0:
                s.history.append(tokens[row])
            if (
                s.matcher is not None
                and slots[row] not in self.failures
                and not s.matcher.consume_token(tokens[row])
            ):
                self.failures[slots[row]] = RuntimeError(f"the grammar refused token {tokens[row]}: "
                                                         f"{s.matcher.get_error()}")  # fmt: skip
        logprobs: list[TokenLogprobs | None] = [None] * len(samplers)
        for k, row in enumerate(asked):
            assert raw is not None
            top: tuple[tuple[int, float], ...] = ()
            if samplers[row].params.logprobs:
                values, ids = raw[k].topk(samplers[row].params.logprobs)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs[row] = TokenLogprobs(float(raw[k, tokens[row]]), top)
        return tokens, logprobs

    @staticmethod
    def _sample_rows(logits: torch.Tensor, samplers: list[SlotSampler]) -> torch.Tensor:
        """Sample one token per row [R, vocab] by inverse CDF: one uniform draw from each request's own
        generator, so a seeded request samples the same tokens whatever else runs in its batch."""
        temps = torch.tensor([s.params.temperature for s in samplers], device=logits.device)
        logits = logits.float() / temps[:, None]
        for row, s in enumerate(samplers):
            p = s.params
            if 0 < p.top_k < logits.shape[-1]:
                kth = torch.topk(logits[row], p.top_k).values[-1]
                logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(logits[row], descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
                logits[row] = logits[row].masked_fill(
                    torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
                )
        cdf = logits.softmax(-1).cumsum(-1)
        uniform = torch.cat([torch.rand(1, generator=s.generator) for s in samplers]).to(cdf.device)
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
        return picks.clamp_(max=logits.shape[-1] - 1)
