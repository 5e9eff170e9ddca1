"""The router passes a peer's refusal of a request on to the client as the same 4xx, in the API's own format
(OpenAI: 400/413 with `error.message`, `error.param`; TGI: 422/413), never a 500 (which clients retry). A real
fleet started from the command line: one prefill pod, one decode pod, a unified pod with the same settings,
and two routers: `router`, given the shapes the operator renders (it refuses an over-long prompt itself, as
the unified pod does), and `loose`, given none (it must pass the decode pod's refusal through). Driven by the
official `openai` (max_retries=0) and `text-generation` clients."""

from __future__ import annotations

import pytest
from support import Fleet, free_port, get_json, post

pytestmark = pytest.mark.real_model

TOKEN = "fleet-token"
# a named dtype: with auto (the default) each pod resolves it for its CPU and the router (no torch)
# reports auto
SHAPES = ("--slots", "2", "--max-seq-len", "512", "--max-input-len", "256", "--dtype", "float32")
PEER_BODY_LIMIT = 1500  # bytes: the peers' --max-body-bytes, below what a 240-token prompt's ids take
LONG = "word " * 300  # over 256 tokens
MEDIUM = "hello " * 240  # under 256 tokens, but more than 1500 bytes as the token ids the router sends on


@pytest.fixture(scope="module")
def fleet(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("passthrough")
    (logs / "token").write_text(TOKEN)
    token = ("--internal-token-file", str(logs / "token"))
    f = Fleet(smollm2_dir, logs)
    peer_limits = (*SHAPES, "--max-body-bytes", str(PEER_BODY_LIMIT), *token)
    # leases to spare: a request the decode pod refuses unread (413) leaves its lease until it expires
    f.add("decode", "--role", "decode", "--kv-port", str(free_port()), "--kv-leases", "8", *peer_limits)
    f.add("prefill", "--role", "prefill", *peer_limits)
    f.add("unified", *SHAPES)
    peers = ("--prefill", f.url("prefill"), "--decode", f.url("decode"), *token)
    f.add("router", "--role", "router", *peers, *SHAPES)
    f.add("loose", "--role", "router", *peers)  # defaults: --max-seq-len 2048, prompts up to 2048
    try:
        f.start("decode", "prefill", "unified")
        f.start("router", "loose")
        yield f
    finally:
        f.close()


def openai_refusal(base: str, prompt: str):
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(APIStatusError) as e:
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    return e.value


def tgi_refusal(base: str, prompt: str):
    from text_generation import Client
    from text_generation.errors import ValidationError

    with pytest.raises(ValidationError) as e:
        Client(base, timeout=120).generate(prompt, max_new_tokens=4)
    return e.value


def test_an_over_long_prompt_is_a_400_through_either_router_as_from_a_unified_pod(fleet):
    unified = openai_refusal(fleet.url("unified"), LONG)
    assert unified.status_code == 400
    assert (
        unified.body["param"] == "prompt" and "the longest this deployment accepts is 256" in unified.message
    )
    for router in ("router", "loose"):
        e = openai_refusal(fleet.url(router), LONG)
        assert e.status_code == 400, (router, e)
        assert type(e).__name__ == "BadRequestError"
        assert e.body == unified.body, router  # message, type, param and code as a unified pod's
    # the loose router accepted the length itself: the 400 is the decode pod's, passed through
    assert get_json(fleet.url("loose") + "/info")["max_input_tokens"] == 2048


def test_the_tgi_api_answers_422_through_either_router_as_from_a_unified_pod(fleet):
    unified = tgi_refusal(fleet.url("unified"), LONG)
    for router in ("router", "loose"):
        e = tgi_refusal(fleet.url(router), LONG)
        assert str(e) == str(unified), router
    assert "the longest this deployment accepts is 256" in str(unified)


def test_a_peers_413_reaches_the_client_as_413_in_each_apis_format(fleet):
    from openai import OpenAI

    too_large = f"the request body exceeds the limit of {PEER_BODY_LIMIT} bytes"  # as the unified pod says
    e = openai_refusal(fleet.url("loose"), MEDIUM)
    assert e.status_code == 413 and too_large in e.message
    body = {"inputs": MEDIUM, "parameters": {"max_new_tokens": 4}}
    code, payload, _ = post(fleet.url("loose"), "/generate", body)
    assert code == 413 and too_large in payload["error"]
    # the same fleet serves a request within every limit
    client = OpenAI(base_url=fleet.url("loose") + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert out.choices[0].text and out.usage.completion_tokens == 4


def test_the_router_reports_the_shapes_it_was_given_like_the_unified_pod(fleet):
    unified = get_json(fleet.url("unified") + "/info")
    router = get_json(fleet.url("router") + "/info")
    keys = ("model_dtype", "max_input_tokens", "max_total_tokens", "max_concurrent_requests")
    assert {k: router[k] for k in keys} == {k: unified[k] for k in keys}
    assert (unified["max_input_tokens"], unified["max_total_tokens"]) == (256, 512)


def test_an_unknown_model_is_a_404_through_the_router_as_from_a_unified_pod(fleet):
    from openai import NotFoundError, OpenAI

    bodies = []
    for name in ("unified", "router"):
        client = OpenAI(base_url=fleet.url(name) + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(NotFoundError) as e:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        bodies.append(e.value.body)
    assert bodies[0] == bodies[1] and bodies[0]["param"] == "model"
