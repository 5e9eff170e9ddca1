"""bench/autoscale_load.py's pure parts: the load pattern, the measures it reports (direction changes, time to
scale up, cold start from zero, request counts) and what it reads (Prometheus text, EndpointSlices)."""

from __future__ import annotations

import pytest
from support import bench_module

bench = bench_module("autoscale_load")


def sample(t: float, ready: int, queue: float = 0, role: str = "unified") -> dict:
    return {"t": t, "ready": {role: ready}, "queue": queue}


def request(start: float, end: float, ok: bool = True, ttft: float | None = 0.1) -> dict:
    return {"start": start, "end": end, "ok": ok, "ttft": ttft if ok else None, "error": None if ok else "E"}


def test_the_load_pattern_is_idle_ramp_burst_idle():
    phases = bench.load_pattern(idle=10, ramp=100, burst=50, cooldown=40, ramp_to=8, burst_to=12)
    assert [(p.name, p.start, p.end) for p in phases] == [
        ("idle", 0, 10), ("ramp", 10, 110), ("burst", 110, 160), ("idle", 160, 200)
    ]  # fmt: skip
    at = lambda t: bench.clients_at(phases, t)  # noqa: E731
    assert [at(0), at(9.9), at(10), at(60), at(109.9)] == [0, 0, 1, 4, 8]  # the ramp is linear, 1 -> 8
    assert [at(110), at(159), at(160), at(199), at(500)] == [12, 12, 0, 0, 0]


def test_a_phase_of_no_length_is_left_out():
    phases = bench.load_pattern(idle=0, ramp=30, burst=0, cooldown=20, ramp_to=4, burst_to=9)
    assert [p.name for p in phases] == ["ramp", "idle"]
    assert bench.clients_at(phases, 0) == 1


@pytest.mark.parametrize(
    ("path", "changes"),
    [
        ([], 0),
        ([1], 0),
        ([1, 1, 1], 0),
        ([1, 2, 3, 3, 1], 1),  # up, up, down: one turn
        ([1, 2, 1, 2, 1], 3),  # the 2 <-> 1 oscillation
        ([3, 1, 1, 2], 1),
    ],
)
def test_direction_changes_count_turns_not_steps(path, changes):
    assert bench.direction_changes(path) == changes


def test_time_to_scale_up_runs_from_the_phases_first_request_to_more_ready_pods():
    phases = bench.load_pattern(idle=10, ramp=20, burst=20, cooldown=10, ramp_to=4, burst_to=8)
    # the ramp's queue passes 1 per pod at 18 (one pod) and the burst's at 33 (2 waiting per pod on 2)
    samples = [sample(t, 1, queue=2 if t >= 18 else 0) for t in range(0, 25)]
    samples += [sample(t, 2, queue=2 if t < 33 else 4) for t in range(25, 38)]
    samples += [sample(t, 3, queue=1) for t in range(38, 60)]
    requests = [request(10.4, 12), request(11, 13), request(30.2, 31), request(35, 40, ok=False)]
    ups = bench.scale_up_times(samples, requests, phases, target=1)
    assert ups == [
        {"phase": "ramp", "first_request_t": 10.4, "ready_before": 1, "ready_after": 2, "seconds": 14.6,
         "queue_over_target_t": 18, "seconds_from_queue": 7},
        {"phase": "burst", "first_request_t": 30.2, "ready_before": 2, "ready_after": 3, "seconds": 7.8,
         "queue_over_target_t": 33, "seconds_from_queue": 5},
    ]  # fmt: skip


def test_a_phase_that_never_scaled_up_says_so():
    phases = bench.load_pattern(idle=0, ramp=10, burst=0, cooldown=5, ramp_to=2, burst_to=2)
    ups = bench.scale_up_times([sample(t, 1) for t in range(15)], [request(0.5, 2)], phases, target=1)
    assert ups == [
        {"phase": "ramp", "first_request_t": 0.5, "ready_before": 1, "ready_after": 1, "seconds": None,
         "queue_over_target_t": None, "seconds_from_queue": None}
    ]  # fmt: skip


def test_cold_start_is_the_first_request_sent_at_zero():
    samples = [sample(0, 1), sample(1, 0), sample(2, 0), sample(9, 1)]
    requests = [request(0.5, 0.9), request(2.5, 9.5, ttft=6.8), request(3, 9.6)]
    cold = bench.cold_start(samples, requests)
    assert cold == {"sent_t": 2.5, "answered": True, "seconds": 7.0, "ttft": 6.8}
    assert bench.cold_start([sample(0, 1)], requests) is None  # never at zero


def test_metric_sum_adds_a_metrics_series_and_nothing_else():
    text = "\n".join([
        "# HELP vllm:num_requests_waiting Requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="smollm2"} 3.0',
        'vllm:num_requests_waiting{model_name="other"} 1.0',
        "vllm:num_requests_waiting_total 40.0",
        'vllm:num_requests_running{model_name="smollm2"} 4.0',
    ])  # fmt: skip
    assert bench.metric_sum(text, "vllm:num_requests_waiting") == 4.0
    assert bench.metric_sum(text, "vllm:num_requests_running") == 4.0
    assert bench.metric_sum(text, "vllm:kv_cache_usage_perc") == 0.0


def test_pod_addresses_are_the_ready_endpoints_http_port():
    slices = [{
        "ports": [{"name": "kv", "port": 9000}, {"name": "http", "port": 41234}],
        "endpoints": [
            {"addresses": ["127.0.0.1"], "conditions": {"ready": True},
             "targetRef": {"kind": "Pod", "name": "smollm2-unified-a"}},
            {"addresses": ["127.0.0.1"], "conditions": {"ready": False},
             "targetRef": {"kind": "Pod", "name": "smollm2-unified-b"}},
        ],
    }, {"ports": [{"name": "metrics", "port": 1}], "endpoints": [{"addresses": ["127.0.0.1"],
        "targetRef": {"kind": "Pod", "name": "x"}}]}]  # fmt: skip
    assert bench.pod_addresses(slices) == {"smollm2-unified-a": "127.0.0.1:41234"}


def test_summarize_counts_sent_answered_and_failed():
    requests = [request(0, 1, ttft=0.2), request(0, 3, ttft=0.4), request(1, 2, ok=False)]
    out = bench.summarize(requests)
    assert (out["sent"], out["answered"], out["failed"], out["errors"]) == (3, 2, 1, ["E"])
    percentiles = (out["ttft_p50_s"], out["ttft_p90_s"], out["latency_p50_s"], out["latency_p90_s"])
    assert percentiles == (0.2, 0.4, 1, 3)
    assert bench.summarize([])["ttft_p50_s"] is None


def test_a_front_door_that_never_scales_is_not_counted_as_ready_pods():
    """A model that may scale to zero keeps its router: at zero only the scaled roles' pods are gone."""
    at_zero = {"t": 5, "ready": {"router": 1, "unified": 0}, "desired": {"unified": 0}, "queue": 0}
    back = {"t": 20, "ready": {"router": 1, "unified": 1}, "desired": {"unified": 1}, "queue": 0}
    assert (bench.ready_total(at_zero), bench.ready_total(back)) == (0, 1)
    assert bench.ready_total({"ready": {"unified": 2}, "desired": {}}) == 2  # before any decision: every role
    cold = bench.cold_start([{**at_zero, "t": 0}, at_zero, back], [request(6, 19, ttft=12.5)])
    assert cold == {"sent_t": 6, "answered": True, "seconds": 13, "ttft": 12.5}
