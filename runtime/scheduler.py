"""Slot bookkeeping and step planning for continuous batching (pure Python; imports no torch).

A fixed number of slots (Neuron compiles a static batch) hold running sequences. Each step the scheduler
admits waiting requests into the lowest free slots (so active slots stay packed at the front and the decode
batch bucket stays small), grouped into one prefill padded to a length bucket under a token budget, and
decodes every running sequence that already has its first token.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from .sampling_params import InvalidRequest, SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the slot's length
    ABORT = "abort"  # cancelled by the client or the server


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later."""


def queue_full_message(slots: int, max_waiting: int) -> str:
    return f"all {slots} slots are busy and the waiting queue holds {max_waiting} requests; retry later"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and its place in the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the slot leaves
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepPlan:
    """What one engine step runs: a prefill group (may be empty) and the decode rows."""

    prefill: list[Sequence]
    decode: list[Sequence]


class Scheduler:
    """Waiting queue, free slots and running sequences."""

    def __init__(
        self,
        num_slots: int,
        max_seq_len: int,
        prefill_buckets: SequenceOf[int],
        max_prefill_tokens: int | None = None,
        max_waiting: int = 1024,
    ) -> None:
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.prefill_buckets = sorted(prefill_buckets)
        self.max_prompt_len = self.prefill_buckets[-1]
        self.max_prefill_tokens = max(max_prefill_tokens or 2048, self.max_prompt_len)
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free: list[int] = list(range(num_slots))
        heapq.heapify(self._free)

    # ---- admission -----------------------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> int:
        """Refuse requests that can never run; returns the resolved max_tokens."""
        if prompt_len < 1:
            raise InvalidRequest("the prompt is empty; send at least one token", "prompt")
        if prompt_len > self.max_prompt_len:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens; the longest this deployment accepts is "
                f"{self.max_prompt_len} (its largest prefill bucket)",
                "prompt",
            )
        room = self.max_seq_len - prompt_len
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens and leaves no room to generate within the slot length "
                f"{self.max_seq_len}",
                "prompt",
            )
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequest(
                f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the slot length "
                f"{self.max_seq_len}; at most {room} new tokens fit",
                "max_tokens",
            )
        return max_tokens if max_tokens is not None else room

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most: one per slot, plus the waiting queue's bound."""
        return self.num_slots + self.max_waiting

    def add(self, seq: Sequence) -> None:
        """Queue a request; those that free slots will take at the next step do not count as waiting."""
        if len(self.waiting) >= self.max_waiting + len(self._free):
            raise QueueFull(queue_full_message(self.num_slots, self.max_waiting))
        self.waiting.append(seq)

    # ---- planning ------------------------------------------------------------------------------------------

    def _bucket(self, n: int) -> int:
        return next(b for b in self.prefill_buckets if b >= n)

    def _take_slot(self, prompt_ids: list[int], reusable: Callable[[int, list[int]], int] | None) -> int:
        """The free slot whose cache already holds the longest prefix of the prompt; else the lowest."""
        best, best_len = self._free[0], 0
        if reusable is not None:
            for slot in self._free:
                n = reusable(slot, prompt_ids)
                if n > best_len or (n == best_len and n > 0 and slot < best):
                    best, best_len = slot, n
        self._free.remove(best)
        heapq.heapify(self._free)
        return best

    def schedule(self, reusable: Callable[[int, list[int]], int] | None = None) -> StepPlan:
        """Admit waiting sequences into free slots (one padded prefill group) and list the decode rows.

        `reusable(slot, prompt_ids)` says how many prompt tokens a slot's cache already holds; a request goes
        to the free slot that holds the most (prefix reuse), else to the lowest free slot."""
        decode = [s for s in self.running.values() if s.output_ids and not s.finished]
        prefill: list[Sequence] = []
        longest = 0
        while self.waiting and self._free:
            seq = self.waiting[0]
            bucket = self._bucket(max(longest, len(seq.prompt_ids)))
            if prefill and bucket * (len(prefill) + 1) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.slot = self._take_slot(seq.prompt_ids, reusable)
            self.running[seq.slot] = seq
            prefill.append(seq)
            longest = max(longest, len(seq.prompt_ids))
        return StepPlan(prefill=prefill, decode=decode)

    def compact(self, batch_buckets: SequenceOf[int]) -> list[tuple[int, int, Sequence]]:
        """Move running sequences out of slots above the smallest batch bucket that holds them all, into free
        slots below it, so a decode step computes no more rows than its bucket needs (a few requests left in
        high slots would otherwise keep every step at full width). Returns the moves (from, to, sequence),
        already booked here; the caller moves the cache."""
        target = next((b for b in sorted(batch_buckets) if b >= len(self.running)), self.num_slots)
        moves = []
        for src in sorted((s for s in self.running if s >= target), reverse=True):
            dst = self._free[0]
            if dst >= target:
                break
            heapq.heappop(self._free)
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
            heapq.heappush(self._free, src)
            moves.append((src, dst, seq))
        return moves

    # ---- completion ----------------------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence finished and release its slot (idempotent)."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a waiting or running request; returns it, or None when it is unknown or already done."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = FinishReason.ABORT
                return seq
        for seq in self.running.values():
            if seq.request_id == request_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None

    # ---- observation ---------------------------------------------------------------------------------------

    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def used_tokens(self) -> int:
        """Tokens held in the KV cache by running sequences."""
        return sum(s.num_tokens for s in self.running.values())
