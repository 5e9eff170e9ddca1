"""The continuous-batching engine on the real SmolLM2 model: batching correctness, sampling, stops, cancel."""

from __future__ import annotations

import asyncio

import pytest
from support import wait_until_async

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import AsyncEngine, Engine
from neuronfleet.runtime.serving.backend import FinishReason
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "Explain gravity in one sentence.",
    "Write a short poem about autumn leaves falling in the park.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def engine(smollm2_dir) -> Engine:
    return Engine.from_model_dir(  # float32: one test compares with transformers in float32
        str(smollm2_dir),
        RuntimeConfig(slots=4, max_seq_len=256, prefill_buckets=[32, 64, 128], dtype="float32"),
    )


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(engine, prompts) -> list[list[int]]:
    """Greedy tokens of each prompt run by itself."""
    params = SamplingParams(max_tokens=24)
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def run_all(engine: Engine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """Step the engine until idle, appending each request's tokens."""
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


def test_request_joining_mid_batch_produces_its_solo_tokens(engine, prompts, alone):
    params = SamplingParams(max_tokens=24)
    first = engine.add_request(prompts[3], params)
    tokens: dict[str, list[int]] = {first: []}
    for _ in range(6):  # the first request is decoding when the others arrive
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    late = [engine.add_request(p, params) for p in (prompts[0], prompts[5])]
    tokens.update({i: [] for i in late})
    run_all(engine, tokens)
    assert tokens[first] == alone[3]
    assert tokens[late[0]] == alone[0]
    assert tokens[late[1]] == alone[5]
    assert engine.scheduler.num_free_slots == 4


def test_many_requests_reuse_slots_and_match_solo_output(engine, prompts, alone):
    outs = engine.generate(prompts + prompts[:4], SamplingParams(max_tokens=24))  # 12 requests, 4 slots
    for i, out in enumerate(outs):
        assert out.token_ids == alone[i % len(prompts)], QUESTIONS[i % len(prompts)]
        assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert engine.stats.prefill_calls > 1 and engine.scheduler.num_free_slots == 4


def test_requests_left_in_high_slots_move_down_and_still_produce_their_solo_tokens(engine, prompts, alone):
    """When few requests remain and some sit in high slots, they move to low free slots (the decode step then
    runs a smaller batch bucket) with their cache and sampler, and their tokens do not change."""
    short, long_ = SamplingParams(max_tokens=2), SamplingParams(max_tokens=24)
    ids = [engine.add_request(prompts[i], short) for i in range(3)]
    ids.append(engine.add_request(prompts[4], long_))  # takes slot 3 next to three short requests
    tokens = {i: [] for i in ids}
    moved = []
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        moved.append(engine.scheduler.running.get(0))
    assert tokens[ids[3]] == alone[4]
    assert any(s is not None and s.request_id == ids[3] for s in moved)  # it ran in slot 0 after the move


def test_interleaved_conversations_reuse_their_histories_through_moves_and_answer_as_without_reuse(
    engine, prompts, smollm2_dir
):
    """Three conversations whose turns come at their own pace: finishing turns free slots, moves down exchange
    the caches of running requests with free slots', later turns find their histories wherever the moves put
    them; every turn's greedy tokens equal those of an engine that reuses nothing."""
    reference = Engine.from_model_dir(
        str(smollm2_dir), RuntimeConfig(slots=1, max_seq_len=256, prefill_buckets=[32, 64, 128, 256],
                                        dtype="float32", prefix_reuse=False),
    )  # fmt: skip
    params = SamplingParams(max_tokens=5)
    reused, slots, moved = [], {}, set()
    engine.step_observers.append(lambda report: reused.append(report.reused_prompt_tokens))
    try:
        history = {c: list(prompts[c]) for c in range(3)}
        turns = {c: 0 for c in range(3)}
        asked = {engine.add_request(history[0], params): 0}  # the others join while it runs
        tokens: dict[str, list[int]] = {i: [] for i in asked}
        step = found_at_least = 0
        later: list[tuple[int, int]] = []
        while asked or later:
            if step in (1, 3):
                c = 1 if step == 1 else 2
                rid = engine.add_request(history[c], params)
                asked[rid], tokens[rid] = c, []
            outputs = engine.step()
            for slot, seq in engine.scheduler.running.items():  # a request in another slot: it moved
                moved |= {seq.request_id} if slots.setdefault(seq.request_id, slot) != slot else set()
                slots[seq.request_id] = slot
            for out in outputs:
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    c = asked.pop(out.request_id)
                    expected = reference.generate([history[c]], params)[0].token_ids
                    assert tokens[out.request_id] == expected, (c, turns[c])
                    turns[c] += 1
                    if turns[c] < 3:
                        found_at_least += len(history[c])  # the next turn finds at least this prompt
                        history[c] += expected + engine.tokenizer.encode(f" And turn {turns[c]}?")
                        later.append((step + 2 * c, c))  # each at its own pace
            for due, c in [x for x in later if x[0] <= step]:
                later.remove((due, c))
                rid = engine.add_request(history[c], params)
                asked[rid], tokens[rid] = c, []
            step += 1
    finally:
        engine.step_observers.pop()
    assert turns == {0: 3, 1: 3, 2: 3} and moved  # every turn answered; running requests moved down
    assert sum(reused) >= found_at_least  # each later turn found its whole history


def test_chat_answer_ends_at_eos_which_is_not_emitted(engine, prompts):
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=60))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids[-1] in engine.eos_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_max_tokens_and_slot_length_finish_with_length(engine, prompts):
    out = engine.generate([prompts[6]], SamplingParams(max_tokens=5))[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 5
    prompt = engine.tokenizer.encode("Count: " + ", ".join(str(i) for i in range(1, 31)))  # ~116 tokens
    assert 100 < len(prompt) <= 128
    out = engine.generate([prompt], SamplingParams(ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert len(prompt) + len(out.token_ids) == engine.config.max_seq_len


def test_stop_strings_cut_the_text_and_are_never_emitted(engine, prompts):
    full = engine.generate([prompts[6]], SamplingParams(max_tokens=40))[0].text
    words = full.split()
    stop = " ".join(words[3:5])  # a stop string spanning tokens in the middle of the answer
    streamed = []
    rid = engine.add_request(prompts[6], SamplingParams(max_tokens=40, stop=("zzz-never", stop)))
    finish = None
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == rid
            streamed.append(out.text)
            finish = out.finish_reason or finish
    text = "".join(streamed)
    assert finish == FinishReason.STOP
    assert text == full[: full.index(stop)]
    assert stop not in text


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine, prompts):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = engine.generate([prompts[1]], params)[0].token_ids
    b = engine.generate([prompts[1]], params)[0].token_ids
    batch = engine.generate(
        [prompts[2], prompts[1], prompts[4]], [SamplingParams(max_tokens=20), params, params]
    )
    assert a == b == batch[1].token_ids
    other = [
        engine.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0.9, seed=s))[0].token_ids
        for s in (1, 2, 3)
    ]
    assert any(o != a for o in other)


def test_repetition_penalty_matches_transformers(engine, smollm2_dir):
    import torch
    from transformers import LlamaForCausalLM

    prompt = engine.tokenizer.encode("one one one one one one one one")
    ref_model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for penalty in (1.0, 1.3):
        ours = engine.generate([prompt], SamplingParams(max_tokens=12, repetition_penalty=penalty))[
            0
        ].token_ids
        with torch.no_grad():
            ref = ref_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert ours == ref, penalty
    plain = engine.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids
    assert max(plain.count(t) for t in plain) > max(
        ours.count(t) for t in ours
    )  # the penalty breaks the loop


def test_requests_that_never_fit_are_refused_with_the_limits(engine):
    with pytest.raises(InvalidRequest, match="longest this deployment accepts is 128"):
        engine.add_request(list(range(10, 150)))
    with pytest.raises(InvalidRequest, match="at most 246 new tokens fit"):
        engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=247))
    assert not engine.has_work()


@pytest.mark.parametrize(
    "text",
    [
        "Hello   world,  spaced  out\n\tand tabbed",
        "你好，世界！今天天气很好。",
        "I ❤️ 🦙 and 👩‍👩‍👧 emoji 🎉!",
        "mixed: café ünïcode 日本語 😀",
    ],
)
def test_incremental_detokenization_never_emits_half_a_character(smollm2_dir, text):
    tok = Tokenizer(smollm2_dir)
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas) or text.isascii()  # multi-byte characters span tokens


def test_cancelling_a_stream_frees_its_slot(engine, prompts):
    async def scenario():
        with AsyncEngine(lambda: engine) as aengine:
            got = []
            async for out in aengine.generate(prompts[3], SamplingParams(max_tokens=200, ignore_eos=True)):
                got.append(out)
                if len(got) == 3:
                    break  # the client goes away
            await wait_until_async(
                lambda: engine.scheduler.num_free_slots == engine.config.slots and not engine.has_work(),
                "the slot to be free",
            )
            await aengine.call(lambda e: e.step())  # the next step drops the slot's sampling state
            assert not engine.runner.sampler.slots
            # the engine still serves afterwards, and concurrent streams finish
            results = await asyncio.gather(*(collect(aengine, p) for p in prompts[:6]))
            return results

    async def collect(aengine, prompt):
        text, finish = "", None
        async for out in aengine.generate(prompt, SamplingParams(max_tokens=24)):
            text += out.text
            finish = out.finish_reason
        return text, finish

    results = asyncio.run(scenario())
    assert all(finish is not None for _, finish in results)
    assert "Paris" in results[0][0]


def test_async_engine_refuses_bad_requests_without_stopping(engine):
    async def scenario():
        with AsyncEngine(lambda: engine) as aengine:
            with pytest.raises(InvalidRequest):
                async for _ in aengine.generate(list(range(10, 200))):
                    pass
            outs = [o async for o in aengine.generate("The sky is", SamplingParams(max_tokens=3))]
            return outs, aengine.alive

    outs, alive = asyncio.run(scenario())
    assert (
        alive and outs[-1].finish_reason == FinishReason.LENGTH and sum(len(o.token_ids) for o in outs) == 3
    )


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_token(engine, prompts):
    greedy = engine.generate([prompts[7]], SamplingParams(max_tokens=16))[0].token_ids
    for seed in (1, 2):
        top_k = SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=seed)
        top_p = SamplingParams(max_tokens=16, temperature=1.5, top_p=1e-6, seed=seed)
        assert engine.generate([prompts[7]], top_k)[0].token_ids == greedy
        assert engine.generate([prompts[7]], top_p)[0].token_ids == greedy
    hot = engine.generate([prompts[7]], SamplingParams(max_tokens=16, temperature=1.5, seed=1))[0].token_ids
    assert hot != greedy  # without the filters, a high temperature wanders off the greedy path


def test_logprobs_are_the_models_raw_log_softmax_as_transformers_computes_it(engine, smollm2_dir):
    """Each generated token's log probability and the 5 most likely tokens', against transformers' raw
    logits (`output_logits`: before the repetition penalty) at every step, float32; a request that asks for
    none, batched with it, gets none."""
    import torch
    from transformers import LlamaForCausalLM

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
    ref_model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for penalty in (1.0, 1.3):
        params = SamplingParams(max_tokens=10, repetition_penalty=penalty, logprobs=5)
        other = engine.add_request(engine.tokenizer.encode("one two three"), SamplingParams(max_tokens=10))
        ours = engine.add_request(prompt, params)
        outs: dict[str, list] = {ours: [], other: []}
        while engine.has_work():
            for out in engine.step():
                outs[out.request_id].append(out)
        assert all(o.logprobs is None for o in outs[other])
        tokens = [t for o in outs[ours] for t in o.token_ids]
        logprobs = [lp for o in outs[ours] for lp in o.logprobs]
        assert len(logprobs) == len(tokens) == 10
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                     repetition_penalty=penalty, pad_token_id=2, output_logits=True,
                                     return_dict_in_generate=True)  # fmt: skip
        assert ref.sequences[0, len(prompt) :].tolist() == tokens
        for step, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            want = ref.logits[step][0].float().log_softmax(-1)
            assert lp.logprob == pytest.approx(want[token].item(), abs=2e-3), (penalty, step)
            values, ids = want.topk(5)
            assert [i for i, _ in lp.top] == ids.tolist(), (penalty, step)
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-3)
    with pytest.raises(InvalidRequest, match="logprobs must be an integer between 0 and 20"):
        SamplingParams(logprobs=21)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_constrained_answer_is_the_greedy_choice_among_what_its_schema_allows(
    engine, prompts, alone, smollm2_dir
):
    """A JSON-schema request batched with a free one: each of its tokens is the argmax of transformers' logits
    (float32) over the tokens an independent llguidance matcher allows at that step, it ends where the schema
    does (EOS, the only token allowed then), and its text validates against the schema; the free request in
    the same steps gets its solo tokens."""
    import json

    import jsonschema
    import llguidance
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    from neuronfleet.runtime.serving.output_constraints import response_format

    constraint = response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert constraint is not None
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    free = engine.add_request(prompts[0], SamplingParams(max_tokens=24))
    ours = engine.add_request(prompt, SamplingParams(max_tokens=48, constraint=constraint))
    tokens = run_all(engine, {free: [], ours: []})
    assert tokens[free] == alone[0]
    assert tokens[ours][-1] in engine.eos_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens[ours])), PERSON)
    vocab = llguidance.LLTokenizer(engine.tokenizer.to_json(), eos_token=sorted(engine.eos_ids))
    matcher = llguidance.LLMatcher(vocab, constraint.grammar, log_level=0)
    ref_model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    for step, token in enumerate(tokens[ours]):
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        with torch.no_grad():
            logits = ref_model(torch.tensor([ids])).logits[0, -1]
        mask = torch.from_numpy(allowed[: logits.shape[-1]].astype(bool))
        assert int(logits.masked_fill(~mask, float("-inf")).argmax()) == token, step
        assert matcher.consume_token(token), step
        ids.append(token)
    assert matcher.is_stopped()


def test_constrained_sampling_is_seeded_and_an_answer_can_continue_from_its_text(engine):
    """A sampled request under `json_object` gives a JSON object, the same one for the same seed; a constraint
    with a `prefix` (what the prefill/decode router sends when it continues an answer on another pod) reads
    that text first, so the prefix and the continuation make one JSON document; a prefix the grammar refuses
    ends that request alone, with an error naming the field."""
    import dataclasses
    import json

    import jsonschema

    from neuronfleet.runtime.serving.output_constraints import response_format

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "A JSON object about a cat, please."}])
    anything = response_format({"type": "json_object"})
    sampled = SamplingParams(max_tokens=48, temperature=1.0, seed=7, constraint=anything)
    first, second = (engine.generate([prompt], sampled)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    if first.finish_reason == FinishReason.STOP:  # (a sampled object may run past max_tokens)
        assert isinstance(json.loads(first.text), dict)
    person = response_format({"type": "json_schema", "json_schema": {"schema": PERSON}})
    assert person is not None
    head = '{"name": "Al'
    params = SamplingParams(max_tokens=32, constraint=dataclasses.replace(person, prefix=head))
    rest = engine.generate([prompt + engine.tokenizer.encode(head, add_special_tokens=False)], params)[0]
    jsonschema.validate(json.loads(head + rest.text), PERSON)
    wrong = SamplingParams(max_tokens=8, constraint=dataclasses.replace(person, prefix="[1, 2"))
    refused, fine = engine.generate([prompt, prompt], [wrong, SamplingParams(max_tokens=4)])
    assert (
        refused.finish_reason == FinishReason.ABORT and "response_format.json_schema.schema" in refused.error
    )
    assert fine.finish_reason == FinishReason.LENGTH and len(fine.token_ids) == 4
