"""Stream resume (runtime/routing/resume.py) against the engines it resumes on: every field the router adds
to a streamed request (the first attempt's, an exact resume's, a text resume's) and every id it reads back
is checked against the record of what vLLM 0.16.0 and 0.24.0 (the pinned versions) and SGLang 0.5.16 to
0.5.23 accept, refuse and stream (tests/data/resume-fields-vllm0.16.0-0.24.0-sglang0.5.16-0.5.23.json:
file, line and class in each wheel from PyPI). A field resume.py starts sending that the record does not
name for every engine fails here, and so does any change to the recorded conflicts: SGLang from 0.5.17
refuses a streamed chat with `return_token_ids` (HTTP 400), which a router that knows it speaks to SGLang
never sends. SGLang at the image's commit 43881a7 could not be read (see the record's `pins`)."""

from __future__ import annotations

import json

import pytest
from support import ROOT

from neuronfleet.runtime.routing.resume import (
    CHAT,
    COMPLETIONS,
    TOKEN_ID_FIELDS,
    StreamResume,
    with_token_ids,
)

RECORD = json.loads(
    (ROOT / "tests" / "data" / "resume-fields-vllm0.16.0-0.24.0-sglang0.5.16-0.5.23.json").read_text()
)
ENGINES = RECORD["engines"]
PINNED = [name for name, engine in ENGINES.items() if engine["pinned"]]
CLIENT = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True},
    COMPLETIONS: {"model": "m", "prompt": "Once", "max_tokens": 8, "stream": True},
}
OPENAI = {"model", "prompt", "messages", "max_tokens", "stream"}  # the client's own (OpenAI's) fields
PROMPT_IDS, SENT_IDS = [1, 2], [7]


def event(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def stream(path: str, ids: dict[str, str] | None) -> bytes:
    """A pod's first events (an opening for a chat, then one token), carrying the token ids where `ids` (an
    engine's `streamed_ids` for the path) says: "chunk..." on the event, "choice..." on its choice."""
    ids = ids or {}

    def put(chunk: dict, name: str, value: list[int]) -> None:
        if name in ids:
            (chunk if ids[name].startswith("chunk") else chunk["choices"][0])[name] = value

    out = b""
    if path == CHAT:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        opening = {
            "id": "a",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [role],
        }
        put(opening, "prompt_token_ids", PROMPT_IDS)
        out += event(opening)
        choice = {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}
        token = {
            "id": "a",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }
    else:
        choice = {"index": 0, "text": "Hel", "finish_reason": None}
        token = {"id": "a", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
        put(token, "prompt_token_ids", PROMPT_IDS)
    put(token, "token_ids", SENT_IDS)
    return out + event(token)


def attempts(engine: str | None = None) -> list[tuple[str, str, dict]]:
    """Every request the router sends a pod for a client's streamed request: (what, path, body); `engine`:
    the record's name of the engine the router knows it speaks to (the P/D router's `--peer-protocol`)."""
    family = engine.split()[0] if engine else None
    out = []
    for path, client in CLIENT.items():
        out.append(("first attempt", path, with_token_ids(client, path, family)))
        exact = StreamResume(path, client, PROMPT_IDS)
        exact.feed(stream(path, {"token_ids": "choice"}))
        assert exact.kind == "resume"
        out.append(("exact resume", *exact.resume()))
        text = StreamResume(path, client, None)
        text.feed(stream(path, None))
        assert text.kind == "resume_text"
        out.append(("text resume", *text.resume()))
        nothing = StreamResume(path, client, None)  # broken before its first token
        out.append(("text resume, nothing sent", *nothing.resume()))
    return out


def added(path: str, body: dict) -> set[str]:
    """The fields the router put in a body beyond the client's (OpenAI's) own."""
    return set(body) - OPENAI - set(CLIENT[COMPLETIONS]) - set(CLIENT[CHAT])


def sent() -> dict[str, set[str]]:
    fields: dict[str, set[str]] = {CHAT: set(), COMPLETIONS: set()}
    for _, path, body in attempts():
        fields[path] |= added(path, body)
    return fields


def test_the_router_adds_these_fields_and_sends_a_resume_as_token_ids():
    assert sent() == {
        COMPLETIONS: {"return_token_ids"},
        CHAT: {"return_token_ids", "continue_final_message", "add_generation_prompt"},
    }
    exact = [body for what, path, body in attempts() if what == "exact resume"]
    assert exact and all(body["prompt"] == PROMPT_IDS + SENT_IDS for body in exact)
    assert TOKEN_ID_FIELDS == ("token_ids", "prompt_token_ids")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_field_the_router_sends_or_reads_is_recorded_for_every_engine(engine):
    record = ENGINES[engine]
    for path, fields in sent().items():
        known = (
            set(record["request_fields"].get(path, {}))
            | set(record["absent_request_fields"].get(path, {}))
            | set(record["refused_when_streamed"].get(path, {}))
        )
        assert fields <= known, f"{engine} {path}: not in the record: {sorted(fields - known)}"
        read = set(record["streamed_ids"].get(path, {})) | set(record["absent_streamed_ids"].get(path, {}))
        assert set(TOKEN_ID_FIELDS) <= read, f"{engine} {path}: not in the record: {TOKEN_ID_FIELDS}"
    assert record["unknown_request_fields"]["effect"] == "ignored"  # an absent field is served without
    assert record["prompt_accepts_token_ids"]  # an exact resume's prompt, on every engine


@pytest.mark.parametrize("engine", PINNED)
def test_the_pinned_vllm_versions_accept_every_field_the_router_sends(engine):
    record = ENGINES[engine]
    assert engine.startswith("vllm ") and set(PINNED) == {"vllm 0.16.0", "vllm 0.24.0"}
    for path, fields in sent().items():
        assert fields <= set(record["request_fields"][path]), (engine, path)
        assert not record["refused_when_streamed"][path] and not record["absent_request_fields"][path]


@pytest.mark.parametrize("engine", PINNED)
def test_the_pinned_vllm_versions_stream_the_ids_the_router_reads_so_a_resume_is_exact(engine):
    record = ENGINES[engine]
    for path, client in CLIENT.items():
        ids = record["streamed_ids"][path]
        assert set(TOKEN_ID_FIELDS) <= set(ids), (engine, path)
        resume = StreamResume(path, client, None)  # no tokenizer: the prompt's ids as the pod says them
        resume.feed(stream(path, ids))
        assert resume.kind == "resume", (engine, path, ids)
        assert resume.resume()[1]["prompt"] == PROMPT_IDS + SENT_IDS


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_no_request_sets_together_what_an_engine_refuses_together(engine):
    """vLLM refuses `continue_final_message` with `add_generation_prompt` both true (HTTP 400)."""
    for path, refused in ENGINES[engine]["refused"].items():
        for combination in refused:
            names = combination.split("+")
            for what, sent_path, body in attempts():
                if sent_path == path:
                    assert not all(body.get(name) is True for name in names), (engine, what, combination)


def test_the_router_never_sends_an_engine_what_it_refuses_on_a_stream():
    """SGLang from 0.5.17 refuses a streamed chat carrying `return_token_ids` (recorded): a router that knows
    it speaks to SGLang (`--peer-protocol sglang`) does not ask it there, while one that does not know (the
    front door) would, and learns it from the 400 (tests/integration/test_front_door_serving.py)."""
    found, unknowing = set(), set()
    for engine, record in ENGINES.items():
        for sent_to, into in ((engine, found), (None, unknowing)):
            for _, path, body in attempts(sent_to):
                assert body.get("stream") is True
                for field in added(path, body) & set(record["refused_when_streamed"][path]):
                    into.add((engine, path, field))
    assert found == set()
    recorded = {
        (engine, conflict["path"], conflict["field"])
        for conflict in RECORD["known_conflicts"]
        for engine in conflict["engines"]
    }
    assert (
        unknowing
        == recorded
        == {("sglang 0.5.17", CHAT, "return_token_ids"), ("sglang 0.5.23", CHAT, "return_token_ids")}
    )
    assert not any(engine in PINNED for engine, _, _ in unknowing)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_where_an_engine_streams_no_ids_the_router_resumes_from_the_text_with_fields_it_accepts(engine):
    record = ENGINES[engine]
    for path, client in CLIENT.items():
        ids = record["streamed_ids"][path]
        if set(TOKEN_ID_FIELDS) <= set(ids):
            continue
        assert not ids or path == COMPLETIONS  # ids without the prompt's: the router's tokenizer gives those
        resume = StreamResume(path, client, None)
        resume.feed(stream(path, ids))
        assert resume.kind == "resume_text"
        next_path, body = resume.resume()
        assert next_path == path
        if path == CHAT:
            assert body["messages"][-1] == {"role": "assistant", "content": "Hel"}
            assert "continue_final_message" in record["request_fields"][CHAT]
            assert "add_generation_prompt" in (
                set(record["request_fields"][CHAT]) | set(record["absent_request_fields"][CHAT])
            )
