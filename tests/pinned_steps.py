"""The model runner driven with slots the test chooses: a `StepPlan` built as the scheduler builds one
(`prompt_rows`: each prompt reuses the longest prefix a slot's cache holds), run by `ModelRunner.run`, and
what it wrote booked in the caller's `PrefixCache`. For tests that compare the model's numbers slot by
slot."""

from __future__ import annotations

from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.engine.prefix_cache import PrefixCache
from neuronfleet.runtime.engine.scheduler import Row, Sequence, StepPlan, prompt_rows
from neuronfleet.runtime.serving.sampling_params import SamplingParams


def step(
    runner: ModelRunner, cache: PrefixCache, prefill_slots, prompts, decode_slots, tokens, positions,
    params: SamplingParams | None = None,
) -> tuple[list[int], list[int]]:  # fmt: skip
    """Admit `prompts` into `prefill_slots` (their sampling state started with `params`, greedy by default)
    and decode one token for each decode slot (its last token at its position), in one step. Returns the
    prompts' first tokens and the decode slots' next tokens."""
    params = params or SamplingParams()
    admitted = [
        Sequence(f"prompt-{slot}", list(ids), params, max_tokens=1, slot=slot)
        for slot, ids in zip(prefill_slots, prompts, strict=True)
    ]
    running = [
        Row(Sequence(f"running-{slot}", [], params, max_tokens=1, slot=slot), [token], position)
        for slot, token, position in zip(decode_slots, tokens, positions, strict=True)
    ]
    rows = prompt_rows(cache, admitted)
    plan = StepPlan(
        admitted=admitted, copies=rows.copies, prefill=rows.prefill, decode=[*running, *rows.decode]
    )
    result = runner.run(plan)
    assert not result.failed, result.failed
    for seq in admitted:
        cache.holds(seq.slot, seq.prompt_ids)
    for row in running:
        cache.wrote(row.slot, row.tokens[0], row.start)
    return [result.tokens[s] for s in admitted], [result.tokens[r.seq] for r in running]
