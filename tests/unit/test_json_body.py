"""A request body decoded as bounded JSON (runtime/serving/api_requests.py `decode_json`), what every server
of the runtime reads its bodies with: each hostile body is an InvalidRequest naming what is wrong (the
servers answer it 400, or 422 on TGI's routes), never an exception that would be a 500; what JSON allows
passes as Python's json decodes it."""

from __future__ import annotations

import json

import pytest

from neuronfleet.runtime.serving.api_requests import MAX_DEPTH, decode_json, nesting_depth
from neuronfleet.runtime.serving.errors import InvalidRequest


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "the request body is empty"),
        (b" \n", "the request body is empty"),
        (b"\xff{}", "not valid UTF-8 (byte 0)"),
        (b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8 (byte 12)"),  # a surrogate encoded in UTF-8
        ('{"prompt": "hi"}'.encode("utf-16"), "not valid UTF-8"),
        (b"\xef\xbb\xbf{}", "not valid JSON: Unexpected UTF-8 BOM"),
        (b'{"prompt": ', "not valid JSON: Expecting value"),
        (b"[" * 100_000 + b"]" * 100_000, "nests arrays and objects 100000 deep; at most 128 levels"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests arrays and objects 100000 deep"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"{MAX_DEPTH + 1} deep"),
        (b"[" * 300_000, "300000 deep"),  # never closed
        (b'{"prompt": "\\ud800"}', "a lone UTF-16 surrogate (\\ud800)"),
        (b'{"messages": [{"role": "\\uDFFF", "content": "x"}]}', "a lone UTF-16 surrogate (\\udfff)"),
        (b'{"\\ud83d": 1}', "a lone UTF-16 surrogate (\\ud83d)"),  # in a key
        (b'{"prompt": "\\ude00\\ud83d"}', "lone UTF-16 surrogate"),  # a pair in the wrong order
        (b'{"temperature": NaN}', "holds NaN, which is not a JSON number"),
        (b'{"top_p": Infinity}', "holds Infinity"),
        (b'{"top_p": -Infinity}', "holds -Infinity"),
        (b'{"temperature": 1e400}', "the number 1e400, past a float's range"),
        (b'{"temperature": -1e400}', "the number -1e400"),
        (b'{"seed": ' + str(2**64).encode() + b"}", f"the integer {2**64}, which does not fit in 64 bits"),
        (b'{"seed": ' + str(-(2**63) - 1).encode() + b"}", "does not fit in 64 bits"),
        (b'{"max_tokens": 1' + b"0" * 400 + b"}", "10000000000000000000... (401 digits)"),
        (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "(5001 digits)"),  # past Python's own 4300-digit bound
    ],
)
def test_a_hostile_body_is_an_invalid_request_naming_the_problem(raw, needle):
    with pytest.raises(InvalidRequest) as e:
        decode_json(raw)
    assert needle in str(e.value) and e.value.field_name == "body" and e.value.status == 400


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": "ünïcødé, 中文, and an emoji \U0001f600 escaped as a pair"},
        {"prompt_ids": list(range(50_000)), "seed": 2**63 - 1, "big": 2**64 - 1, "low": -(2**63)},
        {"temperature": 1.7976931348623157e308, "top_p": 5e-324},
        {"text": "[[[[{{{{ brackets in a string ]]]] " * 100, "escaped": '\\" [ quote then bracket'},
        {"tools": [{"parameters": {"a": {"b": {"c": [[[[1]]]]}}}}]},
    ],
)
def test_what_json_allows_decodes_as_python_does(value):
    raw = json.dumps(value).encode()  # (ensure_ascii: non-ASCII as \u escapes, the emoji as a pair)
    assert decode_json(raw) == value == json.loads(raw)
    assert decode_json(json.dumps(value, ensure_ascii=False).encode()) == value


def test_nesting_is_counted_on_the_bytes_brackets_in_strings_ignored():
    at_limit = b"[[]," + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"]"  # more brackets than levels
    assert nesting_depth(at_limit) == MAX_DEPTH and decode_json(at_limit) == json.loads(at_limit)
    assert nesting_depth(b"[" * 10 + b"]" * 10) == 0  # no more opening brackets than the limit: not counted
    # more opening brackets than the limit, all in strings or side by side: shallow
    assert nesting_depth(json.dumps(["[{" * 500, "x"]).encode()) == 1
    assert nesting_depth(json.dumps([[]] * 1000).encode()) == 2
    # an escaped quote does not end a string; an unterminated one runs to the end
    assert nesting_depth(b'["\\"[[[[' + b"[" * 200 + b'"]') == 1
    assert nesting_depth(b'["' + b"[" * 200) == 1
