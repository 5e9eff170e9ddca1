"""A prompt prefilled by one engine, its KV cache carried by the tcp transport layer by layer into another
engine's slot, decodes there to exactly the tokens a unified engine produces (the real model)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support import CEILING, EXACT_DTYPE

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.kv.kv_transfer import Descriptor, TcpAgent
from neuronfleet.runtime.serving.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three fruits that are red.", "Explain gravity briefly."]


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    def make(**kw) -> Engine:
        return Engine.from_model_dir(
            str(smollm2_dir), RuntimeConfig(max_seq_len=256, dtype=EXACT_DTYPE, **kw)
        )

    return make(slots=2), make(slots=4), make(slots=1, prefix_reuse=False)


SECRET, KEY = "test-model-secret", bytes(range(32))  # the model's secret and a lease's key


async def hand_over(prefill: Engine, ids: list[int]) -> torch.Tensor:
    """Prefill on one engine, send each layer's KV to a receiver agent, return what arrived."""
    runner = prefill.runner
    assert prefill.scheduler.free_slots()[0] == 0  # prefill_and_export runs it in slot 0, which keeps it
    prefill.prefill_and_export(ids)
    c = runner.model_config
    region = torch.zeros((c.num_layers, 2, c.num_kv_heads, len(ids), c.head_dim), dtype=runner.dtype)
    receiver = TcpAgent("decode-0", "smollm2", secret=SECRET)
    receiver.register_memory("lease-1", region, KEY)
    await receiver.start()
    sender = TcpAgent("prefill-0", "smollm2", secret=SECRET)
    per_layer = region[0].numel() * region.element_size()
    transfers = []
    for layer in range(c.num_layers):
        where = Descriptor("lease-1", layer * per_layer, per_layer, KEY)
        kv = runner.export_kv(0, len(ids), layer)
        transfers.append(sender.write_nowait(receiver.metadata(), kv, where, f"r1:{layer}"))
    for t in transfers:
        await t.wait(timeout=CEILING)
    for layer in range(c.num_layers):
        await receiver.wait_notification(f"r1:{layer}", timeout=CEILING)
    await sender.stop()
    await receiver.stop()
    assert torch.equal(region, runner.export_kv(0, len(ids)))
    return region


@pytest.mark.real_model
def test_decode_after_a_kv_handoff_equals_the_unified_engine(engines):
    prefill, decode, unified = engines
    reports = []
    decode.step_observers.append(reports.append)
    for question in QUESTIONS:
        ids = unified.tokenizer.encode_chat([{"role": "user", "content": question}])
        kv = asyncio.run(hand_over(prefill, ids))
        slot = decode.import_prefix(ids, kv)
        assert slot is not None
        reports.clear()
        got = decode.generate([ids], SamplingParams(max_tokens=24))[0]
        want = unified.generate([ids], SamplingParams(max_tokens=24))[0]
        assert got.token_ids == want.token_ids, question
        admitted = next(r for r in reports if r.prefill_requests)
        assert admitted.reused_prompt_tokens == len(ids) - 1  # only the last prompt token was computed


def test_kv_that_does_not_fit_the_slot_is_refused(engines):
    _, decode, _ = engines
    c = decode.runner.model_config
    wrong = torch.zeros((c.num_layers, 2, c.num_kv_heads, 5, c.head_dim), dtype=torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        decode.runner.import_kv(3, wrong, 5)


@pytest.mark.real_model
def test_prefill_and_decode_engines_hand_over_through_their_own_threads(engines):
    """The serving path: each side's runner work runs on its engine thread (AsyncEngine.call); the decode
    side streams exactly the unified tokens, and the prefill side's first token is the first of them."""
    from neuronfleet.runtime.engine.engine import AsyncEngine

    prefill, decode, unified = engines
    question = "Write one sentence about the sea."
    ids = unified.tokenizer.encode_chat([{"role": "user", "content": question}])
    want = unified.generate([ids], SamplingParams(max_tokens=20))[0].token_ids

    async def main():
        with AsyncEngine(lambda: prefill) as p, AsyncEngine(lambda: decode) as d:
            first, kv = await p.call(lambda e: e.prefill_and_export(ids))
            c = prefill.runner.model_config
            region = torch.zeros_like(kv)
            receiver = TcpAgent("decode-0", "smollm2", secret=SECRET)
            sender = TcpAgent("prefill-0", "smollm2", secret=SECRET)
            receiver.register_memory("lease-2", region, KEY)
            await receiver.start()
            per_layer = kv[0].numel() * kv.element_size()
            for layer in range(c.num_layers):
                where = Descriptor("lease-2", layer * per_layer, per_layer, KEY)
                await sender.write(receiver.metadata(), kv[layer].contiguous(), where, f"r2:{layer}")
            await sender.stop()
            await receiver.stop()
            with pytest.raises(
                ValueError, match="does not fit"
            ):  # a bad import fails the call, not the engine
                await d.call(lambda e: e.import_prefix(ids, region.to(torch.float16)))
            assert await d.call(lambda e: e.import_prefix(ids, region)) is not None
            tokens = []
            async for out in d.generate(ids, SamplingParams(max_tokens=20)):
                tokens += out.token_ids
            return first, tokens

    first, tokens = asyncio.run(main())
    assert tokens == want and first == want[0]
