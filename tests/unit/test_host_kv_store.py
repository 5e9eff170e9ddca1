"""The host KV store: blocks kept after their slot is overwritten, segmented (what was reused is protected
from a burst of prompts seen once), exclusive of the slots (a chain fetched into a slot leaves it and comes
back protected), idle chains dropped first, then every chain trimmed from its tail evenly rather than some
dropped whole, tails before heads, its bounds and links held under random use; keyed as the KV events name
blocks; the scheduler's plan saving a slot before a prompt overwrites it and fetching a conversation's prefix
back; the KV events counting the store's blocks as the pod's; and an engine whose answers with the store are
those it gives prefilling everything."""

from __future__ import annotations

import random

import pytest
from support import make_tiny_llama

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.host_kv_store import HostKvStore, block_names
from neuronfleet.runtime.engine.kv_events import (
    BLOCK_SIZE,
    BlockLedger,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_hash,
    decode_batch,
    encode_batch,
)
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.engine.scheduler import Scheduler, Sequence
from neuronfleet.runtime.routing.kv_event_index import PodBlocks
from neuronfleet.runtime.routing.prefix_routing import token_blocks
from neuronfleet.runtime.serving.backend import FinishReason
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer


def seq_of(n_blocks: int, start: int, size: int = 4) -> list[int]:
    return list(range(start, start + n_blocks * size))


def test_blocks_are_named_as_the_kv_events_name_them_chained_from_the_first():
    tokens = list(range(100, 140))  # two whole blocks of 16 and a part
    first = block_hash(None, tokens[:16])
    assert block_names(tokens) == [first, block_hash(first, tokens[16:32])]
    ledger = BlockLedger(1)
    (stored,) = ledger.sync([tokens])
    assert stored.block_hashes == block_names(tokens)


def test_the_least_recently_used_chains_tail_goes_first_and_its_shared_head_last():
    store = HostKvStore(capacity=4, block_size=4)
    a = seq_of(3, 0)  # blocks a0 a1 a2
    fresh, places, evicted = store.save(a)
    assert (fresh, places, evicted) == ([0, 1, 2], [0, 1, 2], [])
    a_names = block_names(a, 4)
    b = a[:4] + seq_of(2, 500)  # shares a's head, then two blocks of its own
    fresh, places, evicted = store.save(b)
    assert fresh == [1, 2] and evicted == [a_names[2]]  # a's tail, not the shared head
    assert sorted(places) == [2, 3]  # the evicted block's place is taken again
    assert store.cached(a_names) == 2 and store.cached(block_names(b, 4)) == 3
    store.use(a_names[:2])  # a's prefix used again: b's own blocks are now the least recent
    c = seq_of(2, 900)
    fresh, _, evicted = store.save(c)
    b_names = block_names(b, 4)
    assert evicted == [b_names[2], b_names[1]]  # b's tail, then its next block; the head stays
    assert store.cached(a_names) == 2 and store.cached(b_names) == 1 and len(store) == 4


def test_a_reused_prefix_outlives_a_burst_of_prompts_seen_once():
    """A conversation whose prefix came back (fetched from the store) is protected: a burst of one-off
    prompts, together larger than the store, passes through probation and leaves it. Under plain LRU the
    burst would have pushed it out."""
    store = HostKvStore(capacity=10, block_size=4)
    convo = seq_of(4, 0)
    names = block_names(convo, 4)
    store.save(convo)
    store.use(names[: store.cached(names)])  # its next turn found it here
    assert set(store.protected) == set(names)
    for k in range(6):  # 6 one-off prompts of 2 blocks: 12 blocks through the 6 left
        store.save(seq_of(2, 1000 + 100 * k))
    assert store.cached(names) == 4 and len(store) == 10
    # a one-off prompt saved again from a slot that held it again is reused too: protected
    again = seq_of(2, 1000 + 100 * 5)
    store.save(again)
    assert set(block_names(again, 4)) <= set(store.protected)


def test_protected_blocks_are_bounded_and_the_least_recent_goes_back_to_probation():
    store = HostKvStore(capacity=10, block_size=4)  # at most 8 protected
    chains = [seq_of(3, 100 * k) for k in range(3)]
    for chain in chains:
        store.save(chain)
        store.use(block_names(chain, 4))
    assert len(store.protected) == 8 and len(store.probation) == 1
    # the first chain's tail went back to probation: the least recently used protected block
    assert list(store.probation) == [block_names(chains[0], 4)[2]]
    store.save(seq_of(2, 9000))  # 1 free place, 2 needed: probation's block is evicted first
    assert store.cached(block_names(chains[0], 4)) == 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_under_pressure_every_conversation_loses_the_end_of_its_history_not_some_all_of_it():
    """Three conversations of 4 blocks in a store of 12: a new one of 3 blocks takes the deepest block of
    each (plain LRU would take 3 of the least recently used conversation's 4); each keeps its start, so each
    finds most of its history when it comes back. Then the deepest again: the oldest of them first."""
    store = HostKvStore(capacity=12, block_size=4)
    chains = [block_names(seq_of(4, 100 * k), 4) for k in range(3)]
    for k in range(3):
        store.save(seq_of(4, 100 * k))
    _, _, evicted = store.save(seq_of(3, 900))
    assert evicted == [c[3] for c in chains]  # depth 3, least recent first
    assert [store.cached(c) for c in chains] == [3, 3, 3]
    _, _, evicted = store.save(seq_of(1, 800))
    assert evicted == [chains[0][2]]


def test_a_conversation_idle_past_the_horizon_is_dropped_whole_before_others_are_trimmed():
    clock = Clock()
    store = HostKvStore(capacity=8, block_size=4, idle_seconds=600, clock=clock)
    gone, live = seq_of(4, 0), seq_of(4, 100)
    store.save(gone)
    clock.now += 500
    store.save(live)
    clock.now += 200  # `gone` is 700 s idle, `live` 200 s
    store.save(seq_of(4, 300))
    assert store.cached(block_names(gone, 4)) == 0 and store.cached(block_names(live, 4)) == 4
    clock.now += 100  # nothing idle past 600 s now: the deepest blocks go, one from each
    store.save(seq_of(2, 500))
    assert store.cached(block_names(live, 4)) == 3 and store.cached(block_names(seq_of(4, 300), 4)) == 3


def test_a_chain_fetched_into_a_slot_leaves_the_store_and_comes_back_protected():
    """Exclusive of the slots: the fetched blocks' places are free for others while the slot holds them; a
    head another stored chain needs stays; saved again from the slot, the chain is protected (reused)."""
    store = HostKvStore(capacity=8, block_size=4)
    a = seq_of(4, 0)
    b = a[:8] + seq_of(1, 500)  # shares a's first two blocks
    store.save(a)
    store.save(b)
    a_names = block_names(a, 4)
    store.use(a_names)
    gone = store.moved_out(a_names)
    assert gone == [a_names[3], a_names[2]]  # a's own blocks; the head b needs stays
    assert len(store) == 3 and store.cached(a_names) == 2 and len(store._free) == 5
    version = store.version
    fresh, _, _ = store.save([*a, 1, 2, 3, 4])  # the slot is overwritten: a and its new block saved back
    assert fresh == [2, 3, 4] and store.version > version
    assert set(a_names) <= set(store.protected)  # reused, not seen once
    assert block_names([*a, 1, 2, 3, 4], 4)[4] in store.probation  # its new block: seen once


def test_the_store_keeps_its_bounds_and_links_under_random_use():
    rng, clock = random.Random(5), Clock()
    store = HostKvStore(capacity=24, block_size=4, idle_seconds=50, clock=clock)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(4, 60))] for _ in range(30)]
    for _ in range(3000):
        clock.now += rng.random() * 2
        tokens = rng.choice(prompts)
        if rng.random() < 0.5:
            fresh, places, evicted = store.save(tokens)
            assert len(places) == len(fresh) and not set(evicted) & set(block_names(tokens, 4)[:24])
            assert len(set(places)) == len(places)
        else:
            names = block_names(tokens, 4)
            store.use(names[: store.cached(names)])
            if rng.random() < 0.5:
                store.moved_out(names[: store.cached(names)])
        assert len(store) <= 24 and len(store.protected) <= store.protected_capacity
        assert len(store.blocks) + len(store._free) == 24 and len(store._moved_out) <= 24
        for segment in (store.probation, store.protected):  # stale heap entries stay bounded
            assert len(segment.heap) <= 2 * store.capacity + 65
        assert set(store.probation) | set(store.protected) == set(store.blocks)
        assert not set(store.probation) & set(store.protected)
        assert len({b.place for b in store.blocks.values()}) == len(store)  # no place given twice
        assert all(b.parent is None or b.parent in store for b in store.blocks.values())  # no orphan


def test_a_sequence_longer_than_the_store_keeps_its_head_and_saving_again_copies_nothing():
    store = HostKvStore(capacity=2, block_size=4)
    tokens = [*seq_of(5, 0), 7, 7]
    fresh, _, _ = store.save(tokens)
    assert fresh == [0, 1] and len(store) == 2
    assert store.save(tokens) == ([], [], [])
    assert store.cached(block_names(tokens, 4)) == 2
    with pytest.raises(ValueError, match="at least 1 block"):
        HostKvStore(capacity=0)


def test_the_store_is_bounded_by_the_bytes_given_over_the_bytes_of_a_block():
    config = RuntimeConfig(slots=2, max_seq_len=64)
    assert config.host_kv_bytes(1000) == 2 * 64 * 1000  # by default: as many bytes as the slots' cache
    assert RuntimeConfig(host_kv_cache_bytes=0).host_kv_bytes(1000) == 0
    with pytest.raises(ValueError, match="0 \\(no host KV store\\) or more bytes"):
        RuntimeConfig(host_kv_cache_bytes=-1)


def scheduler(slots: int, store_blocks: int) -> Scheduler:
    config = RuntimeConfig(slots=slots, max_seq_len=256, prefill_buckets=[16, 32, 64, 128])
    return Scheduler(config, HostKvStore(store_blocks) if store_blocks else None)


def serve(s: Scheduler, prompt: list[int], rid: str, answer: int = 3):
    """One request through the scheduler alone: its admission plan, then `answer` tokens and finished."""
    seq = Sequence(rid, prompt, SamplingParams(), max_tokens=answer)
    s.add(seq)
    plan = s.schedule()
    s.postprocess(plan, {seq: 1}, {})
    for _ in range(answer - 1):
        step = s.schedule()
        s.postprocess(step, {seq: 1}, {})
    s.finish(seq, FinishReason.LENGTH)
    s.schedule()
    return plan, seq


def test_a_conversation_evicted_from_its_slot_is_saved_then_fetched_back_instead_of_prefilled():
    s = scheduler(slots=1, store_blocks=64)
    turn1 = list(range(10, 60))  # 50 tokens: 3 whole blocks
    plan, first = serve(s, turn1, "a1")
    assert not plan.saves and not plan.fetches
    history = [*turn1, *first.output_ids]
    other = list(range(300, 340))
    plan, _ = serve(s, other, "b")  # takes the only slot: what it held goes to the store first
    (save,) = plan.saves
    assert save.slot == 0 and save.blocks == (0, 1, 2) and not plan.fetches
    turn2 = [*history, *range(70, 80)]
    plan, _ = serve(s, turn2, "a2")
    (fetch,) = plan.fetches
    assert fetch.dst == 0 and len(fetch.places) == 3 and not plan.copies
    (row,) = plan.prefill
    assert row.start == 3 * BLOCK_SIZE and row.tokens == turn2[48:]  # only the rest is computed
    assert plan.saves and plan.saves[0].blocks == (0, 1)  # "b"'s two blocks saved in turn


def test_a_slot_that_holds_more_of_the_prompt_than_the_store_is_read_in_place_and_nothing_is_saved():
    s = scheduler(slots=1, store_blocks=64)
    turn1 = list(range(10, 60))
    _, first = serve(s, turn1, "a1")
    plan, _ = serve(s, [*turn1, *first.output_ids, 5, 6, 7], "a2")
    assert not plan.saves and not plan.fetches and plan.prefill[0].start == len(turn1) + 2


def test_without_a_store_the_evicted_conversation_is_prefilled_whole():
    s = scheduler(slots=1, store_blocks=0)
    turn1 = list(range(10, 60))
    _, first = serve(s, turn1, "a1")
    serve(s, list(range(300, 340)), "b")
    plan, _ = serve(s, [*turn1, *first.output_ids, 70], "a2")
    assert not plan.saves and not plan.fetches and plan.prefill[0].start == 0


def test_a_block_kept_in_the_store_is_not_removed_and_one_the_store_drops_is():
    ledger, store = BlockLedger(1, block_size=4), HostKvStore(capacity=2, block_size=4)
    a = seq_of(2, 0)
    (stored,) = ledger.sync([a], store)
    a0, a1 = stored.block_hashes
    store.save(a)  # the slot is about to be overwritten: its blocks go to the store
    b = seq_of(1, 100)
    events = ledger.sync([b], store)
    assert [type(e) for e in events] == [BlockStored]  # b's block stored; a's kept: no removal
    store.save(b)  # the store has room for 2: a's tail goes
    events = ledger.sync([[]], store)
    assert events == [BlockRemoved([a1])]
    fresh_a = a[:4] + [9] * 4  # a's head again from a slot: the pod held it (in the store), so no event
    events = ledger.sync([fresh_a], store)
    assert events[0] == BlockStored([block_hash(a0, [9] * 4)], a0, [9] * 4, 4) and len(events) == 1


def test_a_router_following_the_ledger_knows_exactly_what_the_slots_and_the_store_hold():
    rng = random.Random(11)
    store = HostKvStore(capacity=12)
    ledger, pod = BlockLedger(3), PodBlocks()
    held: list[list[int]] = [[] for _ in range(3)]
    prompts = [[rng.randrange(40) for _ in range(rng.randrange(16, 100))] for _ in range(8)]
    for step in range(400):
        slot = rng.randrange(3)
        op = rng.random()
        if op < 0.45:
            store.save(held[slot])  # what the engine does before a prompt overwrites the slot
            held[slot] = list(rng.choice(prompts))
        elif op < 0.75:
            held[slot].append(rng.randrange(40))
        elif op < 0.85:  # a fetch: the stored prefix copied into the slot, which holds it now
            prompt = rng.choice(prompts)
            store.save(held[slot])  # as the scheduler plans it: the slot saved, then the store read
            names = block_names(prompt)[: store.cached(block_names(prompt))]
            if names:
                store.use(names)
                store.moved_out(names)
                held[slot] = prompt[: len(names) * BLOCK_SIZE]
        else:
            held[slot] = []
        pod.apply(decode_batch(encode_batch(EventBatch(float(step), ledger.sync(held, store)))))
        expected = {name for tokens in held for name in token_blocks(tokens)}
        expected |= {token_blocks(stored_prefix(store, name))[-1] for name in store.blocks}
        assert set(pod.names) == expected, step


def stored_prefix(store: HostKvStore, name: int) -> list[int]:
    """The tokens of a stored block and of all its parents, from the first."""
    chunks = []
    while name is not None:
        chunks.append(store.blocks[name].tokens)
        name = store.blocks[name].parent
    return [t for chunk in reversed(chunks) for t in chunk]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine(folder, tokenizer_dir, **config) -> Engine:
    settings = dict(slots=1, max_seq_len=256, prefill_buckets=[16, 32, 64, 128], dtype="float32")
    runner = ModelRunner(folder, RuntimeConfig(**settings, **config))
    return Engine(runner, Tokenizer(tokenizer_dir, runner.model_config.eos_token_ids))


def test_an_answer_from_the_stores_prefix_equals_the_answer_that_prefills_it(tiny_llama, smollm2_dir):
    """Greedy, float32, one slot: a conversation's second turn after another prompt took its slot."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    rng = random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(70)]
    answers = {}
    for store_bytes in (None, 0):
        e = engine(tiny_llama, smollm2_dir, host_kv_cache_bytes=store_bytes)
        reused: list[int] = []
        e.step_observers.append(lambda report, reused=reused: reused.append(report.reused_prompt_tokens))
        first = e.generate([[*system, 7, 8, 9]], params)[0].token_ids
        e.generate([[rng.randrange(3, 500) for _ in range(40)]], params)  # takes the slot
        second = e.generate([[*system, 7, 8, 9, *first, 11, 12]], params)[0].token_ids
        answers[store_bytes] = (first, second, sum(reused))
    (first, second, reused), (first0, second0, reused0) = answers[None], answers[0]
    assert (first, second) == (first0, second0)
    assert reused0 == 0 and reused == 5 * BLOCK_SIZE  # 85 tokens of history: 5 whole blocks from the store


def test_an_engines_events_keep_what_its_store_keeps_and_remove_what_it_drops(tiny_llama, smollm2_dir):
    """A conversation's slot taken by another prompt: with room in the store none of its blocks is removed;
    with a store of 2 blocks its head stays and its other blocks are removed."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    rng = random.Random(5)
    conversation = [rng.randrange(3, 500) for _ in range(73)]
    other = [rng.randrange(3, 500) for _ in range(40)]
    removed = {}
    for store_bytes in (None, 2 * BLOCK_SIZE * 512):  # the tiny model: 512 bytes of keys and values a token
        e = engine(tiny_llama, smollm2_dir, host_kv_cache_bytes=store_bytes)
        events: list = []
        e.publish_kv_events(events.extend)
        answer = e.generate([conversation], params)[0].token_ids
        held = block_names([*conversation, *answer][: len(conversation) + len(answer) - 1])
        assert [n for ev in events if isinstance(ev, BlockStored) for n in ev.block_hashes] == held
        events.clear()
        e.generate([other], params)
        removed[store_bytes] = [n for ev in events if isinstance(ev, BlockRemoved) for n in ev.block_hashes]
    assert removed[None] == [] and len(held) == 5
    assert sorted(removed[2 * BLOCK_SIZE * 512]) == sorted(held[2:])


def test_keys_and_values_imported_into_a_slot_keep_what_it_held_in_the_store(tiny_llama, smollm2_dir):
    """A decode pod's import (a prefill pod's KV) takes the slot a conversation held: its next turn still
    finds its history, in the store."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = random.Random(9)
    conversation = [rng.randrange(3, 500) for _ in range(50)]
    other = [rng.randrange(3, 500) for _ in range(40)]
    decode, prefill = engine(tiny_llama, smollm2_dir), engine(tiny_llama, smollm2_dir)
    answer = decode.generate([conversation], params)[0].token_ids
    _, kv = prefill.prefill_and_export(other)
    assert decode.import_prefix(other, kv) == 0  # the only slot
    reused: list[int] = []
    decode.step_observers.append(lambda report: reused.append(report.reused_prompt_tokens))
    decode.generate([[*conversation, *answer, 5]], params)
    assert sum(reused) == 3 * BLOCK_SIZE  # 53 tokens held: 3 whole blocks, saved before the import
