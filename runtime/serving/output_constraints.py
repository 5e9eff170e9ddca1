"""What a request asks its output to match (structured outputs), parsed and checked (pure: no tokenizer, no
torch), as a grammar of llguidance, the grammar engine vLLM and SGLang offer
(github.com/guidance-ai/llguidance; pinned in pyproject.toml): OpenAI's `response_format` (`json_object`, or
`json_schema` with its schema), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `json_object`:
vllm/sampling_params.py, StructuredOutputsParams; docs.vllm.ai features/structured_outputs, read for 0.25)
and TGI's `grammar` parameter (`json` or `regex`). A grammar the engine cannot compile is refused here,
naming the part, before a slot is taken.

The engine (`runtime/engine/sampler.py`) builds one matcher per request from the grammar and masks each step's
logits to the tokens it allows; the answer ends where the grammar does (only an end-of-sequence token is
allowed then)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import llguidance

from neuronfleet.runtime.serving.errors import InvalidRequest

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# JSON as the answer writes it: no free whitespace (a small model left free to add spaces may add them until
# its tokens run out), Python's json.dumps separators, which read as prose tokens do
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # `json_object`: any JSON object
MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text at most (a bigger one is refused, not compiled)


@dataclass(frozen=True)
class OutputConstraint:
    """A grammar the answer must match: `grammar` is llguidance's grammar text, `kind` what the request
    asked (json_object, json_schema), `field` the request field it came from (named in errors). `prefix`: text
    the answer already holds, which the grammar reads before the first token (an attempt that continues an
    answer after the tokens its client has: the prefill/decode router's, `routing/router.py`)."""

    kind: str
    grammar: str
    field: str = "response_format"
    prefix: str = ""


def grammar_error(text: str) -> str:
    """llguidance's error text (several lines: a parser state, a regex drawn with a caret) as one line: its
    first, and a regex's own `error:` line where it has one."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()] or [text]
    cause = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {cause}".strip()


@functools.lru_cache(maxsize=512)
def _grammar_error(grammar: str) -> str:
    """llguidance's check of a grammar ("" where it is good): kept for the grammars seen last, as clients send
    the same schemas and tools with every request, and the front door parses each request too (a check
    costs about 0.3 ms for a small schema)."""
    return llguidance.LLMatcher.validate_grammar(grammar)


def _checked(grammar: str, kind: str, field: str, what: str) -> OutputConstraint:
    error = _grammar_error(grammar)
    if error:
        raise InvalidRequest(f"{field} is not {what} this server can follow: {grammar_error(error)}", field)
    return OutputConstraint(kind, grammar, field)


def _schema_grammar(schema: Any, kind: str, field: str) -> OutputConstraint:
    """A JSON schema (an object, or its JSON text) as a grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"{field} is not JSON: {e}", field) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field} must be a JSON Schema object, got {type(schema).__name__}", field)
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{field} is {len(text)} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted",
                             field)  # fmt: skip
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:  # (it reports schema errors through validate_grammar instead)
        raise InvalidRequest(f"{field} is not a JSON schema this server can follow: {e}", field) from None
    return _checked(grammar, kind, field, "a JSON schema")


def _regex_grammar(regex: Any, field: str) -> OutputConstraint:
    if not isinstance(regex, str) or not regex:
        raise InvalidRequest(f"{field} must be a non-empty regular expression (a string)", field)
    if len(regex) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{field} is {len(regex)} characters; at most {MAX_SCHEMA_BYTES} are accepted", field
        )
    return _checked(llguidance.LLMatcher.grammar_from_regex(regex), "regex", field, "a regular expression")


def _choice_grammar(choices: Any, field: str) -> OutputConstraint:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"{field} must be a non-empty list of non-empty strings", field)
    if sum(map(len, choices)) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{field} holds more than {MAX_SCHEMA_BYTES} characters", field)
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)  # (Lark's literals read JSON's escapes)
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "choice", field, "a list of choices")


def response_format(value: Any, field: str = "response_format") -> OutputConstraint | None:
    """The constraint of an OpenAI `response_format` (None for `{type: text}` or none): `{type: json_object}`
    (any JSON object) or `{type: json_schema, json_schema: {name, schema, strict, description}}` (the schema's
    JSON; `strict` is accepted either way: the answer always matches the schema). InvalidRequest names the
    part that is wrong and says what is allowed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f'{field} must be an object such as {{"type": "json_object"}}', field)
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(f"{field}.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                             f"{field}.type")  # fmt: skip
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema_grammar(ANY_OBJECT, kind, field)
    spec = value.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(
            f"{where} must be an object {{name, schema, strict}} for type json_schema", where
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be a string, got {type(name).__name__}", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(
            f"{where}.strict must be a boolean, got {type(strict).__name__}", f"{where}.strict"
        )
    schema = spec.get("schema")
    if schema is None:  # OpenAI's SDK types allow it out; vLLM takes any JSON then
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where}.schema must be a JSON Schema object, got {type(schema).__name__}",
                             f"{where}.schema")  # fmt: skip
    return _schema_grammar(schema, kind, f"{where}.schema")


VLLM_KINDS = ("json", "regex", "choice", "json_object")  # what this server takes of StructuredOutputsParams
VLLM_REFUSED = ("grammar", "structural_tag")  # taken by vLLM (xgrammar's EBNF, its tags), not here yet
VLLM_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                "whitespace_pattern", "backend")  # vLLM's tuning of its own backends: ignored  # fmt: skip


def structured_outputs(value: Any, field: str = "structured_outputs") -> OutputConstraint | None:
    """The constraint of vLLM's `structured_outputs` object: exactly one of `json` (a schema, or its JSON
    text), `regex`, `choice` (a list of strings) or `json_object: true`, as vLLM takes them."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be an object with one of {', '.join(VLLM_KINDS)}", field)
    for name in VLLM_REFUSED:
        if value.get(name) is not None:
            kinds = ", ".join(VLLM_KINDS)
            raise InvalidRequest(f"{field}.{name} is not supported by this server; {kinds} are",
                                 f"{field}.{name}")  # fmt: skip
    unknown = sorted(set(value) - {*VLLM_KINDS, *VLLM_REFUSED, *VLLM_OPTIONS})
    if unknown:
        raise InvalidRequest(f"{field}.{unknown[0]} is not a field of structured_outputs; expected one of "
                             f"{', '.join(VLLM_KINDS)}", f"{field}.{unknown[0]}")  # fmt: skip
    asked = [k for k in VLLM_KINDS if value.get(k) not in (None, False)]
    if len(asked) != 1:
        raise InvalidRequest(f"{field} must set exactly one of {', '.join(VLLM_KINDS)}, got "
                             f"{', '.join(asked) or 'none'}", field)  # fmt: skip
    (kind,) = asked
    if kind == "json":
        return _schema_grammar(value["json"], "json_schema", f"{field}.json")
    if kind == "regex":
        return _regex_grammar(value["regex"], f"{field}.regex")
    if kind == "choice":
        return _choice_grammar(value["choice"], f"{field}.choice")
    if value["json_object"] is not True:
        raise InvalidRequest(f"{field}.json_object must be true or left out", f"{field}.json_object")
    return _schema_grammar(ANY_OBJECT, "json_object", field)


TGI_GRAMMARS = ("json", "regex")


def tgi_grammar(value: Any, field: str = "grammar") -> OutputConstraint | None:
    """The constraint of TGI's `grammar` parameter: `{"type": "json", "value": schema}` (an object or its
    JSON text) or `{"type": "regex", "value": "..."}` (text_generation's `Grammar`)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in TGI_GRAMMARS:
        raise InvalidRequest(f'{field} must be {{"type": "json" or "regex", "value": ...}}', field)
    if value["type"] == "json":
        return _schema_grammar(value.get("value"), "json_schema", f"{field}.value")
    return _regex_grammar(value.get("value"), f"{field}.value")


def check_schema(schema: Any, field: str) -> None:
    """A JSON schema this server can follow, else InvalidRequest naming `field` and the part (a tool's
    parameters)."""
    _schema_grammar(schema, "json_schema", field)


def tool_calls(functions: list[dict], one: bool, field: str = "tool_choice") -> OutputConstraint:
    """An answer of Hermes tool calls (`tool_calls.OPEN`, the call's JSON, `tool_calls.CLOSE`) to the given
    functions (`{"type": "function", "function": {name, parameters}}` each), their arguments matching their
    parameters' schemas: exactly one call (`one`: a named tool_choice), else one or more, a line apart."""
    calls = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
              "arguments": f["function"]["parameters"]}, "required": ["name", "arguments"],
              "additionalProperties": False} for f in functions]  # fmt: skip
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    lark = "\n".join([
        "start: call" if one else 'start: call ("\\n" call)*',
        'call: "<tool_call>\\n" body "\\n</tool_call>"',
        f"body: %json {json.dumps(schema)}",
    ])  # fmt: skip
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "tool_calls", field, "a set of tools")
