"""Text <-> token ids for a model folder: the `tokenizers` tokenizer, the chat template (rendered in a
sandboxed Jinja environment), the end-of-sequence ids, and incremental detokenization for streaming."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from neuronfleet.runtime.model.model_config import ModelLoadError
from neuronfleet.runtime.serving.errors import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves a chat template beside the tokenizer


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older tokenizer_config files
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_template_exception(message: str) -> None:
    raise TemplateError(message)


def chat_template(folder: Path, config: dict) -> str | None:
    """The folder's chat template as Hugging Face's tokenizer loads it: `chat_template.jinja` where it is
    there (transformers saves it so, and it takes priority), else tokenizer_config.json's `chat_template`
    (a string, or named templates: the one named default)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)  # fmt: skip
    return template if isinstance(template, str) else None


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order; each character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]  # fmt: skip
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


class Tokenizer:
    """A model folder's tokenizer."""

    def __init__(self, model_dir: str | Path, extra_eos_ids: Sequence[int] = ()) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"model folder {path} lacks tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = chat_template(path, cfg)
        eos = list(extra_eos_ids)
        if self.eos_token is not None and (eos_id := self._tok.token_to_id(self.eos_token)) is not None:
            eos.append(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what the grammar engine reads the vocabulary from)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs give them as `bytes`: a token may be part of a
        character). Byte-level BPE (GPT-2's alphabet: each byte drawn as one printable character) is read
        back through that alphabet; SentencePiece's pieces with '▁' for a space and <0xNN> for a byte."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> str:
        """Render messages [{role, content}] with the model's own chat template; `tools` (functions the model
        may call, `{"type": "function", "function": {...}}` each) as Hugging Face's `apply_chat_template`
        passes them, to a template that takes them (InvalidRequest naming `tools` otherwise)."""
        if self._template is None:
            raise InvalidRequest(
                "this model has no chat template; use the completions API instead", "messages"
            )
        if tools and not self.takes_tools:
            raise InvalidRequest("this model's chat template takes no tools (it never reads `tools`); "
                                 "send the request without them, or serve a model whose template writes tool "
                                 "calls", "tools")  # fmt: skip
        if not messages:
            raise InvalidRequest("messages is empty; send at least one message", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role"
                )
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content must be a string", f"messages[{i}].content")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": list(tools)} if tools else {}),
            )
        except TemplateError as e:
            raise InvalidRequest(f"the model's chat template refused the messages: {e}", "messages") from None

    @property
    def takes_tools(self) -> bool:
        """The chat template reads `tools` (it can show the model functions to call)."""
        return bool(self.chat_template) and re.search(r"\btools\b", self.chat_template or "") is not None

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: Sequence[dict] | None = None,
    ) -> list[int]:  # fmt: skip
        """Token ids of a chat prompt (the template places any BOS itself). `continue_final_message`: the
        last message left open (rendered without a generation prompt and cut right after its content, as
        Hugging Face's `apply_chat_template(continue_final_message=True)` does), for an answer that
        continues it."""
        text = self.apply_chat_template(messages, add_generation_prompt and not continue_final_message, tools)
        if continue_final_message:
            final = messages[-1]["content"]
            end = text.rfind(final) if final else -1
            if end < 0:
                raise InvalidRequest(
                    "continue_final_message: the chat template does not render the last message's content "
                    "as it is, so it cannot be continued", "continue_final_message",
                )  # fmt: skip
            text = text[: end + len(final)]
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a UTF-8 character.

    It decodes a short window of tokens before the new ones so that tokenizers which change a token's
    text by context (a leading space, SentencePiece's "▁") give the same text as decoding everything.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-self.CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""
