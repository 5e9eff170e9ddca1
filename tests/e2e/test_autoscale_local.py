"""The built-in autoscaler acts, in local mode (the real operator, kubelet, runtime and `kubectl`): the cpu
sample with autoscaling provider builtin (min 1, max 2, metric queue, target 1 waiting request per replica,
scale-down stabilisation 20 s). Concurrent chat requests beyond its slots make it scale 1 -> 2 (the model's
status.autoscaling and `kubectl get events` say ScaledUp, with the reason and the signal values); once the
load is gone and the window has passed it scales back to 1 (ScaledDown); every request is answered. In dry
run the same load is only recorded (status.autoscaling.lastDecision, a DryRunScale Event). The measured
times (load start to the decision, to the second pod ready; load end to the scale-down) are printed.
"""

from __future__ import annotations

import datetime
import time

import pytest
import yaml
from support import ROOT, ChatLoad, chat, local_mode

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NAME = "smollm2"
WORKERS = 8  # concurrent requests: 4 slots, so about 4 wait (the queue signal), well above target 1
# a request of the load may wait for a whole batch on a busy machine: answered late is answered, so the
# load's requests wait up to CEILING, not HTTP_TIMEOUT (a request lost is a failure, a slow one is not)
# scaleDown.stabilizationSeconds: the load's requests have all finished when it stops (ChatLoad waits for
# them), and a pod scaled down with requests in flight has its grace period to finish them
WINDOW = 20

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with local_mode(tmp_path_factory.mktemp("local")) as cluster:
        yield cluster


def test_load_scales_up_and_idle_scales_back_down(local):
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["spec"]["autoscaling"] = {
        "enabled": True, "provider": "builtin", "min": 1, "max": 2, "metric": "queue", "target": 1,
        "scaleDown": {"stabilizationSeconds": WINDOW},
    }  # fmt: skip
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    model = lambda: local.get("nm", NAME)  # noqa: E731
    auto = lambda: (model().get("status") or {}).get("autoscaling") or {}  # noqa: E731
    local.wait("Ready", lambda: (model().get("status") or {}).get("phase") == "Ready")
    status = model()["status"]
    active = {c["type"]: c for c in status["conditions"]}["AutoscalingActive"]
    assert (active["status"], active["reason"]) == ("True", "Builtin"), active
    endpoint = status["endpoint"]
    assert chat(endpoint, NAME, 4)[1]  # serving

    started = time.monotonic()
    with ChatLoad(endpoint, NAME, WORKERS) as load:
        local.wait("the autoscaler's scale-up", lambda: (auto().get("desired") or {}).get("unified") == 2)
        decided = time.monotonic() - started
        local.wait(
            "2 ready pods",
            lambda: (model()["status"].get("replicas") or {}).get("unified", {}).get("ready") == 2,
        )
        serving = time.monotonic() - started
        # read while the load runs: once it stops, the window may pass and the model scale down meanwhile
        up = auto()["lastScale"]
        label = f"neuronfleet.dev/model={NAME}"
        unified = f"{label},neuronfleet.dev/role=unified"  # (the pods; their kv-aware front door aside)
        replicas = lambda: [d["spec"]["replicas"] for d in local.get("deployments", "-l", unified)["items"]]  # noqa: E731
        assert replicas() == [2]
        events = local.kubectl("get", "events").stdout
    stopped = time.monotonic()
    assert not load.failed, load.failed[:5]
    assert load.answered > 0
    assert (up["from"], up["to"]) == ({"unified": 1}, {"unified": 2}), up
    assert "scale up 1 -> 2: queue" in up["reason"] and up["signals"]["unified"]["load"] > 1.1, up
    assert "ScaledUp" in events and "scale up 1 -> 2" in events, events

    # a light load of kept-alive clients (the official `openai` client, no retries; a plain HTTP/1.1
    # connection) through the scale-down: the pod that goes serves what its open connections send
    # (one request at a time: a load the one pod left takes, which lets the scale-down come)
    with ChatLoad(endpoint, NAME, 1, tokens=4, clients=("openai+kept-alive",), pause=0.5) as light:
        local.wait("the scale-down", lambda: (auto().get("desired") or {}).get("unified") == 1)
        down_after = time.monotonic() - stopped
        down = auto()["lastScale"]
        pods = lambda: local.get("pods", "-l", f"{label},neuronfleet.dev/role=unified")["items"]  # noqa: E731
        local.wait("1 pod left", lambda: replicas() == [1] and len(pods()) == 1)
        answered = light.answered
        local.wait("answers after it", lambda: light.answered >= answered + 2)
    assert not light.failed, light.failed[:5]
    assert (down["from"], down["to"]) == ({"unified": 2}, {"unified": 1}), down
    at = lambda scale: datetime.datetime.fromisoformat(scale["at"].replace("Z", "+00:00"))  # noqa: E731
    assert (at(down) - at(up)).total_seconds() >= WINDOW  # the scale-up's demand held the window
    # the autoscaler is the replicas' only writer: a hand edit is put back, with a Warning that says so (an
    # edit back to the count before the last decision: tests/e2e/test_autoscale_cases.py)
    edit = '{"spec":{"replicas":3}}'
    local.kubectl("patch", "deployment", f"{NAME}-unified", "--type", "merge", "-p", edit)
    reverted = lambda: [  # noqa: E731
        e for e in local.get("events")["items"] if e["reason"] == "ReplicasReverted"
    ]
    event = local.wait("ReplicasReverted", lambda: replicas() == [1] and reverted())[0]
    assert event["type"] == "Warning" and "had replicas 3" in event["message"], event
    assert event["message"].endswith("put back to 1"), event
    assert "ScaledDown" in local.kubectl("get", "events").stdout
    assert chat(endpoint, NAME, 4)[1]  # still serving, on one pod

    # dry run: the same load is decided on and recorded (status, Event), the replicas stay as they are
    manifest["spec"]["autoscaling"]["dryRun"] = True
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    dry = lambda: {c["type"]: c for c in model()["status"]["conditions"]}["AutoscalingActive"]["reason"]  # noqa: E731
    local.wait("AutoscalingActive DryRun", lambda: dry() == "DryRun")
    with ChatLoad(endpoint, NAME, WORKERS) as again:
        recorded = local.wait("a dry-run decision", lambda: auto().get("lastDecision"))
    assert not again.failed, again.failed[:5]
    assert (recorded["from"], recorded["to"]) == ({"unified": 1}, {"unified": 2}), recorded
    assert auto()["desired"] == {"unified": 1} and replicas() == [1]  # nothing acted on
    assert "DryRunScale" in local.kubectl("get", "events").stdout
    print(
        f"\nscale-up: decided {decided:.1f}s after the load started, 2 pods ready after {serving:.1f}s; "
        f"scale-down decided {down_after:.1f}s after the load stopped (window {WINDOW}s); "
        f"{load.answered} requests answered, {len(load.failed)} failed"
    )
