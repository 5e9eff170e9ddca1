"""The engines' own prefill/decode protocols at the OpenAI HTTP level (pure): what a router in front of vLLM
or SGLang prefill and decode servers sends each of them, and what it makes of their answers. The HTTP side
(peers, probes, retries, streaming) is `runtime/routing/pd_proxy.py`.

vLLM with the vLLM Neuron plugin of Neuron SDK 2.32.0 (vLLM 0.24.0, NixlConnector or NeuronNixlConnector:
prefill pods `kv_role: kv_producer`, decode pods `kv_consumer`), in the read mode the plugin documents
(aws-neuron/aws-neuron-sdk@v2.32.0:vllm-neuron/docs/design/vllm/disaggregated-inference.md, "Request Flow
(read mode)"; tutorials/tutorial-di-1p1d-xpyd.md runs the plugin's example proxy,
examples/vllm_neuron/vllm/disaggregated_inference/toy_proxy_server.py, read in a copy of the plugin's
repository, and vLLM's own tests/v1/kv_connector/nixl_integration/toy_proxy_server.py it follows):

1. to a prefill server, the client's body with `kv_transfer_params` = {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id, remote_block_ids, remote_host, remote_port: null},
   `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` where the client gave it), without
   `stream_options`, `min_tokens` and `min_completion_tokens` (one token is all a prefill makes; the plugin
   discards it); header `X-Request-Id`: the request's id;
2. to a decode server, the client's body with the `kv_transfer_params` of the prefill server's answer (its
   engine, the KV blocks, the host and port the decode server reads them from over NIXL), `remote_host` set
   to the address the router reached the prefill server at, as the plugin's example proxy does (a prefill
   server advertises its VLLM_NIXL_SIDE_CHANNEL_HOST there, which the tutorial sets to 0.0.0.0), and the same
   `X-Request-Id`. The decode server generates every token, the first included; its answer, streamed or not,
   is the client's.

One deliberate difference: the toy proxy sends the decode request without `kv_transfer_params` when the
prefill server answered none, and the decode server then prefills the prompt itself: a silently degraded
request. Here such an answer is a failed prefill (another prefill server is tried), never a decode-only
request.

SGLang at the commit SGLang-Neuron 0.1.0 pins (43881a7: sgl-project/sglang-neuron@v0.1.0:README.md), as its
mini load balancer does it: sgl-project/sglang@43881a7:python/sglang/srt/disaggregation/mini_lb.py
(`_forward_to_backend`, `_generate_bootstrap_room`;
https://docs.sglang.io/advanced_features/pd_disaggregation.html): the client's body, with `bootstrap_host`
(the prefill server's host, an IPv6 address in brackets), `bootstrap_port` (its
`--disaggregation-bootstrap-port`) and `bootstrap_room` (random in [0, 2**63 - 1], one per request) added,
goes to a prefill and a decode server at once; the decode server pulls the KV cache from the prefill server it
names, and its answer is the client's.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from neuronfleet.runtime.serving.api_requests import decode_json

PROTOCOLS = ("vllm", "sglang")

# what the prefill request carries (toy_proxy_server.py `send_request_to_service`)
VLLM_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
VLLM_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
ROOM_BITS = 63  # bootstrap_room: random.randint(0, 2**63 - 1) in mini_lb.py
REQUEST_ID_HEADER = "X-Request-Id"


class BadPeerAnswer(ValueError):
    """A peer answered 200 with something the protocol cannot continue from."""


def client_body(raw: bytes) -> dict[str, Any]:
    """The client's request: a JSON object, bounded as every server's (`api_requests.decode_json`); what else
    it holds is the engines' to check. ValueError says what is wrong."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def streams(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


# ---- vLLM ------------------------------------------------------------------------------------------------


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, not streamed, asking it to keep the KV cache for a decode."""
    out = {k: v for k, v in body.items() if k not in VLLM_NOT_FOR_PREFILL}
    out.update(kv_transfer_params=dict(VLLM_PREFILL_KV), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def vllm_kv_params(prefill_answer: Any) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill server's answer; BadPeerAnswer when it has none (the server was
    not started as a NixlConnector kv_producer, or it did not keep the KV cache)."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not isinstance(params, dict) or not params:
        raise BadPeerAnswer(
            "the prefill server answered without kv_transfer_params (is it a vLLM server with "
            '--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}?)'
        )
    return params


def vllm_decode_body(body: dict[str, Any], kv_params: dict[str, Any], prefill_url: str) -> dict[str, Any]:
    """The decode server's request: the client's, naming the KV cache the prefill server holds, at the host
    the router reached that server at (`prefill_url`)."""
    host = urlsplit(prefill_url).hostname
    return {**body, "kv_transfer_params": {**kv_params, **({"remote_host": host} if host else {})}}


# ---- SGLang ----------------------------------------------------------------------------------------------


def bootstrap_host(peer_url: str) -> str:
    """The prefill server's host as SGLang's decode server connects to it (IPv6 in brackets)."""
    host = urlsplit(peer_url).hostname or ""
    try:
        return f"[{host}]" if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else host
    except ValueError:  # a name
        return host


def new_room(randbits: Callable[[int], int] = secrets.randbits) -> int:
    """A request's bootstrap room: random, 63 bits."""
    return randbits(ROOM_BITS)


def sglang_body(body: dict[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    """What both the prefill and the decode server receive."""
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


# ---- answers ---------------------------------------------------------------------------------------------


def passed_through(status: int) -> bool:
    """A peer's answer that is the client's as it is: success, or the peer refusing the request itself (a
    4xx). A timeout (408), a full peer (429) and any 5xx are the pod's failure: another pod is tried."""
    return status < 400 or (400 <= status < 500 and status not in (408, 429))


def no_pod_message(role: str, failures: Sequence[str], specs: Sequence[str]) -> str:
    why = "; ".join(failures) or f"{', '.join(specs)} resolve to no address"
    return f"no {role} server could serve the request: {why}"
