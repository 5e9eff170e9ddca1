"""Constrained decoding's device side (llguidance and torch): the model's vocabulary as the grammar engine
reads it, one matcher per constrained request, and the step's token masks laid over the logits of the
constrained rows only, so constrained and free requests share a step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import torch

from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.output_constraints import OutputConstraint, grammar_error
from neuronfleet.runtime.serving.tokenizer import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarVocabulary:
    """The model's tokens for llguidance (built from the tokenizer's own tokenizer.json on the first
    constrained request, not at start: about a quarter of a second for a 49k vocabulary), its end-of-sequence
    ids (what the grammar allows once it is complete) and the logits' width."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int], vocab_size: int) -> None:
        self._tokenizer, self.eos_ids, self.vocab_size = tokenizer, sorted(eos_ids), vocab_size
        self._tokens: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokens(self) -> llguidance.LLTokenizer:
        if self._tokens is None:
            self._tokens = llguidance.LLTokenizer(
                self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._tokens

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A matcher at the start of the answer (past `constraint.prefix`, the text it already holds);
        InvalidRequest naming the constraint's field if the grammar or the prefix is refused."""
        matcher = llguidance.LLMatcher(self.tokens, constraint.grammar, log_level=0)
        if constraint.prefix and not matcher.is_error():
            matcher.consume_tokens(self.tokens.tokenize_str(constraint.prefix))
            if matcher.is_error():
                raise InvalidRequest(f"the text the answer continues does not match {constraint.field}",
                                     constraint.field)  # fmt: skip
        if matcher.is_error():
            raise InvalidRequest(
                f"{constraint.field}: {grammar_error(matcher.get_error())}", constraint.field
            )
        return matcher

    def mask(
        self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[llguidance.LLMatcher]
    ) -> None:
        """Set to -inf, in place, each of `rows` of `logits` [N, vocab] where its matcher does not allow the
        token (the masks are computed in parallel, outside the GIL)."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(rows)
        )
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, : logits.shape[-1]].bool()
        index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
