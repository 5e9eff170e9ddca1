"""Provider builtin, the pure parts of the operator's side: spec.autoscaling as the decision's Policy, the
replicas the builders use (status.autoscaling.desired, within the spec's bounds), the AutoscalingActive
condition, and how the tick loop reads pods (state) and EndpointSlices (where each pod's /metrics is)."""

from __future__ import annotations

import copy

import pytest
import yaml
from support import ROOT

from neuronfleet.operator import autoscale_loop, autoscaler, builders, crd, scaling, status, validation

OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())


UNIFIED = load("smollm2-135m-local-cpu.yaml")
DISAGGREGATED = load("smollm2-135m-local-cpu-disaggregated.yaml")


def parsed(base: dict, **autoscaling):
    obj = copy.deepcopy(base)
    obj["metadata"]["name"] = "m"
    obj["spec"]["autoscaling"] = autoscaling
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def test_a_unified_policy_says_what_the_spec_says():
    spec = parsed(
        UNIFIED, enabled=True, min=1, max=3, metric="queue", target=1,
        scaleUp={"stabilizationSeconds": 5}, scaleDown={"stabilizationSeconds": 30}, dryRun=True,
    )  # fmt: skip
    p = scaling.policy(spec)
    assert p.roles == {"unified": autoscaler.RolePolicy(1, 3, "queue", 1.0)}
    assert (p.scale_up_window, p.scale_down_window, p.dry_run) == (5.0, 30.0, True)
    assert p.slots == spec.neuron.batchSize and p.ratio is None and not p.scale_to_zero


def test_ttft_is_the_slo_in_seconds_and_scale_to_zero_takes_min_0_and_idle_seconds():
    spec = parsed(UNIFIED, enabled=True, min=0, max=2, metric="ttft", ttftSLOMilliseconds=1500,
                  scaleToZero=True, idleSeconds=120)  # fmt: skip
    p = scaling.policy(spec)
    assert p.roles["unified"] == autoscaler.RolePolicy(0, 2, "ttft", 1.5)
    assert (p.scale_to_zero, p.idle) == (True, 120.0)
    assert scaling.policy(parsed(UNIFIED, enabled=True, min=0, max=2, scaleToZero=True)).idle == 300.0


def test_a_disaggregated_policy_decides_prefill_on_its_queue_and_decode_on_occupancy_within_the_ratio():
    spec = parsed(
        DISAGGREGATED, enabled=True, min=1, max=4, metric="occupancy", target=0.5,
        prefill={"min": 1, "max": 2}, prefillDecodeRatio={"min": 0.5, "max": 1},
    )  # fmt: skip
    p = scaling.policy(spec)
    assert p.roles["decode"] == autoscaler.RolePolicy(1, 4, "occupancy", 0.5)
    assert p.roles["prefill"] == autoscaler.RolePolicy(1, 2, "queue", 2.0)  # the queue's default target
    assert p.ratio == (0.5, 1.0)


def test_the_decided_replicas_are_status_autoscaling_desired_within_the_bounds():
    spec = parsed(UNIFIED, enabled=True, min=1, max=2, metric="queue", target=1)
    assert scaling.decided_replicas(spec, {}) is None  # nothing decided yet
    assert scaling.decided_replicas(spec, {"autoscaling": {"desired": {"unified": 2}}}) == {"unified": 2}
    assert scaling.decided_replicas(spec, {"autoscaling": {"desired": {"unified": 7}}}) == {"unified": 2}
    assert scaling.decided_replicas(spec, {"autoscaling": {"desired": {"decode": 2}}}) is None  # other roles
    hpa = parsed(UNIFIED, enabled=True, provider="hpa", min=1, max=2)
    assert scaling.decided_replicas(hpa, {"autoscaling": {"desired": {"unified": 2}}}) is None
    assert not scaling.builtin(parsed(UNIFIED, enabled=False))
    # dry run: decisions are recorded, the spec's replicas run
    dry = parsed(UNIFIED, enabled=True, min=1, max=2, dryRun=True)
    assert scaling.decided_replicas(dry, {"autoscaling": {"desired": {"unified": 2}}}) is None


def test_the_builders_run_the_decided_replicas_and_nothing_else_changes():
    spec = parsed(UNIFIED, enabled=True, min=1, max=3, metric="queue", target=1)
    scaled = scaling.with_replicas(spec, {"unified": 3})
    assert builders.serving_roles(scaled) == {"unified": 3, "router": 1}  # (its kv-aware front door)
    assert builders.compile_hash(scaled) == builders.compile_hash(spec)  # no compile, no roll of the set
    assert scaling.with_replicas(spec, None) is spec
    dis = parsed(DISAGGREGATED, enabled=True, min=1, max=4)
    roles = builders.serving_roles(scaling.with_replicas(dis, {"prefill": 2, "decode": 3}))
    assert (roles["prefill"], roles["decode"]) == (2, 3)


def test_start_replicas_are_the_spec_s_within_the_bounds():
    spec = parsed(UNIFIED, enabled=True, min=2, max=3)
    assert scaling.start_replicas(spec) == {"unified": 2}  # the sample says 1


def test_autoscaling_active_says_builtin_or_dry_run():
    builtin = status.autoscaling_condition([], 3, "2026-01-01T00:00:00Z", None, "Builtin")
    assert (builtin["status"], builtin["reason"]) == ("True", "Builtin")
    dry = status.autoscaling_condition([], 3, "2026-01-01T00:00:00Z", None, "DryRun")
    assert (dry["status"], dry["reason"]) == ("True", "DryRun") and "lastDecision" in dry["message"]


def test_the_crd_keeps_what_the_autoscaler_writes_in_status():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    auto = schema["properties"]["status"]["properties"]["autoscaling"]["properties"]
    assert set(auto) == {
        "desired",
        "lastScale",
        "lastDecision",
        "stuck",
        "coldStartSeconds",
        "coldStartAt",
        "specReplicas",
    }
    assert auto["coldStartSeconds"]["type"] == "number" and auto["coldStartAt"]["type"] == "string"
    assert {"from", "to", "reason", "at", "signals"} <= set(auto["lastScale"]["properties"])


@pytest.mark.parametrize(
    "pod_status,state",
    [
        ({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}, "ready"),
        ({"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}, "starting"),
        (
            {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
            },
            "pending",
        ),
        ({"phase": "Pending"}, "starting"),
    ],
)
def test_a_pod_s_state_for_the_decision(pod_status, state):
    assert autoscale_loop.pod_state({"status": pod_status}) == state


def test_each_ready_pod_s_metrics_address_comes_from_the_endpoint_slices():
    def slice_(pod, host, port, ready=True):
        return {
            "ports": [{"name": "http", "port": port}],
            "endpoints": [
                {
                    "addresses": [host],
                    "conditions": {"ready": ready},
                    "targetRef": {"kind": "Pod", "name": pod},
                }
            ],
        }

    found = autoscale_loop.addresses(
        [slice_("a", "10.0.0.5", 8080), slice_("b", "fd00::5", 8080), slice_("c", "10.0.0.6", 8080, False)]
    )
    assert found == {"a": "10.0.0.5:8080", "b": "[fd00::5]:8080"}


def test_timestamps_read_as_the_api_server_writes_them():
    assert autoscale_loop.seconds("1970-01-01T00:01:40Z") == 100.0
    assert autoscale_loop.iso(100.0) == "1970-01-01T00:01:40Z"
    assert autoscale_loop.seconds(None) is None


def test_scale_to_zero_with_the_builtin_provider_is_accepted_and_hpa_still_refused():
    """The front door holds requests at zero and wakes the autoscaler, so builtin may scale to zero; an HPA
    still cannot (its minReplicas is at least 1)."""
    obj = copy.deepcopy(UNIFIED)
    obj["metadata"]["name"] = "m"
    obj["spec"]["autoscaling"] = {"enabled": True, "min": 0, "max": 2, "scaleToZero": True}
    assert validation.check(obj).ok, validation.check(obj).errors
    obj["spec"]["replicas"] = 1
    obj["spec"]["autoscaling"]["provider"] = "hpa"
    assert any("hpa cannot scale to zero" in e for e in validation.check(obj).errors)


def test_the_measured_cold_start_is_the_policys_lead():
    spec = parsed(UNIFIED, enabled=True, min=0, max=2, scaleToZero=True)
    assert scaling.policy(spec).cold_start == 0.0
    assert scaling.policy(spec, cold_start=42.5).cold_start == 42.5


def test_a_cold_start_runs_from_the_scale_up_to_the_first_new_pod_ready():
    pod = lambda name, state, since, role="unified": autoscaler.Pod(name, role, state, since)  # noqa: E731
    known = frozenset({"old"})
    # nothing new ready yet: the old pod, a new one still loading, a new one of another role
    waiting = [pod("old", "ready", 5.0), pod("new-1", "starting", 101.0), pod("r", "ready", 102.0, "prefill")]
    assert autoscale_loop.cold_start(100.0, known, "unified", waiting) is None
    # the first new pod ready ends it, at its ready time (not the tick's)
    ready = [*waiting[:2], pod("new-2", "ready", 137.5), pod("new-3", "ready", 150.0)]
    assert autoscale_loop.cold_start(100.0, known, "unified", ready) == (37.5, 137.5)


def test_a_pods_ready_time_is_its_ready_conditions_when_it_has_one():
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "1970-01-01T00:01:40Z"}
    assert autoscale_loop.ready_at({"status": {"conditions": [ready]}}) == 100.0
    assert autoscale_loop.ready_at({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}) is None
    assert autoscale_loop.ready_at({"status": {"conditions": [{**ready, "status": "False"}]}}) is None


def test_the_autoscalers_interval_is_the_operators_setting_and_a_bad_one_is_refused_saying_what_is_right():
    assert scaling.tick_seconds({}) == scaling.TICK_SECONDS
    assert scaling.tick_seconds({scaling.TICK_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match=r"number of seconds above 0, e\.g\. 15"):
            scaling.tick_seconds({scaling.TICK_ENV: bad})
