"""Log probabilities in the OpenAI API's two forms (runtime/serving/server.py's `chat_logprobs` and
`completion_logprobs`), on SmolLM2's tokenizer: a chat's entries and a completion's legacy lists."""

from __future__ import annotations

import pytest

from neuronfleet.runtime.serving.backend import TokenLogprobs
from neuronfleet.runtime.serving.server import chat_logprobs, completion_logprobs
from neuronfleet.runtime.serving.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model


def test_both_forms_spell_the_tokens_and_a_completions_offsets_run_on(smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)
    ids = tokenizer.encode(" café au lait", add_special_tokens=False)
    logprobs = [TokenLogprobs(-0.5 * (k + 1), ((t, -0.1), (ids[0], -2.0))) for k, t in enumerate(ids)]
    content = chat_logprobs(tokenizer, ids, logprobs)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == " café au lait"
    assert [e["logprob"] for e in content] == [lp.logprob for lp in logprobs]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [[-0.1, -2.0]] * len(ids)
    first, offset = completion_logprobs(tokenizer, ids[:2], logprobs[:2], 7)
    rest, end = completion_logprobs(tokenizer, ids[2:], logprobs[2:], offset)
    texts = first["tokens"] + rest["tokens"]
    assert first["text_offset"][0] == 7 and rest["text_offset"][0] == offset == 7 + len("".join(texts[:2]))
    assert end == 7 + len("".join(texts))
    assert first["top_logprobs"][0] == {texts[0]: -0.1, tokenizer.decode([ids[0]]): -2.0}
    assert completion_logprobs(tokenizer, ids[:1], [TokenLogprobs(-1.0)], 0)[0]["top_logprobs"] is None
