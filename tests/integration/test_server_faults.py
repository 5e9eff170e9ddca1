"""Faults inside the engine, injected into a real server in this process: one request failing leaves the
engine and the other requests running; the engine failing answers 500s that say so and turns /ready false."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import AsyncEngine, Engine
from neuronfleet.runtime.serving.server import RuntimeServer

pytestmark = pytest.mark.real_model

POISONED_SEED = 13


@pytest.fixture
def engine(smollm2_dir):
    async_engine = AsyncEngine(
        lambda: Engine.from_model_dir(
            str(smollm2_dir), RuntimeConfig(slots=2, max_seq_len=64, dtype="bfloat16")
        )
    )
    yield async_engine
    async_engine.shutdown()


def run_with_client(server: RuntimeServer, scenario) -> None:
    async def main():
        async with TestClient(TestServer(server.app())) as client:
            await scenario(client)

    asyncio.run(main())


def test_one_failing_request_leaves_the_engine_and_other_requests_running(engine, monkeypatch):
    sampler = engine.engine.runner.sampler
    start_slot = sampler.start

    def start_slot_failing_for_one_seed(slot, params, prompt_ids):  # an injected per-request fault
        if params.seed == POISONED_SEED:
            raise ValueError("injected fault in this request's sampler")
        return start_slot(slot, params, prompt_ids)

    monkeypatch.setattr(sampler, "start", start_slot_failing_for_one_seed)
    server = RuntimeServer(engine, "smollm2")

    async def scenario(client):
        ok_body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True}
        bad_body = {**ok_body, "seed": POISONED_SEED, "temperature": 0.7}
        ok, bad, bad_tgi = await asyncio.gather(
            client.post("/v1/completions", json=ok_body),
            client.post("/v1/completions", json=bad_body),
            client.post(
                "/generate",
                json={"inputs": "Hello", "parameters": {"seed": POISONED_SEED, "do_sample": True}},
            ),
        )
        assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 20
        assert bad.status == 500
        message = (await bad.json())["error"]["message"]
        assert "the request failed inside the engine" in message and "injected fault" in message
        assert bad_tgi.status == 500 and (await bad_tgi.json())["error_type"] == "generation"
        ready = await client.get("/ready")
        assert ready.status == 200
        again = await client.post("/v1/completions", json=ok_body)
        assert again.status == 200 and (await again.json())["choices"][0]["finish_reason"] == "length"

    run_with_client(server, scenario)
    assert engine.alive and engine.engine.scheduler.num_free_slots == 2


def test_an_engine_failure_fails_requests_with_500_and_turns_ready_false(engine, monkeypatch):
    runner = engine.engine.runner
    model_step = runner.run
    calls = {"n": 0}

    def step_that_loses_the_device(*args):  # an injected device fault on the 5th model call
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected device failure")
        return model_step(*args)

    monkeypatch.setattr(runner, "run", step_that_loses_the_device)
    server = RuntimeServer(engine, "smollm2")

    async def scenario(client):
        assert (await client.get("/ready")).status == 200
        body = {"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True}
        whole, streamed = await asyncio.gather(
            client.post("/v1/completions", json=body),
            client.post(
                "/v1/chat/completions",
                json={  # ignore_eos: a short answer could end before the fault (as it did on another CPU)
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 30,
                    "ignore_eos": True,
                    "stream": True,
                },
            ),
        )
        assert whole.status == 500
        assert "the engine failed" in (await whole.json())["error"]["message"]
        assert streamed.status == 200  # the stream had started: its last event carries the error
        events = (await streamed.text()).split("\n\n")
        assert any("injected device failure" in e for e in events) and "data: [DONE]" in events
        ready = await client.get("/ready")
        assert ready.status == 503 and (await ready.json())["status"] == "engine failed"
        later = await client.post("/generate", json={"inputs": "Hello"})
        assert later.status == 500 and "the engine failed" in (await later.json())["error"]
        health = await client.get("/health")  # liveness fails too, so that the pod gets restarted
        assert health.status == 503 and "injected device failure" in (await health.json())["status"]

    run_with_client(server, scenario)
    assert not engine.alive
