"""Overload is refused early, drains finish what they took (issue 49), against a real server and the official
`openai` client (one client, max_retries=0), with the load generator of bench/overload.py.

Offered more than it serves, open loop, a server answers each request or refuses it with 429 and
Retry-After, most refusals at once (the expected wait past --max-queue-wait), and none of the requests it
admitted waited for a slot much past the bound (its own histogram of the wait); SIGTERM under that load
loses no request it accepted: every one is answered, or handed back with 503 and Retry-After, never a 500 or
a cut. The timing itself (the estimate, the bound, what a drain keeps) is proven in simulated time in
tests/unit/test_admission.py; here nothing depends on the machine's speed: a slower machine serves less and
refuses more."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal

from support import (
    Process,
    bench_module,
    free_port,
    metric,
    metrics_text,
    neuronfleet_command,
    post,
    running_server,
    wait_until,
)

BOUND = 3.0  # --max-queue-wait: small, so that a short load builds a queue that passes it


def histogram(base: str, name: str) -> dict[str, float]:
    """{bucket bound: observations} of a histogram on /metrics, summed over its series."""
    out: dict[str, float] = {}
    for line in metrics_text(base).splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_offered_more_than_it_serves_every_request_is_answered_or_refused_with_retry_after(smollm2_dir):
    bench = bench_module("overload")
    options = ("--slots", "2", "--max-seq-len", "256", "--max-queue-wait", str(BOUND))
    options += ("--grace-period", "300")
    with running_server(smollm2_dir, *options) as (base, server):
        served = asyncio.run(bench.capacity(base, "smollm2", 2, 24, 8))
        queued_before = bench.queue_seconds(base, "smollm2")

        async def load_then_sigterm():
            stop = asyncio.Event()
            load = asyncio.create_task(bench.offer(base, "smollm2", 3 * served, 60.0, 24, stop=stop))
            # under load until requests have been refused, and some answered since
            rejected = lambda: metric(base, "neuronfleet:requests_rejected_total", reason="overloaded")  # noqa: E731
            while not load.done() and await asyncio.to_thread(rejected) < 3:
                await asyncio.sleep(0.2)
            queued = await asyncio.to_thread(bench.queue_seconds, base, "smollm2")
            steps = await asyncio.to_thread(histogram, base, "neuronfleet:step_duration_seconds")
            stop.set()  # nothing is sent after the SIGTERM (a Service sends a deleted pod nothing new)
            server.signal(signal.SIGTERM)
            return await load, queued, steps

        outcomes, queued, steps = asyncio.run(load_then_sigterm())
        assert server.wait() == 0, server.output()  # drained, and exited on its own
    figures = bench.summary(outcomes)
    refused = [o for o in outcomes if o.kind == "refused"]
    answered = [o for o in outcomes if o.kind == "answered"]
    assert not [o for o in outcomes if o.kind == "failed"], figures  # no 500, no cut, no connection lost
    assert answered and refused, figures
    assert all(o.status == 429 and int(o.retry_after) >= 1 for o in refused), figures
    # refused at once (the expected wait passed the bound), not after waiting: most of them
    assert sorted(o.seconds for o in refused)[len(refused) // 2] < BOUND, figures
    # no admitted request waited for a slot past the bound, but for a step longer than the one before it (the
    # engine refuses a request the next step will not admit when it would pass the bound by that step's end,
    # judged by the last step's time): within the bound and the longest step, as the histograms' buckets say
    longest_step = min(float(le) for le, n in steps.items() if n == steps["+Inf"])
    le = min((k for k in queued["buckets"] if float(k) >= BOUND + longest_step), key=float)
    admitted = queued["count"] - queued_before["count"]
    within = queued["buckets"][le] - queued_before["buckets"][le]
    assert admitted > 0 and within == admitted, (queued, steps)


def test_a_drain_finishes_what_it_can_and_hands_the_rest_back_with_503_never_500(smollm2_dir):
    """One slot, nine requests waiting behind the running one, far more than a grace period of 2 s holds:
    SIGTERM hands back at once what it would not finish (503, Retry-After), and at the grace period's end
    what is left; whatever the machine's speed, every request is answered or handed back."""
    options = ("--slots", "1", "--max-seq-len", "256", "--max-queue-wait", "0", "--grace-period", "2")
    request = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with running_server(smollm2_dir, *options) as (base, server):
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            sent = [pool.submit(post, base, "/v1/completions", request) for _ in range(10)]
            wait_until(
                lambda: metric(base, "vllm:num_requests_waiting", model_name="smollm2") == 9,
                "one request running and nine waiting",
            )
            server.signal(signal.SIGTERM)
            answers = [f.result() for f in sent]
        assert server.wait() == 0, server.output()
    statuses = sorted(code for code, _, _ in answers)
    assert set(statuses) <= {200, 503}, answers
    assert 503 in statuses, statuses  # 10 x 200 tokens never fit in 2 s
    for code, payload, headers in answers:
        if code == 503:
            assert int(headers["Retry-After"]) >= 1
            assert "send it again" in payload["error"]["message"], payload


def healthy(door: str) -> float:
    try:
        return metric(door, "neuronfleet:router_peers_healthy", role="unified")
    except OSError:  # not listening yet
        return 0


def test_a_pod_drained_under_twice_its_load_behind_the_front_door_loses_no_request(smollm2_dir, tmp_path):
    """A roll's step under overload: two pods behind the front door, offered twice what they serve (open loop,
    through the front door), one drained with SIGTERM mid-way while the load goes on (the front door learns of
    the drain from its probes and from the pod's 503s): every request is answered whole or refused with 429 or
    503 and Retry-After, never a 500 or a cut stream, most refusals at once; a full pod's 429 and a draining
    pod's 503 send the request to the other pod before the client hears of them."""
    bench = bench_module("overload")
    options = (
        "--slots",
        "2",
        "--max-seq-len",
        "256",
        "--max-queue-wait",
        str(BOUND),
        "--grace-period",
        "300",
    )
    with (
        running_server(smollm2_dir, *options) as (a, drained),
        running_server(smollm2_dir, *options) as (b, _),
    ):
        port = free_port()
        door = f"http://127.0.0.1:{port}"
        args = [*neuronfleet_command(), "serve", "--role", "router", "--port", str(port),
                "--served-model-name", "smollm2", "--peer-probe-interval", "0.5", "--grace-period", "1",
                "--unified", a, "--unified", b, "--routing", "least-loaded"]  # fmt: skip
        front = Process(args, tmp_path / "door.log")
        try:
            front.wait_until(lambda: healthy(door) == 2, "the front door to see both pods")
            served = asyncio.run(bench.capacity(door, "smollm2", 4, 24, 8))
            rejected = lambda: sum(  # noqa: E731
                metric(pod, "neuronfleet:requests_rejected_total", reason="overloaded") for pod in (a, b)
            )

            async def load_then_sigterm():
                load = asyncio.create_task(bench.offer(door, "smollm2", 2 * served, 40.0, 24))
                while not load.done() and await asyncio.to_thread(rejected) < 3:  # overloaded by now
                    await asyncio.sleep(0.2)
                drained.signal(signal.SIGTERM)  # the load goes on: the front door still names the pod
                return await load

            outcomes = asyncio.run(load_then_sigterm())
            assert drained.wait() == 0, drained.output()  # drained, and exited on its own
            moved = metric(door, "neuronfleet:router_retries_total", kind="retry")
        finally:
            front.stop()
    figures = bench.summary(outcomes)
    refused = [o for o in outcomes if o.kind == "refused"]
    assert not [o for o in outcomes if o.kind == "failed"], figures  # no 500, no cut, no connection lost
    assert [o for o in outcomes if o.kind == "answered"] and refused, figures
    assert all(o.status in (429, 503) and int(o.retry_after) >= 1 for o in refused), figures
    assert sorted(o.seconds for o in refused)[len(refused) // 2] < BOUND, figures  # at once, most of them
    assert moved >= 1, figures  # a full or draining pod's refusal went to the other pod first
