"""`resume.StreamResume`: a streamed OpenAI answer carried across the pods that serve it, event by event, and
the next attempt's request; with the serving side that accepts it (`return_token_ids`, a continued assistant
message)."""

from __future__ import annotations

import json

import pytest

from neuronfleet.runtime.routing.resume import StreamBroken, StreamResume, TgiStreamResume, resumable
from neuronfleet.runtime.serving.api_requests import parse_openai_chat, parse_openai_completion
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
    assert resumable("/v1/completions", {**COMPLETION, "n": 2}) is None
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
    reading the text; a constrained completion is never resumed, nor a chat where the pods do not say so."""
    asking = {**CHAT, "response_format": {"type": "json_object"}}
    assert resumable("/v1/chat/completions", asking) is None
    assert (
        resumable("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}}, True) is None
    )
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
