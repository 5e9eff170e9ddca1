"""A streamed OpenAI answer carried across the pods that serve it (pure, no I/O): what a router that passes
bytes on (the front door of unified pods, the router before vLLM or SGLang servers) needs to resume a stream
whose pod died on another pod, so that its client sees one stream, no token repeated or missing.

`StreamResume` reads the server-sent events of `/v1/completions` and `/v1/chat/completions` streams as they
come (`feed`), keeps what was sent to the client (the generated token ids where the pods give them, their
text), and rewrites each event for the client: the first attempt's `id`, `created` and `model` on every
event, the ids the router asked for removed when the client did not ask, a resumed chat's events in chat form
and without a second role event, the usage counting every token of every attempt against the client's prompt.
`resume()` is the next attempt's path and body:

- exact (`kind` "resume"): every event carried its tokens' ids (`return_token_ids`, vLLM's extension, which
  our runtime accepts too): `/v1/completions` with the prompt as token ids, the client's prompt (the ids the
  pod said in its first event, `prompt_token_ids`, else the router's tokenizer's) followed by the ids sent,
  and `max_tokens` less what was sent. A greedy
  request continues exactly as an undisturbed one would have; a chat goes through `/v1/completions` and
  comes back in chat form (`RESUME_FIELDS` are carried over; a chat asking for `logprobs`, and a
  constrained request, resume from the text instead, below, to keep them in chat form and under the
  grammar; a constrained request is resumed only where the pods continue a grammar: `resumable`).
- from the text (`kind` "resume_text"): a pod that gave no ids: a completion's prompt followed by the text
  sent; a chat's messages followed by an assistant message of the text sent, with vLLM's
  `continue_final_message: true, add_generation_prompt: false`. The text is tokenized again, so the seam
  may differ from an undisturbed answer's. A constrained request also carries our pods' extension that
  makes the text sent the answer's beginning (a chat's `constrain_final_message: true`, a completion's
  `constrained_prefix`): the grammar reads it, then the continuation. A chat read for tool calls resumes
  from its raw answer, the text of every token the pod gave, calls and text it held back included (the
  client got calls, not their text): the next pod reads the calls in it again, sends the ones that were
  held back and numbers its own after them; this needs the tokens' ids and the router's tokenizer.

A stream of `n` choices resumes one choice at a time: each choice not finished at the break is continued by
an attempt of its own (`n` 1, the choice's seed, its events given the choice's index), one after the other,
the usage and `[DONE]` at the end of the last.

A sampled request gets a continuation conditioned on what was sent: the same distribution, not the same
draws (a `seed` is sent again, choice i's as seed + i as our pods sample it, but the random state of the
first pod is gone).

`TgiStreamResume` does the same for TGI's `/generate_stream` (and its `POST /` with `"stream": true`), whose
API takes text only: always from the text (`kind` "resume_text"): the next attempt is the client's request
with `inputs` followed by the text sent and `max_new_tokens` less the tokens sent; its events continue the
client's `index`, its final `generated_text` is the whole answer's, its `details.generated_tokens` counts
every token of every attempt; a `grammar` is continued with our pods' `constrained_prefix`. `resumable()`
says which of the two carries a request's stream; a router uses either alike (`feed`, `ended`,
`after_break`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GENERATE_STREAM, TGI_COMPAT = "/generate_stream", "/"  # TGI's stream, and its route that streams on "stream"
# what a chat's resumed /v1/completions request carries over of the client's body
RESUME_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "user", "stream",
    "stream_options", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


class StreamBroken(Exception):
    """The pod's stream ended before the answer did (an error event, or its end without a finish)."""


def resumable(
    path: str, body: Any, grammars: bool = False
) -> type[StreamResume] | type[TgiStreamResume] | None:
    """What carries this request's stream across pods: `StreamResume` for an OpenAI completion or chat
    streamed (of any `n` choices), `TgiStreamResume` for a TGI stream of text `inputs` and one sequence (TGI
    refuses `best_of` > 1 and `decoder_input_details` on a stream anyway); None for any other request. A
    constrained request (`constrained`) is resumed only where the pods continue an answer under its grammar
    and its reading for tool calls (`grammars`: ours, which say `constrain_final_message` in their ready
    answer): from its text, with that extension."""
    if not isinstance(body, dict):
        return None
    if path in (COMPLETIONS, CHAT):
        if constrained(body) and not grammars:
            return None
        return StreamResume if body.get("stream") is True else None
    if path == GENERATE_STREAM or (path == TGI_COMPAT and body.get("stream") is True):
        parameters = body.get("parameters", {})
        if (
            isinstance(body.get("inputs"), str)
            and isinstance(parameters, dict)
            and parameters.get("best_of") in (None, 1)
            and not parameters.get("decoder_input_details")
            and (parameters.get("grammar") is None or grammars)  # (constrained: as `constrained` says)
        ):
            return TgiStreamResume
    return None


# vLLM's structured-output fields beside OpenAI's response_format (vllm/entrypoints/openai/protocol.py: the
# `structured_outputs` object, and the `guided_*` fields it replaced, removed in 0.12.0: docs.vllm.ai,
# features/structured_outputs, read for 0.25)
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constrained(body: dict) -> bool:
    """The request asks its answer to match a grammar (a JSON schema, any JSON object, vLLM's fields), or
    reads tool calls out of it. Such a stream is resumed only on our pods, which take the text sent as the
    answer's beginning: a vLLM or SGLang pod that continues an answer starts its grammar and its reading for
    calls at the continuation (`continue_final_message`), so the answer would no longer match; there it ends
    cut, as any stream that cannot be resumed."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return True
    if tools_read(body):
        return True
    return any(body.get(name) is not None for name in STRUCTURED_FIELDS)


def tools_read(body: dict) -> bool:
    """A chat whose answer is read for tool calls, or is calls."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


# where an engine refuses `return_token_ids` on a stream: SGLang 0.5.17 to 0.5.23 answers a streamed chat
# carrying it with HTTP 400, and streams a chat no ids anyway (serving_chat.py, _convert_to_internal_request;
# tests/data/resume-fields-vllm0.16.0-0.24.0-sglang0.5.16-0.5.23.json): its chats resume from the text
IDS_REFUSED = frozenset({("sglang", CHAT)})


def with_token_ids(body: dict, path: str, engine: str | None = None) -> dict:
    """The client's body asking the pod for its tokens' ids (vLLM's `return_token_ids`), unless the pods'
    `engine` refuses that on `path` (IDS_REFUSED)."""
    if (engine, path) in IDS_REFUSED:
        return body
    return {**body, "return_token_ids": True}


class CarriedStream:
    """What every carrier of a client's stream shares: whole events cut out of the pod's bytes (`feed`), and
    the one decision a router takes when an attempt's stream broke (`after_break`)."""

    attempts: int  # attempts after the first
    resumes: int  # of those, the ones made after a break
    before: int  # tokens sent before this attempt began
    client_ids: bool  # the client gets the tokens' ids already (asked them, or TGI's events carry them)
    _buffer: bytes

    def feed(self, data: bytes) -> bytes:
        """The client's bytes for the pod's bytes (whole events only: a partial one waits for its end);
        StreamBroken for an error event in place of tokens."""
        self._buffer += data.replace(b"\r\n", b"\n")
        out = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            if (passed := self._event(event)) is not None:
                out.append(passed + b"\n\n")
        return b"".join(out)

    UNFINISHED = "the stream ended before its answer finished"  # StreamBroken's message at an early end
    done: bool  # the answer's last event was sent

    def ended(self) -> None:
        """The pod's stream ended: StreamBroken unless the answer did."""
        if not self.done:
            raise StreamBroken(self.UNFINISHED)

    def broke(self) -> bool:
        """The attempt that ended, ended before its answer did: a break (its pod failed)."""
        return True

    def _event(self, event: bytes) -> bytes | None:
        """One event for the client: comments and events whose data is not a JSON object as they are (none
        for an empty one), `[DONE]` and JSON objects as the carrier says (`_end`, `_chunk`)."""
        data = _data(event)
        if not data:
            return event if event.strip() else None  # comments and other fields as they are
        if data.strip() == b"[DONE]":
            return self._end(event)
        try:
            chunk = json.loads(data)
        except ValueError:
            return event
        return self._chunk(chunk, event) if isinstance(chunk, dict) else event

    def _end(self, event: bytes) -> bytes | None:
        """A `data: [DONE]` event."""
        return event

    def _chunk(self, chunk: dict, event: bytes) -> bytes | None:
        """An event whose data is a JSON object (`event`, as it came)."""
        raise NotImplementedError

    @property
    def possible(self) -> bool:
        raise NotImplementedError

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def remaining(self) -> int | None:
        raise NotImplementedError

    def resume(self) -> tuple[str, dict]:
        raise NotImplementedError

    def closing(self) -> bytes:
        raise NotImplementedError

    def after_break(self, max_resumes: int) -> tuple[str, str, dict] | bytes | None:
        """What follows an attempt whose stream broke: None when it cannot go on (`max_resumes` resumes
        made already, or none `possible`); the closing events when every token was sent and only the finish
        was lost (the router writes them and ends the stream); else the next attempt's kind, path and body
        (`resume`)."""
        if self.resumes >= max_resumes or not self.possible:
            return None
        if self.remaining() == 0:
            return self.closing()
        kind = self.kind
        return (kind, *self.resume())


def _data(event: bytes) -> bytes:
    """An event's data: its `data:` lines joined."""
    return b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))


@dataclass(eq=False)  # (each choice its own: two choices sent the same tokens are still two)
class _Choice:
    """What one choice of the client's stream was sent, over every attempt."""

    sent_ids: list[int] = field(default_factory=list)  # generated tokens sent to the client
    # of those, the ones whose text the client has: a pod holds back a token's text while it ends in part of a
    # character (an event of ids, no text); a resume regenerates the ones after the last text
    shown: int = 0
    sent_text: str = ""
    sent_pieces: int = 0  # events that carried text: one token each, as engines stream
    exact: bool = True  # every event so far carried its tokens' ids
    finished: bool = False  # a finish reason was sent


class StreamResume(CarriedStream):
    """One client's OpenAI stream across the attempts that serve it (see the module's docstring). A stream
    of `n` choices is resumed one choice at a time: after a break, each choice not finished is continued by
    an attempt of its own (n = 1, its events given the choice's index), one after the other; the usage and
    `[DONE]` come once, at the end of the last."""

    def __init__(
        self, path: str, body: dict, prompt_ids: Sequence[int] | None, tokenizer: Any = None
    ) -> None:
        self.path, self.body, self.tokenizer = path, body, tokenizer
        self.chat = path == CHAT
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.client_ids = body.get("return_token_ids") is True
        # a chat read for tool calls: resumed from its raw answer (every token the pod gave, see the module)
        self.raw = self.chat and tools_read(body)
        n = body.get("n")
        self.choices = [_Choice() for _ in range(n if isinstance(n, int) and not isinstance(n, bool) and n > 1
                                                   else 1)]  # fmt: skip
        self.serving: int | None = None  # the choice this attempt continues (None: the first attempt's all)
        self.attempts = 0  # attempts after the first
        self.resumes = 0  # of those, the ones made after a break (not a choice's after another choice's end)
        self.as_completion = False  # this attempt answers a chat through /v1/completions
        self.before = 0  # tokens sent before this attempt began, every choice's
        self.done = False  # `data: [DONE]` was sent
        self.identity: dict[str, Any] | None = None  # id, created, model of the first attempt's first event
        self._buffer = b""
        self._closing = b""  # the finish of a choice with no token left, sent ahead of the next attempt's

    # ---- the stream ----

    def feed(self, data: bytes) -> bytes:
        out = super().feed(data)
        if self._closing:
            out, self._closing = self._closing + out, b""
        return out

    OTHER_CHOICES = "the attempt's choice ended: the answer's other choices go on in attempts of their own"

    def ended(self) -> None:
        if not self.done:
            raise StreamBroken(self.UNFINISHED if self.broke() else self.OTHER_CHOICES)

    def broke(self) -> bool:
        """This attempt ended before its answer did (not a continued choice that finished, others to come)."""
        return self.serving is None or not self.choices[self.serving].finished

    def _end(self, event: bytes) -> bytes | None:
        if all(c.finished for c in self.choices):
            self.done = True
            return b"data: [DONE]"
        if self.broke():
            raise StreamBroken(self.UNFINISHED)
        return None  # (another choice goes on)

    def _chunk(self, chunk: dict, event: bytes) -> bytes | None:
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamBroken(f"the pod's stream ended with an error: {message}")
        chunk = self._rewrite(chunk)
        return None if chunk is None else b"data: " + json.dumps(chunk, ensure_ascii=False).encode()

    def _rewrite(self, chunk: dict) -> dict | None:
        if self.identity is None:
            self.identity = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if self.prompt_ids is None and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids = list(chunk["prompt_token_ids"])
        chunk.update(self.identity)
        if self.as_completion:
            chunk["object"] = "chat.completion.chunk"
        choices = []
        for choice in chunk.get("choices") or []:
            if self.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = list(choice["prompt_token_ids"])
            index = self.serving if self.serving is not None else choice.get("index", 0)
            if not isinstance(index, int) or not 0 <= index < len(self.choices):
                choices.append(choice)  # (not a choice asked for: as it is)
                continue
            state, choice = self.choices[index], {**choice, "index": index}
            ids = choice.get("token_ids")
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if isinstance(ids, list):
                state.sent_ids += ids
            elif text:
                state.exact = False
            state.sent_text += text or ""
            state.sent_pieces += bool(text)
            if choice.get("finish_reason"):
                state.finished = True
            if text or choice.get("finish_reason") or self.raw:
                state.shown = len(state.sent_ids)
            if self.as_completion:
                choice = {k: v for k, v in choice.items() if k != "text"} | {"delta": {"content": text}
                                                                            if text else {}}  # fmt: skip
            elif self.attempts and self.chat:
                delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
                choice = {**choice, "delta": delta}
            if not self.client_ids:
                choice = {k: v for k, v in choice.items() if k not in TOKEN_ID_FIELDS}
            calls = (choice.get("delta") or {}).get("tool_calls")
            shows = text or calls or choice.get("finish_reason") or choice.get("token_ids")
            if not shows and (self.attempts or isinstance(ids, list)):
                continue  # an attempt's opening (the client had one), or ids only, which it did not ask for
            choices.append(choice)
        if not self.client_ids:
            chunk.pop("prompt_token_ids", None)
        if isinstance(chunk.get("usage"), dict):
            if not choices and not all(c.finished for c in self.choices):
                return None  # an attempt's own usage, other choices to come: the last attempt's counts all
            chunk["usage"] = self._usage(chunk["usage"])
        if not choices and chunk.get("choices") and not chunk.get("usage"):
            return None
        chunk["choices"] = choices
        return chunk

    def _usage(self, usage: dict) -> dict:
        """Counted against the client's prompt: every token of every attempt."""
        prompt = len(self.prompt_ids) if self.prompt_ids is not None else usage.get("prompt_tokens", 0)
        if not self.attempts:
            prompt = usage.get("prompt_tokens", prompt)
        completion = self.before + int(usage.get("completion_tokens") or 0)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    # ---- the next attempt ----

    def _next(self) -> _Choice:
        """The choice the next attempt continues: this attempt's, else the first not finished."""
        if self.serving is not None and not self.choices[self.serving].finished:
            return self.choices[self.serving]
        return next((c for c in self.choices if not c.finished), self.choices[0])

    @property
    def possible(self) -> bool:
        """A next attempt can be made: from the token ids, or from the text (a completion whose prompt was
        token ids needs the router's tokenizer for the text's; a chat read for tool calls, the tokens' ids and
        the router's tokenizer for its raw answer)."""
        state = self._next()
        if self.raw:
            return not state.sent_ids or (state.exact and self.tokenizer is not None)
        if self._kind(state) == "resume" or self.chat:
            return True
        prompt = self.body.get("prompt")
        return isinstance(prompt, str) or self.tokenizer is not None or not state.sent_text

    @property
    def kind(self) -> str:
        """How the next attempt resumes: "resume" (from the token ids: exact for greedy requests) or
        "resume_text" (from the text sent, tokenized again). A chat that asked for log probabilities resumes
        from its text, as a chat: the token-id path answers through /v1/completions, whose log probabilities
        are in another form; a constrained request from its text, which the grammar reads first."""
        return self._kind(self._next())

    def _kind(self, state: _Choice) -> str:
        by_ids = state.exact and self.prompt_ids is not None
        as_text = constrained(self.body) or (self.chat and self.body.get("logprobs"))
        return "resume" if by_ids and not as_text else "resume_text"

    def sent_tokens(self, state: _Choice | None = None) -> int:
        """The tokens a choice (the next one continued) was sent."""
        state = state or self._next()
        if state.exact:
            return state.shown
        if self.tokenizer is not None and state.sent_text:
            return len(self.tokenizer.encode(state.sent_text, add_special_tokens=False))
        return state.sent_pieces  # no tokenizer: an engine streams a token an event

    def remaining(self, state: _Choice | None = None) -> int | None:
        """The tokens a choice (the next one continued) may still get (None: no bound was asked)."""
        limit = self.body.get("max_completion_tokens") if self.chat else None
        limit = limit if isinstance(limit, int) else self.body.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool):
            return None
        return max(0, limit - self.sent_tokens(state))

    def after_break(self, max_resumes: int) -> tuple[str, str, dict] | bytes | None:
        """What follows an attempt that ended before the answer: None when it cannot go on (it broke with
        `max_resumes` resumes made already, or none `possible`); a choice that got every token and only lost
        its finish gets its finish (sent ahead of the next attempt's events, or as the stream's end with
        `[DONE]` when no choice is left); else the next attempt's kind, path and body (`resume`)."""
        if (self.broke() and self.resumes >= max_resumes) or not self.possible:
            return None
        for index, state in enumerate(self.choices):
            if not state.finished and self.remaining(state) == 0:
                state.finished = True
                self._closing += self._finish(index)
        if all(c.finished for c in self.choices):
            self.done = True
            out, self._closing = self._closing + b"data: [DONE]\n\n", b""
            return out
        kind = self.kind
        return (kind, *self.resume())

    def resume(self) -> tuple[str, dict]:
        """The next attempt's path and body; call before sending it (its events are read as a resume's)."""
        state, broke = self._next(), self.broke()
        index, kind = self.choices.index(state), self._kind(state)
        del state.sent_ids[state.shown :]  # tokens whose text the client does not have yet: generated again
        answer = self._raw_answer(state) if self.raw else state.sent_text
        rest = self.remaining(state)
        self.before = sum(self.sent_tokens(c) for c in self.choices)
        self.attempts += 1
        self.resumes += broke
        self.serving = index
        self._buffer = b""
        client = {k: v for k, v in self.body.items() if k != "n"}  # (one choice an attempt)
        seed = client.get("seed")
        if index and isinstance(seed, int) and not isinstance(seed, bool):
            client["seed"] = (seed + index) % 2**63  # (choice i samples with seed + i, as our pods do)
        if kind == "resume":
            source = {k: v for k, v in client.items() if not self.chat or k in RESUME_FIELDS}
            body = {k: v for k, v in source.items() if k not in ("prompt", "max_completion_tokens")}
            body["prompt"] = [*self.prompt_ids, *state.sent_ids]  # type: ignore[misc]
            body["return_token_ids"] = True
            self.as_completion = self.chat
            path = COMPLETIONS
        elif self.chat:
            self.as_completion = False
            messages = [*client["messages"], {"role": "assistant", "content": answer}]
            body = {**client, "messages": messages, "continue_final_message": bool(answer),
                    "add_generation_prompt": not answer}  # fmt: skip
            if answer and constrained(client):  # (our pods' extension: the grammar reads it too)
                body["constrain_final_message"] = True
            body.pop("max_completion_tokens", None)
            path = CHAT
        else:
            prompt = client.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
            if isinstance(prompt, str):
                body = {**client, "prompt": prompt + state.sent_text}
            else:  # token ids, the text sent tokenized again
                more = self.tokenizer.encode(state.sent_text, add_special_tokens=False)
                body = {**client, "prompt": [*(prompt or []), *(more if state.sent_text else [])]}
            if state.sent_text and constrained(client):  # (our pods' extension: the grammar reads it too)
                body["constrained_prefix"] = state.sent_text
            path = COMPLETIONS
        if rest is not None:
            body["max_tokens"] = max(rest, 1)
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
            body["min_tokens"] = max(0, min_tokens - self.sent_tokens(state))
        return path, body

    def _raw_answer(self, state: _Choice) -> str:
        """The text of every token the pods gave a choice (a chat read for tool calls), less any at its end
        that make part of a character only (generated again)."""
        if not state.sent_ids:
            return ""
        text = self.tokenizer.decode(state.sent_ids)
        while state.sent_ids and text.endswith("\ufffd"):
            state.sent_ids.pop()
            text = self.tokenizer.decode(state.sent_ids)
        state.shown = len(state.sent_ids)
        return text

    def _finish(self, index: int) -> bytes:
        """The event that ends a choice whose pod died after its last token but before its finish (no token
        left to generate): a finish of reason length."""
        identity = self.identity or {}
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": "length"}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": "length"}
            kind = "text_completion"
        chunk = {**identity, "object": kind, "choices": [choice]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def closing(self) -> bytes:
        """The events that end a stream whose pod died after every choice's last token but before their
        finish: a finish of reason length for each, then `[DONE]`."""
        out = b"".join(self._finish(i) for i, c in enumerate(self.choices) if not c.finished)
        for state in self.choices:
            state.finished = True
        self.done = True
        return out + b"data: [DONE]\n\n"


class TgiStreamResume(CarriedStream):
    """One client's TGI stream (`/generate_stream`, or `POST /` with `"stream": true`) across the attempts
    that serve it, resumed from the text sent (TGI's API takes text `inputs` only).

    TGI 3.3.5's events (router/src/lib.rs `StreamResponse`, `Token`, `StreamDetails`; router/src/server.rs
    `generate_stream_internal`), which our runtime's `/generate_stream` streams alike: one token an event,
    `data:{"index": N, "token": {"id", "text", "logprob", "special"}, "generated_text": null,
    "details": null}` (`index` from 1; `top_tokens` with `top_n_tokens`); the last event carries the last
    token too, with `generated_text` (the whole text, after the prompt where `return_full_text` is true) and
    `details` (`finish_reason`, `generated_tokens`, `seed`, and from TGI `input_length`) where
    `parameters.details` is true; an error is an event `data:{"error": ..., "error_type": ...}` (TGI answers
    200 and streams even a validation error). A break: an error event but a validation one, or the stream's
    end before its last event. A validation error event is the client's answer (its request is wrong, or too
    long once resumed: no pod would take it), passed on as the stream's end."""

    client_ids = True  # TGI's events carry each token's id already: a router asks the pods for nothing

    def __init__(
        self, path: str, body: dict, prompt_ids: Sequence[int] | None = None, tokenizer: Any = None
    ) -> None:
        """`prompt_ids` and `tokenizer` are not used (the same arguments as `StreamResume`'s): TGI's inputs
        are text, and a TGI event is one token."""
        self.path, self.body = path, body
        self.parameters: dict = body.get("parameters") or {}
        self.sent = 0  # tokens sent to the client, every attempt's: the last `index` it got
        self.sent_text = ""  # their text (a special token's left out, as TGI's generated_text leaves it)
        self.attempts = self.resumes = 0  # resumes so far (each attempt after the first is one)
        self.before = 0  # tokens sent before this attempt began
        self.text_before = ""  # their text
        self.done = False  # the last event (its generated_text) was sent
        self._buffer = b""

    @property
    def possible(self) -> bool:
        return True  # the client's inputs are text: the text sent follows them

    @property
    def kind(self) -> str:
        return (
            "resume_text"  # tokenized again by the next pod: the seam may differ from an undisturbed answer
        )

    # ---- the stream ----

    UNFINISHED = "the stream ended before its last event (generated_text)"

    def _chunk(self, chunk: dict, event: bytes) -> bytes | None:
        if "error" in chunk and "token" not in chunk:
            if chunk.get("error_type") == "validation":  # the request's own fault: no pod would take it
                self.done = True
                return event
            raise StreamBroken(f"the pod's stream ended with an error: {chunk.get('error')}")
        index = chunk.get("index")  # this attempt's tokens so far (the pod counts them)
        produced = (
            index if isinstance(index, int) and not isinstance(index, bool) else self.sent - self.before + 1
        )
        chunk["index"] = self.sent = self.before + produced
        token = chunk.get("token")
        if isinstance(token, dict) and not token.get("special") and isinstance(token.get("text"), str):
            self.sent_text += token["text"]
        if chunk.get("generated_text") is not None:
            self.done = True
            if self.attempts:
                chunk["generated_text"] = self._whole_text(chunk["generated_text"])
                if isinstance(chunk.get("details"), dict):
                    chunk["details"] = self._details(chunk["details"])
        return b"data:" + json.dumps(chunk, ensure_ascii=False).encode()

    def _whole_text(self, text: str) -> str:
        """The client's generated_text for a resumed attempt's: the text sent before followed by the new
        attempt's, or as it is where it holds the whole prompt already (`return_full_text`: the resumed
        inputs hold the text sent before). `POST /` without `return_full_text` takes the server's default
        (TGI: true for a text-generation model), so there the text says which it is."""
        full = self.parameters.get("return_full_text")
        if full is None and self.path == TGI_COMPAT:
            full = text.startswith(self.body["inputs"] + self.text_before)
        return text if full is True else self.text_before + text

    def _details(self, details: dict) -> dict:
        """Every token of every attempt counted; TGI's `input_length`, the resumed prompt's, less the tokens
        sent before it (near: the text sent was tokenized again)."""
        details = dict(details)
        if isinstance(details.get("generated_tokens"), int):
            details["generated_tokens"] += self.before
        if isinstance(details.get("input_length"), int):
            details["input_length"] = max(0, details["input_length"] - self.before)
        return details

    # ---- the next attempt ----

    def remaining(self) -> int | None:
        """The tokens the client may still get (None: no `max_new_tokens` asked: the pod's default applies
        again, TGI 3.3.5's as many as fit its max_total_tokens after the longer inputs, ours 20 more)."""
        limit = self.parameters.get("max_new_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool):
            return None
        return max(0, limit - self.sent)

    def resume(self) -> tuple[str, dict]:
        """The next attempt's path and body (the client's path: `POST /` keeps the server's own default of
        `return_full_text`): `inputs` followed by the text sent, `max_new_tokens` less the tokens sent, the
        other parameters as the client sent them (a `seed` sent again); call before sending it."""
        rest = self.remaining()
        self.before, self.text_before = self.sent, self.sent_text
        self.attempts = self.resumes = self.attempts + 1
        self._buffer = b""
        parameters = dict(self.parameters)
        if rest is not None:
            parameters["max_new_tokens"] = max(rest, 1)
        if parameters.get("grammar") is not None and self.sent_text:  # (our pods': the grammar reads it)
            parameters["constrained_prefix"] = self.sent_text
        return self.path, {
            **self.body,
            "inputs": self.body["inputs"] + self.sent_text,
            "parameters": parameters,
        }

    def closing(self) -> bytes:
        """The last event of a stream whose pod died after its last token but before its last event (our
        runtime's last event may carry no token, as after a stop string): a token of no text, marked
        special (TGI's mark for a token to leave out of a text), at the last token's index, with the whole
        text and, where asked, details of reason length."""
        self.done = True
        details = None
        if self.parameters.get("details"):
            details = {
                "finish_reason": "length",
                "generated_tokens": self.sent,
                "seed": self.parameters.get("seed"),
            }
        text = self.sent_text
        if self.parameters.get("return_full_text") is True:
            text = self.body["inputs"] + text
        chunk = {"index": self.sent, "token": {"id": 0, "text": "", "logprob": None, "special": True},
                 "generated_text": text, "details": details}  # fmt: skip
        return b"data:" + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
