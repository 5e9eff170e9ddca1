"""Holding requests at zero (runtime/routing/holding.py) on its own: held until a probe round finds a pod
ready, bounded in number (429) and time (503), Retry-After from the cold start measured, off at 0; and the
serve flags that turn it on (contract)."""

from __future__ import annotations

import asyncio
import time

import pydantic
import pytest
from prometheus_client import CollectorRegistry

from neuronfleet.cli import build_parser
from neuronfleet.contract import ServeConfig
from neuronfleet.runtime.routing.holding import Hold, HoldRejected


class Pods:
    """What a router would know of its pods: ready or not, and how many probe rounds ran."""

    def __init__(self) -> None:
        self.up, self.rounds = False, 0

    async def probe(self) -> None:
        self.rounds += 1


def hold(pods: Pods, limit: int = 2, seconds: float = 30.0) -> tuple[Hold, CollectorRegistry]:
    h = Hold(limit, seconds, ready=lambda: pods.up, refresh=pods.probe, role="unified")
    registry = CollectorRegistry()
    h.register_metrics(registry, "m")
    return h, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_a_held_request_goes_on_at_the_first_probe_round_that_finds_a_pod():
    async def main() -> None:
        pods = Pods()
        h, registry = hold(pods)
        waiting = asyncio.create_task(h.request().wait())
        while h.held == 0:
            await asyncio.sleep(0.01)
        assert sample(registry, "neuronfleet:router_requests_held") == 1 and not waiting.done()
        rounds = pods.rounds
        pods.up = True
        await waiting
        assert pods.rounds > rounds - 1 and h.held == 0
        assert sample(registry, "neuronfleet:router_hold_seconds_count") == 1
        assert h.cold_start is not None and h.cold_start > 0
        assert h.retry_after() == max(1, int(h.cold_start + 0.999999))
        await h.close()

    asyncio.run(main())


def test_one_more_than_the_bound_is_refused_429_and_one_held_too_long_503():
    async def main() -> None:
        pods = Pods()
        h, registry = hold(pods, limit=1, seconds=0.5)
        first = asyncio.create_task(h.request().wait())
        while h.held == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(HoldRejected) as full:
            await h.request().wait()
        assert (full.value.status, full.value.tgi_status, full.value.retry_after) == (429, 429, 1)
        assert "--hold-requests 1" in str(full.value) and full.value.reason == "hold_full"
        started = time.monotonic()
        with pytest.raises(HoldRejected) as late:
            await first
        assert time.monotonic() - started < 5 and late.value.status == 503
        assert "within 0.5 s" in str(late.value) and h.held == 0
        assert sample(registry, "neuronfleet:router_hold_rejected_total", reason="full") == 1
        assert sample(registry, "neuronfleet:router_hold_rejected_total", reason="timeout") == 1
        await h.close()

    asyncio.run(main())


def test_a_router_shutting_down_answers_its_held_requests_503_at_once():
    async def main() -> None:
        pods, stopping = Pods(), []
        h = Hold(2, 600.0, ready=lambda: pods.up, refresh=pods.probe, draining=lambda: bool(stopping))
        waiting = asyncio.create_task(h.request().wait())
        while h.held == 0:
            await asyncio.sleep(0.01)
        stopping.append(True)
        with pytest.raises(HoldRejected, match="shutting down") as e:
            await waiting
        assert (e.value.status, e.value.retry_after, h.held) == (503, 1, 0)
        await h.close()

    asyncio.run(main())


def test_holding_off_or_a_pod_ready_never_holds():
    async def main() -> None:
        pods = Pods()
        off, _ = hold(pods, limit=0)
        await off.request().wait()  # at once, no pod: the router then answers as without holding
        assert off.held == 0 and pods.rounds == 0
        pods.up = True
        on, registry = hold(pods)
        await on.request().wait()
        assert sample(registry, "neuronfleet:router_hold_seconds_count") == 0

    asyncio.run(main())


def parse(*argv: str) -> ServeConfig:
    return ServeConfig.from_namespace(build_parser().parse_args(["serve", *argv]))


def test_the_front_door_flags_parse_and_render_back():
    config = parse("--role", "router", "--unified", "dns://m-unified:8000", "--unified",
                   "http://10.0.0.1:8000", "--hold-requests", "16", "--hold-seconds", "120", "--wake-url",
                   "http://op:8080/wake/ns/m")  # fmt: skip
    assert config.unified == ["dns://m-unified:8000", "http://10.0.0.1:8000"] and config.model is None
    assert (config.hold_requests, config.hold_seconds, config.wake_url) == (
        16,
        120.0,
        "http://op:8080/wake/ns/m",
    )
    assert parse(*config.to_args()) == config
    assert parse("--model", "/m").hold_requests == 0  # off by default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--role", "router", "--unified", "http://a:1", "--decode", "http://b:1"],
            "without --prefill, --decode",
        ),
        (["--model", "/m", "--unified", "http://a:1"], "--unified is for --role router"),
        (["--model", "/m", "--hold-requests", "2"], "--hold-requests and --wake-url are for --role router"),
        (["--role", "router", "--unified", "http://a:1", "--hold-requests", "-1"], "the most requests held"),
        (["--role", "router", "--unified", "http://a:1", "--hold-seconds", "0"], r"in seconds \(over 0\)"),
        (
            ["--role", "router", "--unified", "http://a:1", "--wake-url", "op:8080"],
            "an http:// or https:// URL",
        ),
    ],
)
def test_front_door_and_holding_flags_that_cannot_go_together_are_refused(argv, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        parse(*argv)
