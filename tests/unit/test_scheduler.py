"""The scheduler's slot bookkeeping and step planning (pure Python, no model)."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.prefix_cache import MIN_PREFIX_REUSE
from neuronfleet.runtime.engine.scheduler import Scheduler, Sequence
from neuronfleet.runtime.serving.backend import FinishReason, Limits, check_fits
from neuronfleet.runtime.serving.errors import InvalidRequest, QueueFull
from neuronfleet.runtime.serving.sampling_params import SamplingParams


def seq(rid: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    """A request whose prompt shares no prefix with another's (its first token is its own)."""
    first = zlib.crc32(rid.encode()) % 30000 + 2
    prompt_ids = [first, *[1] * (prompt_len - 1)]
    return Sequence(request_id=rid, prompt_ids=prompt_ids, params=SamplingParams(), max_tokens=max_tokens)


def chat(rid: str, system: list[int], question: list[int]) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=[*system, *question], params=SamplingParams(), max_tokens=8)


def scheduler(slots: int, max_seq_len: int, prefill_buckets: list[int], **kw) -> Scheduler:
    return Scheduler(
        RuntimeConfig(slots=slots, max_seq_len=max_seq_len, prefill_buckets=prefill_buckets, **kw)
    )


def test_scheduler_imports_no_torch():
    code = (
        "import sys, neuronfleet.runtime.engine.scheduler; assert 'torch' not in sys.modules, "
        "'torch imported'"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_admits_into_lowest_free_slots_and_reuses_released_ones():
    s = scheduler(3, 64, [16, 32])
    seqs = [seq(f"r{i}", 4) for i in range(5)]
    for x in seqs:
        s.add(x)
    plan = s.schedule()
    assert [x.slot for x in plan.admitted] == [0, 1, 2] and plan.prefill == plan.rows
    assert [(r.tokens, r.start) for r in plan.prefill] == [(x.prompt_ids, 0) for x in seqs[:3]]
    assert plan.decode == [] and plan.released == []
    assert len(s.waiting) == 2 and s.num_free_slots == 0
    s.postprocess(plan, {x: 5 for x in plan.admitted}, {seqs[1]: FinishReason.STOP})
    assert seqs[0].output_ids == [5] and seqs[1].finished and s.num_free_slots == 1
    plan = s.schedule()
    assert plan.released == [1]  # r1's sampling state goes first
    # two running fit batch bucket 2: r2 moves down into slot 1 (cache and sampling state), r3 takes slot 2
    assert [(m.src, m.dst, m.length) for m in plan.moves] == [(2, 1, 5)] and seqs[2].slot == 1
    assert [x.request_id for x in plan.admitted] == ["r3"] and seqs[3].slot == 2
    assert {(r.seq.request_id, r.tokens[0], r.start) for r in plan.decode} == {("r0", 5, 4), ("r2", 5, 4)}


def test_prefill_group_respects_token_budget_in_padded_tokens():
    s = scheduler(8, 256, [16, 64, 128], max_prefill_tokens=128)
    for i, n in enumerate([10, 12, 60, 5]):
        s.add(seq(f"r{i}", n))
    first = s.schedule().admitted
    # two prompts of <= 16 tokens pad to 16 each; the 60-token one would pad three rows to 64 (192 > 128)
    assert [x.request_id for x in first] == ["r0", "r1"]
    assert [x.request_id for x in s.schedule().admitted] == ["r2", "r3"]  # 2 x 64 = 128 fits


def test_refuses_requests_that_can_never_fit_with_the_limits_in_the_message():
    limits = Limits(max_seq_len=100, max_prompt_len=64, slots=2, dtype="float32", device="cpu")
    with pytest.raises(InvalidRequest, match=r"65 tokens.*longest this deployment accepts is 64"):
        check_fits(limits, 65, None)
    with pytest.raises(InvalidRequest, match=r"max_tokens 50 .* slot length 100; at most 40 new tokens fit"):
        check_fits(limits, 60, 50)
    with pytest.raises(InvalidRequest, match="empty"):
        check_fits(limits, 0, None)
    assert check_fits(limits, 60, None) == 40
    assert check_fits(limits, 60, 40) == 40
    whole = Limits(max_seq_len=64, max_prompt_len=64, slots=2, dtype="float32", device="cpu")
    with pytest.raises(InvalidRequest, match="64 tokens and leaves no room to generate") as info:
        check_fits(whole, 64, None)
    assert info.value.field_name == "prompt"


def test_abort_waiting_and_running_and_queue_bound():
    s = scheduler(1, 64, [16], max_waiting=2)
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for x in (a, b, c):  # a takes the free slot at the next step; b and c wait
        s.add(x)
    with pytest.raises(QueueFull, match="all 1 slots are busy and the waiting queue holds 2"):
        s.add(seq("d", 3))
    s.schedule()
    with pytest.raises(QueueFull):
        s.add(seq("d", 3))
    assert s.abort("b") is b and b.finish_reason == FinishReason.ABORT and list(s.waiting) == [c]
    s.add(seq("d", 3))
    assert s.abort("a") is a and s.num_free_slots == 1 and not s.running
    assert s.abort("a") is None
    assert [s.abort("c"), s.abort("d")] != [None, None] and not s.has_work


def test_sampling_params_refuse_out_of_range_values_naming_the_field():
    for kwargs, name in [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": -3}, "seed"),
        ({"stop": ("",)}, "stop"),
    ]:
        with pytest.raises(InvalidRequest, match=name) as info:
            SamplingParams(**kwargs)
        assert info.value.field_name == name


def test_admits_into_the_free_slot_whose_cache_holds_the_longest_prefix():
    s = scheduler(4, 64, [16, 32])
    for slot, held in (
        (1, range(1, 11)),
        (2, range(1, 13)),
        (3, range(1, 13)),
    ):  # what each slot's cache holds
        s.prefixes.holds(slot, list(held))

    a = Sequence(request_id="a", prompt_ids=list(range(1, 14)), params=SamplingParams(), max_tokens=4)
    b = Sequence(request_id="b", prompt_ids=[9, 9, 9], params=SamplingParams(), max_tokens=4)
    c = Sequence(request_id="c", prompt_ids=[*range(1, 11), 99], params=SamplingParams(), max_tokens=4)
    for x in (a, b, c):
        s.add(x)
    plan = s.schedule()
    # a: slots 2 and 3 both hold 12 of its tokens -> the lower; b: nothing anywhere -> lowest free (0);
    # c: slot 1 and slot 3 hold 10 -> the lower, 1
    assert [(x.request_id, x.slot) for x in plan.admitted] == [("a", 2), ("b", 0), ("c", 1)]
    # a and c find all but their last token in their own slots (no copy): one decode row each; b prefills
    assert plan.copies == []
    assert [(r.seq.request_id, r.start) for r in plan.prefill] == [("b", 0)]
    assert [(r.seq.request_id, r.tokens, r.start) for r in plan.decode] == [("a", [13], 12), ("c", [99], 10)]
    assert plan.reused_tokens(plan.admitted) == 22
    assert s.num_free_slots == 1


def test_compaction_moves_running_sequences_below_the_batch_bucket_that_holds_them():
    s = scheduler(8, 64, [16])
    seqs = [seq(f"r{i}", 4) for i in range(8)]
    for x in seqs:
        s.add(x)
    s.schedule()
    for i in (0, 1, 3, 4, 5):  # three left, in slots 2, 6 and 7: bucket 4 holds them
        s.finish(seqs[i], FinishReason.STOP)
    s.prefixes.holds(7, [*seqs[7].prompt_ids, 5])  # r7's prompt, and a position beyond it
    history = list(range(50, 60))  # what free slot 1 held (a conversation between its turns)
    s.prefixes.holds(1, history)
    plan = s.schedule()
    # the moves exchange caches: as far as the longer of what each side holds
    assert [(m.src, m.dst, m.length) for m in plan.moves] == [(7, 0, 4), (6, 1, 10)]
    assert sorted(s.running) == [0, 1, 2] and seqs[7].slot == 0 and seqs[6].slot == 1
    assert s.prefixes.held[0] == seqs[7].prompt_ids  # the destination holds what the source held of r7
    assert s.prefixes.held[6] == history  # what the destination held is kept, in the slot r6 left
    assert s.schedule().moves == []  # nothing left to move
    assert s.num_free_slots == 5


SYSTEM = list(range(100, 124))  # a chat template's system prompt: 24 tokens


def test_a_prompt_sharing_an_uncached_prefix_with_the_group_waits_a_step_and_copies_it():
    """A burst of chat requests to a fresh engine: the first computes the system prompt, the others wait one
    step and then copy it from its slot, instead of each computing it again."""
    s = scheduler(8, 128, [16, 32, 64])
    a, b, c = (chat(r, SYSTEM, [r.encode()[0], 7, 8]) for r in "abc")
    other = seq("other", 20)  # arrived after them: admission keeps arrival order
    for x in (a, b, c, other):
        s.add(x)
    first = s.schedule()
    assert [x.request_id for x in first.admitted] == ["a"]
    assert [(r.seq, r.start) for r in first.prefill] == [(a, 0)]  # nothing cached: a computes it all
    s.postprocess(first, {a: 5}, {})  # what the step wrote
    second = s.schedule()
    assert [x.request_id for x in second.admitted] == ["b", "c", "other"]
    assert [r.seq for r in second.decode] == [a]
    copies = [(x.seq, x.src, x.length) for x in second.copies]
    assert copies == [(b, a.slot, len(SYSTEM)), (c, a.slot, len(SYSTEM))]
    assert [(r.seq, r.start) for r in second.prefill] == [(b, len(SYSTEM)), (c, len(SYSTEM)), (other, 0)]


def test_prompts_whose_shared_prefix_a_slot_holds_or_is_short_are_admitted_together():
    # a slot holds the system prompt already (an earlier request's): each copies it, none waits
    s = scheduler(8, 128, [16, 32, 64])
    s.prefixes.holds(7, [*SYSTEM, 1, 2, 3])
    burst = [chat(r, SYSTEM, [r.encode()[0], 7, 8]) for r in "abc"]
    for x in burst:
        s.add(x)
    assert s.schedule().admitted == burst
    # a common prefix shorter than worth copying (MIN_PREFIX_REUSE): none waits
    s = scheduler(8, 128, [16, 32, 64])
    short = [chat(r, SYSTEM[: MIN_PREFIX_REUSE - 1], [r.encode()[0], 7, 8]) for r in "abc"]
    for x in short:
        s.add(x)
    assert s.schedule().admitted == short
    # without prefix reuse nothing would be copied: none waits
    s = scheduler(8, 128, [16, 32, 64], prefix_reuse=False)
    burst = [chat(r, SYSTEM, [r.encode()[0], 7, 8]) for r in "abc"]
    for x in burst:
        s.add(x)
    assert s.schedule().admitted == burst


def test_a_prompt_that_reuses_nothing_takes_the_free_slot_worth_least():
    s = scheduler(4, 64, [16, 32])
    a, b, c = seq("a", 12), seq("b", 12), seq("c", 12)
    for x in (a, b, c):
        s.add(x)
    s.postprocess(s.schedule(), {a: 5, b: 5, c: 5}, {b: FinishReason.STOP})  # b's slot (1) frees first
    s.finish(a, FinishReason.STOP)  # then a's (0); c runs in 2; slot 3 has held nothing
    new = seq("new", 12)
    s.add(new)
    s.postprocess(s.schedule(), {new: 5, c: 5}, {})
    assert new.slot == 3  # the empty slot, not slot 0 or 1 whose caches hold a and b
    s.finish(new, FinishReason.STOP)
    again = seq("again", 12)
    s.add(again)
    s.postprocess(s.schedule(), {again: 5, c: 5}, {})
    assert again.slot == 1  # no empty slot left: the one freed longest ago (b's), not a's
    assert c.slot == 0  # c, alone, moved down into slot 0: a's cache went to slot 2, which c left
    # a's next turn still finds its whole prompt in place: its answer's token (sampled, never written) and
    # the new question are computed
    turn = Sequence("a2", [*a.prompt_ids, *a.output_ids, 7, 7], SamplingParams(), 8)
    s.add(turn)
    plan = s.schedule()
    assert turn.slot == 2 and plan.copies == [] and [r.start for r in plan.rows if r.seq is turn] == [12]


@pytest.mark.parametrize("conversations,slots", [(3, 4), (4, 4), (3, 8), (6, 8)])
def test_interleaved_conversations_each_find_their_whole_history_on_every_later_turn(conversations, slots):
    """Conversations whose turns come at their own pace, one engine: however finishing turns free slots,
    moves compact the running ones and new turns take slots, each later turn finds all of its earlier turns
    (prompt and answer) in some slot's cache: it computes only its new question."""
    import random

    rng = random.Random(conversations * 100 + slots)
    s = scheduler(slots, 2048, [16, 64, 256, 1024])
    start = {c: [zlib.crc32(f"{c}".encode()) % 30000 + 2, *(rng.randrange(2, 30000) for _ in range(300))]
             for c in range(conversations)}  # fmt: skip
    later = [(rng.randrange(20), c, Sequence(f"{c}-0", start[c], SamplingParams(), 6)) for c in start]
    running: dict[int, Sequence] = {}
    turns = {c: 0 for c in start}
    step, found = 0, []
    while later or running:
        for item in sorted(x for x in later if x[0] <= step):
            later.remove(item)
            s.add(item[2])
            running[item[1]] = item[2]
        plan = s.schedule()
        for r in plan.rows:
            if r.seq in plan.admitted and turns[int(r.seq.request_id.split("-")[0])]:
                # all but the new question (3 tokens) and the last answer token (sampled, never written)
                found.append((r.start, len(r.seq.prompt_ids) - 4))
        s.postprocess(
            plan,
            {r.seq: rng.randrange(2, 30000) for r in plan.rows},
            {r.seq: FinishReason.LENGTH for r in plan.rows if len(r.seq.output_ids) + 1 >= 6},
        )
        for c, q in list(running.items()):
            if q.finished:
                del running[c]
                turns[c] += 1
                if turns[c] < 4:
                    prompt = [*q.prompt_ids, *q.output_ids, *(rng.randrange(2, 30000) for _ in range(3))]
                    later.append((step + rng.randrange(12), c, Sequence(f"{c}-{turns[c]}", prompt,
                                                                         SamplingParams(), 6)))  # fmt: skip
        step += 1
    assert len(found) == 3 * conversations
    assert all(start >= history for start, history in found), found
