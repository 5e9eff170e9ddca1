"""A request's text as its tokens arrive: incremental detokenization and stop strings, whose matched text is
never emitted (held back while the text may still be starting one). The engine and the router both use it,
so a stream that the router resumes on another decode pod reads exactly like one that never broke.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuronfleet.runtime.serving.backend import FinishReason
from neuronfleet.runtime.serving.tokenizer import IncrementalDetokenizer, Tokenizer


class TextOutput:
    """The text deltas of one request's generated tokens."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = tuple(stop)
        self.held = ""

    def add(self, token: int) -> tuple[str, bool]:
        """The text this token makes ready to send, and whether it completed a stop string (the text is then
        what came before the stop string; the request is over)."""
        text = self.held + self.detok.add(token)
        self.held = ""
        if self.stop:
            cut = min((i for s in self.stop if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                return text[:cut], True
            keep = stop_prefix_len(text, self.stop)
            if keep:
                text, self.held = text[:-keep], text[-keep:]
        return text, False

    def flush(self) -> str:
        """The text held back, when the request ends for another reason (EOS, length)."""
        out, self.held = self.held, ""
        return out

    def accept(self, token: int, *, eos: bool, last: bool) -> tuple[str, FinishReason | None]:
        """One generated token as the client sees it, and whether it ends the request: an EOS token (`eos`:
        one that is not ignored) or a completed stop string as STOP, the length limit (`last`) as LENGTH."""
        if eos:
            return self.flush(), FinishReason.STOP
        text, stopped = self.add(token)
        if stopped:
            return text, FinishReason.STOP
        if last:
            return text + self.flush(), FinishReason.LENGTH
        return text, None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (to hold back)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
