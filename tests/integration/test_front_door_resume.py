"""The front door resumes a stream whose pod dies (`runtime/routing/resume.py`): two real unified servers of
the SmolLM2 cpu model (with a chat template that takes tools) behind a front door without the model's
tokenizer (the pods say the token ids: the prompt's and each event's, `return_token_ids`), driven by the
official `openai` client (max_retries=0); the pod carrying a request is killed (SIGKILL) mid-answer, and the
client still gets one answer equal, token for token, to an undisturbed pod's (greedy), its usage counted
right, the resume counted in `neuronfleet:router_retries_total`; a TGI stream (the official `text-generation`
client, and `/generate_stream` read as it comes) resumed from its text reads as one stream; constrained
answers stay under their grammar, and a chat read for tool calls (through a second front door, with the
model's tokenizer) gets its calls once each. The killed pod is started again on its port between tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import EXACT_DTYPE_OPTIONS, Process, Server, free_port, metric, neuronfleet_command, wait_until

STORY = "Write a short story about a lighthouse keeper."
PROMPT = "Once upon a time, in a small village by the sea,"
OPTIONS = ("--slots", "2", "--max-seq-len", "512", *EXACT_DTYPE_OPTIONS)  # (a chat with tools: 300 tokens)
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
        self.model_door: tuple[Process, str] | None = None

    def healthy(self, door: str | None = None) -> float:
        try:
            return metric(door or self.door, "neuronfleet:router_peers_healthy", role="unified")
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

    def generated(self) -> dict[str, float]:
        return {n: metric(s.base, "vllm:generation_tokens_total") for n, s in self.servers.items()}

    def kill_carrier_after(self, tokens: int, before: dict[str, float]) -> str:
        """Kill the pod carrying a request once it generated `tokens` since `before` (`generated()`): an
        answer the client may have seen nothing of yet (a tool call is held until its block closes)."""

        def carrier() -> str | None:
            name = self.carrying()
            if name is None:
                return None
            return name if self.generated()[name] - before[name] >= tokens else None

        name = wait_until(carrier, f"a pod to generate {tokens} tokens of the request")
        self.servers[name].kill()
        return name

    def door_with_model(self) -> str:
        """A second front door before the same pods, with the model's tokenizer (--model): what a chat read
        for tool calls needs to resume (its raw answer is the text of the tokens' ids)."""
        if self.model_door is None:
            port = free_port()
            args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port),
                    "--served-model-name", "smollm2", "--peer-probe-interval", "0.5", "--grace-period", "1",
                    "--unified", "dns://unified:8000", "--peer-hosts-file", str(self.logs / "peers.json"),
                    "--routing", "least-loaded", "--model", str(self.model_dir)]  # fmt: skip
            self.model_door = Process(args, self.logs / "door-model.log"), f"http://127.0.0.1:{port}"
            self.model_door[0].wait_until(
                lambda: self.healthy(self.model_door[1]) == 2, "the second front door to see both pods"
            )
        return self.model_door[1]

    def revive(self, name: str) -> None:
        old = self.servers[name]
        self.servers[name] = Server(self.model_dir, OPTIONS, old.port, self.logs / f"{name}-again.log")
        self.servers[name].wait_ready()
        for door in (self.door, *([self.model_door[1]] if self.model_door else [])):
            self.process.wait_until(
                lambda d=door: self.healthy(d) == 2, "the front door to take the pod back"
            )

    def resumes(self, kind: str = "resume", door: str | None = None) -> float:
        return metric(door or self.door, "neuronfleet:router_retries_total", kind=kind)

    def close(self) -> None:
        self.process.stop()
        if self.model_door is not None:
            self.model_door[0].stop()
        for server in self.servers.values():
            server.stop_cleanly()


@pytest.fixture(scope="module")
def pods(smollm2_tools_dir, tmp_path_factory):
    fleet = Pods(smollm2_tools_dir, tmp_path_factory.mktemp("resume"))
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


def test_a_stream_of_two_choices_whose_pod_dies_gets_both_whole(pods, want):
    """n = 2 (greedy: both the undisturbed answer), the pod killed with both mid-answer: each choice is
    continued on the other pod in an attempt of its own, from its token ids; the client gets both answers
    whole at their indices, one usage counting every token. The second attempt follows the first one's end,
    not a failure: the pod that served it is not counted failed."""

    def said(what: str) -> int:
        return (pods.logs / "door.log").read_text().count(what)

    resumes, failed, ended = pods.resumes(), said("failed mid-stream"), said("ended a choice")
    stream = client(pods.door).chat.completions.create(
        **CHAT, n=2, stream=True, stream_options={"include_usage": True}
    )
    pieces: dict[int, list[str]] = {0: [], 1: []}
    usage, victim = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces[choice.index].append(choice.delta.content or "")
        if len("".join(pieces[0])) > 10 and victim is None:
            victim = pods.kill_carrier()
    assert victim is not None
    assert ["".join(p) for p in pieces.values()] == [want["chat"].choices[0].message.content] * 2
    assert usage.completion_tokens == 2 * want["chat"].usage.completion_tokens
    assert pods.resumes() == resumes + 2  # (a choice an attempt)
    assert (said("failed mid-stream"), said("ended a choice")) == (failed + 1, ended + 1)
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


NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 20,
           "maxItems": 20}  # fmt: skip


def assert_twenty_numbers(text: str) -> None:
    """The answer matches NUMBERS: twenty integers from 0 to 99."""
    answer = json.loads(text)
    assert len(answer) == 20 and all(isinstance(n, int) and 0 <= n <= 99 for n in answer), answer


def test_a_constrained_chat_stream_whose_pod_dies_goes_on_under_its_grammar(pods):
    """A chat under a JSON schema, its pod killed mid-answer: the front door (whose pods say they continue a
    constrained answer) resumes it from its text on the other pod, whose grammar reads the text sent first:
    the client's one answer matches the schema."""
    schema = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS}}
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
    assert_twenty_numbers("".join(pieces))
    assert pods.resumes("resume_text") == resumes + 1
    pods.revive(victim)


def test_a_constrained_completion_stream_whose_pod_dies_goes_on_under_its_grammar(pods):
    """A completion under vLLM's `structured_outputs` (a JSON schema), its pod killed mid-answer: resumed
    from its text with `constrained_prefix` (the next pod's grammar reads the text sent first): the one
    answer the client gets matches the schema."""
    ask = dict(model="smollm2", prompt="Twenty numbers as a JSON list:", max_tokens=120, temperature=0,
               extra_body={"structured_outputs": {"json": NUMBERS}})  # fmt: skip
    resumes = pods.resumes("resume_text")
    pieces, finish, victim = [], None, None
    for chunk in client(pods.door).completions.create(**ask, stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if len([p for p in pieces if p]) == 5 and victim is None:
            victim = pods.kill_carrier()
    assert victim is not None and finish == "stop"
    assert_twenty_numbers("".join(pieces))
    assert pods.resumes("resume_text") == resumes + 1
    pods.revive(victim)


def test_a_tool_call_stream_whose_pod_dies_gets_each_call_once(pods):
    """A chat whose answer must be tool calls (`required`), its pod killed a few tokens in, while the call's
    text is still held back (the client has nothing of it): the front door with the model's tokenizer
    resumes it from the raw answer, the next pod reads the call begun and sends it whole; the client gets
    the undisturbed answer's calls (greedy), each once, numbered from 0, and finish reason tool_calls."""
    from support import TOOLS

    door = pods.door_with_model()
    question = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
    ask = dict(model="smollm2", messages=question, max_tokens=80, temperature=0, tools=TOOLS,
               tool_choice="required")  # fmt: skip
    want = client(pods.servers["a"].base).chat.completions.create(**ask).choices[0].message.tool_calls
    assert want, "the undisturbed answer makes calls"

    def streamed(kill: Callable[[], str]) -> tuple[list, str | None, str]:
        calls, finish, victim = [], None, None
        with ThreadPoolExecutor(1) as pool:
            stream = client(door).chat.completions.create(**ask, stream=True)
            killing = pool.submit(kill)
            for chunk in stream:
                for choice in chunk.choices:
                    calls += choice.delta.tool_calls or []
                    finish = choice.finish_reason or finish
            victim = killing.result()
        return calls, finish, victim

    resumes = pods.resumes("resume_text", door)
    before = pods.generated()
    calls, finish, victim = streamed(lambda: pods.kill_carrier_after(4, before))
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(want)
    ]
    assert finish == "tool_calls" and pods.resumes("resume_text", door) == resumes + 1
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


def test_a_tgi_grammar_stream_whose_pod_dies_goes_on_under_its_grammar(pods):
    """TGI's `grammar` (a regex) on `/generate_stream`, its pod killed mid-answer: resumed from its text with
    `parameters.constrained_prefix`: the whole text matches the regex."""
    import re

    import requests

    regex = "([a-z]+ ){20}[a-z]+\\."
    body = {"inputs": "Twenty-one words about the sea:",
            "parameters": {"max_new_tokens": 80, "grammar": {"type": "regex", "value": regex}}}  # fmt: skip
    resumes = pods.resumes("resume_text")
    events, victim = [], None
    with requests.post(pods.door + "/generate_stream", json=body, stream=True, timeout=600) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 5 and victim is None:
                    victim = pods.kill_carrier()
    assert victim is not None and all("error" not in e for e in events)
    assert re.fullmatch(regex, events[-1]["generated_text"]), events[-1]["generated_text"]
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
