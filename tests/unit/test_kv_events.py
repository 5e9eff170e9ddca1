"""KV-cache events: vLLM's wire format read in both of its encodings, the embedded runtime's ledger of what
its slots hold, and a router's index of a pod built from them (pure: no sockets)."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest

from neuronfleet.runtime.engine.kv_events import (
    AllBlocksCleared,
    BlockLedger,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    decode_batch,
    encode_batch,
)
from neuronfleet.runtime.routing.kv_event_index import PodBlocks, _endpoint
from neuronfleet.runtime.routing.prefix_routing import token_blocks

TOKENS = list(range(1000, 1064))  # four blocks of 16


def sha(i: int) -> bytes:  # later vLLM versions' block hashes are bytes (sha256)
    return hashlib.sha256(str(i).encode()).digest()


# a batch recorded from vLLM 0.26.0's publisher (`--kv-events-config '{"enable_kv_cache_events":true,
# "topic":"kv-events"}'`, Qwen3-8B), as decoded in volcano-sh/kthena#1535: a positional batch of tagged maps
RECORDED_HASH = 15760518052499183552
RECORDED_0_26 = msgpack.packb([1789095808.8378847, [{
    "type": "BlockStored", "block_hashes": [RECORDED_HASH], "parent_block_hash": None,
    "token_ids": [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198,
                  151667],
    "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
    "group_idx": 0, "kv_cache_spec_kind": "full_attention"}], 0], use_bin_type=True)  # fmt: skip

# vLLM's batches as its publisher encodes them (vllm/distributed/kv_events.py), written out field by field:
# the map form (msgspec structs without array_like: an event's class name under "type"; at commit 0181ea3)
MAP_FORM = msgpack.packb({
    "ts": 1764800000.5,
    "events": [
        {"type": "BlockStored", "block_hashes": [sha(1), sha(2)], "parent_block_hash": None,
         "token_ids": TOKENS[:32], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [sha(3)], "parent_block_hash": sha(2),
         "token_ids": TOKENS[32:48], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
         "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [sha(3)], "medium": "GPU"},
    ],
    "data_parallel_rank": 0,
}, use_bin_type=True)  # fmt: skip
# the array form of earlier versions (array_like structs: fields in order, an event's class name first)
ARRAY_FORM = msgpack.packb([
    1764800000.5,
    [["BlockStored", [11, 12], None, TOKENS[:32], 16, None, "GPU"],
     ["BlockRemoved", [12], "GPU"],
     ["AllBlocksCleared"]],
    None,
], use_bin_type=True)  # fmt: skip


def test_a_batch_recorded_from_vllm_decodes_and_names_its_block_as_the_router_names_the_prompt():
    batch = decode_batch(RECORDED_0_26)
    (stored,) = batch.events
    assert (batch.data_parallel_rank, stored.block_size, stored.medium) == (0, 16, "GPU")
    pod = PodBlocks()
    pod.apply(batch)
    assert pod.held(token_blocks([*stored.token_ids, 1, 2, 3])) == 1  # a prompt starting with that block
    removed = {"type": "BlockRemoved", "block_hashes": [RECORDED_HASH], "medium": "GPU", "group_idx": 0}
    pod.apply(decode_batch(msgpack.packb([1.0, [removed], 0])))
    assert not pod.names


def test_every_encoding_of_vllms_batches_decodes_to_the_same_events():
    batch = decode_batch(MAP_FORM)
    assert batch.ts == 1764800000.5 and batch.data_parallel_rank == 0
    assert batch.events[0] == BlockStored([sha(1), sha(2)], None, TOKENS[:32], 16, None, "GPU", None)
    assert batch.events[1].parent_block_hash == sha(2) and batch.events[2] == BlockRemoved([sha(3)], "GPU")
    old = decode_batch(ARRAY_FORM)
    stored = BlockStored([11, 12], None, TOKENS[:32], 16, None, "GPU")
    assert old.events == [stored, BlockRemoved([12], "GPU"), AllBlocksCleared()]
    ours = EventBatch(2.0, [BlockStored([5], None, TOKENS[:16], 16), BlockRemoved([5])], 1)
    assert decode_batch(encode_batch(ours)) == ours
    sent = msgpack.unpackb(encode_batch(ours))  # as vLLM 0.26.0 sends it
    assert sent[1][1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": None}


@pytest.mark.parametrize(
    "payload,message",
    [
        (b"\xc1not msgpack", "must be msgpack"),
        (msgpack.packb("text"), r"\[ts, events, rank\] or a map"),
        (msgpack.packb([1.0, [["BlockEvicted", [1]]], None]), "unknown KV event 'BlockEvicted'"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 16, None, None]], None]),
         "1 blocks of 16 tokens carries 3 token ids"),
        (msgpack.packb({"ts": 1.0, "events": [{"type": "BlockRemoved"}]}), "BlockRemoved lacks a field"),
        (msgpack.packb([1.0, [7], None]), "a tagged map or array"),
    ],
)  # fmt: skip
def test_a_payload_that_is_not_a_batch_says_what_is_wrong(payload, message):
    with pytest.raises(KvEventError, match=message):
        decode_batch(payload)


def test_a_pod_index_names_blocks_as_the_router_names_a_prompt_and_follows_removals():
    pod = PodBlocks()
    prompt = token_blocks(TOKENS)  # the router's names of a prompt of these 64 tokens
    pod.apply(decode_batch(MAP_FORM))  # blocks 1-2 stored, 3 stored then removed
    assert pod.held(prompt) == 2
    pod.apply(EventBatch(1.0, [BlockStored([sha(3), sha(4)], sha(2), TOKENS[32:64], 16)]))
    assert pod.held(prompt) == 4
    pod.apply(EventBatch(2.0, [BlockRemoved([sha(2)])]))  # a block in the middle went: the prefix ends there
    assert pod.held(prompt) == 1
    # a block whose parent was never seen stored cannot be named: skipped, not guessed
    pod.apply(EventBatch(3.0, [BlockStored([sha(9)], sha(8), TOKENS[:16], 16)]))
    assert pod.unnamed == 1 and pod.held(prompt) == 1
    pod.apply(EventBatch(4.0, [AllBlocksCleared()]))
    assert pod.held(prompt) == 0 and not pod.names


def test_engine_blocks_of_a_multiple_of_16_tokens_are_several_router_blocks_and_others_are_refused():
    pod = PodBlocks()
    pod.apply(EventBatch(1.0, [BlockStored([b"a", b"b"], None, TOKENS, 32)]))
    assert pod.held(token_blocks(TOKENS)) == 4
    pod.apply(EventBatch(2.0, [BlockRemoved([b"b"])]))
    assert pod.held(token_blocks(TOKENS)) == 2
    pod.apply(EventBatch(3.0, [BlockStored([b"c"], None, TOKENS[:8], 8)]))
    assert pod.refused == 1


def test_the_ledger_says_what_the_slots_came_to_hold_and_stopped_holding():
    ledger = BlockLedger(2, block_size=4)
    events = ledger.sync([list(range(10)), []])  # two whole blocks (the rest is part of a block)
    assert [type(e) for e in events] == [BlockStored] and events[0].token_ids == list(range(8))
    first, second = events[0].block_hashes
    assert ledger.sync([list(range(10)), list(range(9))]) == []  # slot 1 holds the same blocks: no news
    assert ledger.sync([[], list(range(9))]) == []  # slot 0 cleared, slot 1 still holds them
    events = ledger.sync([[], list(range(4)) + [99] * 4])  # the second block changed
    assert events[0] == BlockStored([events[0].block_hashes[0]], first, [99] * 4, 4)
    assert events[1] == BlockRemoved([second])
    # a move exchanging two slots' caches changes nothing the pod holds
    assert ledger.sync([list(range(4)) + [99] * 4, []]) == []


def test_a_router_following_the_ledgers_events_knows_exactly_what_the_slots_hold():
    rng = random.Random(7)
    ledger, pod = BlockLedger(4), PodBlocks()
    held = [[] for _ in range(4)]
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(10, 90))] for _ in range(6)]
    for step in range(300):
        slot = rng.randrange(4)
        op = rng.random()
        if op < 0.4:
            held[slot] = list(rng.choice(prompts))  # a prefill
        elif op < 0.7:
            held[slot].append(rng.randrange(50))  # a decode step
        elif op < 0.8:
            a, b = rng.sample(range(4), 2)  # a move: the two slots' caches exchanged
            held[a], held[b] = held[b], held[a]
        elif op < 0.9:
            held[slot] = held[slot][: rng.randrange(len(held[slot]) + 1)]  # a copy of a shorter prefix
        else:
            held[slot] = []
        pod.apply(decode_batch(encode_batch(EventBatch(float(step), ledger.sync(held)))))
        expected = {name for tokens in held for name in token_blocks(tokens)}
        assert set(pod.names) == expected, step


def test_a_wildcard_endpoint_is_the_pods_own_host():
    assert _endpoint("http://10.0.0.7:8000", "tcp://*:5557") == "tcp://10.0.0.7:5557"
    assert _endpoint("http://10.0.0.7:8000", "tcp://0.0.0.0:5557") == "tcp://10.0.0.7:5557"
    assert _endpoint("http://10.0.0.7:8000", "tcp://10.0.0.8:5557") == "tcp://10.0.0.8:5557"
    assert _endpoint("http://10.0.0.7:8000", "ipc:///tmp/p.sock") == "ipc:///tmp/p.sock"
