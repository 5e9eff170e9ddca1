"""Slot bookkeeping and step planning for continuous batching (pure Python; imports no torch).

A fixed number of slots (Neuron compiles a static batch) hold running sequences. Each step the scheduler
admits waiting requests into the lowest free slots (so active slots stay packed at the front and the decode
batch bucket stays small), grouped into one prefill padded to a length bucket under a token budget, and
decodes every running sequence that already has its first token. It also owns which tokens each slot's cache
holds (`prefix_cache`), so it sends a prompt to the free slot that holds most of it, and holds back a prompt
that shares a prefix no cache holds with one of the group: a step later it copies what that one computed.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from .backend import FinishReason
from .config import RuntimeConfig, pick_bucket
from .errors import QueueFull, queue_full_message
from .prefix_cache import MIN_PREFIX_REUSE, PrefixCache, common_prefix
from .sampling_params import SamplingParams


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

    def __init__(self, config: RuntimeConfig) -> None:
        self.num_slots = config.slots
        self.prefill_buckets = config.prefill_buckets
        self.max_prefill_tokens = config.max_prefill_tokens
        self.max_waiting = config.max_waiting
        self.batch_buckets = config.batch_buckets
        self.prefixes = PrefixCache(config.slots, config.prefix_reuse)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free: list[int] = list(range(config.slots))
        heapq.heapify(self._free)

    # ---- admission -----------------------------------------------------------------------------------------

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

    def _take_slot(self, prompt_ids: list[int]) -> int:
        """The free slot whose cache already holds the longest prefix of the prompt; else the lowest."""
        best, best_len = self._free[0], 0
        for slot in self._free:
            n = self.prefixes.reusable(slot, prompt_ids)
            if n > best_len or (n == best_len and n > 0 and slot < best):
                best, best_len = slot, n
        self._free.remove(best)
        heapq.heapify(self._free)
        return best

    def schedule(self) -> StepPlan:
        """Admit waiting sequences into free slots (one padded prefill group) and list the decode rows.

        A request goes to the free slot whose cache holds the most of its prompt (prefix reuse), else to the
        lowest free slot. Admission stops, in arrival order, at a prompt that would compute a prefix a prompt
        of the group computes (`_computed_twice`)."""
        decode = [s for s in self.running.values() if s.output_ids and not s.finished]
        prefill: list[Sequence] = []
        longest = 0
        while self.waiting and self._free:
            seq = self.waiting[0]
            if self._computed_twice(seq.prompt_ids, prefill):
                break  # it waits a step and copies that prefix from the slot this step writes it into
            bucket = pick_bucket(self.prefill_buckets, max(longest, len(seq.prompt_ids)))
            if prefill and bucket * (len(prefill) + 1) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.slot = self._take_slot(seq.prompt_ids)
            self.running[seq.slot] = seq
            prefill.append(seq)
            longest = max(longest, len(seq.prompt_ids))
        return StepPlan(prefill=prefill, decode=decode)

    def _computed_twice(self, prompt_ids: list[int], group: list[Sequence]) -> bool:
        """Whether admitting the prompt into this group would compute a prefix twice: it starts like a prompt
        of the group by MIN_PREFIX_REUSE tokens or more beyond what any slot's cache holds of it (a burst of
        chat requests to a fresh engine, all with one system prompt). Admitted a step later, it copies that
        prefix from the slot the group's prompt went into. Never without prefix reuse (nothing is copied)."""
        if not (group and self.prefixes.enabled):
            return False
        shared = max(common_prefix(prompt_ids, s.prompt_ids) for s in group)
        shared = min(shared, len(prompt_ids) - 1)  # the last token is always computed
        if shared < MIN_PREFIX_REUSE:
            return False
        cached = max(self.prefixes.reusable(slot, prompt_ids) for slot in range(self.num_slots))
        return shared - cached >= MIN_PREFIX_REUSE

    def compact(self) -> list[tuple[int, int, Sequence]]:
        """Move running sequences out of slots above the smallest batch bucket that holds them all, into free
        slots below it, so a decode step computes no more rows than its bucket needs (a few requests left in
        high slots would otherwise keep every step at full width). Returns the moves (from, to, sequence),
        already booked here (the destination holds what the source held); the caller moves the cache."""
        target = next((b for b in self.batch_buckets if b >= len(self.running)), self.num_slots)
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
            self.prefixes.copied(src, dst, seq.num_tokens)
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
