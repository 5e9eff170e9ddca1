"""Scale to zero and back with no request lost, in local mode (the real operator, kubelet, runtime and
`kubectl`): the cpu sample with autoscaling provider builtin, min 0, max 1, scaleToZero, idleSeconds 30 (the
spec's least) and a 30 s scale-down window. It gets a front door (a router Deployment, never scaled to zero,
selected by the model's Service); idle, it goes to zero unified pods (`kubectl get pods` shows none, the
router stays); then a burst of concurrent chat requests through the model's endpoint is held by the front
door, which wakes the operator at once: the autoscaler scales 0 -> 1 (a ScaledUp Event for the requests held
at the front door), the first pod's cold start is measured into status.autoscaling.coldStartSeconds, and every
request of the burst is answered 200. The steps share one model and run in order; the measured times (idle
to zero, wake to decision, cold start, burst answered) are printed.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import yaml
from support import CEILING, ROOT, chat, local_mode, metric

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NAME = "smollm2"
BURST = 8  # concurrent requests at zero: 2 batches of the pod's 4 slots, all held, all answered
# max 1: the one scale-up is the one from zero (its decision and its cold start are the status' last ones)
IDLE = 30  # autoscaling.idleSeconds (the spec's least)
WINDOW = 30  # scaleDown.stabilizationSeconds
LABEL = f"neuronfleet.dev/model={NAME}"

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with local_mode(tmp_path_factory.mktemp("local")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    out: dict[str, float] = {}
    yield out
    print("\nscale to zero, measured: " + ", ".join(f"{k} {v:.1f}s" for k, v in out.items()))


def model(local) -> dict:
    return local.get("nm", NAME)


def auto(local) -> dict:
    return (model(local).get("status") or {}).get("autoscaling") or {}


def pods(local, role: str) -> list[dict]:
    items = local.get("pods", "-l", f"{LABEL},neuronfleet.dev/role={role}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def at(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_a_model_that_may_scale_to_zero_serves_through_its_front_door(local):
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["spec"]["autoscaling"] = {
        "enabled": True, "provider": "builtin", "min": 0, "max": 1, "scaleToZero": True, "idleSeconds": IDLE,
        "metric": "queue", "target": 1, "scaleDown": {"stabilizationSeconds": WINDOW},
    }  # fmt: skip
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    local.wait("Ready", lambda: (model(local).get("status") or {}).get("phase") == "Ready")
    status = model(local)["status"]
    assert set(status["replicas"]) == {"unified", "router"}, status["replicas"]
    service = local.get("service", NAME)
    assert service["spec"]["selector"]["neuronfleet.dev/role"] == "router"  # the front door is the endpoint
    assert chat(status["endpoint"], NAME, 4)[0] == 200  # through the router to the unified pod


def test_idle_it_goes_to_zero_unified_pods_and_the_router_stays(local, measured):
    started = time.monotonic()
    local.wait("the scale to zero", lambda: (auto(local).get("desired") or {}).get("unified") == 0)
    measured["idle to the decision"] = time.monotonic() - started
    down = auto(local)["lastScale"]
    assert (down["from"], down["to"]) == ({"unified": 1}, {"unified": 0}), down
    assert "scale to zero" in down["reason"], down
    local.wait("no unified pod", lambda: not pods(local, "unified"))
    shown = local.kubectl("get", "pods", "-l", f"{LABEL},neuronfleet.dev/role=unified")
    assert "No resources found" in shown.stdout + shown.stderr, shown.stdout
    (router,) = pods(local, "router")
    ready = {c["type"]: c["status"] for c in router["status"]["conditions"]}
    assert ready["Ready"] == "True", router["status"]  # the front door takes requests at zero
    # The deleted pod still serves through its preStop sleep, and the front door sends it requests until it
    # resolves the Service again without it (as on a real cluster): at zero once none is in its rotation.
    endpoint = model(local)["status"]["endpoint"]
    in_rotation = {"model_name": NAME, "role": "unified"}
    local.wait(
        "the front door at zero",
        lambda: metric(endpoint, "neuronfleet:router_peers_healthy", **in_rotation) == 0,
    )
    assert local.get("deployment", f"{NAME}-unified")["spec"]["replicas"] == 0
    assert model(local)["status"]["phase"] == "Ready"


def test_a_burst_at_zero_is_held_then_every_request_is_answered(local, measured):
    endpoint = model(local)["status"]["endpoint"]
    answers: list[int] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            status, text = chat(
                endpoint, NAME, 8, CEILING
            )  # held through the cold start: answered late is answered
            with lock:
                answers.append(status if text else -1)
        except Exception as e:  # every failure is counted and reported
            with lock:
                failures.append(repr(e))

    sent = time.time()
    threads = [threading.Thread(target=one, daemon=True) for _ in range(BURST)]
    for t in threads:
        t.start()
    local.wait("the scale-up from zero", lambda: (auto(local).get("desired") or {}).get("unified") == 1)
    measured["burst to the scale-up (as kubectl sees it)"] = time.time() - sent
    local.wait("the burst's answers", lambda: len(answers) + len(failures) == BURST)
    answered = time.time() - sent
    assert not failures, failures
    assert answers == [200] * BURST, answers  # none lost
    up = auto(local)["lastScale"]
    assert (up["from"], up["to"]) == ({"unified": 0}, {"unified": 1}), up
    assert "requests held at the front door" in up["reason"], up
    events = local.kubectl("get", "events").stdout
    assert "ScaledUp" in events and "requests held at the front door" in events, events
    cold = local.wait("the measured cold start", lambda: auto(local).get("coldStartAt") and auto(local))
    # the cold start runs to the pod's Ready condition, which its readiness probe (every 5 s) may set after
    # the front door's own probe (every 0.5 s) has already released the held requests to it
    assert 0 < cold["coldStartSeconds"] < answered + 5 + 1, cold
    assert at(up["at"]) <= at(cold["coldStartAt"]), (up, cold)
    measured["cold start"] = cold["coldStartSeconds"]
    measured["burst answered"] = answered
