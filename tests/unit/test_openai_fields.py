"""docs/api.md against the other side's contract: every request field the official `openai` client can send
to /v1/chat/completions and /v1/completions (its own TypedDicts, `CompletionCreateParamsBase`) is listed with
what our runtime does with it, and does it: a refused field's non-neutral value is a 400 naming the field,
its neutral value is taken; a supported or ignored field is taken."""

from __future__ import annotations

import importlib
import json
import re
import typing
from pathlib import Path

import pytest

from neuronfleet.runtime.serving.api_requests import parse_openai_chat, parse_openai_completion
from neuronfleet.runtime.serving.errors import InvalidRequest

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
# a value of each field that is not its neutral one (what a client asking for it sends)
ASKED = {
    "model": "smollm2", "max_completion_tokens": 5, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
    "seed": 3, "stop": ["."], "stream": True, "stream_options": {"include_usage": True}, "n": 2,
    "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "logit_bias": {"15": 5}, "response_format": {"type": "json_object"}, "tools": [TOOL],
    "tool_choice": "auto", "functions": [TOOL["function"]], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"}, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "a guess"}, "reasoning_effort": "low", "verbosity": "low",
    "store": True, "metadata": {"team": "a"}, "user": "u1", "safety_identifier": "s1", "service_tier": "auto",
    "prompt_cache_key": "k", "prompt_cache_options": {"mode": "implicit"}, "prompt_cache_retention": "24h",
    "best_of": 2, "echo": True, "suffix": " the end", "top_k": 5, "repetition_penalty": 1.1,
    "ignore_eos": True, "return_token_ids": True, "add_generation_prompt": True,
    "continue_final_message": False, "structured_outputs": {"choice": ["yes", "no"]},
}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Hello"}]}
# where an API's own value differs (the completions API's logprobs is a count); what a field needs beside it
ASKED_BY_API = {"`POST /v1/completions`": {"logprobs": 3}}
NEEDS = {"top_logprobs": {"logprobs": True}}  # OpenAI's (and vLLM's) rule: top_logprobs with logprobs true
COMPLETION = {"prompt": "Hello"}


def documented(section: str) -> dict[str, tuple[str, str]]:
    """A section's table of docs/api.md: field -> (what it says here, its notes)."""
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (supported|ignored|refused) \|(.*)\|$", text, re.MULTILINE)
    return {field: (here, notes.strip()) for field, here, notes in rows}


def official(params: type) -> set[str]:
    return {*typing.get_type_hints(params), "stream"}  # (stream: the client's overloads add it)


def check(parse, base: dict, field: str, here: str, notes: str, asked: dict) -> None:
    if here == "refused":
        with pytest.raises(InvalidRequest, match=rf"^{field} ") as refused:  # (the message names it first)
            parse({**base, field: asked[field]})
        assert refused.value.field_name == field and refused.value.status == 400
        neutral = re.search(r"neutral: `(.+?)`", notes)
        if neutral is not None:  # ("none": any value is refused)
            parse({**base, field: json.loads(neutral.group(1))})
    else:
        parse({**base, **NEEDS.get(field, {}), field: asked[field]})
    parse({**base, field: None})  # (null: as if left out)


@pytest.mark.parametrize(
    ("section", "params", "parse", "base"),
    [
        (
            "`POST /v1/chat/completions`",
            "openai.types.chat.completion_create_params",
            parse_openai_chat,
            CHAT,
        ),
        (
            "`POST /v1/completions`",
            "openai.types.completion_create_params",
            parse_openai_completion,
            COMPLETION,
        ),
    ],
    ids=["chat", "completions"],
)
def test_every_field_the_official_client_sends_is_listed_and_does_what_the_page_says(
    section, params, parse, base
):
    sent = official(importlib.import_module(params).CompletionCreateParamsBase)
    table = documented(section)
    assert sent <= set(table), sent - set(table)
    asked = {**ASKED, **ASKED_BY_API.get(section, {})}
    for field, (here, notes) in table.items():
        if field not in base:  # (the request itself: messages, prompt)
            check(parse, base, field, here, notes, asked)


def test_vllms_extensions_are_taken_by_both():
    for field, (here, _) in documented("vLLM's extensions, taken by both").items():
        assert here == "supported"
        parse_openai_chat({**CHAT, field: ASKED[field]})
        if field not in ("add_generation_prompt", "continue_final_message"):  # (chat only)
            parse_openai_completion({**COMPLETION, field: ASKED[field]})
