"""Request bodies, pure (no I/O): a body's bytes decoded as bounded JSON (`decode_json`, which every server
of the runtime uses, internal endpoints included), and OpenAI and TGI bodies parsed and validated into engine
requests.

Each parser returns what the engine needs or raises `InvalidRequest` naming the field, the value and the
allowed range; the server turns that into the API's own error format.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from neuronfleet.runtime.serving import output_constraints, tool_calls
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.output_constraints import OutputConstraint
from neuronfleet.runtime.serving.sampling_params import MAX_LOGPROBS, SamplingDefaults, SamplingParams

OPENAI_DEFAULTS = SamplingDefaults()
# the most choices (`n`) a request may ask (OpenAI's bound; the server's slots bound it too)
MAX_CHOICES = 128
TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")  # what a chat message keeps beside role, content
# vLLM's fields that `structured_outputs` replaced, removed in vLLM 0.12.0 (docs.vllm.ai, features/
# structured_outputs, read for 0.25): taken as they are, an answer would come back unconstrained
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

MAX_STOP_SEQUENCES = 16
_UNSET = object()

# ---- bounded JSON ------------------------------------------------------------------------------------------

MAX_DEPTH = 128  # arrays and objects nested in each other, at most (an OpenAI body nests a few levels; a
# tool's JSON schema a few dozen)
INT_RANGE = (-(2**63), 2**64)  # the integers a body may hold: 64-bit, signed or not
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.S)  # a JSON string, or an unterminated one to the end
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NESTING = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_LONG_INT = re.compile(rb"\d{19}")  # an integer that may be past 64 bits (2**63 has 19 digits)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \uD800-\uDFFF: half of a pair, or alone


class _Refused(ValueError):
    """A value the decoding hooks refuse (the message says which)."""


def nesting_depth(raw: bytes) -> int:
    """How deeply a JSON text's arrays and objects nest (brackets inside strings ignored); 0 when it cannot
    nest past MAX_DEPTH (no more opening brackets than that). Linear in the bytes, no recursion: Python's
    json recurses in C and raises RecursionError only near the interpreter's limit, which a 1 MiB body of
    `[` reaches."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_NESTING.__getitem__, brackets)), default=0)


def _no_constant(name: str) -> Any:
    raise _Refused(
        f"the request body holds {name}, which is not a JSON number (RFC 8259 has no NaN or Infinity); send "
        "a finite number"
    )


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the request body holds the number {text}, past a float's range (about ±1.8e308)")
    return value


def _int64(text: str) -> int:
    digits = text.lstrip("-")
    value = int(text) if len(digits) <= 20 else None
    if value is None or not INT_RANGE[0] <= value < INT_RANGE[1]:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(digits)} digits)"
        raise _Refused(f"the request body holds the integer {shown}, which does not fit in 64 bits")
    return value


def decode_json(raw: bytes) -> Any:
    """A request body's JSON value, or InvalidRequest (field `body`) saying what is wrong: not UTF-8, not
    JSON, nested deeper than MAX_DEPTH, a lone UTF-16 surrogate escaped in a string (`\\ud800`: no text can
    hold it), NaN or Infinity, a float past float range (1e400) or an integer past 64 bits. Python's json
    takes all but the first two; each would fail later, deep inside, as a 500."""
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object", "body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {e.start})", "body") from None
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise InvalidRequest(
            f"the request body nests arrays and objects {depth} deep; at most {MAX_DEPTH} levels are "
            "accepted", "body",
        )  # fmt: skip
    hooks: dict[str, Any] = {"parse_constant": _no_constant, "parse_float": _finite}
    if _LONG_INT.search(raw):
        hooks["parse_int"] = _int64
    try:
        value = json.loads(text, **hooks)
    except _Refused as e:
        raise InvalidRequest(str(e), "body") from None
    except ValueError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}", "body") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            lone = e.object[e.start : e.end].encode("utf-8", "backslashreplace").decode()
            raise InvalidRequest(
                f"the request body holds a lone UTF-16 surrogate ({lone}) in a string; send whole characters "
                "(a character outside the BMP is a surrogate pair: \\ud83d\\ude00)", "body",
            ) from None  # fmt: skip
    return value


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: the prompt (text, token ids or chat messages) and how to generate."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    details: bool = False
    add_generation_prompt: bool = True  # chat: the template's opening of the assistant's answer
    continue_final_message: bool = False  # chat: the answer continues the last message, left open
    return_token_ids: bool = False  # vLLM's extension: each choice carries its tokens' ids (what a router
    # resuming the stream on another pod continues from: runtime/routing/resume.py)
    n: int = 1  # choices: as many answers to the same prompt
    tools: tool_calls.Tools | None = None  # chat: the functions the model may call, and how (tool_choice)
    answer_prefix: str = ""  # chat: the answer's beginning, already sent (the continued final message, with
    # our constrain_final_message): read for tool calls before the continuation, and not sent again


def _get(
    body: dict, name: str, kinds: tuple[type, ...], default: Any = None, label: str | None = None
) -> Any:
    value = body.get(name, _UNSET)
    if value is _UNSET or value is None:
        return default
    label = label or name
    if isinstance(value, bool) and bool not in kinds:
        raise InvalidRequest(f"{label} must be {_kinds(kinds)}, got a boolean", label)
    if not isinstance(value, kinds):
        raise InvalidRequest(f"{label} must be {_kinds(kinds)}, got {type(value).__name__}", label)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{label} must be a finite number, got {value}", label)
    return value


def _kinds(kinds: tuple[type, ...]) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _in_range(
    name: str, value: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise InvalidRequest(f"{name} must be in {left}{lo}, {hi}{right}, got {value}", name)


def _stop(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest(f"{name} must be a non-empty string or a list of non-empty strings", name)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"{name} has {len(stops)} entries; at most {MAX_STOP_SEQUENCES} are allowed", name
        )
    return tuple(stops)


def _require_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", "body")


def _refuse_unsupported(body: dict, fields: dict[str, Any]) -> None:
    """Fields we do not implement: absent, null, or equal to their neutral value (None: none is); anything
    else is refused."""
    for name, neutral in fields.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise InvalidRequest(f"{name} is not supported by this server (got {value!r})", name)


def _openai_request(
    body: dict,
    prompt: str | list[int] | None,
    messages: list[dict] | None,
    max_tokens_default: int | None,
    defaults: SamplingDefaults,
) -> ParsedRequest:
    """The generation settings shared by the completions and chat APIs, around a checked prompt; a sampling
    field left out (or null) takes the server's default (`SamplingDefaults`)."""
    max_tokens = _get(body, "max_completion_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), max_tokens_default)
    elif body.get("max_tokens") is not None:
        _get(body, "max_tokens", (int,))
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), defaults.temperature))
    _in_range("temperature", temperature, 0.0, 2.0)
    top_p = float(_get(body, "top_p", (int, float), defaults.top_p))
    _in_range("top_p", top_p, 0.0, 1.0, lo_open=True)
    top_k = _get(body, "top_k", (int,), defaults.top_k)
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
    seed = _get(body, "seed", (int,), None)
    if seed is not None:
        _in_range("seed", seed, 0, 2**63 - 1)
    n = _get(body, "n", (int,), 1)
    _in_range("n", n, 1, MAX_CHOICES)  # (and at most the server's slots: the server checks)
    penalty = float(_get(body, "repetition_penalty", (int, float), defaults.repetition_penalty))  # vLLM's
    _in_range("repetition_penalty", penalty, 0.0, 2.0, lo_open=True)
    ignore_eos = _get(body, "ignore_eos", (bool,), False)  # vLLM's extension
    for name in ("presence_penalty", "frequency_penalty"):
        _get(body, name, (int, float))
    _refuse_unsupported(body, {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1})
    logprobs = _logprobs(body, chat=messages is not None)
    _get(body, "logit_bias", (dict,))
    _refuse_unsupported(body, {"logit_bias": {}})
    _get(body, "user", (str,))
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False, "stream_options.include_usage")
    return_token_ids = _get(body, "return_token_ids", (bool,), False)
    constraint = _constraint(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        repetition_penalty=penalty,
        seed=seed,
        stop=_stop(body.get("stop"), "stop"),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        constraint=constraint,
    )
    return ParsedRequest(
        prompt, messages, params, stream, include_usage, return_token_ids=return_token_ids, n=n
    )


def _constraint(body: dict) -> OutputConstraint | None:
    """What the answer must match: OpenAI's `response_format` or vLLM's `structured_outputs`, not both; vLLM's
    former `guided_*` fields are refused naming the current ones (taken as they are, an answer would come
    back unconstrained)."""
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is vLLM's former field; send structured_outputs (json, regex, "
                                 "choice, json_object) or response_format", name)  # fmt: skip
    openai = output_constraints.response_format(body.get("response_format"))
    vllm = output_constraints.structured_outputs(body.get("structured_outputs"))
    if openai is not None and vllm is not None:
        raise InvalidRequest("send response_format or structured_outputs, not both", "structured_outputs")
    return openai or vllm


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many most likely tokens to report beside each generated token's log probability (None: no log
    probabilities). Chat: `logprobs` true, with `top_logprobs` 0-20; completions: `logprobs` 0-20 (OpenAI's
    legacy API allows 5; vLLM, 20)."""
    if not chat:
        n = _get(body, "logprobs", (int,), None)
        if n is not None:
            _in_range("logprobs", n, 0, MAX_LOGPROBS)
        return n
    asked = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None)
    if top is not None:
        _in_range("top_logprobs", top, 0, MAX_LOGPROBS)
        if top and not asked:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if asked else None


def parse_openai_completion(body: Any, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """POST /v1/completions."""
    _require_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty; send at least one character", "prompt")
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompt = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise InvalidRequest("prompt is empty; send at least one token", "prompt")
    else:
        raise InvalidRequest(
            "prompt must be a string, a list with one string, or a list of token ids", "prompt"
        )
    _refuse_unsupported(body, {"echo": False, "suffix": ""})
    parsed = _openai_request(body, prompt=prompt, messages=None, max_tokens_default=16, defaults=defaults)
    prefix = _constrained_prefix(body, prompt, parsed.params, "constrained_prefix")
    return dataclasses.replace(parsed, params=_constrained_from(parsed.params, prefix)) if prefix else parsed


def parse_openai_chat(body: Any, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """POST /v1/chat/completions."""
    _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"messages[{i}].role must be a non-empty string: system, user, assistant...", f"messages[{i}]"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}] must be a text part {{type: text, text}}; "
                        "images and other part types are not supported",
                        f"messages[{i}].content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""  # (an answer that was tool calls only)
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}]"
            )
        kept = {k: m[k] for k in TOOL_MESSAGE_FIELDS if m.get(k) is not None}  # (tool calls and results)
        clean.append({"role": role, "content": content, **kept})
    # what would change the answer and this server does not do (docs/api.md lists every field); the rest of
    # the official client's fields (store, metadata, user, service_tier, prediction, ...) are hints, ignored
    _refuse_unsupported(
        body,
        {"functions": [],
         "function_call": "none", "audio": None, "modalities": ["text"], "web_search_options": None,
         "moderation": None},
    )  # fmt: skip
    # vLLM's extensions: the answer continues the last (assistant) message instead of starting a new one
    # (what a router resuming a stream sends: runtime/routing/resume.py)
    add_generation_prompt = _get(body, "add_generation_prompt", (bool,), True)
    continue_final = _get(body, "continue_final_message", (bool,), False)
    if continue_final and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message continues the last message: send it with add_generation_prompt false",
            "continue_final_message",
        )
    if continue_final and (clean[-1]["role"] != "assistant" or not clean[-1]["content"]):
        raise InvalidRequest(
            "continue_final_message needs a last message of role assistant with some content to continue",
            "continue_final_message",
        )
    tools = tool_calls.parse_tools(body)
    if tools is not None:
        for i, function in enumerate(tools.functions):
            output_constraints.check_schema(
                function["function"]["parameters"], f"tools[{i}].function.parameters"
            )
    parsed = _openai_request(body, prompt=None, messages=tool_calls.template_messages(clean),
                             max_tokens_default=None, defaults=defaults)  # fmt: skip
    params = parsed.params
    if tools is not None and tools.forced:  # required, or a named function: the answer is calls to them
        if params.constraint is not None:
            other = params.constraint.field.split(".")[0]
            raise InvalidRequest(f"tool_choice {tools.choice} makes the answer tool calls: send it or "
                                 f"{other}, not both", "tool_choice")  # fmt: skip
        constraint = output_constraints.tool_calls(
            tools.forced, one=tools.named is not None or not tools.parallel
        )
        params = dataclasses.replace(params, constraint=constraint)
    # our extension: the continued final message is the answer's beginning: its grammar and its reading for
    # tool calls cover that message and what follows it (what a front door resuming a constrained stream or
    # one read for tool calls on one of our pods sends); without it, as vLLM, both start at the continuation
    answer_prefix = ""
    if _get(body, "constrain_final_message", (bool,), False):
        if not continue_final:
            raise InvalidRequest("constrain_final_message applies to a continued final message: send it with "
                                 "continue_final_message true", "constrain_final_message")  # fmt: skip
        answer_prefix = clean[-1]["content"]
        params = _constrained_from(params, answer_prefix)
    return dataclasses.replace(
        parsed, params=params, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final, tools=tools, answer_prefix=answer_prefix,
    )  # fmt: skip


def _constrained_from(params: SamplingParams, prefix: str) -> SamplingParams:
    """The request's grammar (if any) reading `prefix` before the answer's first token."""
    if params.constraint is None:
        return params
    return dataclasses.replace(params, constraint=dataclasses.replace(params.constraint, prefix=prefix))


def _constrained_prefix(where: dict, prompt: str | list[int], params: SamplingParams, label: str) -> str:
    """Our extension on completions and TGI's parameters, `constrained_prefix`: the text the constrained
    answer already holds, which the prompt ends with; the grammar reads it before the continuation (what a
    front door resuming a constrained stream on one of our pods sends: runtime/routing/resume.py)."""
    prefix = _get(where, "constrained_prefix", (str,), "", label)
    if not prefix:
        return ""
    if params.constraint is None:
        raise InvalidRequest(f"{label} applies to a constrained request (response_format, structured_outputs "
                             "or grammar): send one, or leave it out", label)  # fmt: skip
    if isinstance(prompt, str) and not prompt.endswith(prefix):
        raise InvalidRequest(f"{label} is the answer so far, which the prompt ends with: this prompt does "
                             "not end with it", label)  # fmt: skip
    return prefix


def parse_tgi_generate(body: Any) -> ParsedRequest:
    """POST /generate, /generate_stream and / (TGI's ranges: temperature > 0, top_k > 0, top_p in (0, 1))."""
    _require_object(body)
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise InvalidRequest("inputs must be a non-empty string", "inputs")
    p = _get(body, "parameters", (dict,), {})
    max_new = _get(p, "max_new_tokens", (int,), 20)
    if max_new < 1:
        raise InvalidRequest(f"max_new_tokens must be at least 1, got {max_new}", "max_new_tokens")
    temperature = _get(p, "temperature", (int, float), None)
    if temperature is not None:
        _in_range("temperature", float(temperature), 0.0, 100.0, lo_open=True)
    top_k = _get(p, "top_k", (int,), None)
    if top_k is not None and top_k < 1:
        raise InvalidRequest(f"top_k must be a positive integer, got {top_k}", "top_k")
    top_p = _get(p, "top_p", (int, float), None)
    if top_p is not None:
        _in_range("top_p", float(top_p), 0.0, 1.0, lo_open=True, hi_open=True)
    penalty = _get(p, "repetition_penalty", (int, float), None)
    if penalty is not None:
        _in_range("repetition_penalty", float(penalty), 0.0, 100.0, lo_open=True)
    seed = _get(p, "seed", (int,), None)
    if seed is not None:
        _in_range("seed", seed, 0, 2**63 - 1)
    do_sample = _get(p, "do_sample", (bool,), False)
    sampling = do_sample or any(v is not None for v in (temperature, top_k, top_p))
    _get(p, "details", (bool,))
    _get(p, "return_full_text", (bool,))
    top_n = _get(p, "top_n_tokens", (int,), None)  # TGI's: the most likely tokens beside each one
    if top_n is not None:
        _in_range("top_n_tokens", top_n, 0, MAX_LOGPROBS)
    stream = _get(body, "stream", (bool,), False)
    _refuse_unsupported(
        p,
        {
            "best_of": 1,
            "watermark": False,
            "decoder_input_details": False,
            "typical_p": None,
            "frequency_penalty": 0,
            "return_full_text": False,
            "truncate": None,
        },
    )
    params = SamplingParams(
        max_tokens=max_new,
        temperature=float(temperature if temperature is not None else 1.0) if sampling else 0.0,
        top_k=top_k or 0,
        top_p=float(top_p) if top_p is not None else 1.0,
        repetition_penalty=float(penalty) if penalty is not None else 1.0,
        seed=seed,
        stop=_stop(p.get("stop"), "stop"),
        constraint=output_constraints.tgi_grammar(p.get("grammar")),
        # (TGI gives every token's log probability: in `details.tokens` and each streamed event's token)
        logprobs=top_n or 0,
    )
    prefix = _constrained_prefix(p, inputs, params, "parameters.constrained_prefix")
    return ParsedRequest(
        prompt=inputs,
        messages=None,
        params=_constrained_from(params, prefix),
        stream=stream,
        details=bool(p.get("details", False)),
    )
