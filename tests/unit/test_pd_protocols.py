"""The engines' P/D protocols as the router speaks them (runtime/routing/pd_protocols.py), and the serve
options that select them (contract.ServeConfig): what each peer is sent, what is taken from its answer, what
passes to the client, and the refusals of options that cannot go together."""

from __future__ import annotations

import pydantic
import pytest

from neuronfleet.cli import build_parser
from neuronfleet.contract import ServeConfig
from neuronfleet.runtime.routing import pd_protocols as pd

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 7,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
    "temperature": 0.5,
}
KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_block_ids": [3, 4],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}


def test_the_vllm_prefill_request_asks_one_unstreamed_token_and_a_kept_kv_cache():
    sent = pd.vllm_prefill_body(CHAT)
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert CHAT["max_tokens"] == 7 and "stream_options" in CHAT  # the client's body is left as it was
    assert pd.vllm_prefill_body({**CHAT, "max_completion_tokens": 9})["max_completion_tokens"] == 1


def test_the_vllm_decode_request_is_the_clients_with_the_prefill_answers_kv_params():
    """At the prefill server's address as the router reached it: the plugin's example proxy does so, since a
    prefill server advertises its VLLM_NIXL_SIDE_CHANNEL_HOST (0.0.0.0 in the plugin's tutorial)."""
    advertised = {**KV, "remote_host": "0.0.0.0"}
    sent = pd.vllm_decode_body(CHAT, advertised, "http://10.1.2.3:8000")
    assert sent == {**CHAT, "kv_transfer_params": {**KV, "remote_host": "10.1.2.3"}}
    assert advertised["remote_host"] == "0.0.0.0"  # the answer is left as it was


@pytest.mark.parametrize("answer", [{}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}, [], "x"])
def test_a_prefill_answer_without_kv_params_is_refused_never_a_decode_only_request(answer):
    with pytest.raises(pd.BadPeerAnswer, match=r'without kv_transfer_params .* "NixlConnector"'):
        pd.vllm_kv_params(answer)
    assert pd.vllm_kv_params({"choices": [], "kv_transfer_params": KV}) == KV


def test_sglang_sends_both_servers_the_clients_body_with_the_bootstrap_fields():
    room = pd.new_room()
    sent = pd.sglang_body(CHAT, "10.0.0.9", 8998, room)
    assert sent == {**CHAT, "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": room}


def test_rooms_are_random_63_bit_numbers():
    rooms = {pd.new_room() for _ in range(200)}
    assert len(rooms) == 200 and all(0 <= r < 2**63 for r in rooms)
    assert max(rooms) >= 2**60  # drawn over the whole range, not a counter
    assert pd.new_room(lambda bits: (1 << bits) - 1) == 2**63 - 1  # the largest room mini_lb can draw


@pytest.mark.parametrize(
    ("url", "host"),
    [("http://10.1.2.3:8000", "10.1.2.3"), ("http://[fd00::5]:8000", "[fd00::5]"),
     ("http://prefill-0.svc:8000", "prefill-0.svc")],
)  # fmt: skip
def test_the_bootstrap_host_is_the_prefill_servers_host_ipv6_in_brackets(url, host):
    assert pd.bootstrap_host(url) == host


@pytest.mark.parametrize(
    ("status", "passed"),
    [(200, True), (400, True), (404, True), (413, True), (422, True), (408, False), (429, False),
     (500, False), (502, False), (503, False)],
)  # fmt: skip
def test_a_peers_4xx_is_the_clients_answer_its_5xx_408_429_the_pods_failure(status, passed):
    assert pd.passed_through(status) is passed


def test_the_client_body_must_be_a_json_object():
    assert pd.client_body(b'{"a": 1}') == {"a": 1}
    for raw, message in ((b"[1]", "must be a JSON object, not list"), (b"{", "not valid JSON"),
                         (b"\xff", "not valid UTF-8")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            pd.client_body(raw)


def test_no_pod_left_names_every_failure():
    message = pd.no_pod_message("prefill", ["http://a:1: refused", "http://b:1 answered 500"], ["dns://p:1"])
    assert (
        message == "no prefill server could serve the request: http://a:1: refused; http://b:1 answered 500"
    )
    assert pd.no_pod_message("decode", [], ["dns://d:1"]) == (
        "no decode server could serve the request: dns://d:1 resolve to no address"
    )


# ---- the serve options -------------------------------------------------------------------------------------


def parse(*argv: str) -> ServeConfig:
    return ServeConfig.from_namespace(build_parser().parse_args(["serve", *argv]))


def test_an_engine_router_needs_no_model_and_sglang_its_bootstrap_port():
    config = parse("--role", "router", "--peer-protocol", "sglang", "--bootstrap-port", "8998",
                   "--prefill", "dns://p:8000", "--decode", "dns://d:8000")  # fmt: skip
    assert (config.model, config.peer_protocol, config.bootstrap_port) == (None, "sglang", 8998)
    assert parse(*config.to_args()) == config
    assert parse("--role", "router", "--peer-protocol", "vllm").model is None
    # a vllm router given the model reads its tokenizer, to name the prefill peers' KV-cache events' blocks
    events = parse(*VLLM, "--model", "/m", "--peer-kv-events", PEERS)
    assert (events.model, events.peer_kv_events) == ("/m", PEERS)
    assert parse(*events.to_args()) == events


ROUTER = ("--role", "router")
VLLM = (*ROUTER, "--peer-protocol", "vllm")
PEERS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5570", "replay_endpoint": "tcp://*:5571"}'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "unified"], "--role unified needs --model"),
        ([*ROUTER], "--role router needs --model .* only a router with --peer-protocol"),
        (
            [*ROUTER, "--peer-protocol", "sglang", "--bootstrap-port", "1", "--model", "/m"],
            "sglang reads no model files .* remove --model",
        ),
        ([*VLLM, "--peer-kv-events", PEERS], "--peer-kv-events is for .* with --model"),
        ([*ROUTER, "--model", "/m", "--peer-kv-events", PEERS], "--peer-kv-events is for"),
        (
            [*VLLM, "--model", "/m", "--peer-kv-events", '{"endpoint": "ipc:///tmp/x"}'],
            "endpoint 'ipc:///tmp/x' is not a ZeroMQ tcp endpoint",
        ),
        ([*VLLM, "--model", "/m", "--peer-kv-events", "tcp://*:5570"], "takes the peers' --kv-events-config"),
        (["--role", "decode", "--model", "/m", "--peer-protocol", "vllm"], "vllm is for --role router"),
        ([*ROUTER, "--peer-protocol", "sglang"], "--bootstrap-port .* needed with --peer-protocol sglang"),
        ([*VLLM, "--bootstrap-port", "1"], r"only there \(here: vllm\)"),
    ],
)
def test_options_that_cannot_go_together_are_refused_saying_what_would_work(argv, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        parse(*argv)


def test_the_openai_fields_clients_lean_on_reach_both_servers_as_the_client_sent_them():
    """Structured outputs, tools, log probabilities, n and seed go to the prefill and the decode server
    (vLLM's and SGLang's) unchanged: the decode server, which generates every token, keeps a constrained
    request constrained, and the prefill server's one token is made under the same constraint."""
    asked = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}},
        "structured_outputs": {"regex": "[a-z]+"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required", "parallel_tool_calls": False, "logprobs": True, "top_logprobs": 3, "n": 2,
        "seed": 7,
    }  # fmt: skip
    body = {**CHAT, **asked}
    for sent in (
        pd.vllm_prefill_body(body),
        pd.vllm_decode_body(body, KV, "http://10.1.2.3:8000"),
        pd.sglang_body(body, "10.0.0.9", 8998, pd.new_room()),
    ):
        assert {k: sent[k] for k in asked} == asked
