"""Holding at zero in the P/D routers and in front of another engine's servers, from the command line:
`--hold-requests N` makes ours (`RemoteBackend`: real prefill and decode servers) and the one in front of
vLLM's P/D servers (`EngineRouter`: the stand-ins of tests/standins/engines.py) ready with no peer, hold a
request while no peer it needs is ready, and send it on once peers started afterwards are; the front door in
front of a vLLM stand-in (no /ready: probed at /health) passes the request on exactly as sent."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import (
    EXACT_DTYPE_OPTIONS,
    ROOT,
    Process,
    Server,
    free_port,
    http_status,
    metric,
    neuronfleet_command,
    unified_reference,
)

STANDIN = ROOT / "tests" / "standins" / "engines.py"
TOKEN = "s3cret"


def _status(url: str) -> int:
    try:
        return http_status(url)
    except OSError:
        return 0


def router(tmp: Path, *options: str) -> tuple[str, Process]:
    port = free_port()
    args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port),
            "--peer-probe-interval", "0.5", "--grace-period", "1", *options]  # fmt: skip
    process = Process(args, tmp / f"router-{port}.log")
    base = f"http://127.0.0.1:{port}"
    process.wait_until(lambda: _status(base + "/health") == 200, "the router to serve")
    return base, process


def standin(tmp: Path, role: str, port: int, name: str, *extra: str) -> Process:
    record = str(tmp / f"{name}.jsonl")
    args = [sys.executable, str(STANDIN), "--engine", "vllm", "--role", role, "--port", str(port),
            "--name", name, "--record", record, "--model", "m", "--max-model-len", "64"]  # fmt: skip
    if role == "prefill":
        args += ["--side-port", str(free_port())]
    process = Process([*args, *extra], tmp / f"{name}.log")
    process.wait_until(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, f"stand-in {name}")
    return process


def records(tmp: Path, name: str) -> list[dict]:
    path = tmp / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def openai(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def held(base: str) -> float:
    return metric(base, "neuronfleet:router_requests_held")


def waiting_and_running(base: str) -> tuple[float, float]:
    """The queue and running gauges an inference gateway's endpoint picker reads, under vLLM's names."""
    return metric(base, "vllm:num_requests_waiting"), metric(base, "vllm:num_requests_running")


def test_the_vllm_pd_router_holds_at_zero_until_prefill_and_decode_are_ready(tmp_path):
    prefill_port, decode_port = free_port(), free_port()
    base, process = router(tmp_path, "--peer-protocol", "vllm", "--served-model-name", "m", "--hold-requests",
                           "2", "--prefill", f"http://127.0.0.1:{prefill_port}", "--decode",
                           f"http://127.0.0.1:{decode_port}")  # fmt: skip
    peers: list[Process] = []
    try:
        assert _status(base + "/ready") == 200
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                lambda: openai(base).completions.create(model="m", prompt="a b c", max_tokens=3)
            )
            process.wait_until(lambda: held(base) == 1, "the request to be held")
            peers.append(standin(tmp_path, "decode", decode_port, "decode"))
            process.wait_until(lambda: metric(base, "neuronfleet:router_peers_healthy", role="decode") == 1,
                               "the decode stand-in to be in rotation")  # fmt: skip
            assert held(base) == 1 and not answer.done()  # a request needs a prefill server too
            assert waiting_and_running(base) == (1, 0)  # what an inference gateway's endpoint picker reads
            peers.append(standin(tmp_path, "prefill", prefill_port, "prefill"))
            text = answer.result().choices[0].text
        assert text.startswith("decode-0 ")
        (decode,) = records(tmp_path, "decode")
        assert "prefilled_here" not in decode  # it read the prefill stand-in's blocks: a real exchange
        assert held(base) == 0 and metric(base, "neuronfleet:router_hold_seconds_count") == 1
        assert waiting_and_running(base) == (0, 0)
    finally:
        for peer in [*peers, process]:
            peer.kill()


def test_the_front_door_to_another_engine_passes_requests_on_as_sent(tmp_path):
    """A vLLM stand-in as the unified pod (it has no /ready: probed at /health): the body, the query and the
    client's headers arrive as sent, and the answer comes back."""
    port = free_port()
    pod = standin(tmp_path, "decode", port, "pod")
    base, process = router(tmp_path, "--unified", f"http://127.0.0.1:{port}")
    try:
        process.wait_until(lambda: _status(base + "/ready") == 200, "the front door to find its pod")
        client = openai(base)
        out = client.completions.create(model="m", prompt="x y", max_tokens=2, extra_query={"trace": "1"},
                                        extra_headers={"X-Request-Id": "r-42"})  # fmt: skip
        (record,) = records(tmp_path, "pod")
        assert record["body"] == {"model": "m", "prompt": "x y", "max_tokens": 2}
        assert (
            record["request_id"] == "r-42"
            and out.choices[0].text == record["answer"]["json"]["choices"][0]["text"]
        )
    finally:
        process.kill()
        pod.kill()


@pytest.mark.real_model
def test_our_pd_router_holds_at_zero_until_a_decode_pod_is_ready(smollm2_dir, tmp_path):
    from neuronfleet.runtime.serving.sampling_params import SamplingParams

    (tmp_path / "token").write_text(TOKEN)
    common = ("--max-seq-len", "256", "--internal-token-file", str(tmp_path / "token"), *EXACT_DTYPE_OPTIONS)
    prefill_port, decode_port = free_port(), free_port()
    base, process = router(tmp_path, "--model", str(smollm2_dir), "--served-model-name", "smollm2",
                           "--prefill", f"http://127.0.0.1:{prefill_port}", "--decode",
                           f"http://127.0.0.1:{decode_port}", "--hold-requests", "1", *common)  # fmt: skip
    unified = unified_reference(smollm2_dir)
    ids = unified.tokenizer.encode_chat([{"role": "user", "content": "Name a red fruit."}])
    want = unified.generate([ids], SamplingParams(max_tokens=12))[0].text
    servers: list[Server] = []
    try:
        assert _status(base + "/ready") == 200
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(lambda: openai(base).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Name a red fruit."}], max_tokens=12,
                temperature=0))  # fmt: skip
            process.wait_until(lambda: held(base) == 1, "the request to be held")
            assert waiting_and_running(base) == (1, 0)
            assert metric(base, "vllm:kv_cache_usage_perc") == 0  # no decode pod in rotation yet
            from openai import RateLimitError

            with pytest.raises(RateLimitError):  # the bound is 1
                openai(base).completions.create(model="smollm2", prompt="hi", max_tokens=2)
            for role, port in (("decode", decode_port), ("prefill", prefill_port)):
                servers.append(Server(smollm2_dir, ("--role", role, *common), port, tmp_path / f"{role}.log"))
            text = answer.result().choices[0].message.content
        assert text == want
        assert held(base) == 0 and metric(base, "neuronfleet:router_hold_rejected_total", reason="full") == 1
        assert waiting_and_running(base) == (0, 0)
        # the picker's static families, as a model server exports them (tests/data/gie-v1.5.0-epp-...yaml)
        assert metric(base, "vllm:cache_config_info") == 1 and metric(base, "vllm:lora_requests_info") > 0
    finally:
        for server in servers:
            server.kill()
        process.kill()


def test_a_pod_that_dies_mid_stream_cuts_the_clients_stream_never_a_clean_end(tmp_path):
    """The answer started: the front door cannot move it; the client's stream breaks (the client sees an
    error, not a stream that merely ended early) after the chunks the pod sent."""
    from openai import APIError

    port = free_port()
    pod = standin(tmp_path, "decode", port, "pod", "--die-mid-stream")
    base, process = router(tmp_path, "--unified", f"http://127.0.0.1:{port}")
    try:
        process.wait_until(lambda: _status(base + "/ready") == 200, "the front door to find its pod")
        stream = openai(base).completions.create(model="m", prompt="x y", max_tokens=6, stream=True)
        got = []
        with pytest.raises(APIError):
            for chunk in stream:
                got.append(chunk.choices[0].text)
        assert got == ["pod-0", " pod-1"]
        assert pod.wait() == 1
    finally:
        process.kill()
        pod.kill()
