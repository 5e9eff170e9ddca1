"""`response_format` parsed into a grammar (what it accepts, read through SmolLM2's vocabulary), and refused
with the part that is wrong; a constrained stream is not resumed."""

from __future__ import annotations

import json

import llguidance
import pytest

from neuronfleet.runtime.routing.resume import resumable
from neuronfleet.runtime.serving.api_requests import (
    parse_openai_chat,
    parse_openai_completion,
    parse_tgi_generate,
)
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.output_constraints import response_format
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab(smollm2_dir) -> llguidance.LLTokenizer:
    tokenizer = Tokenizer(smollm2_dir)
    return llguidance.LLTokenizer(tokenizer.to_json(), eos_token=sorted(tokenizer.eos_token_ids))


def accepts(vocab: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
    return matcher.consume_tokens(vocab.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.real_model
def test_each_format_accepts_what_it_names(vocab):
    assert response_format(None) is None and response_format({"type": "text"}) is None
    anything = response_format({"type": "json_object"})
    assert anything is not None and anything.kind == "json_object"
    assert accepts(vocab, anything.grammar, '{"x": [1, "two", null]}')
    assert not accepts(vocab, anything.grammar, "[1, 2]")  # an object, not any JSON
    schema = response_format(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    )
    assert schema is not None and schema.field == "response_format.json_schema.schema"
    assert accepts(vocab, schema.grammar, '{"a": 3}')
    for wrong in (
        '{"a": "3"}',
        '{"b": 3}',
        '{"a": 3, "b": 4}',
        '{ "a": 3}',
    ):  # (no free whitespace: JSON_OPTIONS)
        assert not accepts(vocab, schema.grammar, wrong), wrong
    # (OpenAI's SDK types let the schema out: any JSON then, as vLLM)
    loose = response_format({"type": "json_schema", "json_schema": {"name": "any"}})
    assert loose is not None and accepts(vocab, loose.grammar, "[true]")


@pytest.mark.parametrize(
    "value, field, needle",
    [
        ("json", "response_format", "must be an object"),
        ({"type": "xml"}, "response_format.type", "one of text, json_object, json_schema, got 'xml'"),
        ({}, "response_format.type", "got None"),
        ({"type": "json_schema"}, "response_format.json_schema", "must be an object {name, schema, strict}"),
        ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema",
         "must be a JSON Schema object, got list"),
        ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
         "response_format.json_schema.name", "must be a string"),
        ({"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}},
         "response_format.json_schema.strict", "must be a boolean"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}},
         "response_format.json_schema.schema", "Invalid type: objectx"),
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}},
         "response_format.json_schema.schema", "does not exist"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
         "response_format.json_schema.schema", "regex parse error"),
        ({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": 5}}}},
         "response_format.json_schema.schema", "schema must be an object or boolean"),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70000]}}},
         "response_format.json_schema.schema", "at most 65536 are accepted"),
    ],
)  # fmt: skip
def test_a_bad_format_is_refused_naming_the_part(value, field, needle):
    with pytest.raises(InvalidRequest) as refused:
        response_format(value)
    assert refused.value.field_name == field and needle in str(refused.value)
    with pytest.raises(InvalidRequest, match="response_format"):  # through both APIs' parsers
        parse_openai_chat({**CHAT, "response_format": value})
    with pytest.raises(InvalidRequest, match="response_format"):
        parse_openai_completion({"prompt": "hi", "response_format": value})


def test_both_apis_carry_the_constraint_and_refuse_it_with_ignore_eos():
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    chat = parse_openai_chat({**CHAT, **body}).params.constraint
    completion = parse_openai_completion({"prompt": "x", **body}).params.constraint
    assert chat is not None and chat == completion and chat.kind == "json_schema"
    assert parse_openai_chat({**CHAT, "response_format": {"type": "text"}}).params.constraint is None
    with pytest.raises(InvalidRequest, match="ignore_eos would run a constrained answer past") as refused:
        parse_openai_chat({**CHAT, **body, "ignore_eos": True})
    assert refused.value.field_name == "ignore_eos"
    with pytest.raises(InvalidRequest):
        SamplingParams(constraint=chat, ignore_eos=True)


@pytest.mark.parametrize(
    "extra, resumed",
    [
        ({}, True),
        ({"response_format": {"type": "text"}}, True),
        ({"response_format": {"type": "json_object"}}, False),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, False),
        ({"structured_outputs": {"json": SCHEMA}}, False),  # vLLM's own field
        ({"guided_json": SCHEMA}, False),  # vLLM's former one
    ],
)
def test_a_constrained_stream_is_not_resumed(extra, resumed):
    """A pod that continues an answer starts its grammar at the continuation (vLLM's, SGLang's), so a
    constrained stream is not resumed on another pod: it ends cut, as any stream that cannot be resumed."""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x"})):
        assert (resumable(path, {**body, "stream": True, **extra}) is not None) is resumed


@pytest.mark.real_model
def test_vllms_structured_outputs_and_tgis_grammar_accept_what_they_name(vocab):
    """vLLM's `structured_outputs` (json as an object or its text, regex, choice, json_object) and TGI's
    `grammar` (json, regex) become the same grammars."""
    from neuronfleet.runtime.serving.output_constraints import structured_outputs, tgi_grammar

    for value in ({"json": SCHEMA}, {"json": json.dumps(SCHEMA)}):
        schema = structured_outputs(value)
        assert schema is not None and accepts(vocab, schema.grammar, '{"a": 3}')
        assert not accepts(vocab, schema.grammar, '{"a": "x"}')
    regex = structured_outputs({"regex": r"\d{3}-[a-z]+"})
    assert regex is not None and accepts(vocab, regex.grammar, "123-abc")
    assert not accepts(vocab, regex.grammar, "12-abc")
    choice = structured_outputs({"choice": ["yes", "no way", 'a "quoted" \\ one']})
    assert choice is not None and all(
        accepts(vocab, choice.grammar, c) for c in ("yes", "no way", 'a "quoted" \\ one')
    )
    assert not accepts(vocab, choice.grammar, "maybe")
    anything = structured_outputs({"json_object": True, "disable_any_whitespace": True})
    assert anything is not None and accepts(vocab, anything.grammar, '{"b": []}')
    tgi = tgi_grammar({"type": "json", "value": SCHEMA})
    assert tgi is not None and accepts(vocab, tgi.grammar, '{"a": 3}')
    tgi = tgi_grammar({"type": "regex", "value": "[ab]+"})
    assert tgi is not None and accepts(vocab, tgi.grammar, "abba") and not accepts(vocab, tgi.grammar, "abc")
    assert parse_tgi_generate({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a+"}}}
                              ).params.constraint is not None  # fmt: skip


@pytest.mark.parametrize(
    "body, field, needle",
    [
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", "not supported"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "not a field of"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "is not JSON"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
         "true or left out"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "not both"),
        ({"guided_json": SCHEMA}, "guided_json", "send structured_outputs"),
    ],
)  # fmt: skip
def test_vllms_fields_refused_naming_the_part(body, field, needle):
    for parse, base in ((parse_openai_chat, CHAT), (parse_openai_completion, {"prompt": "x"})):
        with pytest.raises(InvalidRequest) as refused:
            parse({**base, **body})
        assert refused.value.field_name == field and needle in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "grammar, field, needle",
    [
        ({"type": "ebnf", "value": "x"}, "grammar", '"type": "json" or "regex"'),
        ({"type": "json", "value": 5}, "grammar.value", "must be a JSON Schema object"),
        ({"type": "json", "value": {"type": "nope"}}, "grammar.value", "Invalid type"),
        ({"type": "regex", "value": ""}, "grammar.value", "non-empty regular expression"),
    ],
)
def test_tgis_grammar_refused_naming_the_part(grammar, field, needle):
    with pytest.raises(InvalidRequest) as refused:
        parse_tgi_generate({"inputs": "x", "parameters": {"grammar": grammar}})
    assert refused.value.field_name == field and needle in str(refused.value), str(refused.value)
    assert resumable("/generate_stream", {"inputs": "x", "parameters": {"grammar": grammar}}) is None
