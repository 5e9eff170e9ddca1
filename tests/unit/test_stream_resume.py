"""`resume.StreamResume`: a streamed OpenAI answer carried across the pods that serve it, event by event, and
the next attempt's request; with the serving side that accepts it (`return_token_ids`, a continued assistant
message)."""

from __future__ import annotations

import json

import pytest

from neuronfleet.runtime.routing.resume import StreamBroken, StreamResume, TgiStreamResume, resumable
from neuronfleet.runtime.serving.api_requests import (
    parse_openai_chat,
    parse_openai_completion,
    parse_tgi_generate,
)
from neuronfleet.runtime.serving.errors import InvalidRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "stream": True}
COMPLETION = {"model": "m", "prompt": "Once", "max_tokens": 6, "stream": True}
TGI = {"inputs": "Once", "parameters": {"max_new_tokens": 6, "details": True, "seed": 7}}


def event(chunk: dict | str) -> bytes:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode()


def chat_chunk(content: str | None, ids: list[int] | None, finish=None, rid="a", role=False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


def text_chunk(text: str, ids: list[int] | None, finish=None, rid="b", usage=None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    chunk = {"id": rid, "object": "text_completion", "created": 2, "model": "m", "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def events(data: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for raw in data.split(b"\n\n"):
        if raw.startswith(b"data: "):
            body = raw[6:].decode()
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_openai_streams_of_one_choice_and_tgi_streams_of_one_sequence_are_resumable():
    assert resumable("/v1/chat/completions", CHAT) is resumable("/v1/completions", COMPLETION) is StreamResume
    assert resumable("/v1/completions", {**COMPLETION, "stream": False}) is None
    assert resumable("/v1/completions", {**COMPLETION, "n": 2}) is StreamResume  # (a choice at a time)
    assert resumable("/generate_stream", TGI) is TgiStreamResume
    assert resumable("/", {**TGI, "stream": True}) is TgiStreamResume  # TGI's compat route, streamed
    assert resumable("/", TGI) is None  # a whole answer: sent again, not resumed
    assert resumable("/generate", TGI) is None
    best_of = {**TGI, "parameters": {"best_of": 2}}  # (TGI refuses both on a stream anyway)
    assert resumable("/generate_stream", best_of) is None
    details = {**TGI, "parameters": {"decoder_input_details": True}}
    assert resumable("/generate_stream", details) is None
    assert resumable("/generate_stream", {"inputs": ["x"]}) is None


def test_a_chat_resumed_from_token_ids_goes_on_through_completions_and_reads_as_one_chat_stream():
    resume = StreamResume("/v1/chat/completions", CHAT, prompt_ids=[1, 2, 3])
    first = event(chat_chunk(None, None, role=True)) + event(chat_chunk("Hel", [7]))
    half = event(chat_chunk("lo", [8]))
    # events split anywhere: only whole ones are passed on, without the ids the client did not ask for
    out = resume.feed(first + half[:10])
    assert [e["choices"][0]["delta"] for e in events(out)] == [{"role": "assistant", "content": ""},
                                                             {"content": "Hel"}]  # fmt: skip
    assert "token_ids" not in out.decode()
    out = resume.feed(half[10:])
    assert events(out)[0]["choices"][0]["delta"] == {"content": "lo"}
    with pytest.raises(StreamBroken):  # the pod's stream ended before its answer
        resume.ended()
    assert resume.kind == "resume" and resume.remaining() == 8
    path, body = resume.resume()
    assert path == "/v1/completions"
    assert body == {"model": "m", "stream": True, "prompt": [1, 2, 3, 7, 8], "max_tokens": 8,
                    "return_token_ids": True}  # fmt: skip
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    out = resume.feed(
        event(text_chunk(" there", [9])) + event(text_chunk("!", [10], finish="stop"))
        + event(text_chunk("", None, usage=usage) | {"choices": []}) + event("[DONE]")
    )  # fmt: skip
    got = events(out)
    assert [e["choices"][0]["delta"] for e in got[:2]] == [{"content": " there"}, {"content": "!"}]
    assert all(
        e["id"] == "a" and e["created"] == 1 and e["object"] == "chat.completion.chunk" for e in got[:3]
    )
    assert got[1]["choices"][0]["finish_reason"] == "stop"
    # counted against the client's prompt, every token of both attempts
    assert got[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert got[3] == "[DONE]"
    resume.ended()


def test_a_chat_asking_for_logprobs_resumes_as_a_chat_that_asks_for_them_again():
    """The token-id path answers through /v1/completions, whose log probabilities are lists, not a chat's
    entries: such a chat resumes from its text, in chat form, its logprobs fields carried."""
    asking = {**CHAT, "logprobs": True, "top_logprobs": 2}
    resume = StreamResume("/v1/chat/completions", asking, prompt_ids=[1, 2, 3])
    resume.feed(event(chat_chunk(None, None, role=True)) + event(chat_chunk("Hel", [7])))
    assert resume.kind == "resume_text"
    path, body = resume.resume()
    assert path == "/v1/chat/completions"
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    # a completion's logprobs are carried on the token-id path as they are
    resume = StreamResume("/v1/completions", {**COMPLETION, "logprobs": 2}, prompt_ids=[5])
    resume.feed(event(text_chunk("Once", [1])))
    assert resume.kind == "resume" and resume.resume()[1]["logprobs"] == 2


def test_a_constrained_chat_resumes_from_its_text_under_its_grammar_only_on_pods_that_continue_one():
    """A chat under a `response_format` resumes, on pods that say they continue a constrained answer (ours),
    from its text as a chat with `constrain_final_message` (the grammar reads the text sent first, then the
    continuation: the whole answer matches); the server takes what the router sends, its constraint then
    reading the text; where the pods do not say so (vLLM's, SGLang's), no constrained request is resumed."""
    asking = {**CHAT, "response_format": {"type": "json_object"}}
    assert resumable("/v1/chat/completions", asking) is None
    assert resumable("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}}) is None
    assert resumable("/v1/chat/completions", {**CHAT, "tools": TOOLS}) is None
    assert resumable("/generate_stream", {**TGI, "parameters": {"grammar": REGEX}}) is None
    assert resumable("/v1/chat/completions", asking, True) is StreamResume
    resume = StreamResume("/v1/chat/completions", asking, prompt_ids=[1, 2, 3])
    resume.feed(event(chat_chunk(None, None, role=True)) + event(chat_chunk('{"a": ', [7, 8])))
    assert resume.kind == "resume_text"
    path, body = resume.resume()
    assert path == "/v1/chat/completions" and body["response_format"] == {"type": "json_object"}
    assert body["messages"][-1] == {"role": "assistant", "content": '{"a": '}
    assert body["continue_final_message"] and body["constrain_final_message"]
    parsed = parse_openai_chat(body)
    assert parsed.params.constraint is not None and parsed.params.constraint.prefix == '{"a": '
    with pytest.raises(InvalidRequest, match="continue_final_message true") as refused:
        parse_openai_chat({**asking, "constrain_final_message": True})
    assert refused.value.field_name == "constrain_final_message"


REGEX = {"type": "regex", "value": "[a-z]+ [0-9]+"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip


def test_a_constrained_completion_resumes_from_its_text_which_its_grammar_reads_first():
    """On our pods a completion under a grammar resumes from its text (its ids would give the same tokens, but
    the grammar must read them: `constrained_prefix`, our extension); a TGI stream under a `grammar` too.
    The server takes the prefix into the constraint, and refuses one the prompt does not end with, or one
    without a grammar."""
    asking = {**COMPLETION, "structured_outputs": {"regex": "[a-z]+ [0-9]+"}}
    assert resumable("/v1/completions", asking, True) is StreamResume
    resume = StreamResume("/v1/completions", asking, prompt_ids=[5])
    resume.feed(event(text_chunk("upon", [1])) + event(text_chunk(" 1", [2])))
    assert resume.kind == "resume_text"
    body = {**asking, "prompt": "Onceupon 1", "constrained_prefix": "upon 1", "max_tokens": 4}
    assert resume.resume() == ("/v1/completions", body)
    constraint = parse_openai_completion(body).params.constraint
    assert constraint is not None and constraint.prefix == "upon 1"
    with pytest.raises(InvalidRequest, match="does not end with it") as refused:
        parse_openai_completion({**body, "prompt": "Once"})
    assert refused.value.field_name == "constrained_prefix"
    with pytest.raises(InvalidRequest, match="applies to a constrained request"):
        parse_openai_completion({**COMPLETION, "prompt": "Onceupon", "constrained_prefix": "upon"})
    tgi = {**TGI, "parameters": {**TGI["parameters"], "grammar": REGEX}}
    assert resumable("/generate_stream", tgi, True) is TgiStreamResume
    resume = TgiStreamResume("/generate_stream", tgi)
    resume.feed(tgi_event(1, "upon") + tgi_event(2, " 1"))
    _, body = resume.resume()
    assert body["inputs"] == "Onceupon 1" and body["parameters"]["constrained_prefix"] == "upon 1"
    constraint = parse_tgi_generate(body).params.constraint
    assert constraint is not None and constraint.prefix == "upon 1"
    with pytest.raises(InvalidRequest, match="does not end with it") as refused:
        parse_tgi_generate({**body, "inputs": "Once"})
    assert refused.value.field_name == "parameters.constrained_prefix"


@pytest.mark.real_model
def test_a_chat_read_for_tool_calls_resumes_from_its_raw_answer(smollm2_tools_dir):
    """The pod holds a tool call's text back until its block closes, then sends the call (`delta.tool_calls`):
    the client holds calls, not text. Such a chat resumes from its raw answer, every token's text (the held
    part included) with `constrain_final_message`: the next pod reads the calls in it, sends what was held
    and numbers its own calls after the ones sent. The client gets each event with calls; a token that is
    part of a character only is generated again."""
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_tools_dir)
    asking = {**CHAT, "tools": TOOLS, "max_tokens": 60}
    assert resumable("/v1/chat/completions", asking, True) is StreamResume
    raw = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    first, held = raw, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    ids = tokenizer.encode(first + held, add_special_tokens=False)
    cut = len(tokenizer.encode(first, add_special_tokens=False))
    resume = StreamResume("/v1/chat/completions", asking, prompt_ids=[1, 2], tokenizer=tokenizer)
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    with_call = chat_chunk(None, ids[1:cut])
    with_call["choices"][0]["delta"] = {"tool_calls": [call]}
    out = resume.feed(
        event(chat_chunk(None, None, role=True)) + event(chat_chunk("Let me check.", ids[:1]))
        + event(with_call) + b"".join(event(chat_chunk(None, [i])) for i in ids[cut:])
    )  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events(out)]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Let me check."},
        {"tool_calls": [call]},
    ]
    llama = tokenizer.encode("\U0001f999", add_special_tokens=False)  # (a llama: three tokens, one character)
    resume.feed(b"".join(event(chat_chunk(None, [i])) for i in llama[:2]))  # two of them: part of it
    assert resume.possible and resume.kind == "resume_text"
    path, body = resume.resume()
    assert path == "/v1/chat/completions" and body["tools"] == TOOLS
    assert body["messages"][-1] == {"role": "assistant", "content": first + held}
    assert body["continue_final_message"] and body["constrain_final_message"]
    assert body["max_tokens"] == 60 - len(ids)
    parsed = parse_openai_chat(body)
    assert parsed.answer_prefix == first + held
    # the next pod's reading: the held call completed by its continuation, numbered after the one sent
    from neuronfleet.runtime.serving.tool_calls import CallStream

    stream = CallStream(parsed.answer_prefix)
    content, calls = stream.feed('me"}}\n</tool_call>')
    assert content == "" and [c.arguments for c in calls] == ['{"city": "Rome"}'] and stream.calls == 2
    # without the router's tokenizer, or without ids, it cannot be resumed
    blind = StreamResume("/v1/chat/completions", asking, prompt_ids=[1, 2])
    blind.feed(event(chat_chunk("Let", [5])))
    assert not blind.possible


def test_an_error_event_in_place_of_tokens_is_a_break():
    resume = StreamResume("/v1/completions", COMPLETION, prompt_ids=[5])
    resume.feed(event(text_chunk("Once", [1])))
    with pytest.raises(StreamBroken, match="engine shut down"):
        resume.feed(event({"error": {"message": "the engine shut down", "code": 500}}))


def test_without_token_ids_a_chat_resumes_as_a_continued_assistant_message():
    resume = StreamResume("/v1/chat/completions", CHAT, prompt_ids=None)
    resume.feed(event(chat_chunk(None, None, role=True)) + event(chat_chunk("Hel", None)))
    assert resume.kind == "resume_text"
    path, body = resume.resume()
    assert path == "/v1/chat/completions"
    assert body["messages"] == [*CHAT["messages"], {"role": "assistant", "content": "Hel"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 9  # a token an event, without a tokenizer
    # the resumed stream's own opening is not passed on again
    out = resume.feed(
        event(chat_chunk(None, None, role=True, rid="z")) + event(chat_chunk("lo", None, rid="z"))
    )
    assert [e["choices"][0]["delta"] for e in events(out)] == [{"content": "lo"}]
    assert events(out)[0]["id"] == "a"


def test_a_completion_without_token_ids_resumes_from_its_prompt_and_text():
    resume = StreamResume("/v1/completions", {**COMPLETION, "min_tokens": 4}, prompt_ids=None)
    resume.feed(event(text_chunk(" upon", None)) + event(text_chunk(" a", None)))
    path, body = resume.resume()
    assert (path, body["prompt"]) == ("/v1/completions", "Once upon a")
    assert (body["max_tokens"], body["min_tokens"]) == (4, 2)


def test_a_pod_lost_after_its_last_token_ends_the_stream_with_its_finish():
    resume = StreamResume("/v1/completions", {**COMPLETION, "max_tokens": 2}, prompt_ids=[5])
    resume.feed(event(text_chunk("a", [1])) + event(text_chunk("b", [2])))
    assert resume.remaining() == 0
    got = events(resume.closing())
    assert got[0]["choices"][0]["finish_reason"] == "length" and got[0]["id"] == "b" and got[1] == "[DONE]"


def test_after_a_break_a_router_resumes_ends_the_stream_or_gives_up_at_the_bound():
    """`after_break`, what every router does with a broken attempt: the next attempt (and its kind) while
    resumes are left; the closing events once every token was sent; None past `max_resumes`."""
    resume = StreamResume("/v1/completions", COMPLETION, prompt_ids=[5])
    resume.feed(event(text_chunk("a", [1])))
    kind, path, body = resume.after_break(max_resumes=2)
    assert (kind, path, body["prompt"], body["max_tokens"]) == ("resume", "/v1/completions", [5, 1], 5)
    resume.feed(event(text_chunk("b", [2])))
    assert resume.after_break(max_resumes=1) is None  # one resume made: the bound
    kind, _, body = resume.after_break(max_resumes=2)
    assert (kind, body["prompt"], body["max_tokens"]) == ("resume", [5, 1, 2], 4)
    for token in (3, 4, 5, 6):
        resume.feed(event(text_chunk("c", [token])))
    closing = resume.after_break(max_resumes=5)
    assert isinstance(closing, bytes) and events(closing)[-1] == "[DONE]"


def choice_chunk(index: int, content: str | None, ids: list[int] | None, finish=None, role=False) -> dict:
    chunk = chat_chunk(content, ids, finish, role=role)
    chunk["choices"][0]["index"] = index
    return chunk


def test_a_stream_of_several_choices_resumes_each_unfinished_choice_in_an_attempt_of_its_own():
    """n = 3, greedy, the pod lost with choice 1 finished, choices 0 and 2 mid-answer: choice 0 goes on in
    an attempt of its own (n = 1, through /v1/completions from its ids, its events given index 0), whose
    usage and [DONE] are held back; then choice 2 (seed + 2): not a resume past the bound, a choice's turn.
    The client sees one stream: each choice's tokens once, at its index, one usage counting every token,
    one [DONE]."""
    asking = {**CHAT, "n": 3, "seed": 10, "stream_options": {"include_usage": True}}
    resume = StreamResume("/v1/chat/completions", asking, prompt_ids=[1, 2])
    opening = b"".join(event(choice_chunk(i, None, None, role=True)) for i in range(3))
    out = resume.feed(
        opening + event(choice_chunk(0, "A", [7])) + event(choice_chunk(1, "B", [8], finish="stop"))
        + event(choice_chunk(2, "C", [9]))
    )  # fmt: skip
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events(out)[3:]] == [
        (0, {"content": "A"}), (1, {"content": "B"}), (2, {"content": "C"})
    ]  # fmt: skip
    with pytest.raises(StreamBroken, match="before its answer finished"):
        resume.ended()
    kind, path, body = resume.after_break(max_resumes=1)
    assert (kind, path) == ("resume", "/v1/completions") and "n" not in body
    assert (body["prompt"], body["max_tokens"], body["seed"]) == ([1, 2, 7], 9, 10)
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    out = resume.feed(
        event(text_chunk("a", [10], finish="stop"))
        + event(text_chunk("", None, usage=usage) | {"choices": []}) + event("[DONE]")
    )  # fmt: skip
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events(out)] == [
        (0, {"content": "a"})
    ]
    with pytest.raises(StreamBroken, match="other choices go on"):
        resume.ended()
    kind, path, body = resume.after_break(max_resumes=1)  # (one resume made, and the bound is one)
    assert (body["prompt"], body["max_tokens"], body["seed"]) == ([1, 2, 9], 9, 12)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    out = resume.feed(
        event(text_chunk("c", [11])) + event(text_chunk("!", [12], finish="length"))
        + event(text_chunk("", None, usage=usage) | {"choices": []}) + event("[DONE]")
    )  # fmt: skip
    got = events(out)
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in got[:2]] == [
        (2, {"content": "c"}), (2, {"content": "!"})
    ]  # fmt: skip
    assert got[1]["choices"][0]["finish_reason"] == "length"
    # A B C, a, c ! : six tokens in all, against the client's prompt
    assert got[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert got[3] == "[DONE]" and all(e["id"] == "a" for e in got[:3])
    resume.ended()


def test_a_choice_that_got_every_token_gets_its_finish_ahead_of_the_next_choices_attempt():
    resume = StreamResume("/v1/completions", {**COMPLETION, "n": 2, "max_tokens": 2}, prompt_ids=[5])
    a, b = text_chunk("a", [1]), text_chunk("b", [2])
    b["choices"][0]["index"] = 1
    resume.feed(event(a) + event(a) + event(b))  # choice 0: both its tokens; choice 1: one
    kind, _, body = resume.after_break(max_resumes=1)
    assert (kind, body["prompt"], body["max_tokens"]) == ("resume", [5, 2], 1)
    got = events(resume.feed(event(text_chunk("c", [3], finish="length")) + event("[DONE]")))
    assert [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in got[:2]] == [
        (0, "length"), (1, "length")
    ]  # fmt: skip
    assert got[2] == "[DONE]"


def test_the_server_accepts_what_a_router_resumes_with():
    assert parse_openai_completion({"prompt": [1, 2], "return_token_ids": True}).return_token_ids
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    parsed = parse_openai_chat(
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert parsed.continue_final_message and not parsed.add_generation_prompt
    with pytest.raises(InvalidRequest, match="add_generation_prompt false"):
        parse_openai_chat({"messages": messages, "continue_final_message": True})
    with pytest.raises(InvalidRequest, match="role assistant"):
        parse_openai_chat(
            {"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False}
        )


@pytest.mark.real_model
def test_a_continued_assistant_message_is_left_open(smollm2_dir):
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("Hello th")
    closed = tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert len(closed) > len(ids) and closed[: len(ids)] == ids  # the template's end of turn, cut


def test_a_token_whose_text_the_pod_held_back_is_generated_again():
    """A pod holds a token's text while it ends in part of a character: the event carries its id, no text.
    The client did not get that text, so the next pod generates the token again."""
    resume = StreamResume("/v1/completions", COMPLETION, prompt_ids=[5])
    out = resume.feed(event(text_chunk("a", [1])) + event(text_chunk("", [2])))
    assert [e["choices"][0]["text"] for e in events(out)] == ["a"]  # the ids-only event is not passed on
    assert resume.resume() == ("/v1/completions", {**COMPLETION, "prompt": [5, 1], "max_tokens": 5,
                                                    "return_token_ids": True})  # fmt: skip


# ---- TGI's /generate_stream (TGI 3.3.5's StreamResponse: router/src/lib.rs) ----


def tgi_event(index: int, text: str, last: dict | None = None, token_id: int | None = None) -> bytes:
    token = {"id": token_id if token_id is not None else 100 + index, "text": text, "logprob": -0.5,
             "special": False}  # fmt: skip
    chunk = {"index": index, "token": token, "generated_text": None, "details": None, **(last or {})}
    return f"data:{json.dumps(chunk)}\n\n".encode()


def tgi_events(data: bytes) -> list[dict]:
    return [json.loads(raw[5:]) for raw in data.split(b"\n\n") if raw.startswith(b"data:")]


def test_a_tgi_stream_resumes_from_its_text_and_reads_as_one_stream():
    resume = TgiStreamResume("/generate_stream", TGI)
    assert resume.client_ids  # TGI's events carry the ids: nothing asked of the pods
    first = tgi_event(1, " upon") + tgi_event(2, " a")
    out = resume.feed(first[:30])  # a partial event waits for its end
    assert out == b""
    out = resume.feed(first[30:] + b":\n\n")  # a keep-alive comment passes as it is
    assert [(e["index"], e["token"]["text"]) for e in tgi_events(out)] == [(1, " upon"), (2, " a")]
    assert out.endswith(b":\n\n")
    with pytest.raises(StreamBroken):  # ended before its last event
        resume.ended()
    kind, path, body = resume.after_break(max_resumes=2)
    assert (kind, path) == ("resume_text", "/generate_stream")
    # the inputs followed by the text sent, max_new_tokens less the tokens sent, the rest as sent (the seed)
    assert body == {"inputs": "Once upon a", "parameters": {"max_new_tokens": 4, "details": True, "seed": 7}}
    assert resume.before == 2 and resume.attempts == 1
    # the next pod's own stream: its indices from 1, its generated_text its own, its details its own
    last = {"generated_text": " time there", "details": {"finish_reason": "length", "generated_tokens": 2,
                                                         "seed": 7, "input_length": 4}}  # fmt: skip
    out = resume.feed(tgi_event(1, " time") + tgi_event(2, " there", last))
    got = tgi_events(out)
    assert [(e["index"], e["token"]["text"]) for e in got] == [(3, " time"), (4, " there")]
    assert got[1]["generated_text"] == " upon a time there"  # the whole answer's text
    assert got[1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "seed": 7,
                                 "input_length": 2}  # fmt: skip
    assert got[1]["token"] == {"id": 102, "text": " there", "logprob": -0.5, "special": False}
    resume.ended()


def test_a_tgi_error_event_is_a_break_but_a_validation_error_is_the_answer():
    resume = TgiStreamResume("/generate_stream", TGI)
    resume.feed(tgi_event(1, " upon"))
    with pytest.raises(StreamBroken, match="Request failed during generation"):
        resume.feed(b'data:{"error":"Request failed during generation","error_type":"generation"}\n\n')
    resume = TgiStreamResume("/generate_stream", TGI)
    refused = b'data:{"error":"Input validation error: too long","error_type":"validation"}\n\n'
    assert resume.feed(refused) == refused  # no pod would take it: the client's answer, as it is
    resume.ended()


def test_a_tgi_stream_resumed_twice_counts_every_token_and_special_tokens_stay_out_of_the_text():
    body = {"inputs": "Q:", "parameters": {"max_new_tokens": 10, "details": True}}
    resume = TgiStreamResume("/generate_stream", body)
    resume.feed(tgi_event(1, " A"))
    _, _, body2 = resume.after_break(max_resumes=2)
    assert body2["inputs"] == "Q: A" and body2["parameters"]["max_new_tokens"] == 9
    resume.feed(tgi_event(1, " B") + tgi_event(2, " C"))
    _, _, body3 = resume.after_break(max_resumes=2)
    assert body3["inputs"] == "Q: A B C" and body3["parameters"]["max_new_tokens"] == 7
    assert resume.after_break(max_resumes=2) is None  # the bound: the stream ends cut
    eos = {"id": 2, "text": "</s>", "logprob": -0.1, "special": True}
    last = {
        "generated_text": " D",
        "details": {"finish_reason": "eos_token", "generated_tokens": 2, "seed": None},
    }
    out = resume.feed(tgi_event(1, " D") + tgi_event(2, "", last | {"token": eos}))
    got = tgi_events(out)
    assert [e["index"] for e in got] == [4, 5]
    assert got[1]["generated_text"] == " A B C D" and got[1]["details"]["generated_tokens"] == 5


def test_a_tgi_stream_with_the_full_text_keeps_the_resumed_attempts_text():
    """`return_full_text`: the resumed attempt's generated_text is its inputs (the client's and the text sent)
    followed by its own: the whole of it already. On `POST /` without the field the server's default says
    which (TGI: true for a text-generation model): the text tells."""
    body = {"inputs": "Q:", "parameters": {"max_new_tokens": 4, "return_full_text": True}}
    resume = TgiStreamResume("/generate_stream", body)
    resume.feed(tgi_event(1, " A"))
    resume.resume()
    out = resume.feed(tgi_event(1, " B", {"generated_text": "Q: A B"}))
    assert tgi_events(out)[0]["generated_text"] == "Q: A B"
    assert tgi_events(out)[0]["details"] is None  # details not asked
    for said, want in (("Q: A B", "Q: A B"), (" B", " A B")):  # the server's default: full text, or not
        resume = TgiStreamResume("/", {"inputs": "Q:", "stream": True, "parameters": {"max_new_tokens": 4}})
        resume.feed(tgi_event(1, " A"))
        path, body = resume.resume()
        assert (path, body["stream"], body["inputs"]) == ("/", True, "Q: A")
        out = resume.feed(tgi_event(1, " B", {"generated_text": said}))
        assert tgi_events(out)[0]["generated_text"] == want


def test_a_tgi_stream_whose_pod_died_after_its_last_token_gets_its_last_event():
    """Our runtime's last event may carry no token (after a stop string): lost, the router writes it."""
    resume = TgiStreamResume(
        "/generate_stream", {**TGI, "parameters": {**TGI["parameters"], "max_new_tokens": 2}}
    )
    resume.feed(tgi_event(1, " upon") + tgi_event(2, " a"))
    closing = resume.after_break(max_resumes=2)
    assert isinstance(closing, bytes)
    (last,) = tgi_events(closing)
    assert last["index"] == 2 and last["token"]["text"] == "" and last["token"]["special"]
    assert last["generated_text"] == " upon a"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 2, "seed": 7}
    resume.ended()


def test_a_tgi_stream_without_max_new_tokens_leaves_the_bound_to_the_pod():
    resume = TgiStreamResume("/generate_stream", {"inputs": "Once"})
    resume.feed(tgi_event(1, " upon"))
    assert resume.remaining() is None
    assert resume.after_break(max_resumes=1)[2] == {"inputs": "Once upon", "parameters": {}}


def test_the_server_accepts_what_a_router_resumes_a_tgi_stream_with():
    from neuronfleet.runtime.serving.api_requests import parse_tgi_generate

    resume = TgiStreamResume(
        "/", {**TGI, "stream": True, "parameters": {**TGI["parameters"], "best_of": None}}
    )
    resume.feed(tgi_event(1, " upon"))
    _, body = resume.resume()
    parsed = parse_tgi_generate(body)
    assert (parsed.prompt, parsed.params.max_tokens, parsed.params.seed, parsed.stream) == (
        "Once upon",
        5,
        7,
        True,
    )
