"""The HTTP server on the real model, driven by the official `openai` and `text-generation` clients."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    """`neuronfleet serve` as a user starts it, on 127.0.0.1 and a free port; stopped with SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "neuronfleet.cli",
            "serve",
            "--model",
            str(smollm2_dir),
            "--port",
            str(port),
            "--slots",
            "4",
            "--max-seq-len",
            "512",
            "--served-model-name",
            "smollm2",
            "--max-waiting",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/ready", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not become ready: " + proc.stdout.read())
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    from neuronfleet.runtime.engine import Engine

    return Engine.from_model_dir(str(smollm2_dir), slots=1, max_seq_len=512)


def post(base: str, path: str, body: bytes | dict, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_openai_chat_equals_the_engines_offline_greedy_output(server, offline):
    from openai import OpenAI

    from neuronfleet.runtime.sampling_params import SamplingParams

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0
    )
    prompt = offline.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    expected = offline.generate([prompt], SamplingParams(max_tokens=40))[0]
    assert resp.choices[0].message.content == expected.text == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.object == "chat.completion" and resp.model == "smollm2" and resp.id.startswith("chatcmpl-")
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_openai_streaming_completion_with_usage_and_stop(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    whole = client.completions.create(
        model="smollm2", prompt="The three primary colors are", max_tokens=24, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt="The three primary colors are",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len(chunks) > 3
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    word = whole.choices[0].text.split()[2]
    stopped = client.completions.create(
        model="smollm2", prompt="The three primary colors are", max_tokens=24, temperature=0, stop=[word]
    )
    assert stopped.choices[0].text == whole.choices[0].text[: whole.choices[0].text.index(word)]
    assert stopped.choices[0].finish_reason == "stop"


def test_openai_seed_reproduces_sampled_output(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    kw = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=20,
        temperature=0.9,
        seed=42,
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_tgi_client_generate_and_stream(server, offline):
    from text_generation import Client

    from neuronfleet.runtime.sampling_params import SamplingParams

    client = Client(server, timeout=120)
    resp = client.generate("The capital of France is", max_new_tokens=12)
    expected = offline.generate(["The capital of France is"], SamplingParams(max_tokens=12))[0]
    assert resp.generated_text == expected.text
    assert resp.details.generated_tokens == 12 and resp.details.finish_reason.value == "length"
    assert [t.id for t in resp.details.tokens] == expected.token_ids
    streamed = list(client.generate_stream("The capital of France is", max_new_tokens=12))
    assert "".join(s.token.text for s in streamed) == expected.text
    assert streamed[-1].generated_text == expected.text


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"\xff\xfe", 400, "UTF-8"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "new tokens fit"),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature must be in"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature must be"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n must be 1"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "word " * 600}, 400, "longest this deployment accepts"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "not supported",
        ),
        ("/generate", {"inputs": "hi", "parameters": {"temperature": 0}}, 422, "temperature must be in (0.0"),
        ("/generate", {"inputs": "hi", "parameters": {"top_k": 0}}, 422, "top_k"),
        ("/generate", {"inputs": ""}, 422, "inputs"),
    ],
)
def test_bad_input_gets_a_4xx_in_the_apis_format(server, path, body, status, needle):
    code, payload, _ = post(server, path, body)
    assert code == status
    message = payload["error"]["message"] if path.startswith("/v1") else payload["error"]
    assert needle in message
    if not path.startswith("/v1"):
        assert payload["error_type"] == "validation"


def test_metrics_and_health(server):
    with urllib.request.urlopen(server + "/health") as r:
        assert r.status == 200
    with urllib.request.urlopen(server + "/metrics") as r:
        text = r.read().decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    ):
        assert name in text, name
    assert 'vllm:num_requests_running{model_name="smollm2"} 0.0' in text
