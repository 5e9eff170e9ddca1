"""Tool calls' pure parts: `tools` and `tool_choice` checked, messages made ready for a template, and calls
read out of an answer whole and as it streams (Hermes' `<tool_call>` blocks)."""

from __future__ import annotations

import json

import pytest

from neuronfleet.runtime.serving.api_requests import parse_openai_chat
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.tool_calls import CallStream, parse_tools, split_calls, template_messages

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_an_answer_is_split_into_its_text_and_its_calls():
    assert split_calls("no calls here") == ("no calls here", [])
    content, calls = split_calls(f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}")
    assert content == "Let me look."
    cities = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == cities
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert split_calls(broken) == (broken, [])  # (not a call: the text as written)
    assert split_calls('<tool_call>\n{"name": "f"') == ('<tool_call>\n{"name": "f"', [])  # (never closed)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_streamed_answer_gives_the_same_text_and_calls_in_any_pieces(size):
    text = f"Sure. {CALL}\n{CALL} done <tool_ca"
    stream, content, names = CallStream(), "", []
    for i in range(0, len(text), size):
        piece, calls = stream.feed(text[i : i + size])
        content += piece
        names += [c.name for c in calls]
    content += stream.end()
    assert names == ["get_weather", "get_weather"] and stream.calls == 2
    assert content == "Sure. done <tool_ca"  # (what stayed held at the end is text)


def test_tools_and_tool_choice_are_checked_naming_the_part():
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert tools is not None and tools.forced == [WEATHER] and tools.parsed and tools.parallel
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = parse_tools({"tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False})
    assert named is not None and named.named == "get_weather" and not named.parallel
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).forced == []  # type: ignore[union-attr]
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "auto"}) is None
    bad = [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": {"a": 1}}, "tools", "must be a list"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "must be {type: function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "JSON Schema object"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "one of none, auto, required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope', which is not one of the tools (get_weather)"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ]  # fmt: skip
    for body, field, needle in bad:
        with pytest.raises(InvalidRequest) as refused:
            parse_tools(body)
        assert refused.value.field_name == field and needle in str(refused.value), (body, str(refused.value))


def test_a_chat_with_tools_is_parsed_with_its_constraint_and_its_messages_ready_for_the_template():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    parsed = parse_openai_chat({"messages": history, "tools": [WEATHER], "tool_choice": "required"})
    assert parsed.params.constraint is not None and parsed.params.constraint.kind == "tool_calls"
    assert parsed.messages[1]["content"] == "" and parsed.messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}  # fmt: skip
    assert parsed.messages[2]["tool_call_id"] == "call_1"
    assert parse_openai_chat({**CHAT, "tools": [WEATHER]}).params.constraint is None  # auto: free
    with pytest.raises(InvalidRequest, match="Invalid type: objectx") as refused:
        parse_openai_chat({**CHAT, "tools": [{"type": "function", "function": {"name": "f",
                           "parameters": {"type": "objectx"}}}]})  # fmt: skip
    assert refused.value.field_name == "tools[0].function.parameters"
    with pytest.raises(InvalidRequest, match="not both") as refused:
        parse_openai_chat({**CHAT, "tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}})  # fmt: skip
    assert refused.value.field_name == "tool_choice"
    with pytest.raises(InvalidRequest, match="arguments is not JSON"):
        template_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{nope"}}]}])  # fmt: skip


@pytest.mark.real_model
def test_a_template_that_takes_no_tools_refuses_them(smollm2_dir):
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)  # (SmolLM2's template never reads `tools`)
    assert not tokenizer.takes_tools
    with pytest.raises(InvalidRequest, match="takes no tools") as refused:
        tokenizer.encode_chat(CHAT["messages"], tools=[WEATHER])
    assert refused.value.field_name == "tools"
