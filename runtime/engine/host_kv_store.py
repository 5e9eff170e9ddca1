"""The host KV store: whole KV blocks kept in host memory after their slot is overwritten, so that a prefix
outlives its slot (pure Python; no torch: which block sits where, the runner copies the tensors).

A slot's cache is overwritten when a new prompt takes the slot and reuses less than it holds; before that, the
scheduler saves the slot's whole blocks (`kv_events.BLOCK_SIZE` tokens) here, and a later prompt finds its
longest cached prefix here as well as in the slots, and has it copied back into its slot instead of prefilled.
Blocks are named as the KV events name them (`kv_events.block_hash`: a hash of the parent's name and the
block's tokens, so a name stands for its whole prefix), which lets the events say exactly what the pod holds.

Each block has a place in the runner's host pool (`place`, 0 .. capacity-1). The store is bounded in blocks
(the pool's bytes over one block's bytes). What it keeps when full:
- **Exclusive of the slots.** A chain copied back into a slot leaves the store (`moved_out`; a block another
  stored block still needs stays), and is saved again when that slot is overwritten: the slots and the store
  together hold as many tokens as their sizes, not the same conversations twice.
- **Segmented.** A block saved and not reused since is on probation; a block reused (found here by a prompt,
  or saved again from a slot that held it again, after being moved out or not) is protected, up to
  PROTECTED_SHARE of the store; beyond, one protected block goes back to probation. Probation is evicted
  first, so a burst of prompts seen once passes through it and leaves the prefixes in use (the Linux page
  cache's active and inactive lists are the same idea).
- **Idle chains first, then trimmed evenly.** Within a segment, a block untouched for `idle_seconds` (a user
  who left; the routers forget a prompt after as long) is dropped first, least recent first. Otherwise the
  deepest block goes (ties: the least recent), so that under pressure every conversation in use loses the end
  of its history rather than some losing all of it: the same tokens are kept, but each conversation that comes
  back finds the start of its history, and the typical turn, not only some, is faster. Plain LRU on
  conversations that come back after a while, more of them than the store holds, keeps exactly the ones that
  are not coming back next. A chain is always dropped from its tail, its head (a system prompt other chains
  share) last: a block whose children are stored is never evicted, since they would be unreachable.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuronfleet.runtime.engine.kv_events import BLOCK_SIZE, block_hash


@dataclass(frozen=True)
class StoredBlock:
    """One block in the store: its place in the host pool, its parent's name (None: the first block) and
    its tokens."""

    place: int
    parent: int | None
    tokens: tuple[int, ...]
    depth: int  # its index in its sequence (0: the first block)


def block_names(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """The names of the whole blocks of a token sequence, chained as the KV events name them."""
    names: list[int] = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        names.append(block_hash(names[-1] if names else None, token_ids[i : i + block_size]))
    return names


PROTECTED_SHARE = 0.8  # of the store's blocks, at most this share protected (the rest is probation's)
IDLE_SECONDS = 600.0  # a block untouched this long is evicted before any other (the routers' index forgets
# a prompt after 10 minutes too: runtime/routing/prefix_routing.py)


class _Segment:
    """Blocks in least-recently-used order (`order`, least recent first: name -> (depth, touch)) and a heap
    that gives the deepest (then least recent) of them: entries (-depth, touch, name), stale ones skipped."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.heap: list[tuple[int, int, int]] = []

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, name: int) -> bool:
        return name in self.order

    def __iter__(self):
        return iter(self.order)

    def add(self, name: int, depth: int, touch: int) -> None:
        """The block is this segment's most recent."""
        self.order.pop(name, None)
        self.order[name] = (depth, touch)
        heapq.heappush(self.heap, (-depth, touch, name))
        if len(self.heap) > 2 * len(self.order) + 64:  # stale entries outnumber the live ones: rebuild
            self.heap = [(-d, t, n) for n, (d, t) in self.order.items()]
            heapq.heapify(self.heap)

    def remove(self, name: int) -> None:
        del self.order[name]

    def deepest(self, eligible: Callable[[int], bool]) -> int | None:
        """The deepest block (ties: the least recent) for which `eligible` holds; None if none does."""
        aside, found = [], None
        while self.heap:
            entry = heapq.heappop(self.heap)
            depth, touch, name = -entry[0], entry[1], entry[2]
            if self.order.get(name) != (depth, touch):
                continue  # stale: touched again, moved to the other segment or dropped since
            aside.append(entry)
            if eligible(name):
                found = name
                break
        for entry in aside:
            if entry[2] != found:
                heapq.heappush(self.heap, entry)
        return found


class HostKvStore:
    """Blocks by name (`blocks`), at most `capacity` of them, in two segments: `probation` and `protected`."""

    def __init__(
        self,
        capacity: int,
        block_size: int = BLOCK_SIZE,
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a host KV store holds at least 1 block, got {capacity}")
        self.capacity = capacity
        self.block_size = block_size
        self.idle_seconds = idle_seconds
        self._clock = clock
        self.blocks: dict[int, StoredBlock] = {}
        self.probation = _Segment()
        self.protected = _Segment()
        self.protected_capacity = int(capacity * PROTECTED_SHARE)
        self._children: dict[int, int] = {}  # name -> children in the store
        self._touched: dict[int, float] = {}  # name -> the clock at its last use
        self._touches = 0  # uses counted, block by block (the segments' order of recency)
        self._moved_out: OrderedDict[int, None] = OrderedDict()  # names moved into slots (reused when back)
        self._free = list(range(capacity - 1, -1, -1))  # places in the pool, the lowest taken first
        self.version = 0  # counts changes of what the store holds (a KV event ledger re-reads it on change)

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, name: int) -> bool:
        return name in self.blocks

    def cached(self, names: Sequence[int]) -> int:
        """How many leading blocks of a chain the store holds (no use is recorded)."""
        n = 0
        while n < len(names) and names[n] in self.blocks:
            n += 1
        return n

    def _touch(self, names: Sequence[int], segment: _Segment) -> None:
        """Blocks of one chain are used now: the segment's most recent, tail first, head last (a parent is
        never less recent than its children, so the least recent block of a segment is a leaf there)."""
        now = self._clock()
        for name in reversed(names):
            self._touches += 1
            self._touched[name] = now
            other = self.probation if segment is self.protected else self.protected
            if name in other:
                other.remove(name)
            segment.add(name, self.blocks[name].depth, self._touches)

    def use(self, names: Sequence[int]) -> list[int]:
        """A chain's blocks (all held) are reused: protected, the most recent; their places, in order."""
        self._touch(names, self.protected)
        keep = set(names)
        while len(self.protected) > self.protected_capacity:
            name = self._victim(self.protected, keep)
            if name is None:  # (every protected block has children or is this chain's)
                name = next(iter(self.protected))
            depth, touch = self.protected.order[name]
            self.protected.remove(name)
            self.probation.add(name, depth, touch)
        return [self.blocks[name].place for name in names]

    def moved_out(self, names: Sequence[int]) -> list[int]:
        """A chain just fetched (`use`) now sits in a slot: its blocks leave the store from its tail, up to
        the first that another stored block needs (a shared head stays). Their names."""
        gone = []
        for name in reversed(names):
            if name not in self.blocks or self._children.get(name):
                break
            self._drop(name)
            self._moved_out[name] = None
            gone.append(name)
        while len(self._moved_out) > self.capacity:
            self._moved_out.popitem(last=False)
        if gone:
            self.version += 1
        return gone

    def save(self, token_ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Keep the whole blocks of a sequence (at most the store's capacity, from its head): the blocks it
        lacks are given places, evicting other chains' blocks; those it holds already, or that were moved out
        into a slot, are reused (protected), the others go on probation.

        Returns (which blocks of the sequence the caller copies in, their places, the names evicted)."""
        bs = self.block_size
        names = block_names(token_ids, bs)[: self.capacity]
        chain = set(names)
        fresh = [i for i, name in enumerate(names) if name not in self.blocks]
        evicted: list[int] = []
        while len(self._free) < len(fresh):
            evicted.append(self._evict(chain))
        places = []
        for i in fresh:
            parent = names[i - 1] if i else None
            place = self._free.pop()
            self.blocks[names[i]] = StoredBlock(place, parent, tuple(token_ids[i * bs : (i + 1) * bs]), i)
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
            places.append(place)
        held = len(names) - len(fresh)  # fresh blocks come after those held: a chain is kept from its head
        back = held
        while back < len(names) and names[back] in self._moved_out:
            back += 1  # a block moved out into a slot and saved back: it was reused
        for name in names:
            self._moved_out.pop(name, None)
        self._touch(names[back:], self.probation)
        if back:
            self.use(names[:back])
        if fresh or evicted:
            self.version += 1
        return fresh, places, evicted

    def _victim(self, segment: _Segment, keep: set[int]) -> int | None:
        """The block to go from a segment: an idle leaf (the least recent first), else the deepest leaf (ties:
        the least recent); none of `keep`. None when every block has children or is kept."""

        def evictable(name: int) -> bool:
            return name not in keep and not self._children.get(name)

        idle_before = self._clock() - self.idle_seconds
        for name in segment:
            if self._touched[name] > idle_before:
                break
            if evictable(name):
                return name
        return segment.deepest(evictable)

    def _evict(self, keep: set[int]) -> int:
        """Drop a block not in `keep`, probation's before protected's (`_victim`); its name."""
        for segment in (self.probation, self.protected):
            name = self._victim(segment, keep)
            if name is not None:
                self._drop(name)
                return name
        raise AssertionError("a full host KV store with no block to evict outside the chain saved")

    def _drop(self, name: int) -> None:
        (self.probation if name in self.probation else self.protected).remove(name)
        del self._touched[name]
        block = self.blocks.pop(name)
        if block.parent is not None:
            left = self._children[block.parent] - 1
            if left:
                self._children[block.parent] = left
            else:
                del self._children[block.parent]
        self._free.append(block.place)

    def clear(self) -> list[int]:
        """Drop every block (what the pool holds is unknown: a step failed midway); their names."""
        names = list(self.blocks)
        self.blocks.clear()
        self.probation, self.protected = _Segment(), _Segment()
        self._children.clear()
        self._touched.clear()
        self._moved_out.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        if names:
            self.version += 1
        return names
