"""The router in front of vLLM and SGLang prefill/decode servers (`neuronfleet serve --role router
--peer-protocol vllm|sglang`, no model files), driven by the official `openai` client (chat and
completions, streamed and not), against STAND-INS for the engines (tests/standins/engines.py: small servers
written from each engine's documented P/D protocol, which record every request they receive). Each test
checks the exact requests each stand-in received and that the client's answer is the decode stand-in's; then
the failures: a dead prefill server (the request succeeds on the other), none left (a clear 503), a
stand-in's 400 (the client's 400).

Two prefill stand-ins listen on 127.0.0.2 and 127.0.0.3, as two pods have two addresses: SGLang's prefill
servers all use the same bootstrap port, and the decode stand-in meets the prefill it is told of at
`bootstrap_host`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from support import (
    ROOT,
    Process,
    free_port,
    http_status,
    metric,
    neuronfleet_command,
    serve_and_report_imports,
    wait_until,
)

STANDIN = ROOT / "tests" / "standins" / "engines.py"
MODEL = "m"
MAX_MODEL_LEN = 64  # the stand-ins' limit: prompt words + max_tokens
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 5, "temperature": 0}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


class EngineFleet:
    """Two prefill and two decode stand-ins of one engine and the router in front of them, as processes."""

    def __init__(self, engine: str, tmp: Path, extra: dict[str, list[str]] | None = None) -> None:
        """`extra`: more stand-in options by name (e.g. {"decode-a": ["--die-mid-stream"]})."""
        self.engine, self.tmp, self.extra = engine, tmp, extra or {}
        self.processes: dict[str, Process] = {}
        self.urls: dict[str, str] = {}
        self.bootstrap_port = free_port()
        self.router = f"http://127.0.0.1:{free_port()}"

    def start(self) -> None:
        engine, tmp = self.engine, self.tmp
        for name, host in (("prefill-a", "127.0.0.2"), ("prefill-b", "127.0.0.3"),
                           ("decode-a", "127.0.0.1"), ("decode-b", "127.0.0.1")):  # fmt: skip
            port = free_port()
            role = name.split("-")[0]
            args = [sys.executable, str(STANDIN), "--engine", engine, "--role", role, "--host", host,
                    "--port", str(port), "--name", name, "--record", str(tmp / f"{name}.jsonl"),
                    "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
            if role == "prefill" and engine == "vllm":
                args += ["--side-port", str(free_port())]
            if role == "prefill" and engine == "sglang":
                args += ["--bootstrap-port", str(self.bootstrap_port)]
            self.processes[name] = Process([*args, *self.extra.get(name, [])], tmp / f"{name}.log")
            self.urls[name] = f"http://{host}:{port}"
        for name, process in self.processes.items():
            process.wait_until(lambda u=self.urls[name]: _answers(u + "/health"), f"stand-in {name}")
        self.start_router("router", self.router)

    def start_router(self, name: str, url: str) -> None:
        """A router over every stand-in (`extra["router"]`: more options), ready."""
        peers = [x for n, u in self.urls.items() for x in (f"--{n.split('-')[0]}", u)]
        args = [*neuronfleet_command(), "serve", "--role", "router", "--peer-protocol", self.engine,
                "--port", url.rsplit(":", 1)[1], "--served-model-name", MODEL,
                "--peer-probe-interval", "0.3", *peers, *self.extra.get("router", [])]  # fmt: skip
        if self.engine == "sglang":
            args += ["--bootstrap-port", str(self.bootstrap_port)]
        self.processes[name] = Process(args, self.tmp / f"{name}.log")
        self.processes[name].wait_until(lambda: _answers(url + "/ready"), f"{name} to be ready")

    def requests(self, name: str) -> list[dict]:
        path = self.tmp / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def client(self, router: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=(router or self.router) + "/v1", api_key="unused", max_retries=0)

    def kill(self, name: str) -> None:
        self.processes[name].kill()

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()


def _answers(url: str) -> bool:
    try:
        return http_status(url) == 200
    except OSError:
        return False


def host_of(url: str) -> str:
    return url.removeprefix("http://").rsplit(":", 1)[0]


@pytest.fixture
def fleet_of(tmp_path):
    """Start a fleet of an engine's stand-ins; all are stopped after the test."""
    fleets: list[EngineFleet] = []

    def start(engine: str, **extra: list[str]) -> EngineFleet:
        folder = tmp_path / f"{engine}-{len(fleets)}"
        folder.mkdir()
        fleets.append(EngineFleet(engine, folder, {k.replace("_", "-"): v for k, v in extra.items()}))
        fleets[-1].start()
        return fleets[-1]

    yield start
    for fleet in fleets:
        fleet.close()


def ask(fleet: EngineFleet, chat: bool, stream: bool, **over) -> tuple[dict, str]:
    """(what the client sent, the text it got) through the official client."""
    sent = {**(CHAT if chat else COMPLETION), **over}
    if stream:
        sent["stream"] = True
    client = fleet.client()
    api = client.chat.completions if chat else client.completions
    out = api.create(**sent)
    if not stream:
        return sent, out.choices[0].message.content if chat else out.choices[0].text
    text = ""
    for chunk in out:
        if chunk.choices:
            text += (chunk.choices[0].delta.content or "") if chat else chunk.choices[0].text
    return sent, text


def answer_text(record: dict, chat: bool) -> str:
    answer = record["answer"]
    if "stream_text" in answer:
        return answer["stream_text"]
    choice = answer["json"]["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def one_of(fleet: EngineFleet, names: tuple[str, ...], before: dict[str, int]) -> tuple[str, dict]:
    """The one stand-in of `names` that got a request since `before` (counts by name), and that request."""
    new = [(n, r) for n in names for r in fleet.requests(n)[before[n] :]]
    assert len(new) == 1, new
    return new[0]


def counts(fleet: EngineFleet) -> dict[str, int]:
    return {n: len(fleet.requests(n)) for n in ("prefill-a", "prefill-b", "decode-a", "decode-b")}


CASES = [(chat, stream) for chat in (True, False) for stream in (False, True)]


@pytest.mark.parametrize(("chat", "stream"), CASES, ids=lambda v: str(v))
def test_vllm_prefill_then_decode_with_the_prefills_kv_transfer_params(fleet_of, chat, stream):
    fleet = fleet_of("vllm")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    seen = set()
    for _ in range(4):  # every pod is used in turn
        before = counts(fleet)
        sent, text = ask(
            fleet, chat, stream, **({"stream_options": {"include_usage": True}} if stream else {})
        )
        pname, prefill = one_of(fleet, ("prefill-a", "prefill-b"), before)
        dname, decode = one_of(fleet, ("decode-a", "decode-b"), before)
        seen |= {pname, dname}
        if stream:  # a stream may be resumed: the servers are asked for their tokens' ids
            sent = {**sent, "return_token_ids": True}
        expected_prefill = {k: v for k, v in sent.items() if k != "stream_options"}
        expected_prefill.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})  # fmt: skip
        assert (prefill["path"], prefill["body"]) == (path, expected_prefill)
        kv = prefill["answer"]["json"]["kv_transfer_params"]
        assert kv["remote_engine_id"] == f"{pname}-engine" and kv["remote_host"] == host_of(fleet.urls[pname])
        assert (decode["path"], decode["body"]) == (path, {**sent, "kv_transfer_params": kv})
        assert decode["request_id"] == prefill["request_id"] and prefill["request_id"].startswith("nf-")
        assert decode["answer"]["status"] == 200 and "prefilled_here" not in decode  # it read the blocks
        assert text == answer_text(decode, chat) and text.startswith(f"{dname}-0 ")
    assert seen == {"prefill-a", "prefill-b", "decode-a", "decode-b"}


@pytest.mark.parametrize(("chat", "stream"), CASES, ids=lambda v: str(v))
def test_sglang_the_same_request_to_prefill_and_decode_with_one_bootstrap_room(fleet_of, chat, stream):
    fleet = fleet_of("sglang")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rooms = set()
    for _ in range(4):
        before = counts(fleet)
        sent, text = ask(fleet, chat, stream)
        pname, prefill = one_of(fleet, ("prefill-a", "prefill-b"), before)
        dname, decode = one_of(fleet, ("decode-a", "decode-b"), before)
        host = host_of(fleet.urls[pname])
        room = prefill["body"]["bootstrap_room"]
        if stream and not chat:  # a stream may be resumed: the servers are asked for their tokens' ids, but
            sent = {**sent, "return_token_ids": True}  # on a chat, which SGLang refuses (the stand-in too)
        expected = {
            **sent,
            "bootstrap_host": host,
            "bootstrap_port": fleet.bootstrap_port,
            "bootstrap_room": room,
        }
        assert (prefill["path"], prefill["body"]) == (path, expected)
        assert (decode["path"], decode["body"]) == (path, expected)  # the same fields: it met that prefill
        assert decode["answer"]["status"] == 200
        assert text == answer_text(decode, chat) and text.startswith(f"{dname}-0 ")
        assert isinstance(room, int) and 0 <= room < 2**63
        rooms.add(room)
    assert len(rooms) == 4  # a new room per request


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_dead_prefill_server_is_retried_on_the_other_and_none_left_is_a_clear_503(fleet_of, engine):
    from openai import APIStatusError

    fleet = fleet_of(engine)
    fleet.kill("prefill-a")
    before = counts(fleet)
    for i in range(4):  # whichever the router picks first, each request succeeds
        _, text = ask(fleet, chat=bool(i % 2), stream=i >= 2)
        assert text.startswith("decode-")
    after = counts(fleet)
    assert after["prefill-b"] - before["prefill-b"] == 4
    answered = [
        r for n in ("decode-a", "decode-b") for r in fleet.requests(n) if r["answer"]["status"] == 200
    ]
    assert len(answered) == 4  # (an SGLang decode server told of the dead prefill failed; it was retried)
    fleet.kill("prefill-b")
    before = counts(fleet)
    for stream in (False, True):
        with pytest.raises(APIStatusError) as e:
            ask(fleet, chat=True, stream=stream)
        assert e.value.status_code == 503
        message = e.value.body["message"]  # the client's `body` is the OpenAI error object
        assert "no prefill server could serve the request" in message
        assert fleet.urls["prefill-a"] in message and fleet.urls["prefill-b"] in message
    if engine == "vllm":  # never a decode-only request
        assert (
            counts(fleet)["decode-a"] + counts(fleet)["decode-b"] == before["decode-a"] + before["decode-b"]
        )
    fleet.processes["router"].wait_until(lambda: http_status(fleet.router + "/ready") == 503,
                                         "the router to say it cannot serve")  # fmt: skip
    assert metric(fleet.router, "neuronfleet:router_peers_healthy", role="prefill") == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_stand_ins_400_reaches_the_client_as_the_same_400(fleet_of, engine):
    from openai import BadRequestError, NotFoundError

    fleet = fleet_of(engine)
    long_prompt = "word " * MAX_MODEL_LEN
    with pytest.raises(BadRequestError) as e:  # the prefill server refuses the prompt
        ask(fleet, chat=False, stream=False, prompt=long_prompt)
    assert e.value.status_code == 400 and "maximum context length is 64 tokens" in e.value.message
    refusals = [
        r for n in ("prefill-a", "prefill-b") for r in fleet.requests(n) if r["answer"]["status"] == 400
    ]
    assert len(refusals) == 1 and e.value.body == refusals[0]["answer"]["json"]["error"]  # as the peer said
    if engine == "vllm":  # the prefill asks 1 token: the decode server refuses max_tokens itself
        with pytest.raises(BadRequestError) as e:
            ask(fleet, chat=True, stream=True, max_tokens=MAX_MODEL_LEN)
        assert e.value.status_code == 400 and "However, you requested" in e.value.message
        assert [r["answer"]["status"] for n in ("decode-a", "decode-b") for r in fleet.requests(n)] == [400]
    with pytest.raises(NotFoundError) as e:
        ask(fleet, chat=True, stream=False, model="other")
    assert "The model `other` does not exist." in e.value.message


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_dead_decode_server_is_retried_on_the_other_before_the_answer_starts(fleet_of, engine):
    fleet = fleet_of(engine)
    fleet.kill("decode-a")
    for i in range(4):
        _, text = ask(fleet, chat=bool(i % 2), stream=i >= 2)
        assert text.startswith("decode-b-0 ")
    assert fleet.requests("decode-b") and not fleet.requests("decode-a")


def test_a_vllm_prefill_answer_without_kv_params_is_a_failed_prefill_never_a_decode_only_request(fleet_of):
    from openai import APIStatusError

    fleet = fleet_of("vllm", prefill_a=["--no-kv-params"])
    for i in range(3):  # prefill-b gives its KV cache's whereabouts: every request goes through it
        _, text = ask(fleet, chat=True, stream=bool(i % 2))
        assert text.startswith("decode-")
    decoded = [r for n in ("decode-a", "decode-b") for r in fleet.requests(n)]
    assert len(decoded) == 3 and not any(r.get("prefilled_here") for r in decoded)
    assert all(r["body"]["kv_transfer_params"]["remote_engine_id"] == "prefill-b-engine" for r in decoded)
    fleet.kill("prefill-b")  # only the server without the connector is left: no request can be served right
    with pytest.raises(APIStatusError) as e:
        ask(fleet, chat=True, stream=False)
    assert e.value.status_code == 503 and "answered without kv_transfer_params" in e.value.body["message"]
    assert len([r for n in ("decode-a", "decode-b") for r in fleet.requests(n)]) == 3  # none decode-only


def test_vllm_decode_reads_the_kv_cache_at_the_prefill_servers_address_not_the_one_it_advertises(fleet_of):
    """The plugin's DI tutorial sets VLLM_NIXL_SIDE_CHANNEL_HOST to 0.0.0.0, which its prefill servers then
    advertise as remote_host; its example proxy names the prefill server's own address instead. Here the
    prefill stand-ins advertise 127.0.0.9, where nothing listens: decode reads the blocks only at the
    address the router reached the prefill at."""
    fleet = fleet_of(
        "vllm", prefill_a=["--advertise-host", "127.0.0.9"], prefill_b=["--advertise-host", "127.0.0.9"]
    )
    for stream in (False, True):
        before = counts(fleet)
        _, text = ask(fleet, chat=True, stream=stream)
        pname, prefill = one_of(fleet, ("prefill-a", "prefill-b"), before)
        _, decode = one_of(fleet, ("decode-a", "decode-b"), before)
        assert prefill["answer"]["json"]["kv_transfer_params"]["remote_host"] == "127.0.0.9"
        assert decode["body"]["kv_transfer_params"]["remote_host"] == host_of(fleet.urls[pname])
        assert decode["answer"]["status"] == 200 and "prefilled_here" not in decode
        assert text.startswith("decode-")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_decode_server_that_dies_mid_stream_ends_the_stream_with_an_error(fleet_of, engine):
    """Both decode servers die mid-stream: resumed once on the other, which dies too; then an error event."""
    from openai import APIError

    die = ["--die-mid-stream"]
    fleet = fleet_of(engine, decode_a=die, decode_b=die)
    with pytest.raises(APIError) as e:
        ask(fleet, chat=True, stream=True)
    assert "failed mid-stream" in e.value.message


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_stream_whose_decode_server_dies_is_resumed_with_another_exchange_as_one_stream(
    fleet_of, engine, chat
):
    """The stand-ins give no token ids: the stream is resumed from the text sent (a chat's continued
    assistant message, a completion's prompt and text), for the tokens left, counted as resume_text."""
    fleet = fleet_of(engine, decode_a=["--die-mid-stream"])
    for i in range(8):  # new prompts (the least loaded decode server, in turn) until decode-a took one
        before = counts(fleet)
        question = f"Question {i}: what is the capital of France?"
        over = {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question}
        sent, text = ask(fleet, chat, stream=True, **over)
        if fleet.processes["decode-a"].poll() is not None:
            break
        assert text == " ".join(f"decode-b-{n}" for n in range(sent["max_tokens"]))
    else:
        pytest.fail("no request reached decode-a")
    assert text == "decode-a-0 decode-a-1" + " ".join(f"decode-b-{n}" for n in range(sent["max_tokens"] - 2))
    _, resumed = one_of(fleet, ("decode-b",), before)
    if chat:
        assert resumed["path"] == "/v1/chat/completions"
        assert resumed["body"]["messages"] == [
            *sent["messages"],
            {"role": "assistant", "content": "decode-a-0 decode-a-1"},
        ]
        assert resumed["body"]["continue_final_message"] is True
        assert resumed["body"]["add_generation_prompt"] is False
    else:
        assert resumed["path"] == "/v1/completions"
        assert resumed["body"]["prompt"] == sent["prompt"] + "decode-a-0 decode-a-1"
    assert resumed["body"]["max_tokens"] == sent["max_tokens"] - 2
    assert metric(fleet.router, "neuronfleet:router_retries_total", kind="resume_text") == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engine_router_loads_no_model_code_and_drains_on_sigterm(engine):
    """Started as the operator starts it (no model, peers that do not answer), serving: no torch, tokenizer
    or model library in its modules; SIGTERM ends it cleanly (exit 0)."""
    port = free_port()
    args = [
        "serve",
        "--role",
        "router",
        "--peer-protocol",
        engine,
        "--port",
        str(port),
        "--grace-period",
        "1",
        "--prefill",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
    ]
    if engine == "sglang":
        args += ["--bootstrap-port", "8998"]
    model_code = ("torch", "numpy", "safetensors", "tokenizers", "transformers")
    run = serve_and_report_imports(args, port, model_code)
    assert run.returncode == 0, run.stderr
    assert "IMPORTED -" in run.stdout, run.stdout + run.stderr


@pytest.mark.real_model
def test_a_vllm_router_given_the_model_routes_by_its_prefill_servers_kv_cache_events(fleet_of, smollm2_dir):
    """The precise path for vLLM: prefill stand-ins publish KV-cache events as vLLM 0.24.0 does (msgspec's
    encoding, blocks of the token ids Hugging Face's chat template gives), and a router given the model's
    tokenizer and --peer-kv-events names a prompt's blocks alike. A conversation's second turn through a
    second router replica, which never saw the first, goes to the prefill server whose events say it holds
    the first turn (reason prefix), and that replica's view of each server is what the events said."""
    events_port = free_port()
    long = ["--max-model-len", "100000"]
    publish = [*long, "--kv-events-port", str(events_port), "--tokenizer", str(smollm2_dir)]
    peers = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}"}
    router = ["--model", str(smollm2_dir), "--peer-kv-events", json.dumps(peers)]
    fleet = fleet_of(
        "vllm", prefill_a=publish, prefill_b=publish, decode_a=long, decode_b=long, router=router
    )
    second = f"http://127.0.0.1:{free_port()}"
    fleet.start_router("router-2", second)
    history = [{"role": "system", "content": "You answer questions about geography. " * 8},
               {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip

    def cached(router: str) -> dict[str, float]:
        return {host_of(u): metric(router, "neuronfleet:router_pod_cached_blocks", role="prefill", pod=u) or 0
                for u in (fleet.urls["prefill-a"], fleet.urls["prefill-b"])}  # fmt: skip

    def prefix_decisions(router: str) -> float:
        name = "neuronfleet:router_routing_decisions_total"
        return metric(router, name, role="prefill", reason="prefix") or 0

    # the routers subscribe as they first probe a prefill server; a first request shows both receive events
    # (ZeroMQ drops what a subscriber missed before it connected: retried until they do)
    def events_reach_both() -> bool:
        fleet.client().chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": f"warm-up {time.monotonic()} " * 12}])  # fmt: skip
        return all(sum(cached(r).values()) > 0 for r in (fleet.router, second))

    wait_until(events_reach_both, "both routers to learn from the prefill servers' events", interval=0.5)
    before, seen = counts(fleet), cached(second)
    fleet.client().chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    holder, _ = one_of(fleet, ("prefill-a", "prefill-b"), before)
    host = host_of(fleet.urls[holder])
    wait_until(lambda: cached(second)[host] > seen[host], "the second router to hear of the first turn")
    decided = prefix_decisions(second)
    history += [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    before = counts(fleet)
    fleet.client(second).chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    assert one_of(fleet, ("prefill-a", "prefill-b"), before)[0] == holder
    assert prefix_decisions(second) == decided + 1
