"""The host KV store: whole KV blocks kept in host memory after their slot is overwritten, so that a prefix
outlives its slot (pure Python; no torch: which block sits where, the runner copies the tensors).

A slot's cache is overwritten when a new prompt takes the slot and reuses less than it holds; before that, the
scheduler saves the slot's whole blocks (`kv_events.BLOCK_SIZE` tokens) here, and a later prompt finds its
longest cached prefix here as well as in the slots, and has it copied back into its slot instead of prefilled.
Blocks are named as the KV events name them (`kv_events.block_hash`: a hash of the parent's name and the
block's tokens, so a name stands for its whole prefix), which lets the events say exactly what the pod holds.

Each block has a place in the runner's host pool (`place`, 0 .. capacity-1). The store is bounded in blocks
(the pool's bytes over one block's bytes) and is a segmented LRU: a block saved and not reused since is on
probation; a block reused (found here by a prompt, or saved again from a slot that held it again) is
protected, up to PROTECTED_SHARE of the store (beyond, the least recently used protected block goes back to
probation, as its most recent). Eviction takes probation's least recently used block first, then
protected's (the two lists of the Linux page cache, active and inactive, are the same idea). Under plain
LRU a burst of prompts seen once, or more conversations than the store holds going round, push out every
prefix in use; here a prefix that came back once stays protected while what was seen once passes through
probation. Within each order a use or a save touches a chain from its tail to its head (the head last, most
recent), which keeps every parent more recent than its children; the least recently used block is then a
leaf, and a chain is dropped from its tail, its shared head (a system prompt) last. Dropping a whole chain
at once would throw away the head that other conversations share; dropping a head first would leave its
children unreachable, taking memory for nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
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


class HostKvStore:
    """Blocks by name (`blocks`), at most `capacity` of them, in two least-recently-used orders: `probation`
    and `protected` (least recent first)."""

    def __init__(self, capacity: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"a host KV store holds at least 1 block, got {capacity}")
        self.capacity = capacity
        self.block_size = block_size
        self.blocks: dict[int, StoredBlock] = {}
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.protected_capacity = int(capacity * PROTECTED_SHARE)
        self._children: dict[int, int] = {}  # name -> children in the store
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

    def use(self, names: Sequence[int]) -> list[int]:
        """A chain's blocks (all held) are reused: protected, touched tail first, head last; their places, in
        order."""
        for name in reversed(names):
            self.probation.pop(name, None)
            self.protected[name] = None
            self.protected.move_to_end(name)
        while len(self.protected) > self.protected_capacity:
            name, _ = self.protected.popitem(last=False)
            self.probation[name] = None
        return [self.blocks[name].place for name in names]

    def save(self, token_ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Keep the whole blocks of a sequence (at most the store's capacity, from its head): the blocks it
        lacks are given places on probation, evicting the least recently used blocks of other chains; those
        it holds already are reused (protected).

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
        for name in reversed(names[held:]):
            self.probation[name] = None
        if held:
            self.use(names[:held])
        if fresh or evicted:
            self.version += 1
        return fresh, places, evicted

    def _evict(self, keep: set[int]) -> int:
        """Drop the least recently used leaf not in `keep`, probation's before protected's; its name."""
        for order in (self.probation, self.protected):
            name = next((n for n in order if n not in keep and not self._children.get(n)), None)
            if name is not None:
                break
        else:
            raise AssertionError("a full host KV store with no block to evict outside the chain saved")
        del order[name]
        block = self.blocks.pop(name)
        if block.parent is not None:
            left = self._children[block.parent] - 1
            if left:
                self._children[block.parent] = left
            else:
                del self._children[block.parent]
        self._free.append(block.place)
        return name

    def clear(self) -> list[int]:
        """Drop every block (what the pool holds is unknown: a step failed midway); their names."""
        names = list(self.blocks)
        self.blocks.clear()
        self.probation.clear()
        self.protected.clear()
        self._children.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        if names:
            self.version += 1
        return names
