"""The front door resumes a stream whose pod dies (`runtime/routing/resume.py`): two real unified servers of
the SmolLM2 cpu model behind a front door without the model's tokenizer (the pods say the token ids: the
prompt's and each event's, `return_token_ids`), driven by the official `openai` client
(max_retries=0); the pod carrying a request is killed (SIGKILL) mid-answer, and the client still gets one
answer equal, token for token, to an undisturbed pod's (greedy), its usage counted right, the resume counted
in `neuronfleet:router_retries_total`; a TGI stream (the official `text-generation` client, and
`/generate_stream` read as it comes) resumed from its text reads as one stream. The killed pod is started
again on its port between tests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import EXACT_DTYPE_OPTIONS, Process, Server, free_port, metric, neuronfleet_command, wait_until

STORY = "Write a short story about a lighthouse keeper."
PROMPT = "Once upon a time, in a small village by the sea,"
OPTIONS = ("--slots", "2", "--max-seq-len", "256", *EXACT_DTYPE_OPTIONS)
TOKENS = 40  # long enough for the kill to land mid-answer
pytestmark = pytest.mark.real_model


class Pods:
    """Two unified servers, each restartable on its port, and the front door before them."""

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.servers = {name: Server(model_dir, OPTIONS, free_port(), logs / f"{name}.log") for name in "ab"}
        for server in self.servers.values():
            server.wait_ready()
        peers = logs / "peers.json"
        peers.write_text(json.dumps({"unified:8000": [f"127.0.0.1:{s.port}" for s in self.servers.values()]}))
        port = free_port()
        self.door = f"http://127.0.0.1:{port}"
        args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port),
                "--served-model-name", "smollm2", "--peer-probe-interval", "0.5", "--grace-period", "1",
                "--unified", "dns://unified:8000", "--peer-hosts-file", str(peers),
                "--routing", "least-loaded"]  # fmt: skip
        self.process = Process(args, logs / "door.log")
        self.process.wait_until(lambda: self.healthy() == 2, "the front door to see both pods")

    def healthy(self) -> float:
        try:
            return metric(self.door, "neuronfleet:router_peers_healthy", role="unified")
        except OSError:
            return 0

    def carrying(self) -> str | None:
        """The pod running a request now."""
        for name, server in self.servers.items():
            try:
                if metric(server.base, "vllm:num_requests_running") > 0:
                    return name
            except OSError:
                continue
        return None

    def kill_carrier(self) -> str:
        name = wait_until(self.carrying, "a pod to carry the request")
        self.servers[name].kill()
        return name

    def revive(self, name: str) -> None:
        old = self.servers[name]
        self.servers[name] = Server(self.model_dir, OPTIONS, old.port, self.logs / f"{name}-again.log")
        self.servers[name].wait_ready()
        self.process.wait_until(lambda: self.healthy() == 2, "the front door to take the pod back")

    def resumes(self, kind: str = "resume") -> float:
        return metric(self.door, "neuronfleet:router_retries_total", kind=kind)

    def close(self) -> None:
        self.process.stop()
        for server in self.servers.values():
            server.stop_cleanly()


@pytest.fixture(scope="module")
def pods(smollm2_dir, tmp_path_factory):
    fleet = Pods(smollm2_dir, tmp_path_factory.mktemp("resume"))
    yield fleet
    fleet.close()


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


CHAT = dict(model="smollm2", messages=[{"role": "user", "content": STORY}], max_tokens=TOKENS, temperature=0)
COMPLETION = dict(model="smollm2", prompt=PROMPT, max_tokens=TOKENS, temperature=0)


@pytest.fixture(scope="module")
def want(pods) -> dict:
    """The undisturbed answers, from one pod directly."""
    direct = client(pods.servers["a"].base)
    chat = direct.chat.completions.create(**CHAT)
    completion = direct.completions.create(**COMPLETION)
    return {"chat": chat, "completion": completion}


def test_a_chat_stream_whose_pod_dies_goes_on_on_the_other_pod_token_for_token(pods, want):
    resumes = pods.resumes()
    stream = client(pods.door).chat.completions.create(
        **CHAT, stream=True, stream_options={"include_usage": True}
    )
    pieces, ids, roles, usage, victim = [], set(), 0, None, None
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.role:
            roles += 1
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) == 3 and victim is None:  # the pod streaming it dies now
            victim = pods.kill_carrier()
    assert victim is not None
    assert "".join(pieces) == want["chat"].choices[0].message.content
    assert len(ids) == 1 and roles == 1  # one stream, as the client sees it
    assert usage.completion_tokens == want["chat"].usage.completion_tokens
    assert usage.prompt_tokens == want["chat"].usage.prompt_tokens
    assert pods.resumes() == resumes + 1
    pods.revive(victim)


def test_a_completion_stream_whose_pod_dies_goes_on_token_for_token(pods, want):
    resumes = pods.resumes()
    stream = client(pods.door).completions.create(**COMPLETION, stream=True)
    pieces, finish, victim = [], None, None
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if len([p for p in pieces if p]) == 3 and victim is None:
            victim = pods.kill_carrier()
    assert victim is not None
    assert "".join(pieces) == want["completion"].choices[0].text
    assert finish == want["completion"].choices[0].finish_reason
    assert pods.resumes() == resumes + 1
    pods.revive(victim)


def test_a_whole_answer_whose_pod_dies_is_sent_again(pods, want):
    retries = pods.resumes("retry")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client(pods.door).chat.completions.create, **CHAT)
        victim = pods.kill_carrier()
        got = answer.result()
    assert got.choices[0].message.content == want["chat"].choices[0].message.content
    assert got.usage.completion_tokens == want["chat"].usage.completion_tokens
    assert pods.resumes("retry") == retries + 1
    pods.revive(victim)


def test_a_constrained_chat_stream_whose_pod_dies_goes_on_under_its_grammar(pods):
    """A chat under a JSON schema, its pod killed mid-answer: the front door (whose pods say they continue a
    constrained answer) resumes it from its text on the other pod, whose grammar reads the text sent first:
    the client's one answer matches the schema."""
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 20,
               "maxItems": 20}  # fmt: skip
    schema = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": numbers}}
    ask = dict(model="smollm2", messages=[{"role": "user", "content": "Twenty numbers, please."}],
               max_tokens=120, temperature=0, response_format=schema)  # fmt: skip
    resumes = pods.resumes("resume_text")
    pieces, finish, victim = [], None, None
    for chunk in client(pods.door).chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        if len(pieces) == 5 and victim is None:
            victim = pods.kill_carrier()
    assert victim is not None and finish == "stop"
    answer = json.loads("".join(pieces))
    assert len(answer) == 20 and all(isinstance(n, int) and 0 <= n <= 99 for n in answer), answer
    assert pods.resumes("resume_text") == resumes + 1
    pods.revive(victim)


def tgi(base: str):
    from text_generation import Client

    return Client(base, timeout=600)


@pytest.fixture(scope="module")
def want_tgi(pods) -> str:
    """The undisturbed TGI answer (greedy: TGI's default), from one pod directly."""
    return tgi(pods.servers["a"].base).generate(PROMPT, max_new_tokens=TOKENS).generated_text


def test_a_tgi_stream_whose_pod_dies_goes_on_from_its_text(pods, want_tgi):
    """The official `text-generation` client's `generate_stream` (TGI's `POST /`, streamed): one stream, no
    error, its last event's generated_text the streamed tokens' texts joined, every token counted. From the
    text, the tokens at the seam may differ from the undisturbed answer's; here the pod dies a few tokens in,
    between whole words (" there was a"), which tokenize alike again: the greedy text equals the undisturbed
    one (it did in every run)."""
    resumes = pods.resumes("resume_text")
    tokens, last, victim = [], None, None
    for response in tgi(pods.door).generate_stream(PROMPT, max_new_tokens=TOKENS):
        tokens.append(response.token)
        last = response
        if len([t for t in tokens if t.text]) == 3 and victim is None:  # the pod streaming it dies now
            victim = pods.kill_carrier()
    assert victim is not None
    text = "".join(t.text for t in tokens if not t.special)
    assert last.generated_text == text
    assert last.details.generated_tokens == len(tokens)
    assert pods.resumes("resume_text") == resumes + 1
    assert text == want_tgi
    pods.revive(victim)


def test_a_generate_stream_resumed_continues_its_indices(pods):
    """TGI's `/generate_stream` read as it comes: the indices run 1..N without a gap across the pods, the
    last event's details count every token."""
    import requests

    resumes = pods.resumes("resume_text")
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "details": True}}
    events, victim = [], None
    with requests.post(pods.door + "/generate_stream", json=body, stream=True, timeout=600) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if len([e for e in events if e["token"]["text"]]) == 3 and victim is None:
                    victim = pods.kill_carrier()
    assert victim is not None
    assert all("error" not in e for e in events)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["generated_text"] is not None for e in events] == [False] * (len(events) - 1) + [True]
    texts = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == texts
    assert events[-1]["details"]["generated_tokens"] == len(events)
    assert pods.resumes("resume_text") == resumes + 1
    pods.revive(victim)


def test_past_max_resumes_the_stream_ends_cut(pods, tmp_path):
    from openai import APIConnectionError

    port = free_port()
    args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port), "--served-model-name",
            "smollm2", "--peer-probe-interval", "0.5", "--grace-period", "1", "--max-resumes", "0",
            *[x for s in pods.servers.values() for x in ("--unified", s.base)]]  # fmt: skip
    door = Process(args, tmp_path / "door.log")
    base = f"http://127.0.0.1:{port}"
    try:
        door.wait_until(lambda: metric_or_zero(base) == 2, "the second front door to see both pods")
        stream = client(base).completions.create(**COMPLETION, stream=True)
        pieces, victim = [], None
        with pytest.raises(APIConnectionError):  # cut, never a clean end
            for chunk in stream:
                pieces.append(chunk.choices[0].text)
                if len([p for p in pieces if p]) == 3 and victim is None:
                    victim = pods.kill_carrier()
        assert victim is not None
        assert metric(base, "neuronfleet:router_retries_total", kind="resume") == 0
    finally:
        door.stop()
    pods.revive(victim)


def metric_or_zero(base: str) -> float:
    try:
        return metric(base, "neuronfleet:router_peers_healthy", role="unified")
    except OSError:
        return 0
