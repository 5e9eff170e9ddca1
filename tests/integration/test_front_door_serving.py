"""The front door (`neuronfleet serve --role router --unified PEER`, no model files), started from the command
line in front of real unified servers, driven by the official `openai` and `text-generation` clients:
answers equal a direct request's (greedy; OpenAI chat, completions and streamed chat; TGI generate and
generate_stream); at zero a request is held, the wake URL (a tiny aiohttp server here) is POSTed at once, and
a server started afterwards on the port the static peer map names answers it; one request more than the
bound gets 429 and one held past the bound 503, both with Retry-After and in the API's error format."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web
from support import (
    EXACT_DTYPE_OPTIONS,
    Process,
    Server,
    free_port,
    http_status,
    metric,
    metrics_text,
    neuronfleet_command,
    running_server,
    structured_outputs_round,
    tool_call_round,
    wait_until,
)

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
OPTIONS = ("--slots", "2", "--max-seq-len", "256", "--no-prefix-reuse")


class ThreadApp:
    """A tiny aiohttp server in a thread (the wake endpoint, a pod of another kind): every request it gets is
    recorded (time, method, path, body; its headers in `headers`) and answered with `status` and `body`; its
    probes (`GET /ready`) with 200."""

    def __init__(self, status: int = 202, body: dict | None = None, handler=None) -> None:
        """`handler`: an async function of the request that answers it instead (a stand-in pod)."""
        self.port, self.seen, self.status, self.body, self.handler = free_port(), [], status, body, handler
        self.headers: list[dict[str, str]] = []
        self.base = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        async def answer(request: web.Request) -> web.Response:
            if request.path == "/ready":
                return web.json_response({"ready": True})
            self.seen.append((time.monotonic(), request.method, request.path, await request.read()))
            self.headers.append(dict(request.headers))
            if self.handler is not None:
                return await self.handler(request)
            return web.json_response(self.body, status=self.status)

        app = web.Application()
        app.add_routes([web.route("*", "/{tail:.*}", answer)])
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def front_door(tmp: Path, *options: str) -> tuple[str, Process]:
    """A front door as the operator runs it, with a static peer map (no cluster DNS here)."""
    port = free_port()
    args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port), "--served-model-name",
            "smollm2", "--peer-probe-interval", "0.5", "--grace-period", "1", *options]  # fmt: skip
    door = Process(args, tmp / f"door-{port}.log")
    base = f"http://127.0.0.1:{port}"
    door.wait_until(lambda: _status(base + "/health") == 200, "the front door to serve")
    return base, door


def peer_map(tmp: Path, name: str, ports: list[int]) -> tuple[str, ...]:
    """The static peer map naming `name` -> 127.0.0.1:port..., and the flags that use it."""
    path = tmp / "peers.json"
    path.write_text(json.dumps({name: [f"127.0.0.1:{p}" for p in ports]}))
    return "--unified", f"dns://{name}", "--peer-hosts-file", str(path)


def _status(url: str) -> int:
    try:
        return http_status(url)
    except OSError:
        return 0


def openai(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat(base: str, **over) -> str:
    out = openai(base).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        **over,
    )
    return out.choices[0].message.content


def tgi(base: str):
    from text_generation import Client

    return Client(base, timeout=600)


@pytest.mark.real_model
def test_answers_through_the_front_door_equal_a_direct_requests(smollm2_dir, tmp_path):
    with running_server(smollm2_dir, *OPTIONS) as (direct, server):
        # with the model's tokenizer (--model): routed by the token blocks the pod caches
        peers = peer_map(tmp_path, "unified:8000", [server.port])
        door, process = front_door(tmp_path, *peers, "--model", str(smollm2_dir))
        try:
            assert chat(door) == chat(direct)
            # the same conversation again: the pod holds its token blocks (a prefix decision, not load)
            assert (
                metric(door, "neuronfleet:router_routing_decisions_total", role="unified", reason="prefix")
                == 0
            )
            assert chat(door) == chat(direct)
            assert (
                metric(door, "neuronfleet:router_routing_decisions_total", role="unified", reason="prefix")
                == 1
            )
            stream = openai(door).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                temperature=0, stream=True,
            )  # fmt: skip
            chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
            assert len(chunks) > 2 and "".join(chunks) == chat(direct)
            # the door times the pod, what its policy prices it with: answers to their end, and a stream's
            # first token against the prompt tokens the pod did not hold (a new prompt's)
            pod = f"http://127.0.0.1:{server.port}"
            assert metric(door, "neuronfleet:router_pod_answer_seconds", role="unified", pod=pod) > 0
            rivers = "Name three rivers of Europe, the countries they cross and the seas they reach. " * 3
            new = openai(door).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": rivers}], max_tokens=2, stream=True
            )
            assert [c for c in new if c.choices]
            timed = rf'^neuronfleet:router_pod_prefill_seconds_per_token{{[^}}]*pod="{re.escape(pod)}"'
            assert re.search(timed, metrics_text(door), re.MULTILINE)
            completion = dict(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
            assert openai(door).completions.create(**completion).choices[0].text == (
                openai(direct).completions.create(**completion).choices[0].text
            )
            # TGI's API, paths and client, through the same door
            want = tgi(direct).generate(PROMPT, max_new_tokens=8)
            got = tgi(door).generate(PROMPT, max_new_tokens=8)
            assert (
                got.generated_text == want.generated_text
                and got.details.finish_reason == want.details.finish_reason
            )
            streamed = [r.token.text for r in tgi(door).generate_stream(PROMPT, max_new_tokens=8)]
            assert "".join(streamed) == want.generated_text
            assert tgi(door).generate(PROMPT, max_new_tokens=8).generated_text == want.generated_text
            # the pod's own endpoints and errors pass through as they are
            assert openai(door).models.list().data[0].id == "smollm2"
            from openai import BadRequestError

            with pytest.raises(BadRequestError, match="max_tokens"):
                openai(door).completions.create(model="smollm2", prompt=PROMPT, max_tokens=-1)
            assert metric(door, "neuronfleet:router_peers_healthy", role="unified") == 1
            assert metric(door, "vllm:num_requests_running") == 0
            assert metric(door, "neuronfleet:router_requests_held") == 0
        finally:
            process.stop()


@pytest.mark.real_model
def test_at_zero_a_request_is_held_the_autoscaler_woken_and_the_first_ready_pod_answers(
    smollm2_dir, tmp_path
):
    port = free_port()  # where the unified pod will be: nothing listens there yet
    wake = ThreadApp()  # the autoscaler's wake endpoint
    (tmp_path / "token").write_text("the-models-token\n")  # as the operator mounts it from the model's Secret
    door, process = front_door(tmp_path, *peer_map(tmp_path, "unified:8000", [port]), "--hold-requests", "2",
                               "--hold-seconds", "600", "--wake-url", wake.base + "/wake",
                               "--internal-token-file", str(tmp_path / "token"))  # fmt: skip
    server = None
    try:
        assert _status(door + "/ready") == 200  # it takes requests at zero
        with ThreadPoolExecutor(2) as pool:
            first_held = time.monotonic()
            held_chat = pool.submit(chat, door)
            wait_until(lambda: metric(door, "neuronfleet:router_requests_held") == 1, "the chat to be held")
            held_tgi = pool.submit(lambda: tgi(door).generate(PROMPT, max_new_tokens=8))
            wait_until(
                lambda: metric(door, "neuronfleet:router_requests_held") == 2, "the TGI request to be held"
            )
            wait_until(lambda: wake.seen, "the wake URL to be POSTed")
            assert wake.seen[0][1:] == ("POST", "/wake", b"")  # no body
            assert wake.headers[0]["Authorization"] == "Bearer the-models-token"  # what the operator checks
            # one more than the bound: 429 with Retry-After, in each API's format
            from openai import RateLimitError

            with pytest.raises(RateLimitError) as full:
                chat(door)
            assert int(full.value.response.headers["Retry-After"]) == 600  # no cold start measured yet
            assert (
                full.value.body["type"] == "RateLimitError"
                and "--hold-requests 2" in full.value.body["message"]
            )
            from text_generation.errors import OverloadedError

            with pytest.raises(OverloadedError):
                tgi(door).generate(PROMPT, max_new_tokens=8)
            assert not held_chat.done() and not held_tgi.done()
            started = time.monotonic()
            server = Server(smollm2_dir, OPTIONS, port, tmp_path / "unified.log")
            server.wait_ready()
            ready = time.monotonic() - started  # the pod's cold start, as seen from here
            answer, generated = held_chat.result(), held_tgi.result()
        assert wake.seen[0][0] < started  # at once, before the pod started
        assert answer == chat(server.base)
        assert generated.generated_text == tgi(server.base).generate(PROMPT, max_new_tokens=8).generated_text
        assert metric(door, "neuronfleet:router_requests_held") == 0
        assert metric(door, "neuronfleet:router_hold_seconds_count") == 2
        assert metric(door, "neuronfleet:router_hold_rejected_total", reason="full") == 2
        # from the first request held (before the pod started) to its release (at most a probe round after
        # the pod was ready)
        measured = metric(door, "neuronfleet:router_cold_start_seconds")
        assert ready - 0.5 < measured < time.monotonic() - first_held
    finally:
        if server is not None:
            server.stop_cleanly()
        process.stop()
        wake.close()


def test_a_request_held_past_the_bound_gets_503_with_retry_after(tmp_path):
    """No pod ever comes: the held request ends after --hold-seconds with 503 and Retry-After, OpenAI's error
    on /v1 and TGI's on /generate; never 404, never a hang."""
    peers = peer_map(tmp_path, "unified:8000", [free_port()])
    door, process = front_door(tmp_path, *peers, "--hold-requests", "4", "--hold-seconds", "2")
    try:
        from openai import APIStatusError

        started = time.monotonic()
        with pytest.raises(APIStatusError) as held:
            chat(door)
        assert time.monotonic() - started >= 2
        assert held.value.status_code == 503 and held.value.response.headers["Retry-After"] == "2"
        assert (
            held.value.body["type"] == "ServiceUnavailableError"
            and "--hold-seconds" in held.value.body["message"]
        )
        from text_generation.errors import OverloadedError

        with pytest.raises(OverloadedError, match="no unified pod became ready within 2 s"):
            tgi(door).generate(PROMPT, max_new_tokens=4)
        assert metric(door, "neuronfleet:router_hold_rejected_total", reason="timeout") == 2
        assert metric(door, "neuronfleet:router_hold_seconds_count") == 0
    finally:
        process.stop()


def test_without_holding_the_front_door_at_zero_is_not_ready_and_answers_503(tmp_path):
    """--hold-requests 0 (the default): today's router behaviour: not ready without a pod, 503 at once."""
    door, process = front_door(tmp_path, *peer_map(tmp_path, "unified:8000", [free_port()]))
    try:
        assert _status(door + "/ready") == 503
        from openai import APIStatusError

        with pytest.raises(APIStatusError) as e:
            chat(door)
        assert (
            e.value.status_code == 503 and "no unified pod could serve the request" in e.value.body["message"]
        )
    finally:
        process.stop()


def test_a_front_door_stopped_answers_its_held_requests_503_and_exits_cleanly(tmp_path):
    """SIGTERM while a request is held: it stays held while a pod may still come (the grace period's first
    nine tenths: nothing is refused that could be served), then gets 503 with Retry-After (not a cut
    connection at the end of the grace period), and the front door exits 0."""
    import signal

    peers = peer_map(tmp_path, "unified:8000", [free_port()])
    door, process = front_door(tmp_path, *peers, "--hold-requests", "4", "--grace-period", "10")
    try:
        from openai import APIStatusError

        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, door)
            process.wait_until(
                lambda: metric(door, "neuronfleet:router_requests_held") == 1, "a held request"
            )
            process.signal(signal.SIGTERM)
            with pytest.raises(APIStatusError) as e:
                held.result()
        assert e.value.status_code == 503 and "shutting down" in e.value.body["message"]
        assert e.value.response.headers["Retry-After"] == "1"
        assert process.wait() == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("status", [503, 408])
def test_a_pod_that_answers_503_before_its_answer_started_is_left_for_another(tmp_path, status):
    """A pod that answers 503 (it began draining since its last probe) or 408 (it timed out the headers the
    front door sent whole: a draining pod that stopped reading a new connection): the request goes to the
    other pod; the client only ever sees the good answer."""
    draining = ThreadApp(status, {"error": {"message": "the server is shutting down"}})
    good = ThreadApp(200, {"choices": [{"text": "ok"}]})
    door, process = front_door(tmp_path, "--unified", draining.base, "--unified", good.base)
    try:
        from support import post

        def answered_by_the_good_pod() -> bool:
            code, body, _ = post(door, "/v1/completions?x=1", {"prompt": "p"})
            assert (code, body) == (200, {"choices": [{"text": "ok"}]})
            return metric(door, "neuronfleet:router_retries_total", kind="retry") >= 1

        wait_until(answered_by_the_good_pod, "a request first sent to the draining pod", ceiling=120)
        assert any(path == "/v1/completions" for _, _, path, _ in draining.seen)
    finally:
        process.stop()
        draining.close()
        good.close()


FULL = {"error": {"message": "the server is full: retry later", "type": "server_overloaded"}}


def test_a_full_pods_429_sends_the_request_to_another_and_every_pod_full_is_refused_at_once(tmp_path):
    """A pod whose admission refuses a request (429: full) is not failing: the request goes to the other pod,
    and the full pod stays in rotation. When every pod is full the client gets the pod's 429 with its
    Retry-After at once: never held, although the front door holds requests while no pod is ready."""
    full = ThreadApp(429, FULL)
    good = ThreadApp(200, {"choices": [{"text": "ok"}]})
    door, process = front_door(tmp_path, "--unified", full.base, "--unified", good.base,
                               "--hold-requests", "8", "--routing", "least-loaded")  # fmt: skip
    try:
        from support import post

        process.wait_until(lambda: metric(door, "neuronfleet:router_peers_healthy", role="unified") == 2,
                           "the front door to see both pods")  # fmt: skip
        for _ in range(6):
            assert post(door, "/v1/completions", {"prompt": "p"})[:2] == (200, {"choices": [{"text": "ok"}]})
        assert any(path == "/v1/completions" for _, _, path, _ in full.seen)  # it was asked, and refused
        assert metric(door, "neuronfleet:router_peers_healthy", role="unified") == 2  # full is not failing
        good.status, good.body = 429, FULL
        code, body, headers = post(door, "/v1/completions", {"prompt": "p"})
        assert (code, body) == (429, FULL)
        assert headers["Retry-After"] == "1"
        assert metric(door, "neuronfleet:router_hold_seconds_count") == 0  # never held
    finally:
        process.stop()
        full.close()
        good.close()


def _completions(pod: ThreadApp) -> int:
    return sum(path == "/v1/completions" for _, _, path, _ in pod.seen)


def test_while_every_pods_slots_are_taken_a_request_waits_at_the_front_door_for_the_first_to_free_one(
    tmp_path,
):
    """Late binding (`slot_queue`): two stand-in pods of one slot each (`--routing-pod-slots 1`, as the
    operator gives a front door its pods' batch size), each holding its answers until told. Two requests take
    both slots; a third waits at the front door (counted waiting), reaching no pod, until a pod's answer
    ends, and then goes to that pod. With `--max-queue-wait 1` a request that waited that long is refused:
    OpenAI 429 with Retry-After. With `--no-router-queue` it goes at once to a pod whose slot is taken."""
    open_ = {"a": threading.Event(), "b": threading.Event()}

    def holding(name: str):
        async def answer(request: web.Request) -> web.Response:
            while not open_[name].is_set():
                await asyncio.sleep(0.01)
            return web.json_response({"choices": [{"text": name}]})

        return answer

    pods = {name: ThreadApp(handler=holding(name)) for name in open_}
    unified = ("--unified", pods["a"].base, "--unified", pods["b"].base, "--routing-pod-slots", "1")
    doors = [front_door(tmp_path, *unified, *more) for more in ((), ("--max-queue-wait", "1"),
                                                               ("--no-router-queue",))]  # fmt: skip
    from support import post

    def send(door: str) -> tuple[int, dict, dict]:
        return post(door, "/v1/completions", {"prompt": "p", "max_tokens": 1})

    def seen() -> int:
        return sum(_completions(p) for p in pods.values())

    try:
        for door, process in doors:
            process.wait_until(lambda d=door: metric(d, "neuronfleet:router_peers_healthy", role="unified")
                               == 2, "the front door to see both pods")  # fmt: skip
        (door, process), (bounded, _), (off, _) = doors
        with ThreadPoolExecutor(6) as pool:
            first = [pool.submit(send, door) for _ in range(2)]
            process.wait_until(lambda: seen() == 2, "both slots to be taken")
            assert _completions(pods["a"]) == _completions(pods["b"]) == 1
            third = pool.submit(send, door)
            process.wait_until(lambda: metric(door, "vllm:num_requests_waiting") == 1, "the third to wait")
            assert seen() == 2 and not third.done()  # at the front door, not in a pod's queue
            open_["b"].set()  # b's answer ends: the third takes b's slot
            assert third.result()[:2] == (200, {"choices": [{"text": "b"}]})
            assert _completions(pods["b"]) == 2 and _completions(pods["a"]) == 1
            open_["a"].set()
            assert sorted(f.result()[1]["choices"][0]["text"] for f in first) == ["a", "b"]
            assert metric(door, "neuronfleet:router_queue_seconds_count") == 3
            assert metric(door, "vllm:num_requests_waiting") == 0

            for event in open_.values():
                event.clear()
            before = seen()
            taken = [pool.submit(send, bounded) for _ in range(2)]
            process.wait_until(lambda: seen() == before + 2, "both slots to be taken again")
            code, body, headers = send(bounded)  # waits 1 s, reaching no pod, and is refused
            assert code == 429 and "--max-queue-wait" in body["error"]["message"], body
            assert int(headers["Retry-After"]) >= 1 and seen() == before + 2

            # without the queue, once that front door's own requests take both slots, a third goes at once
            # to a pod whose slot is taken
            late = [pool.submit(send, off) for _ in range(3)]
            process.wait_until(lambda: seen() == before + 5, "the third request to reach a full pod")
            assert metric(off, "vllm:num_requests_waiting") == 0 and not any(f.done() for f in late)
            for event in open_.values():
                event.set()
            assert [f.result()[0] for f in (*taken, *late)] == [200] * 5
    finally:
        for event in open_.values():
            event.set()
        for _, process in doors:
            process.stop()
        for pod in pods.values():
            pod.close()


def _event(choice: dict, **chunk) -> bytes:
    choice = {"index": 0, "logprobs": None, "finish_reason": None, **choice}
    body = {"id": "cmpl-stand-in", "object": "text_completion", "created": 1, "model": "smollm2",
            "choices": [choice], **chunk}  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_a_resumed_stream_that_finds_every_pod_full_waits_for_room_and_goes_on(tmp_path):
    """A stream whose pod dies is resumed; the other pod's admission refuses the resume (429) twice and the
    dying pod answers 503: the resume waits for room (its client holds half an answer) instead of ending the
    stream, and the client gets one stream, no token repeated or missing; one resume counted."""
    import random

    async def dies_mid_stream(request: web.Request) -> web.StreamResponse:
        if dying.seen[1:]:  # (it is gone: what reaches it after its death is refused)
            return web.json_response({"error": {"message": "shutting down"}}, status=503)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_event({"text": "Hello", "token_ids": [11]}, prompt_token_ids=[5, 6, 7]))
        await out.write(_event({"text": " world", "token_ids": [12]}))
        request.transport.close()  # killed
        return out

    async def full_then_serves(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not dying.seen or len([b for b in other.seen if b"[5, 6, 7" in b[3]]) <= 2:
            return web.json_response(FULL, status=429, headers={"Retry-After": "1"})
        other.resumed = body
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_event({"text": " again", "token_ids": [13], "finish_reason": "stop"}))
        await out.write(b"data: [DONE]\n\n")
        return out

    dying, other = ThreadApp(handler=dies_mid_stream), ThreadApp(handler=full_then_serves)
    pods = [dying.base, other.base]
    random.shuffle(pods)
    door, process = front_door(tmp_path, "--unified", pods[0], "--unified", pods[1])
    try:
        process.wait_until(lambda: metric(door, "neuronfleet:router_peers_healthy", role="unified") == 2,
                           "the front door to see both pods")  # fmt: skip
        stream = openai(door).completions.create(model="smollm2", prompt="Say it", max_tokens=10, stream=True)
        texts = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
        assert "".join(t for t, _ in texts) == "Hello world again"
        assert texts[-1][1] == "stop"
        assert other.resumed["prompt"] == [5, 6, 7, 11, 12] and other.resumed["max_tokens"] == 8
        assert metric(door, "neuronfleet:router_retries_total", kind="resume") == 1
    finally:
        process.stop()
        dying.close()
        other.close()


def test_pods_that_refuse_the_token_ids_asked_on_a_chat_get_it_without_and_its_stream_resumes_from_the_text(
    tmp_path,
):
    """Pods that answer 400 to the `return_token_ids` the front door adds to a streamed chat (SGLang from
    0.5.17; the front door does not know the engine): asked again without it, and never again on that path;
    when its pod dies, the stream resumes from its text (a continued assistant message) as one stream."""
    message = "return_token_ids is not supported with streaming on /v1/chat/completions"
    refusal = {"object": "error", "code": 400, "message": message}

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "smollm2",
                "choices": [choice]}  # fmt: skip
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def refuses_ids(request_body: dict) -> web.Response | None:
        if request_body.get("return_token_ids"):
            return web.json_response(refusal, status=400)
        return None

    async def dies_mid_stream(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if (refused := refuses_ids(body)) is not None:
            return refused
        if served[0]:
            return web.json_response({"error": {"message": "shutting down"}}, status=503)
        served[0] = True
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for delta in ({"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " world"}):
            await out.write(chunk(delta))
        request.transport.close()  # killed
        return out

    async def resumes(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if (refused := refuses_ids(body)) is not None:
            return refused
        if not served[0]:
            return web.json_response(FULL, status=429)  # (the first stream goes to the other pod)
        other.resumed = body
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(chunk({"role": "assistant", "content": ""}) + chunk({"content": " again"}, "stop"))
        await out.write(b"data: [DONE]\n\n")
        return out

    served = [False]
    dying, other = ThreadApp(handler=dies_mid_stream), ThreadApp(handler=resumes)
    door, process = front_door(tmp_path, "--unified", dying.base, "--unified", other.base)
    try:
        process.wait_until(lambda: metric(door, "neuronfleet:router_peers_healthy", role="unified") == 2,
                           "the front door to see both pods")  # fmt: skip
        stream = openai(door).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello world again"
        assert other.resumed["messages"][-1] == {"role": "assistant", "content": "Hello world"}
        assert other.resumed["continue_final_message"] is True and "return_token_ids" not in other.resumed
        assert metric(door, "neuronfleet:router_retries_total", kind="resume_text") == 1
        asked = [b for app in (dying, other) for *_, b in app.seen if b"return_token_ids" in b]
        assert len(asked) == 1  # asked once, refused: never again
        served[0] = False  # (another stream: asked without the ids at once)
        openai(door).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, stream=True
        ).close()
        assert len([b for app in (dying, other) for *_, b in app.seen if b"return_token_ids" in b]) == 1
    finally:
        process.stop()
        dying.close()
        other.close()


@pytest.mark.real_model
def test_two_front_doors_given_the_model_follow_the_pods_kv_cache_events(smollm2_tools_dir, tmp_path):
    """Unified pods publishing their KV-cache events (--kv-events-config; their ready answer says where) and
    two front doors given the model's tokenizer: a conversation's second turn through the door that never
    saw its first goes to the pod whose events say it holds that first turn (reason prefix). Structured
    outputs, log probabilities, n choices and tool calls pass through such a door (the pods' template takes
    tools). The pods compute in float32 (EXACT_DTYPE): the round compares a streamed answer with a whole
    one, which may find different prefixes cached (bfloat16, `auto` on CPUs with AVX512-BF16, rounds a
    cached prefix's prefill differently enough to change a greedy token: `"land_area": 112` against
    `111`)."""
    options = ("--slots", "2", "--max-seq-len", "512", *EXACT_DTYPE_OPTIONS)

    def publishing(port: int) -> tuple[str, str]:
        return "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                 "endpoint": f"tcp://127.0.0.1:{port}"})  # fmt: skip

    with (
        running_server(smollm2_tools_dir, *options, *publishing(free_port())) as (_, one),
        running_server(smollm2_tools_dir, *options, *publishing(free_port())) as (_, two),
    ):
        peers = peer_map(tmp_path, "unified:8000", [one.port, two.port])
        door_a, process_a = front_door(tmp_path, *peers, "--model", str(smollm2_tools_dir))
        door_b, process_b = front_door(tmp_path, *peers, "--model", str(smollm2_tools_dir))
        try:
            pods = {f"http://127.0.0.1:{s.port}": s for s in (one, two)}

            def cached(door: str) -> dict[str, float]:
                return {u: metric(door, "neuronfleet:router_pod_cached_blocks", role="unified", pod=u) or 0
                        for u in pods}  # fmt: skip

            def served(url: str) -> float:  # (prompt tokens: counted for every request, however it ends)
                return metric(url, "vllm:prompt_tokens_total") or 0

            history = [{"role": "system", "content": "You answer questions about geography. " * 10},
                       {"role": "user", "content": QUESTION}]  # fmt: skip
            before, seen = {u: served(u) for u in pods}, cached(door_b)
            openai(door_a).chat.completions.create(model="smollm2", messages=history, max_tokens=3)
            (holder,) = [u for u in pods if served(u) > before[u]]
            wait_until(lambda: cached(door_b)[holder] > seen[holder], "door B to hear of the first turn")
            history += [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
            before = {u: served(u) for u in pods}
            name = "neuronfleet:router_routing_decisions_total"
            decided = metric(door_b, name, role="unified", reason="prefix") or 0
            openai(door_b).chat.completions.create(model="smollm2", messages=history, max_tokens=3)
            assert [u for u in pods if served(u) > before[u]] == [holder]
            assert metric(door_b, name, role="unified", reason="prefix") == decided + 1
            # structured outputs and log probabilities through a door of two pods, routed by their prompts
            structured_outputs_round(door_a)
            whole = openai(door_a).chat.completions.create(
                model="smollm2", messages=history, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
            )
            entries = whole.choices[0].logprobs.content
            text = "".join(e.token for e in entries)  # (an end-of-sequence token has its entry, as vLLM's)
            assert text.removesuffix("<|im_end|>") == whole.choices[0].message.content
            assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
            two = openai(door_a).chat.completions.create(model="smollm2", messages=history, max_tokens=4, n=2,
                                                         temperature=0)  # fmt: skip
            assert [c.index for c in two.choices] == [0, 1] and two.choices[0].message.content == (
                two.choices[1].message.content
            )
            tool_call_round(door_b)
        finally:
            process_a.stop()
            process_b.stop()


def test_a_front_door_whose_tokenizer_cannot_be_read_routes_by_text_and_stays_up(tmp_path):
    """The compiled artifacts gone from under it: the front door says so and routes by the prompts' text
    (it is the model's public endpoint), it does not crash-loop."""
    good = ThreadApp(200, {"choices": [{"text": "ok"}]})
    peers = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5570"})
    door, process = front_door(tmp_path, "--unified", good.base, "--model", str(tmp_path / "gone"),
                               "--peer-kv-events", peers)  # fmt: skip
    try:
        from support import post

        answer = post(door, "/v1/completions", {"prompt": "p " * 40})
        assert answer[:2] == (200, {"choices": [{"text": "ok"}]})
        assert "the tokenizer cannot be read" in process.log.read_text()
        assert process.poll() is None
    finally:
        process.stop()
        good.close()
