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
  comes back in chat form (a chat's `tools`, `response_format` and `logprobs` are not carried over:
  `RESUME_FIELDS` are).
- from the text (`kind` "resume_text"): a pod that gave no ids: a completion's prompt followed by the text
  sent; a chat's messages followed by an assistant message of the text sent, with vLLM's
  `continue_final_message: true, add_generation_prompt: false`. The text is tokenized again, so the seam
  may differ from an undisturbed answer's.

A sampled request gets a continuation conditioned on what was sent: the same distribution, not the same
draws (a `seed` is sent again, but the random state of the first pod is gone).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# what a chat's resumed /v1/completions request carries over of the client's body
RESUME_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "user", "stream",
    "stream_options", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


class StreamBroken(Exception):
    """The pod's stream ended before the answer did (an error event, or its end without a finish)."""


def resumable(path: str, body: Any) -> bool:
    """An OpenAI completion or chat request streamed to the client with one choice."""
    return (
        path in (COMPLETIONS, CHAT)
        and isinstance(body, dict)
        and body.get("stream") is True
        and body.get("n", 1) in (1, None)
    )


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


class StreamResume:
    """One client's stream across the attempts that serve it (see the module's docstring)."""

    def __init__(
        self, path: str, body: dict, prompt_ids: Sequence[int] | None, tokenizer: Any = None
    ) -> None:
        self.path, self.body, self.tokenizer = path, body, tokenizer
        self.chat = path == CHAT
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.client_ids = body.get("return_token_ids") is True
        self.sent_ids: list[int] = []  # generated tokens sent to the client
        # of those, the ones whose text the client has: a pod holds back a token's text while it ends in part
        # of a character (an event of ids, no text); a resume regenerates the ones after the last text
        self.shown = 0
        self.sent_text = ""
        self.sent_pieces = 0  # events that carried text: one token each, as engines stream
        self.exact = True  # every event so far carried its tokens' ids
        self.attempts = 0  # resumes so far
        self.as_completion = False  # this attempt answers a chat through /v1/completions
        self.before = 0  # tokens sent before this attempt began
        self.finished = False  # a finish reason was sent
        self.done = False  # `data: [DONE]` was sent
        self.identity: dict[str, Any] | None = None  # id, created, model of the first attempt's first event
        self._buffer = b""

    # ---- the stream ----

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

    def ended(self) -> None:
        """The pod's stream ended: StreamBroken unless the answer did."""
        if not self.done:
            raise StreamBroken("the stream ended before its answer finished")

    def _event(self, event: bytes) -> bytes | None:
        lines = event.split(b"\n")
        data = b"".join(line[5:].lstrip() for line in lines if line.startswith(b"data:"))
        if not data:
            return event if event.strip() else None  # comments and other fields as they are
        if data.strip() == b"[DONE]":
            if not self.finished:
                raise StreamBroken("the stream ended before its answer finished")
            self.done = True
            return b"data: [DONE]"
        try:
            chunk = json.loads(data)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
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
            ids = choice.get("token_ids")
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if isinstance(ids, list):
                self.sent_ids += ids
            elif text:
                self.exact = False
            self.sent_text += text or ""
            self.sent_pieces += bool(text)
            if choice.get("finish_reason"):
                self.finished = True
            if text or choice.get("finish_reason"):
                self.shown = len(self.sent_ids)
            if self.as_completion:
                choice = {k: v for k, v in choice.items() if k != "text"} | {"delta": {"content": text}
                                                                            if text else {}}  # fmt: skip
            elif self.attempts and self.chat:
                delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
                choice = {**choice, "delta": delta}
            if not self.client_ids:
                choice = {k: v for k, v in choice.items() if k not in TOKEN_ID_FIELDS}
            shows = text or choice.get("finish_reason") or choice.get("token_ids")
            if not shows and (self.attempts or isinstance(ids, list)):
                continue  # an attempt's opening (the client had one), or ids only, which it did not ask for
            choices.append(choice)
        if not self.client_ids:
            chunk.pop("prompt_token_ids", None)
        if isinstance(chunk.get("usage"), dict):
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

    @property
    def possible(self) -> bool:
        """A next attempt can be made: from the token ids, or from the text (a completion whose prompt was
        token ids needs the router's tokenizer for the text's)."""
        if self.kind == "resume" or self.chat:
            return True
        prompt = self.body.get("prompt")
        return isinstance(prompt, str) or self.tokenizer is not None or not self.sent_text

    @property
    def kind(self) -> str:
        """How the next attempt resumes: "resume" (from the token ids: exact for greedy requests) or
        "resume_text" (from the text sent, tokenized again)."""
        return "resume" if self.exact and self.prompt_ids is not None else "resume_text"

    def sent_tokens(self) -> int:
        if self.exact:
            return self.shown
        if self.tokenizer is not None and self.sent_text:
            return len(self.tokenizer.encode(self.sent_text, add_special_tokens=False))
        return self.sent_pieces  # no tokenizer: an engine streams a token an event

    def remaining(self) -> int | None:
        """The tokens the client may still get (None: no bound was asked)."""
        limit = self.body.get("max_completion_tokens") if self.chat else None
        limit = limit if isinstance(limit, int) else self.body.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool):
            return None
        return max(0, limit - self.sent_tokens())

    def after_break(self, max_resumes: int) -> tuple[str, str, dict] | bytes | None:
        """What follows an attempt whose stream broke: None when it cannot go on (`max_resumes` resumes
        made already, or none `possible`); the closing events when every token was sent and only the finish
        was lost (the router writes them and ends the stream); else the next attempt's kind, path and body
        (`resume`)."""
        if self.attempts >= max_resumes or not self.possible:
            return None
        if self.remaining() == 0:
            return self.closing()
        kind = self.kind
        return (kind, *self.resume())

    def resume(self) -> tuple[str, dict]:
        """The next attempt's path and body; call before sending it (its events are read as a resume's)."""
        kind, rest = self.kind, self.remaining()
        del self.sent_ids[self.shown :]  # tokens whose text the client does not have yet: generated again
        self.before = self.sent_tokens()
        self.attempts += 1
        self._buffer = b""
        if kind == "resume":
            source = {k: v for k, v in self.body.items() if not self.chat or k in RESUME_FIELDS}
            body = {k: v for k, v in source.items() if k not in ("prompt", "max_completion_tokens")}
            body["prompt"] = [*self.prompt_ids, *self.sent_ids]  # type: ignore[misc]
            body["return_token_ids"] = True
            self.as_completion = self.chat
            path = COMPLETIONS
        elif self.chat:
            messages = [*self.body["messages"], {"role": "assistant", "content": self.sent_text}]
            body = {**self.body, "messages": messages, "continue_final_message": bool(self.sent_text),
                    "add_generation_prompt": not self.sent_text}  # fmt: skip
            body.pop("max_completion_tokens", None)
            path = CHAT
        else:
            prompt = self.body.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
            if isinstance(prompt, str):
                body = {**self.body, "prompt": prompt + self.sent_text}
            else:  # token ids, the text sent tokenized again
                more = self.tokenizer.encode(self.sent_text, add_special_tokens=False)
                body = {**self.body, "prompt": [*(prompt or []), *(more if self.sent_text else [])]}
            path = COMPLETIONS
        if rest is not None:
            body["max_tokens"] = max(rest, 1)
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
            body["min_tokens"] = max(0, min_tokens - self.before)
        return path, body

    def closing(self) -> bytes:
        """The events that end a stream whose pod died after its last token but before its finish (no token
        left to generate): a finish of reason length, then `[DONE]`."""
        self.finished = self.done = True
        identity = self.identity or {}
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
            kind = "text_completion"
        chunk = {**identity, "object": kind, "choices": [choice]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
