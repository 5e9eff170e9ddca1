"""Tool calls in our runtime's OpenAI chat API (pure: no tokenizer, no torch): a request's `tools` and
`tool_choice` checked, its messages' tool calls and tool results made ready for the chat template, and the
model's tool calls read back out of its answer, whole (`split_calls`) or as it streams (`CallStream`).

The format is Hermes' (NousResearch's function-calling format, which Qwen2.5, Qwen3, Hermes and SmolLM3's
templates write and vLLM's `--tool-call-parser hermes` reads): each call a JSON object `{"name": ...,
"arguments": {...}}` between `<tool_call>` and `</tool_call>`. A chat template that takes tools (its source
names `tools`) and writes that marker is taken to speak it; one that does not take tools refuses them.
`tool_choice` `required` or a named function constrains the answer to such calls (a grammar:
`output_constraints.tool_calls`); `auto` leaves the answer free and reads any calls out of it; `none` reads
none (the tools are still shown to the model, as vLLM does by default). The parsing is ours: vLLM's
`hermes` parser lives inside vLLM (not a library that installs alone), and llguidance parses grammars, not
answers."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from neuronfleet.runtime.serving.errors import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    """A request's tools (as the template takes them: `{"type": "function", "function": {...}}` each) and its
    choice: none, auto, required, or the name of the one function it must call."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: a required choice may make several calls (false: one)

    @property
    def parsed(self) -> bool:
        """The answer is read for calls."""
        return self.choice != "none"

    @property
    def forced(self) -> list[dict]:
        """The functions the answer must call (required: any of them; named: that one); [] for auto, none."""
        if self.named is not None:
            return [f for f in self.functions if f["function"]["name"] == self.named]
        return list(self.functions) if self.choice == "required" else []


def parse_tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` of a chat request, checked: InvalidRequest names the part that is wrong and
    says what is allowed. None when the request has no tools (a `tool_choice` other than none is refused
    then)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest(
                "tool_choice needs tools: send the functions the model may call", "tool_choice"
            )
        return None
    if not isinstance(tools, list):
        raise InvalidRequest(
            "tools must be a list of {type: function, function: {name, parameters}}", "tools"
        )
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise InvalidRequest(f"{where} must be {{type: function, function: {{name, parameters}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got "
                                 f"{name!r}", f"{where}.function.name")  # fmt: skip
        if name in names:
            raise InvalidRequest(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema object, got "
                                 f"{type(parameters).__name__}", f"{where}.function.parameters")  # fmt: skip
        kept = {"name": name, "parameters": parameters if parameters is not None else {"type": "object"}}
        if description is not None:
            kept["description"] = description
        functions.append({"type": "function", "function": kept})
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if named not in names:
            raise InvalidRequest(f"tool_choice names {named!r}, which is not one of the tools "
                                 f"({', '.join(sorted(names))})", "tool_choice")  # fmt: skip
        choice = "named"
    elif choice not in CHOICES:
        raise InvalidRequest(f"tool_choice must be one of {', '.join(CHOICES)} or {{type: function, "
                             f"function: {{name}}}}, got {choice!r}", "tool_choice")  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return Tools(tuple(functions), choice, named, parallel is not False)


def template_messages(messages: list[dict]) -> list[dict]:
    """The chat's messages as chat templates take them: an assistant's `tool_calls` with each call's
    `arguments` as an object (OpenAI sends its JSON text; Hugging Face's templates write the object, as vLLM
    gives it them), a tool message's `tool_call_id` and `name` kept."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        ready = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(
                    f"{where} must be {{id, type: function, function: {{name, arguments}}}}", where
                )
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except ValueError:
                    raise InvalidRequest(f"{where}.function.arguments is not JSON", where) from None
            ready.append({**call, "function": {"name": fn["name"], "arguments": arguments}})
        out.append({**m, "tool_calls": ready})
    return out


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def split_calls(text: str, prefix: str = "") -> tuple[str, list[ToolCall]]:
    """An answer's text outside its tool calls (what follows a call starts at its first character that is not
    whitespace), and the calls (a block that is not a call's JSON stays in the text, as written). The same
    as streaming it through `CallStream` (`prefix`: the answer's beginning, sent before: read, not given)."""
    stream = CallStream(prefix)
    content, calls = stream.feed(text)
    content += stream.end()
    return (content.strip() if calls else content), calls


class CallStream:
    """An answer's text as it streams, split into content and tool calls: `feed` a text delta, get the content
    that can be sent now and the calls completed; text that may begin a call (`<tool_call>`, or a prefix of
    it at the end) is held until it is known, and the whitespace after a call is dropped. `end` gives what
    is held at the end (an unclosed block is content, as written). `prefix`: the answer's beginning, which
    was sent before (an answer continued on another pod): read first, its content and calls not given again,
    what it holds back held, its calls counted (the next call's index follows them)."""

    def __init__(self, prefix: str = "") -> None:
        self.held, self.calls, self._after_call = "", 0, False
        if prefix:
            self.feed(prefix)

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.held += delta
        content, calls = [], []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = _partial(self.held)
                content.append(self._content(self.held[: len(self.held) - keep]))
                self.held = self.held[len(self.held) - keep :]
                break
            content.append(self._content(self.held[:start]))
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:
                break
            call = _call(self.held[len(OPEN) : end].strip())
            if call is None:
                content.append(self._content(self.held[: end + len(CLOSE)]))
            else:
                calls.append(call)
                self._after_call = True
            self.held = self.held[end + len(CLOSE) :]
        self.calls += len(calls)
        return "".join(content), calls

    def end(self) -> str:
        held, self.held = self.held, ""
        return self._content(held)


def _partial(text: str) -> int:
    """How many characters at the end of `text` could be the start of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
