"""The autoscaler's decision, case by case (tables), and /metrics read into its signals, with the names
checked against a real runtime registry."""

from __future__ import annotations

import pytest

from neuronfleet.operator import pod_metrics
from neuronfleet.operator.autoscaler import Demand, History, Pod, Policy, RolePolicy, decide, deletion_costs
from neuronfleet.operator.pod_metrics import Histogram, MetricsError, PodLoad

UNIFIED = {"unified": RolePolicy(min=1, max=8, signal="occupancy", target=0.75)}
PD = {
    "prefill": RolePolicy(min=1, max=8, signal="queue", target=2.0),
    "decode": RolePolicy(min=1, max=8, signal="occupancy", target=0.75),
}


def policy(**changes) -> Policy:
    settings = dict(roles=UNIFIED, scale_down_window=300.0, warmup=30.0, stale_after=60.0, slots=4)
    return Policy(**{**settings, **changes})


def ready(
    name: str, occupancy: float = 0.0, *, role: str = "unified", since: float = -1000.0, at: float = 0.0,
    slots: int = 4, **load,
) -> Pod:  # fmt: skip
    """A ready pod, warm since `since`, scraped at `at`, with `occupancy` of its slots (past 1: a queue)."""
    running = min(occupancy, 1.0) * slots
    waiting = max(occupancy - 1.0, 0.0) * slots
    return Pod(name, role, "ready", since, at, PodLoad(waiting=waiting, running=running, slots=slots, **load))


def quiet_history(now: float, want: int, role: str = "unified", since: float = -1000.0) -> History:
    """Ticks every 15 s over the last 400 s, each asking for `want` replicas."""
    ticks = tuple(Demand(t, role, want, 0.0) for t in range(int(now) - 400, int(now), 15))
    return History(demands=ticks, since=since, busy_at=now)


# ---- the policy ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"roles": {"prefill": UNIFIED["unified"]}}, "expected ['unified'] or ['decode', 'prefill']"),
        ({"scale_to_zero": True}, "scale_to_zero needs min 0"),
        ({"ratio": (1.0, 2.0)}, "ratio bounds apply to prefill and decode roles only"),
        ({"tolerance": 1.0}, "tolerance 1.0 must be in [0, 1)"),
        ({"idle": -1}, "idle -1 must be 0 or more seconds"),
        ({"roles": PD, "ratio": (1.0,)}, "expected (low, high) prefill replicas per decode replica"),
        ({"roles": PD, "ratio": (2.0, 1.0)}, "need 0 < low <= high"),
    ],
)
def test_a_bad_policy_says_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError) as error:
        policy(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min": 3, "max": 2, "signal": "queue", "target": 1}, "need 0 <= min <= max"),
        ({"min": 1, "max": 2, "signal": "load", "target": 1}, "signal 'load' is not one of queue, occupancy"),
        ({"min": 1, "max": 2, "signal": "ttft", "target": 0}, "target 0 of ttft must be above 0"),
    ],
)
def test_a_bad_role_policy_says_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolePolicy(**kwargs)


def test_pods_of_a_role_the_policy_does_not_scale_are_refused():
    with pytest.raises(ValueError, match=r"pods of roles \['decode'\]"):
        decide([ready("d", role="decode")], {"unified": 1}, policy(), History(), 0.0)
    with pytest.raises(ValueError, match=r"current replicas \{'unified': -1\} must be 0 or more"):
        decide([], {"unified": -1}, policy(), History(), 0.0)
    with pytest.raises(ValueError, match=r"current replicas name roles \['decode'\]"):
        decide([], {"decode": 1}, policy(), History(), 0.0)


# ---- scale-up ----


@pytest.mark.parametrize(
    "occupancies, replicas, desired",
    [
        ([0.9, 0.9], 2, 3),  # 1.8 pods of work at 0.75 per pod: ceil(2.4)
        ([0.75, 0.75], 2, 2),  # exactly at target: steady
        ([0.8, 0.8], 2, 2),  # 0.8 is within the 10% tolerance of 0.75: steady
        ([3.0], 1, 2),  # a deep queue says over capacity, not by how much: at most double
        ([0.99] * 7, 7, 8),  # capped at max
    ],
)
def test_scale_up_acts_at_once_to_the_load_over_target(occupancies, replicas, desired):
    pods = [ready(f"p{i}", o) for i, o in enumerate(occupancies)]
    d = decide(pods, {"unified": replicas}, policy(), History(), 0.0)
    assert d.desired == {"unified": desired}
    assert d.act == (desired != replicas)
    if desired > replicas:
        assert d.reasons["unified"].startswith(f"scale up {replicas} -> {desired}: occupancy")
        assert d.signals["unified"]["load"] == pytest.approx(sum(occupancies))


@pytest.mark.parametrize("state", ["pending", "starting"])
def test_pods_on_the_way_count_as_capacity_so_one_spike_is_one_scale_up(state):
    """llm-d inference-sim #1109: a 60 s load with a 15 s tick scaled up four times. Here the queue keeps
    growing while the new pods load, and the replicas stay where the first tick put them."""
    first = decide([ready("a", 1.0)], {"unified": 1}, policy(), History(), 0.0)
    assert first.desired == {"unified": 2}
    history = first.history
    for now, backlog in ((15.0, 2.0), (30.0, 3.0), (45.0, 4.0)):
        pods = [ready("a", backlog, at=now), Pod("b", "unified", state, 0.0)]
        d = decide(pods, {"unified": 2}, policy(), history, now)
        history = d.history
        assert d.desired == {"unified": 2} and not d.act
        assert "1 pod(s) are on the way" in d.reasons["unified"]
        assert d.signals["unified"]["coming"] == 1


def test_warming_pods_are_capacity_not_load():
    """Dynamo #12430: warm-up samples over-scaled decode. A pod ready 10 s ago reports a spike; it counts as
    a replica, its samples do not count as load, and it freezes both directions until it is warm."""
    pods = [ready("old", 0.5), ready("new", 6.0, since=-10.0)]
    d = decide(pods, {"unified": 2}, policy(), History(), 0.0)
    assert d.desired == {"unified": 2}
    assert d.signals["unified"]["load"] == pytest.approx(0.5)
    assert d.signals["unified"]["warming"] == 1
    later = decide([ready("old", 0.5, at=400.0), ready("new", 0.5, since=-10.0, at=400.0)],
                   {"unified": 2}, policy(), quiet_history(400.0, 1), 400.0)  # fmt: skip
    assert later.signals["unified"]["load"] == pytest.approx(1.0) and later.signals["unified"]["warming"] == 0


def test_the_cold_start_decides_how_early_a_rising_load_scales_up():
    """A load rising 0.05 pods of work per second, with a 60 s cold start, scales up for the load one cold
    start ahead; without a measured cold start it waits until the load is over target."""
    ramp = tuple(Demand(t, "unified", 1, load) for t, load in ((-45.0, 0.55), (-30.0, 0.6), (-15.0, 0.65)))
    rising = History(demands=ramp, since=-600.0, busy_at=-15.0)
    pods = [ready("a", 0.7)]
    early = decide(pods, {"unified": 1}, policy(cold_start=60.0), rising, 0.0)
    assert early.desired == {"unified": 2}  # 0.7 + (0.15 / 45) * 60 = 0.9 > 0.75 * 1.1: 2 pods
    assert early.signals["unified"]["projected"] == pytest.approx(0.9)
    assert "projected 0.9 one cold start ahead" in early.reasons["unified"]
    noisy = History(demands=(*ramp[:1], Demand(-30.0, "unified", 1, 0.5), ramp[2]), since=-600.0)
    assert decide(pods, {"unified": 1}, policy(cold_start=60.0), noisy, 0.0).desired == {"unified": 1}
    late = decide(pods, {"unified": 1}, policy(cold_start=0.0), rising, 0.0)
    assert late.desired == {"unified": 1}


# ---- scale-down ----


def test_scale_down_waits_for_its_window():
    pods = [ready("a", 0.1), ready("b", 0.1), ready("c", 0.1)]
    fresh = decide(pods, {"unified": 3}, policy(), History(), 0.0)
    pods = [ready("a", 0.1, at=1000.0), ready("b", 0.1, at=1000.0), ready("c", 0.1, at=1000.0)]
    assert fresh.desired == {"unified": 3}
    assert "the scale-down window has not been observed yet" in fresh.reasons["unified"]
    recent_peak = quiet_history(1000.0, 1)
    recent_peak = History(demands=(*recent_peak.demands, Demand(900.0, "unified", 3, 2.1)), since=-1000.0)
    held = decide(pods, {"unified": 3}, policy(), recent_peak, 1000.0)
    assert held.desired == {"unified": 3}
    assert "higher demand within the scale-down window" in held.reasons["unified"]
    after = decide(pods, {"unified": 3}, policy(), quiet_history(1000.0, 1), 1000.0)
    assert after.desired == {"unified": 1} and after.act
    assert after.reasons["unified"].startswith("scale down 3 -> 1")


@pytest.mark.parametrize(
    "occupancies, desired",
    [
        ([0.35, 0.35], 2),  # 0.70 on one pod > 0.75 * 0.9: the survivor would be over, stay at 2
        ([0.3, 0.3], 1),  # 0.60 <= 0.675: one pod carries it
        ([0.5, 0.5, 0.5], 3),  # 1.5 on 2 pods = 0.75 > 0.675: stay at 3
        ([0.4, 0.4, 0.4], 2),  # 1.2 on 2 pods = 0.6: down to 2, not 1 (1.2 on 1 would be over)
    ],
)
def test_scale_down_only_when_the_survivors_stay_under_target(occupancies, desired):
    """Dynamo PR #9294: survivors absorb N/(N-1) of the load; scaling down to where that is over target makes
    2 <-> 1 oscillation under constant load."""
    pods = [ready(f"p{i}", o, at=1000.0) for i, o in enumerate(occupancies)]
    n = len(pods)
    d = decide(pods, {"unified": n}, policy(), quiet_history(1000.0, 0), 1000.0)
    assert d.desired == {"unified": desired}
    if desired == n:
        assert "would be over 0.75 * (1 - 0.1) with the load redistributed" in d.reasons["unified"]


@pytest.mark.parametrize("running, desired", [(4, 3), (3, 2), (2, 2), (1, 1), (0, 1)])
def test_on_the_queue_signal_full_pods_with_no_queue_are_not_scaled_down(running, desired):
    """Three pods of 4 slots, no request waiting, `running` in each: scaling down to pods whose slots
    cannot hold the requests running now would only make the queue that scales them back up (3 -> 2 -> 3
    under a constant load). With 3 running in each, 2 pods hold 8 and queue 1: 0.5 per pod, under target."""
    queue = {"unified": RolePolicy(min=1, max=4, signal="queue", target=1.0)}
    pods = [Pod(f"p{i}", "unified", "ready", -1000.0, 1000.0, PodLoad(running=running, slots=4))
            for i in range(3)]  # fmt: skip
    d = decide(pods, {"unified": 3}, policy(roles=queue), quiet_history(1000.0, 0), 1000.0)
    assert d.desired == {"unified": desired}, d.reasons
    assert d.signals["unified"]["running"] == 3 * running


def test_a_scale_down_marks_its_pods_by_their_requests_so_the_idlest_go_first():
    """The requests each pod runs or queues become its pod-deletion-cost: the Deployment deletes the idle ones
    and the requests in flight keep their pods. Only the roles going down, only ready measured pods."""
    pods = [ready("busy", 0.5, at=1000.0), ready("idle", 0.0, at=1000.0), ready("some", 0.25, at=1000.0)]
    others = [Pod("starting", "unified", "starting", 990.0), Pod("silent", "unified", "ready", -1000.0)]
    d = decide(pods, {"unified": 3}, policy(), quiet_history(1000.0, 0), 1000.0)
    assert d.desired == {"unified": 2}
    assert deletion_costs(d, pods + others) == {"busy": 2, "idle": 0, "some": 1}
    up = decide([ready("a", 2.0, at=1000.0)], {"unified": 1}, policy(), quiet_history(1000.0, 1), 1000.0)
    assert up.desired["unified"] > 1 and deletion_costs(up, pods) == {}


def test_a_pod_without_fresh_metrics_freezes_scale_down_but_not_scale_up():
    """aibrix #1032: one pod without metrics blocked all scaling."""
    stale = Pod("s", "unified", "ready", -1000.0, scraped_at=900.0, load=PodLoad(running=4, slots=4))
    missing = Pod("m", "unified", "ready", -1000.0)
    for silent in (stale, missing):
        idle = [ready("a", 0.1, at=1000.0), ready("b", 0.1, at=1000.0), silent]
        d = decide(idle, {"unified": 3}, policy(), quiet_history(1000.0, 1), 1000.0)
        assert d.desired == {"unified": 3}
        assert d.reasons["unified"] == "scale-down frozen: 1 pod(s) without fresh metrics"
        busy = [ready("a", 2.0, at=1000.0), ready("b", 2.0, at=1000.0), silent]
        d = decide(busy, {"unified": 3}, policy(), quiet_history(1000.0, 1), 1000.0)
        assert d.desired == {"unified": 6} and d.act  # 4 pods of work measured on the two that report
        assert d.signals["unified"]["stale"] == 1


def test_a_scale_up_stuck_pending_is_reported_does_not_block_scale_down_and_is_not_retried():
    """Dynamo #14251: scale-down blocked forever behind a Pending pod."""
    p = policy(pending_deadline=600.0, stuck_retry=1800.0)
    stuck = Pod("x", "unified", "pending", 0.0)
    busy = [ready("a", 1.5, at=700.0), ready("b", 1.5, at=700.0), stuck]
    d = decide(busy, {"unified": 3}, p, quiet_history(700.0, 3), 700.0)
    assert d.stuck == {"unified": 1}
    assert d.desired == {"unified": 3} and not d.act  # 4 pods of work, but no retry past the stuck one
    assert "1 pod(s) Pending past the deadline: waiting for capacity" in d.reasons["unified"]
    assert d.history.stuck_until == {"unified": 700.0 + 1800.0}
    # the load falls: the stuck pod does not hold the scale-down (it goes first)
    calm = [ready("a", 0.3, at=1100.0), ready("b", 0.3, at=1100.0), stuck]
    history = History(quiet_history(1100.0, 1).demands, -1000.0, 1100.0, d.history.stuck_until)
    down = decide(calm, {"unified": 3}, p, history, 1100.0)
    assert down.desired == {"unified": 1} and down.act  # 0.6 on one pod <= 0.675
    assert down.reasons["unified"].startswith("scale down 3 -> 1")
    # the load rises again within stuck_retry: no new scale-up into the same lack of capacity
    again = decide([ready("a", 1.5, at=1200.0)], {"unified": 1}, p, down.history, 1200.0)
    assert again.desired == {"unified": 1} and not again.act
    assert "no scale-up past the serving pods until 2900" in again.reasons["unified"]  # 1100 + 1800
    # and after stuck_retry it is tried again, once
    retry = decide([ready("a", 1.5, at=3000.0)], {"unified": 1}, p, again.history, 3000.0)
    assert retry.desired == {"unified": 2} and retry.act


# ---- scale to zero and back ----


def test_scale_to_zero_after_the_idle_period_and_back_at_once_on_held_requests():
    roles = {"unified": RolePolicy(min=0, max=4, signal="occupancy", target=0.75)}
    p = policy(roles=roles, scale_to_zero=True, idle=600.0)
    early = decide(
        [ready("a", 0.0, at=500.0)],
        {"unified": 1},
        p,
        History(quiet_history(500.0, 0).demands, -1000.0, 0.0),
        500.0,
    )
    assert early.desired == {"unified": 1}  # idle 500 s < 600 s
    late = decide(
        [ready("a", 0.0, at=700.0)],
        {"unified": 1},
        p,
        History(quiet_history(700.0, 0).demands, -1000.0, 0.0),
        700.0,
    )
    assert late.desired == {"unified": 0} and late.act
    assert late.reasons["unified"] == "idle for 700s >= 600s: scale to zero"
    # at zero: held requests at the front door scale up at once, no window, no stabilisation
    back = decide([], {"unified": 0}, p, late.history, 701.0, held=3)
    assert back.desired == {"unified": 1} and back.act
    assert back.reasons["unified"] == "requests held at the front door (3) with no replica: scale up at once"
    many = decide([], {"unified": 0}, p, late.history, 701.0, held=9)
    assert many.desired == {"unified": 3}  # 9 held requests on 4-slot pods at 0.75: ceil(2.25 / 0.75)


@pytest.mark.parametrize("signal, target", [("kv", 0.8), ("ttft", 1.0), ("itl", 0.05)])
def test_held_requests_scale_up_from_zero_whatever_the_signal(signal, target):
    """Signals that held requests do not add to (KV use, latencies: no pod, no sample) still get one pod."""
    roles = {"unified": RolePolicy(min=0, max=4, signal=signal, target=target)}
    p = policy(roles=roles, scale_to_zero=True, idle=600.0)
    assert decide([], {"unified": 0}, p, History(since=0.0), 2000.0, held=1).desired == {"unified": 1}
    assert decide([], {"unified": 0}, p, History(since=0.0), 2000.0, held=0).desired == {"unified": 0}


def test_without_scale_to_zero_an_idle_model_keeps_one_replica():
    d = decide([ready("a", 0.0, at=5000.0)], {"unified": 1}, policy(), quiet_history(5000.0, 0), 5000.0)
    assert d.desired == {"unified": 1}


# ---- prefill and decode together ----


@pytest.mark.parametrize(
    "prefill_waiting, decode_occupancy, ratio, desired",
    [
        ([6.0], [0.5, 0.5], None, {"prefill": 3, "decode": 2}),  # each on its own signal
        ([1.0], [1.0] * 4, (0.5, 2.0), {"prefill": 3, "decode": 6}),  # decode 6 needs prefill >= 3
        ([16.0], [0.5, 0.5], (0.5, 2.0), {"prefill": 8, "decode": 4}),  # prefill 8 needs decode >= 4
        ([1.0], [0.5, 0.5], (0.5, 2.0), {"prefill": 1, "decode": 2}),  # within bounds: unchanged
    ],
)
def test_prefill_and_decode_are_decided_together_within_the_ratio(prefill_waiting, decode_occupancy, ratio,
                                                                  desired):  # fmt: skip
    pods = [Pod(f"p{i}", "prefill", "ready", -1000.0, 0.0, PodLoad(waiting=w, slots=4))
            for i, w in enumerate(prefill_waiting)]  # fmt: skip
    pods += [ready(f"d{i}", o, role="decode") for i, o in enumerate(decode_occupancy)]
    current = {"prefill": len(prefill_waiting), "decode": len(decode_occupancy)}
    d = decide(pods, current, policy(roles=PD, ratio=ratio), History(), 0.0)
    assert d.desired == desired
    if ratio and desired != {"prefill": 1, "decode": 2}:
        raised = "prefill" if desired["prefill"] * 2 == desired["decode"] else "decode"
        assert "to keep prefill:decode" in d.reasons[raised]


def test_latency_signals_scale_prefill_on_ttft_and_decode_on_itl():
    roles = {
        "prefill": RolePolicy(min=1, max=8, signal="ttft", target=1.0),
        "decode": RolePolicy(min=1, max=8, signal="itl", target=0.05),
    }
    pods = [
        Pod("p0", "prefill", "ready", -1000.0, 0.0, PodLoad(ttft_p90=2.5, slots=4)),
        Pod("p1", "prefill", "ready", -1000.0, 0.0, PodLoad(ttft_p90=1.2, slots=4)),
        Pod("d0", "decode", "ready", -1000.0, 0.0, PodLoad(itl_p90=0.04, slots=4)),
    ]
    d = decide(pods, {"prefill": 2, "decode": 1}, policy(roles=roles), History(), 0.0)
    assert d.desired == {"prefill": 5, "decode": 1}  # the worst p90 2.5 s on 2 pods against 1 s: ceil(5.0)
    assert d.signals["prefill"]["load"] == pytest.approx(2.5)


# ---- dry run ----


def test_dry_run_computes_and_reports_but_does_not_act():
    pods = [ready("a", 1.5), ready("b", 1.5)]
    d = decide(pods, {"unified": 2}, policy(dry_run=True), History(), 0.0)
    assert d.desired == {"unified": 4} and d.changed and not d.act
    assert d.reasons["unified"].startswith("scale up 2 -> 4")
    assert d.history.last == {"unified": (0.0, 2, 4)}


# ---- /metrics -> signals ----

EXPOSITION = """\
# HELP vllm:num_requests_waiting Requests waiting for a slot.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="other"} 99.0
vllm:num_requests_running{model_name="m"} 2.0
neuronfleet:slots_busy{model_name="m"} 2.0
vllm:kv_cache_usage_perc{model_name="m",note="a \\"quoted\\" \\\\ value"} 0.25 1712345678000
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 4.2
"""


def test_an_exposition_is_read_into_one_models_signals():
    scrape = pod_metrics.read(EXPOSITION, "m")
    load = pod_metrics.load(scrape, None, slots=4)
    assert (load.waiting, load.running, load.kv_usage) == (3.0, 2.0, 0.25)
    assert load.occupancy == pytest.approx(5 / 4)
    # the 9th of 10 observations lies in (0.5, 1.0], which holds 4: 0.5 + 0.5 * (9 - 6) / 4
    assert load.ttft_p90 == pytest.approx(0.875)
    assert load.itl_p90 is None and load.requests == 10.0
    assert pod_metrics.parse(EXPOSITION)[4].labels["note"] == 'a "quoted" \\ value'


def test_latency_p90_is_over_the_window_between_two_scrapes():
    earlier = Histogram(((0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (float("inf"), 10.0)), 10.0, 4.2)
    later = Histogram(((0.1, 12.0), (0.5, 16.0), (1.0, 20.0), (float("inf"), 20.0)), 20.0, 5.0)
    window = later.minus(earlier)
    assert window.count == 10.0 and window.buckets[0] == (0.1, 10.0)
    assert window.quantile(0.9) == pytest.approx(0.09)  # all 10 new ones are fast: 0.1 * 9 / 10
    assert later.quantile(0.9) == pytest.approx(0.75)  # since the start the slow ones still weigh in
    restarted = Histogram(((0.1, 1.0), (0.5, 1.0), (1.0, 1.0), (float("inf"), 1.0)), 1.0, 0.05)
    assert restarted.minus(earlier) == restarted  # a counter reset: the window is the new pod's content
    assert Histogram(((float("inf"), 3.0),), 3.0, 9.0).quantile(0.9) == 0.0  # only +Inf: no finite bound
    assert earlier.minus(earlier).quantile(0.9) is None  # nothing observed in the window


@pytest.mark.parametrize(
    "text, message",
    [
        ("vllm:num_requests_waiting{model_name=m} 1", "bad label set"),
        ("vllm:num_requests_waiting many", "value 'many' is not a number"),
        ("{} 1", "line 1 is not a sample"),
    ],
)
def test_a_body_that_is_not_prometheus_text_says_where(text, message):
    with pytest.raises(MetricsError, match=message):
        pod_metrics.parse(text)


def test_the_names_read_are_the_ones_the_runtime_exports(smollm2_dir):
    """A real engine's /metrics registry (server.Metrics over an AsyncEngine, with the role queue of a prefill
    pod) rendered as the server renders it, read back by the operator's reader."""
    from prometheus_client import generate_latest

    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import AsyncEngine, Engine
    from neuronfleet.runtime.kv.roles import KVMetrics
    from neuronfleet.runtime.serving.server import Metrics

    engine = Engine.from_model_dir(
        str(smollm2_dir), RuntimeConfig(slots=4, max_seq_len=128, prefill_buckets=[64])
    )
    with AsyncEngine(lambda: engine) as backend:
        metrics = Metrics(backend, "m")
        role_queue = KVMetrics(metrics.registry, "m", role="prefill")
        role_queue.queued = 5
        for seconds in (0.03, 0.03, 0.3, 3.0):
            metrics.ttft.observe(seconds)
        scrape = pod_metrics.read(generate_latest(metrics.registry).decode(), "m")
    exported = set(scrape.gauges)
    names = (pod_metrics.WAITING, pod_metrics.RUNNING, pod_metrics.KV_USAGE, pod_metrics.SLOTS_BUSY)
    assert exported == {*names, pod_metrics.ROLE_QUEUE}
    assert set(scrape.histograms) == {pod_metrics.TTFT, pod_metrics.ITL}
    load = pod_metrics.load(scrape, None, slots=4)
    assert (load.waiting, load.running, load.kv_usage, load.requests) == (5.0, 0.0, 0.0, 4.0)
    assert 2.0 < load.ttft_p90 <= 5.0  # the 4th of 4 lies in the (2, 5] bucket
