"""Slot bookkeeping and step planning for continuous batching (pure Python; imports no torch).

A fixed number of slots (Neuron compiles a static batch) hold running sequences. Each step `schedule()`
returns exactly what the model runner runs (`StepPlan`): the sampling state of slots released since the last
step, requests moved down into lower free slots (so a decode step's batch bucket stays small), requests
admitted into free slots (one prefill group padded to a length bucket under a token budget), the cached
prefixes they copy from other slots, the prefill rows, and the decode rows (every running sequence's next
token, and each admitted prompt with one token left to compute). After the runner has run it,
`postprocess()` appends the new tokens, books what each slot's cache now holds (`prefix_cache`) and frees
the slots of finished requests. Because the scheduler owns that bookkeeping it sends a prompt to the free
slot that holds most of it, and holds back a prompt that shares a prefix no cache holds with one of the
group: a step later it copies what that one computed.

What a free slot holds is kept as long as it can be (a conversation's history between its turns): a prompt
that reuses nothing takes the free slot whose cache is worth least (empty, else the one freed longest ago),
and a running request moved down swaps caches with its destination instead of overwriting it. With a host KV
store (`host_kv_store`), a slot about to be overwritten has its whole blocks saved there first (`Save`), and a
prompt whose longest cached prefix is in the store rather than in a slot has it copied back (`Fetch`).

The scheduler also measures how long requests hold their slots (`admission.ServiceTimes`), from which a new
request's expected wait is estimated, and says which waiting requests are turned away: those that have waited
longer than the bound (`overdue`), and while draining those it could not finish before the deadline
(`hand_backs`).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.engine.config import RuntimeConfig, pick_bucket
from neuronfleet.runtime.engine.host_kv_store import HostKvStore, block_names
from neuronfleet.runtime.engine.prefix_cache import FROM_STORE, MIN_PREFIX_REUSE, PrefixCache, common_prefix
from neuronfleet.runtime.serving.backend import FinishReason
from neuronfleet.runtime.serving.errors import QueueFull, queue_full_message
from neuronfleet.runtime.serving.sampling_params import SamplingParams


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
    slot_time: float | None = None  # when it took its slot

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, eq=False)
class Row:
    """What one sequence computes in a pass: `tokens` at positions `start`, `start + 1`, ... of its slot,
    whose cache holds positions [0, start) when the pass runs. One token is a decode row (a running request's
    last token, or an admitted prompt whose every token but the last is cached); more is a prefill row."""

    seq: Sequence
    tokens: list[int]
    start: int

    @property
    def slot(self) -> int:
        assert self.seq.slot is not None
        return self.seq.slot


@dataclass(frozen=True)
class Copy:
    """Before the pass: cache positions [0, length) of slot `src` copied into slot `dst` (an admitted prompt's
    cached prefix held by another slot)."""

    seq: Sequence
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Save:
    """Before the copies: whole blocks `blocks` of slot `slot` (block i: cache positions [i * B, (i + 1) * B),
    B the store's block size) copied into the host pool's `places` (a slot about to be overwritten keeps its
    blocks in the host KV store)."""

    slot: int
    blocks: tuple[int, ...]
    places: tuple[int, ...]


@dataclass(frozen=True)
class Fetch:
    """After the copies, before the pass: the host pool's `places` copied into blocks 0, 1, ... of slot `dst`
    (an admitted prompt's cached prefix found in the host KV store)."""

    seq: Sequence
    dst: int
    places: tuple[int, ...]


@dataclass(frozen=True)
class Move:
    """Before the pass: a running request moved from slot `src` to the free slot `dst` with its sampling
    state, the two slots' cache positions [0, length) exchanged (what `dst` held for prefix reuse goes to
    `src`, which is free from then on)."""

    src: int
    dst: int
    length: int


@dataclass
class StepPlan:
    """Exactly what one step runs, in this order: release, move, admit (start sampling), save (slots into the
    host KV store), copy (slot to slot), fetch (store into slots), one pass over the prefill and decode
    rows."""

    released: list[int] = field(default_factory=list)  # slots whose sampling state goes
    moves: list[Move] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # their sampling state starts
    copies: list[Copy] = field(default_factory=list)  # in the group's order, all before the pass writes
    saves: list[Save] = field(default_factory=list)  # before the copies
    fetches: list[Fetch] = field(default_factory=list)  # after the copies
    prefill: list[Row] = field(default_factory=list)
    decode: list[Row] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        return [*self.prefill, *self.decode]

    def reused_tokens(self, ran: Collection[Sequence]) -> int:
        """Prompt tokens the admitted requests among `ran` did not compute (found in a slot's cache)."""
        admitted = set(self.admitted)
        return sum(r.start for r in self.rows if r.seq in admitted and r.seq in ran)


@dataclass
class PromptRows:
    """What admitting a group of prompts into their slots runs (`prompt_rows`)."""

    copies: list[Copy] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    prefill: list[Row] = field(default_factory=list)
    decode: list[Row] = field(default_factory=list)


def saves_before_admission(prefixes: PrefixCache, store: HostKvStore, admitted: list[Sequence]) -> list[Save]:
    """The whole blocks of the admitted prompts' slots that their prompts would overwrite (what a slot holds
    beyond its common prefix with the prompt spans a whole block), saved into the store first: the slot's
    whole chain (a block is useless without its parents), each block the store lacks."""
    saves = []
    bs = store.block_size
    for seq in admitted:
        held = prefixes.held[seq.slot]
        if len(held) // bs > common_prefix(held, seq.prompt_ids) // bs:
            fresh, places, _ = store.save(held)
            if fresh:
                saves.append(Save(seq.slot, tuple(fresh), tuple(places)))
    return saves


def stored_prefix(store: HostKvStore | None, prompt_ids: list[int]) -> tuple[int, list[int]]:
    """How many leading tokens of a prompt the host KV store can give (its whole blocks, less the prompt's
    last token, none below MIN_PREFIX_REUSE), and the names of the blocks that hold them."""
    if store is None:
        return 0, []
    names = block_names(prompt_ids, store.block_size)
    k = store.cached(names)
    n = min(k * store.block_size, len(prompt_ids) - 1)
    if n < MIN_PREFIX_REUSE:
        return 0, []
    return n, names[: -(-n // store.block_size)]


def prompt_rows(
    prefixes: PrefixCache, admitted: list[Sequence], store: HostKvStore | None = None
) -> PromptRows:
    """The saves, copies, fetches, prefill rows and decode rows of prompts admitted into their slots: what a
    slot would lose of its cache goes to the host KV store first (`saves_before_admission`); each prompt
    reuses the longest prefix a slot's cache or the store holds (`PrefixCache.plan`: copied first when that
    is another slot or the store) and computes the rest; a rest of one token is a decode row (the same
    arithmetic as prefilling one token after a prefix, and a step that admits only such prompts is then a
    decode-only pass, replayed from the recorded graph)."""
    out = PromptRows()
    if store is not None and prefixes.enabled:
        out.saves = saves_before_admission(prefixes, store, admitted)
    else:
        store = None
    stored = [stored_prefix(store, s.prompt_ids) for s in admitted]
    plan = prefixes.plan([s.slot for s in admitted], [s.prompt_ids for s in admitted], [n for n, _ in stored])
    fetched = []
    for seq, (source, n), (_, names) in zip(admitted, plan, stored, strict=True):
        if source == FROM_STORE:
            assert store is not None
            out.fetches.append(Fetch(seq, seq.slot, tuple(store.use(names))))
            fetched.append(names)
        elif source != seq.slot and n:
            out.copies.append(Copy(seq, source, seq.slot, n))
        row = Row(seq, seq.prompt_ids[n:], n)
        (out.decode if len(row.tokens) == 1 else out.prefill).append(row)
    for names in fetched:  # in their slots now (the store is exclusive of them); their places are not
        store.moved_out(names)  # given again before this step's copies have read them: no save follows
    return out


class Scheduler:
    """Waiting queue, free slots and running sequences."""

    def __init__(self, config: RuntimeConfig, store: HostKvStore | None = None) -> None:
        self.num_slots = config.slots
        self.prefill_buckets = config.prefill_buckets
        self.max_prefill_tokens = config.max_prefill_tokens
        self.max_waiting = config.max_waiting
        self.batch_buckets = config.batch_buckets
        self.prefixes = PrefixCache(config.slots, config.prefix_reuse)
        self.store = store  # the host KV store, where there is one
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free: list[int] = list(range(config.slots))
        heapq.heapify(self._free)
        self._freed_at: list[int] = [0] * config.slots  # per slot, when it was last freed (finish count)
        self._finished = 0
        self._released: list[int] = []  # slots freed since the last plan: their sampling state goes
        self.max_queue_wait = config.max_queue_wait
        self.service = admission.ServiceTimes()  # slot seconds of the requests served lately
        # the service time to estimate waits with (`estimate`), read by the event loop's admission
        self.slot_seconds: float | None = None
        self.slot_spread = 0.0  # their standard deviation
        self.drain_deadline: float | None = None  # (monotonic) set when the server drains

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
        slot = self._slot_for(prompt_ids)
        self._free.remove(slot)
        heapq.heapify(self._free)
        return slot

    def _slot_for(self, prompt_ids: list[int]) -> int:
        """The free slot whose cache already holds the longest prefix of the prompt (the lower of equals);
        else the one whose cache is worth least (`_cheapest_free`)."""
        best, best_len = -1, 0
        for slot in self._free:
            n = self.prefixes.reusable(slot, prompt_ids)
            if n > best_len or (n == best_len and n > 0 and slot < best):
                best, best_len = slot, n
        return best if best >= 0 else self._cheapest_free()

    def _cheapest_free(self) -> int:
        """The free slot whose cache is worth least to keep: one that holds nothing, else the one freed
        longest ago (its prefix the least likely to be asked for again); the lowest of equals. A high slot
        costs nothing lasting: a move down exchanges caches (`_compact`)."""
        return min(self._free, key=lambda s: (bool(self.prefixes.held[s]), self._freed_at[s], s))

    def schedule(self) -> StepPlan:
        """Plan the next step: releases, moves down, admissions (one padded prefill group), copies, rows.

        A request goes to the free slot whose cache holds the most of its prompt (prefix reuse), else to the
        lowest free slot. Admission stops, in arrival order, at a prompt that would compute a prefix a prompt
        of the group computes (`_computed_twice`)."""
        released, self._released = self._released, []
        moves = self._compact()
        running = [
            Row(s, [s.output_ids[-1]], s.num_tokens - 1)
            for s in self.running.values()
            if s.output_ids and not s.finished
        ]
        admitted = self._admit()
        rows = prompt_rows(self.prefixes, admitted, self.store)
        return StepPlan(
            released, moves, admitted, rows.copies, rows.saves, rows.fetches, rows.prefill,
            [*running, *rows.decode],
        )  # fmt: skip

    def plan_export(self, seq: Sequence) -> StepPlan:
        """A prefill pod's step for one prompt, run alone: it borrows a free slot as an admission would take
        one (reusing any prefix a slot holds), which stays free; its sampling state goes at the next step."""
        if not self._free:
            raise QueueFull(queue_full_message(self.num_slots, self.max_waiting))
        seq.slot = self._slot_for(seq.prompt_ids)
        rows = prompt_rows(self.prefixes, [seq], self.store)
        self._released.append(seq.slot)
        self._finished += 1
        self._freed_at[seq.slot] = self._finished
        return StepPlan(
            admitted=[seq], copies=rows.copies, saves=rows.saves, fetches=rows.fetches,
            prefill=rows.prefill, decode=rows.decode,
        )  # fmt: skip

    def _admit(self) -> list[Sequence]:
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
            seq.slot_time = time.monotonic()
            self.running[seq.slot] = seq
            prefill.append(seq)
            longest = max(longest, len(seq.prompt_ids))
        return prefill

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
        cached = max(cached, stored_prefix(self.store, prompt_ids)[0])
        return shared - cached >= MIN_PREFIX_REUSE

    def _compact(self) -> list[Move]:
        """Move running sequences out of slots above the smallest batch bucket that holds them all, into free
        slots below it, so a decode step computes no more rows than its bucket needs (a few requests left in
        high slots would otherwise keep every step at full width). The two slots' caches are exchanged, so
        the prefix the destination held stays (in the source, free now). Booked here."""
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
            length = max(seq.num_tokens, len(self.prefixes.held[dst]))
            self.prefixes.swapped(src, dst, length)
            self._freed_at[src] = self._freed_at[dst]
            moves.append(Move(src, dst, length))
        return moves

    # ---- completion ----------------------------------------------------------------------------------------

    def postprocess(
        self, plan: StepPlan, tokens: Mapping[Sequence, int], finished: Mapping[Sequence, FinishReason]
    ) -> None:
        """After the runner ran `plan`: book what each row wrote into its slot's cache, append each new token
        (`tokens`: per sequence that ran), stamp the admitted ones' first token, and free the slots of the
        `finished` sequences (those that stopped, failed or never ran)."""
        now, admitted = time.monotonic(), set(plan.admitted)
        for row in plan.rows:
            seq = row.seq
            if seq not in tokens:
                continue
            if seq in admitted:
                self.prefixes.holds(row.slot, seq.prompt_ids)
                seq.first_token_time = now
            else:
                self.prefixes.wrote(row.slot, row.tokens[0], row.start)
            seq.output_ids.append(tokens[seq])
        for seq, reason in finished.items():
            self.finish(seq, reason)

    def lost_cache(self) -> None:
        """A pass failed: what each slot's cache holds is unknown now, and what the host pool holds (the
        step's saves may not have run)."""
        self.prefixes.forget_all()
        if self.store is not None:
            self.store.clear()

    def slot_for_import(self, token_ids: list[int]) -> tuple[int, Save | None] | None:
        """The highest free slot (low ones stay free for new requests), booked as holding `token_ids`, whose
        keys and values the caller places there, after saving what the slot held into the host KV store
        (the Save to run first, if any); None when no slot is free."""
        if not self._free:
            return None
        slot = max(self._free)
        seq = Sequence("import", token_ids, SamplingParams(), max_tokens=1, slot=slot)
        saves = saves_before_admission(self.prefixes, self.store, [seq]) if self.store is not None else []
        self.prefixes.holds(slot, token_ids)
        return slot, (saves[0] if saves else None)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence finished and release its slot (idempotent)."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            if reason is not FinishReason.ABORT and seq.slot_time is not None:  # served: measured
                self.service.served(time.monotonic() - seq.slot_time)
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)
            self._released.append(seq.slot)
            self._finished += 1
            self._freed_at[seq.slot] = self._finished

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

    # ---- admission and the drain (engine.admission) ------------------------------------------------------

    def estimate(self, now: float) -> float | None:
        """The service time to estimate waits with, now (`admission.slot_seconds`), kept in `slot_seconds`."""
        held = [now - s.slot_time for s in self.running.values() if s.slot_time is not None]
        self.slot_seconds = admission.slot_seconds(self.service.mean(), held)
        self.slot_spread = self.service.spread()
        return self.slot_seconds

    def overdue(self, now: float, within: float = 0.0) -> list[Sequence]:
        """Waiting requests that will have waited longer than `max_queue_wait` `within` seconds from now (the
        next step's time: those the free slots take at the next step excepted, the others wait for it at
        least): taken out of the queue, finished (ABORT), returned. None without a bound."""
        if self.max_queue_wait <= 0:
            return []
        behind = list(self.waiting)[len(self._free) :]
        late = [s for s in behind if now + within - s.arrival_time > self.max_queue_wait]
        return self._turn_away(late)

    def hand_backs(self, now: float) -> list[Sequence]:
        """While draining: the waiting requests that would not finish before `drain_deadline`
        (`admission.drain_keeps`), taken out of the queue and returned (the last ones in it)."""
        if self.drain_deadline is None or not self.waiting:
            return []
        seconds = self.estimate(now)
        held = [now - s.slot_time for s in self.running.values() if s.slot_time is not None]
        remaining = [max(0.0, (seconds or 0.0) - h) for h in held]
        keep = admission.drain_keeps(
            remaining, len(self.waiting), self.num_slots, seconds, self.drain_deadline - now
        )
        return self._turn_away(list(self.waiting)[keep:])

    def _turn_away(self, seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            self.waiting.remove(seq)
            seq.finish_reason = FinishReason.ABORT
        return seqs

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
