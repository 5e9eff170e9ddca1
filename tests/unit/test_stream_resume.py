"""`resume.StreamResume`: a streamed OpenAI answer carried across the pods that serve it, event by event, and
the next attempt's request; with the serving side that accepts it (`return_token_ids`, a continued assistant
message)."""

from __future__ import annotations

import json

import pytest

from neuronfleet.runtime.routing.resume import StreamBroken, StreamResume, resumable
from neuronfleet.runtime.serving.api_requests import parse_openai_chat, parse_openai_completion
from neuronfleet.runtime.serving.errors import InvalidRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "stream": True}
COMPLETION = {"model": "m", "prompt": "Once", "max_tokens": 6, "stream": True}


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


def test_only_openai_streams_of_one_choice_are_resumable():
    assert resumable("/v1/chat/completions", CHAT) and resumable("/v1/completions", COMPLETION)
    assert not resumable("/v1/completions", {**COMPLETION, "stream": False})
    assert not resumable("/v1/completions", {**COMPLETION, "n": 2})
    assert not resumable("/generate_stream", {"inputs": "x", "stream": True})


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
