"""The backend surface the HTTP server serves from: one request check, and errors that carry their HTTP
status."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from neuronfleet.runtime.routing.router import RemoteBackend
from neuronfleet.runtime.serving.backend import Limits, check_fits
from neuronfleet.runtime.serving.errors import (
    BodyTooLarge,
    Draining,
    EngineFailed,
    HandedBack,
    InvalidRequest,
    Overloaded,
    QueueFull,
    RequestFailed,
    Unavailable,
)

LIMITS = Limits(max_seq_len=64, max_prompt_len=64, slots=1, dtype="float32", device="remote")


def test_backend_errors_and_the_server_import_no_torch():
    code = (
        "import sys, neuronfleet.runtime.serving.backend, neuronfleet.runtime.serving.errors, "
        "neuronfleet.runtime.serving.server, neuronfleet.runtime.routing.router; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_each_error_carries_its_status_per_api():
    """OpenAI and TGI answer some errors differently; the server reads the status from the error alone."""
    cases = [
        (InvalidRequest("x"), 400, 422, "invalid"),
        (BodyTooLarge("x"), 413, 413, "body_too_large"),
        (QueueFull("x"), 429, 503, "queue_full"),
        (Overloaded("x", retry_after=7), 429, 503, "overloaded"),
        (Draining("x"), 503, 503, "draining"),
        (HandedBack("x", retry_after=1), 503, 503, "handed_back"),
        (RequestFailed("x"), 500, 500, "failed"),
        (EngineFailed("x"), 500, 500, "failed"),
        (Unavailable("x"), 503, 503, "unavailable"),
    ]
    for error, openai, tgi, reason in cases:
        assert (error.http_status(tgi=False), error.http_status(tgi=True), error.reason) == (
            openai,
            tgi,
            reason,
        )
    assert isinstance(InvalidRequest("x"), ValueError)  # the command line reports it as a usage error


def test_check_fits_refuses_a_prompt_that_leaves_no_room_to_generate():
    assert check_fits(LIMITS, 63, None) == 1
    with pytest.raises(
        InvalidRequest, match="64 tokens and leaves no room to generate within the slot length 64"
    ):
        check_fits(LIMITS, 64, None)


def test_the_router_refuses_a_prompt_that_leaves_no_room_before_any_peer_is_asked():
    """The same check as the engine's: a router never sends its peers a request they would refuse."""
    unreachable = ["http://127.0.0.1:9"]
    backend = RemoteBackend(None, frozenset(), LIMITS, unreachable, unreachable, "token")  # type: ignore[arg-type]

    async def first_output(prompt_len: int):
        return await anext(backend.generate(list(range(1, prompt_len + 1))))

    with pytest.raises(InvalidRequest, match="leaves no room to generate") as info:
        asyncio.run(first_output(64))
    assert info.value.field_name == "prompt" and not backend.decode.peers  # refused before looking for peers
    with pytest.raises(InvalidRequest, match="longest this deployment accepts is 64"):
        asyncio.run(first_output(65))


def test_the_router_refuses_at_once_a_request_whose_expected_wait_for_a_decode_slot_passes_the_bound():
    """Our prefill/decode router admits as the engine does (engine.admission), over its decode pods' slots
    and the decode streams' durations it measured: two slots serving one request each 20 s, three requests
    ahead: 20 s of wait, past a bound of 10 s (Retry-After 10 s); with two ahead, 10 s: admitted."""
    from neuronfleet.runtime.routing.router import NoPeerAvailable

    unreachable = ["http://127.0.0.1:9"]
    backend = RemoteBackend(None, frozenset(), LIMITS, unreachable, unreachable, "token",  # type: ignore[arg-type]
                            probe_interval=3600, max_queue_wait=10.0)  # fmt: skip

    async def main():
        await backend.watch.refresh()
        try:
            for peer in backend.decode.peers.values():
                peer.slots = 2
            for _ in range(4):
                backend.service.served(20.0)
            backend.in_flight = 3
            with pytest.raises(Overloaded, match="would likely wait 20 s for a decode slot") as refused:
                await anext(backend.generate([1, 2, 3]))
            assert refused.value.retry_after == 10 and backend.in_flight == 3
            backend.in_flight = 2
            with pytest.raises(NoPeerAvailable):  # admitted: then no decode pod answers
                await anext(backend.generate([1, 2, 3]))
        finally:
            await backend.watch.close()

    asyncio.run(main())


async def full_decode_pod():
    """A decode pod whose every slot stays busy: its status says so, its reserve answers 503."""
    from aiohttp import web
    from support import free_port

    async def status(request):
        return web.json_response({"ready": True, "identity": "full", "slots": 1, "running": 1, "waiting": 0})

    async def reserve(request):
        return web.json_response({"error": "no slot is free"}, status=503)

    app = web.Application()
    app.add_routes([web.get("/internal/status", status), web.post("/internal/reserve", reserve)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("case", ["waited past the bound", "draining"])
def test_the_router_refuses_a_request_still_waiting_for_a_decode_slot_past_the_bound_or_at_a_drains_end(case):
    """Every decode pod full: a request waits for room (RoomWait) until it has waited --max-queue-wait
    (Overloaded, 429), or until the end of the router's drain (HandedBack, 503), with Retry-After."""

    async def main():
        runner, url = await full_decode_pod()
        bound = 0.5 if case == "waited past the bound" else 0.0
        backend = RemoteBackend(None, frozenset(), LIMITS, [url], [url], "token",  # type: ignore[arg-type]
                                probe_interval=3600, busy_timeout=3600, max_queue_wait=bound)  # fmt: skip
        try:
            await backend.watch.refresh()
            if case == "draining":
                backend.drain(grace_period=1.0)  # its last second: now
            with pytest.raises(Overloaded if bound else HandedBack) as refused:
                await anext(backend.generate([1, 2, 3]))
            assert refused.value.http_status(tgi=False) == (429 if bound else 503)
            assert refused.value.retry_after >= 1 and backend.in_flight == 0
        finally:
            await backend.watch.close()
            await runner.cleanup()

    asyncio.run(main())
