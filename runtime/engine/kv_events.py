"""KV-cache events, in vLLM's wire format: which prefix blocks a pod's cache stored or removed, so that a
router knows precisely what each pod holds (pure; msgpack only, no sockets).

The format is vLLM's `--kv-events-config` publisher's (vllm-project/vllm, `vllm/distributed/kv_events.py`):
a batch `KVEventBatch(ts, events, data_parallel_rank)` of tagged events `BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)`, `BlockRemoved(block_hashes,
medium, ...)` and `AllBlocksCleared()`, encoded with msgspec's msgpack encoder. Its encoding has changed
twice: every struct positional (msgspec `array_like`: an event is an array, its class name first) in earlier
versions; events as maps with the class name under "type" inside a positional batch since vllm-project/vllm
#42892 (a batch recorded from vLLM 0.26.0 reads `[ts, [{"type": "BlockStored", ...}], 0]`,
volcano-sh/kthena#1535); the batch a map too at commit 0181ea3 of main. Consumers (llm-d-kv-cache#661) read
fields by name. `decode_batch` reads every form and ignores fields it does not use (`extra_keys`,
`group_idx`, ...); `encode_batch` writes the recorded 0.26.0 form. A block hash is opaque (an int, or bytes in
later versions): a consumer re-derives its own names from `token_ids` and the parent
(`routing/kv_event_index.py`).

The embedded runtime publishes the same events (`BlockLedger`): its cache is one sequence per slot, so the
blocks it holds are the whole blocks (BLOCK_SIZE tokens) of what each slot holds, counted across slots, and
those its host KV store holds (`host_kv_store`, blocks named as here); a block is stored when the pod comes to
hold it (a slot or the store) and removed when neither any slot nor the store holds it any more: a block
evicted from its slot but kept in the store is not removed, one the store drops and no slot holds is.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from neuronfleet.runtime.engine.prefix_cache import common_prefix

if TYPE_CHECKING:
    from neuronfleet.runtime.engine.host_kv_store import HostKvStore

BLOCK_SIZE = 16  # tokens per block: vLLM's default block size


class KvEventError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
_EVENTS: dict[str, type] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                            "AllBlocksCleared": AllBlocksCleared}  # fmt: skip
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    """A batch as vLLM 0.26.0's publisher sends it: [ts, events, data_parallel_rank], each event a map
    tagged by "type"."""
    events = []
    for event in batch.events:
        name = type(event).__name__
        item: dict[str, Any] = {"type": name}
        for key in _FIELDS[name]:
            item[key] = getattr(event, key)
        events.append(item)
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack bytes, in the map or the array form; KvEventError says what is wrong."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise KvEventError(f"a KV event batch must be msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    else:
        raise KvEventError(
            f"a KV event batch is [ts, events, rank] or a map of them, got {type(raw).__name__}"
        )
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KvEventError("a KV event batch needs a number ts and a list of events")
    return EventBatch(float(ts), [_event(e) for e in events], rank)


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        name = raw.get("type")
        values = {k: raw[k] for k in _FIELDS.get(name, ()) if k in raw} if isinstance(name, str) else {}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        name = raw[0]
        values = dict(zip(_FIELDS.get(name, ()), raw[1:], strict=False))
    else:
        raise KvEventError(f"a KV event is a tagged map or array, got {raw!r:.80}")
    if name not in _EVENTS:
        raise KvEventError(f"unknown KV event {name!r}: expected one of {', '.join(_EVENTS)}")
    try:
        event = _EVENTS[name](**values)
    except TypeError as e:
        raise KvEventError(f"{name} lacks a field: {e}") from e
    if isinstance(event, BlockStored) and (
        not isinstance(event.token_ids, list) or not isinstance(event.block_size, int) or event.block_size < 1
        or len(event.token_ids) != len(event.block_hashes) * event.block_size
    ):  # fmt: skip
        raise KvEventError(
            f"BlockStored of {len(event.block_hashes)} blocks of {event.block_size} tokens carries "
            f"{len(event.token_ids) if isinstance(event.token_ids, list) else 'no'} token ids"
        )
    return event


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The embedded runtime's name for a block: a hash of its parent's name and its tokens (63 bits, so
    msgpack writes it as a plain integer)."""
    data = (parent or 0).to_bytes(8, "little") + struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class BlockLedger:
    """Which whole blocks the slots and the host KV store of an embedded engine hold, and the events that say
    what changed."""

    def __init__(self, slots: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.tokens: list[list[int]] = [[] for _ in range(slots)]  # each slot's tokens as last synced
        self.blocks: list[list[int]] = [[] for _ in range(slots)]  # each slot's block names
        self.count: dict[int, int] = {}  # block name -> slots holding it
        self.in_store: set[int] = set()  # the host KV store's blocks as last synced
        self.store_version = -1

    def sync(self, held: Sequence[list[int]], store: HostKvStore | None = None) -> list[Event]:
        """Compare with what each slot holds now (`PrefixCache.held`) and the host KV store; the events of
        the difference: blocks the pod did not hold before (stored, with their parent and tokens), then
        blocks it holds no more (in no slot, not in the store)."""
        before_store = self.in_store
        if store is None:
            self.in_store = set()
        elif store.version != self.store_version:
            self.in_store, self.store_version = set(store.blocks), store.version
        stored: list[BlockStored] = []
        dropped: dict[int, None] = {}  # blocks no slot holds since this sync (in order)
        bs = self.block_size
        for slot, now in enumerate(held):
            before, blocks = self.tokens[slot], self.blocks[slot]
            common = len(before) if now[: len(before)] == before else common_prefix(before, now)
            if common == len(before) and len(now) // bs == len(blocks):
                if len(now) != len(before):
                    self.tokens[slot] = list(now)
                continue  # no whole block came or went
            keep = min(common // bs, len(blocks))
            for name in blocks[keep:]:
                self.count[name] -= 1
                if not self.count[name]:
                    del self.count[name]
                    dropped[name] = None
            del blocks[keep:]
            run: list[int] = []  # a run of blocks the pod did not hold, stored as one event
            for i in range(keep, len(now) // bs + 1):
                chunk = now[i * bs : (i + 1) * bs]
                new = False
                if len(chunk) == bs:
                    name = block_hash(blocks[-1] if blocks else None, chunk)
                    blocks.append(name)
                    self.count[name] = self.count.get(name, 0) + 1
                    if self.count[name] == 1:
                        if name in dropped:  # held again in the same sync: neither removed nor stored
                            del dropped[name]
                        else:
                            new = name not in before_store
                if new:
                    run.append(i)
                elif run:
                    parent = blocks[run[0] - 1] if run[0] else None
                    tokens = now[run[0] * bs : (run[-1] + 1) * bs]
                    stored.append(BlockStored([blocks[j] for j in run], parent, list(tokens), bs))
                    run = []
            self.tokens[slot] = list(now)
        removed = [n for n in dropped if n not in self.in_store]
        if self.in_store is not before_store:
            # the store's part: what it dropped that no slot holds is removed; what it came to hold that the
            # pod did not hold (only where the ledger started after the store) is stored, parents first
            gone = before_store - self.in_store
            removed.extend(n for n in gone if n not in self.count and n not in dropped)
            if store is not None:
                new = (n for n in self.in_store - before_store if n not in self.count and n not in dropped)
                for name in sorted(new, key=lambda n: store.blocks[n].depth):
                    block = store.blocks[name]
                    stored.append(BlockStored([name], block.parent, list(block.tokens), bs))
        events: list[Event] = [*stored]
        if removed:
            events.append(BlockRemoved(removed))
        return events
