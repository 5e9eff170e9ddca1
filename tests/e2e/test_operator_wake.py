"""The operator's wake endpoint (operator/wake.py), the real operator process against the emulated API server
(no kubelet: the test marks the compile Job complete itself): a model with builtin autoscaling and scaleToZero
gets a front door whose routers are given the operator's wake URL; at zero, a POST to it with the model's
token (from its Secret, as its routers send it) makes the autoscaler decide at once (not at its next 15 s
tick): status.autoscaling says 0 -> 1 for the requests held at the front door, a ScaledUp Event says so, and
the unified Deployment gets its replica. Wakes while one runs or just ran start no other; an unknown model and
a wake without the token are answered as a good wake is, and decide nothing; a flood is 429 with
Retry-After."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, OperatorCluster, free_port

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NAME = "smollm2"
NM = f"/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels/{NAME}"
JOBS = "/apis/batch/v1/namespaces/default/jobs"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"


@pytest.fixture()
def cluster(tmp_path):
    api = OperatorCluster(tmp_path)
    yield api
    api.stop()


def post(url: str, token: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def test_a_wake_scales_a_model_at_zero_up_at_once(cluster):
    api, port = cluster, free_port()
    base = f"http://127.0.0.1:{port}"
    operator = api.start_operator("--wake-port", str(port), "--wake-host", "127.0.0.1", "--wake-url", base)
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["spec"]["autoscaling"] = {
        "enabled": True, "provider": "builtin", "min": 0, "max": 2, "scaleToZero": True, "idleSeconds": 30,
    }  # fmt: skip
    api.call("POST", "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels", manifest)
    listed = lambda: api.call("GET", f"{JOBS}?labelSelector=neuronfleet.dev/model")["items"]  # noqa: E731
    jobs = operator.wait_until(listed, "the compile Job")
    complete = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True", "reason": "Emulated"}]}
    api.call("PATCH", f"{JOBS}/{jobs[0]['metadata']['name']}/status", {"status": complete},
             "application/merge-patch+json")  # fmt: skip
    router = operator.wait_until(lambda: api.call("GET", f"{DEPLOYMENTS}/{NAME}-router"), "the front door")
    command = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--wake-url") + 1] == f"{base}/wake/default/{NAME}"
    assert command[command.index("--unified") + 1] == f"dns://{NAME}-unified:8000"

    # the model at zero, as the autoscaler leaves it after idleSeconds (its only writer: status)
    operator.wait_until(lambda: (api.call("GET", NM).get("status") or {}).get("compileHash"), "compileHash")
    zero = {"status": {"autoscaling": {"desired": {"unified": 0}}}}
    api.call("PATCH", f"{NM}/status", zero, "application/merge-patch+json")
    # (the autoscaler queues the model's reconcile itself; here a touch of the model does)
    api.kubectl("annotate", "neuronmodel", NAME, "test.neuronfleet.dev/at-zero=true")
    operator.wait_until(
        lambda: api.call("GET", f"{DEPLOYMENTS}/{NAME}-unified")["spec"]["replicas"] == 0,
        "0 unified replicas",
    )
    assert api.call("GET", f"{DEPLOYMENTS}/{NAME}-router")["spec"]["replicas"] == 1  # the front door stays

    # the model's token, as its routers read it from the Secret they mount
    secret = api.call("GET", f"/api/v1/namespaces/default/secrets/{NAME}-internal")
    token = base64.b64decode(secret["data"]["token"]).decode()
    accepted = (202, {"wake": "accepted"})
    assert post(f"{base}/wake/default/nosuchmodel")[:2] == accepted  # as for a model that exists
    assert post(f"{base}/wake/default/nosuchmodel", token)[:2] == accepted
    assert post(f"{base}/wake/default/{NAME}")[:2] == accepted  # without the token: nothing done
    assert post(f"{base}/wake/default/{NAME}", "not-the-token")[:2] == accepted
    assert f"wake of default/{NAME}: " not in operator.output()  # no decision ran for any of them
    woken = time.monotonic()
    assert post(f"{base}/wake/default/{NAME}", token)[:2] == accepted
    operator.wait_until(lambda: f"wake of default/{NAME}: started" in operator.output(), "the decision")
    assert post(f"{base}/wake/default/{NAME}", token)[:2] == accepted
    operator.wait_until(lambda: operator.output().count(f"wake of default/{NAME}: ") == 2, "the second wake")
    second = operator.output().rsplit(f"wake of default/{NAME}: ", 1)[1].split()[0]
    assert second in ("running", "recent"), second  # no second decision
    auto = lambda: (api.call("GET", NM).get("status") or {}).get("autoscaling") or {}  # noqa: E731
    scale = operator.wait_until(lambda: auto().get("lastScale"), "the wake's decision")
    decided = time.monotonic() - woken
    assert (scale["from"], scale["to"]) == ({"unified": 0}, {"unified": 1}), scale
    assert "requests held at the front door" in scale["reason"], scale
    assert auto()["desired"] == {"unified": 1}
    operator.wait_until(
        lambda: api.call("GET", f"{DEPLOYMENTS}/{NAME}-unified")["spec"]["replicas"] == 1, "1 unified replica"
    )
    events = api.kubectl("get", "events").stdout
    assert "ScaledUp" in events and "requests held at the front door" in events, events
    # far sooner than the 15 s tick (the wake decided; on a busy machine, a few seconds)
    print(f"\nwake to decision: {decided:.2f}s")
    assert decided < 15.0

    answers = [post(f"{base}/wake/default/{NAME}", token) for _ in range(40)]
    limited = [headers for code, _, headers in answers if code == 429]
    assert limited and all(h.get("Retry-After") == "1" for h in limited), [a[:2] for a in answers]
    assert {code for code, _, _ in answers} <= {202, 429}
