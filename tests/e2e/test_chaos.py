"""Chaos in local mode, with bench/chaos.py's players (the longer run and its figures are that script's):

- the control plane: 300 NeuronModels created, changed and deleted while the leading operator replica (of 3,
  leader election on, lease 4 s, renew deadline 3 s, retry 1 s) is killed with SIGKILL every 15 s, the API
  server is restarted (its objects kept in its data file) and every watch is expired. Every model converges
  (its status at its generation, one compile Job for its hash, its Deployment as its spec says, its Service),
  no child is doubled or left without its owner, no change waits for its reconcile longer than a failover
  plus an API-server restart plus one pass over every model, and the audit log shows no write from a replica
  that did not hold the Lease;
- serving: the real SmolLM2 model under a chat load from the official `openai` client (one, reused, no
  retries), a kept-alive HTTP/1.1 connection and a connection per request, through the leader killed and an
  API-server outage as a restart makes it (every connection dropped, none taken for 5 s, no watch resumable;
  the process kubelet, which runs beside the emulated server, keeps its pods as a node does): not one request
  fails, and nothing is rolled or restarted."""

from __future__ import annotations

import threading
import time

import pytest
from support import ChatLoad, bench_module, wait_until

from neuronfleet.localcluster import local

chaos = bench_module("chaos")

OUTAGE = 5.0  # seconds without the API server: longer than the renew deadline, so the leader steps down
ONE_PASS = 15.0  # seconds a busy 2-core machine may take to reconcile every one of 300 models once (at least)


@pytest.fixture()
def plane(tmp_path):
    plane = chaos.ControlPlane(tmp_path, chaos.Timing(), replicas=3)
    yield plane
    plane.stop()


def test_300_models_converge_through_kills_restarts_and_expired_watches(plane):
    timing = plane.timing
    run = chaos.Chaos(models=300, seconds=75, rate=6, kill_every=15, api_restarts=(35,), watch_expiries=(55,))
    outcome = chaos.run_chaos(plane, run, converge_limit=600)
    summary = outcome.summary()
    print(summary)
    assert not outcome.errors, outcome.errors
    assert not outcome.problems, outcome.problems
    assert not outcome.leaderless, outcome.leaderless[:5]
    # every kill was followed by another replica's leadership; each replica that ended was killed or stepped
    # down (SIGTERM to itself: exit 0), none crashed
    assert len(outcome.kills) >= 4 and all(took is not None for _, _, took in outcome.kills), outcome.kills
    assert {code for _, code in outcome.exits} <= {-9, 0}, outcome.exits
    # no change waited longer than the worst failover (a lease's lapse and a retry), an API-server restart,
    # a step-down after it (a leader that could not renew: another lapse), and one pass over every model (the
    # longest takeover pass of this run, read from the replicas' logs: a loaded machine takes longer; a change
    # a leader dropped would wait for the 600 s resync)
    outage = max(up - down for down, up, _ in outcome.restarts)
    one_pass = max([ONE_PASS, *outcome.passes])
    bound = 2 * (timing.lease + timing.retry) + outage + one_pass
    worst = max(lag for _, lag in outcome.lags)
    assert worst <= bound, (worst, bound, summary)
    # each replica that led wrote; the work was shared out as the leadership moved
    assert len([u for u, n in outcome.operator_writes.items() if n]) >= 3, outcome.operator_writes


def test_a_model_under_chat_load_answers_through_a_failover_and_an_api_server_outage(tmp_path):
    plane = chaos.ControlPlane(tmp_path, chaos.Timing(), replicas=2, kubelet=True)
    stop, errors = threading.Event(), []
    supervisor = chaos.background(plane.supervise, stop, 0.2, errors)
    try:
        local._local_models(plane.access, tmp_path)
        code, body = plane.call("POST", chaos.MODELS, chaos.manifest("smollm2"))
        assert code == 201, body

        def model() -> dict:
            return plane.call("GET", f"{chaos.MODELS}/smollm2")[1]

        def logged() -> int:
            return sum(p.stat().st_size for p in tmp_path.rglob("*.log"))

        def ready() -> bool:
            status = model().get("status") or {}
            return status.get("phase") == "Ready" and status.get("observedGeneration") == 1

        wait_until(ready, "the model Ready", progress=logged, diagnose=plane.logs, interval=0.5)
        endpoint = model()["status"]["endpoint"]
        served = chaos.CHILDREN["Deployment"] + "/smollm2-unified"

        def rolled() -> tuple:
            """What a roll or a restart changes: the Deployment's generation, its pods, their restarts."""
            pods = plane.items(chaos.CHILDREN["Pod"], "neuronfleet.dev/role=unified")
            restarts = [
                c.get("restartCount", 0) for p in pods for c in p["status"].get("containerStatuses", [])
            ]
            return (
                plane.call("GET", served)[1]["metadata"]["generation"],
                sorted(p["metadata"]["uid"] for p in pods),
                restarts,
            )

        before = rolled()
        with ChatLoad(
            endpoint, "smollm2", workers=3, tokens=4, clients=("urllib", "openai", "kept-alive")
        ) as load:

            def answers(more: int, what: str) -> None:
                target = load.answered + more
                wait_until(lambda: load.answered >= target, what, progress=logged, diagnose=plane.logs)

            answers(3, "answers before the chaos")
            leader = plane.holder()
            assert plane.kill(leader)
            wait_until(
                lambda: plane.holder() not in ("", leader), "another replica leading", diagnose=plane.logs
            )
            answers(3, "answers after the failover")

            leading = plane.holder()
            plane.switch(outage=OUTAGE)
            time.sleep(OUTAGE + 0.5)  # (the outage's span: the API server answers nothing meanwhile)
            wait_until(lambda: plane.holder() != "", "a leader after the outage", diagnose=plane.logs)
            wait_until(ready, "the model Ready after the outage", diagnose=plane.logs)
            answers(3, "answers after the outage")
        print(f"answers: {load.by_client}; replicas that ended: {plane.exits}")
        assert not load.failed, load.failed[:5]
        assert all(load.by_client.get(k) for k in ("urllib", "openai", "kept-alive")), load.by_client
        assert rolled() == before
        assert (leading, 0) in plane.exits  # it could not renew for longer than its deadline: it stepped down
        assert not chaos.leaderless_writes(plane.audit())
        assert not errors, errors
    finally:
        stop.set()
        supervisor.join()
        plane.stop()
