"""Tool calls through our runtime's OpenAI chat API on the real model with a template that takes tools
(`smollm2_tools_dir`), driven by the official `openai` client (support.tool_call_round); bad tools refused
naming the part, never a 500 and never a held slot."""

from __future__ import annotations

import pytest
from support import TOOLS, metric, post, running_server, tool_call_round

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def server(smollm2_tools_dir):
    with running_server(smollm2_tools_dir, "--slots", "2", "--max-seq-len", "1024") as (base, _):
        yield base


def test_a_tool_call_round_trip_whole_and_streamed(server):
    first = tool_call_round(server)
    assert tool_call_round(server) == first  # (greedy: the same call and final answer again)


@pytest.mark.parametrize(
    "extra, field, needle",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "book_flight"}}}, "tool_choice",
         "'book_flight', which is not one of the tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
         "tools[0].function.parameters", "Invalid type: objectx"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 5}}}}]},
         "tools[0].function.parameters", "schema must be an object or boolean"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name",
         "letters, digits"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "not both"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "get_time", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0]",
         "arguments is not JSON"),
    ],
)  # fmt: skip
def test_bad_tools_get_a_400_naming_the_part_and_the_server_goes_on(server, extra, field, needle):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}
    code, answer, _ = post(server, "/v1/chat/completions", body)
    assert code == 400 and answer["error"]["param"] == field and needle in answer["error"]["message"], answer
    assert metric(server, "vllm:num_requests_running") == 0
    ok = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "max_tokens": 2,
    }
    assert post(server, "/v1/chat/completions", ok)[0] == 200
