"""The process kubelet's pure parts: how a container's command and paths become a local process's, what a
pod's status says (Neuron device requests recorded, not enforced; terminated reasons, the previous instance),
how logs are written and read back under PodLogOptions, and how probe results follow their thresholds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from neuronfleet.contract import KV_EVENTS_CONFIG, KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT
from neuronfleet.localcluster.events import Recorder, reference
from neuronfleet.localcluster.jobs import expired, finished_at
from neuronfleet.localcluster.kubelet import deletion_rank, template_hash
from neuronfleet.localcluster.podlogs import (
    LogOptions,
    cri_line,
    format_time,
    parse_line,
    parse_time,
    select,
)
from neuronfleet.localcluster.probes import Probe, Prober, Streak, Target
from neuronfleet.localcluster.processes import LocalPod, exit_status, map_path, pod_status, rewrite_command
from neuronfleet.localcluster.semantics import ApiError
from neuronfleet.localcluster.store import ClusterClient, Store

POD = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "server", "image": "img"}]}}


def local_pod(tmp_path: Path, policy: str = "Always") -> LocalPod:
    return LocalPod("ns", "p", "uid", tmp_path, tmp_path / "logs", {}, {}, restart_policy=policy)


def test_ports_hosts_and_mounted_paths_are_mapped():
    mounts = [
        ("/var/lib/neuronfleet/cache", Path("/s/volumes/ns/cache")),
        ("/etc/neuronfleet", Path("/s/cm")),
    ]
    command = ["neuronfleet", "serve", "--model", "/var/lib/neuronfleet/cache/artifacts/h/model",
               "--host", "0.0.0.0", "--port", "8000", "--kv-port", "7000", "--slots", "8000",
               "--config=/etc/neuronfleet/compile.json", "/etc/neuronfleetx/other"]  # fmt: skip
    out = rewrite_command(command, {8000: 41000, 7000: 41001}, mounts)
    assert out[0].endswith("neuronfleet") and out[0] != "neuronfleet"  # the installed command
    assert out[1:] == ["serve", "--model", "/s/volumes/ns/cache/artifacts/h/model", "--host", "127.0.0.1",
                       "--port", "41000", "--kv-port", "41001", "--slots", "8000",
                       "--config=/s/cm/compile.json", "/etc/neuronfleetx/other"]  # fmt: skip
    assert map_path("/var/lib/neuronfleet/cache", mounts) == "/s/volumes/ns/cache"
    # a KV-cache event publisher's endpoints: their ports mapped, on the pods' loopback address
    ports = {KV_EVENTS_PORT: 41002, KV_EVENTS_REPLAY_PORT: 41003}
    events = rewrite_command(["x", "--kv-events-config", KV_EVENTS_CONFIG], ports, [])
    assert json.loads(events[2]) == {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:41002",
                                     "replay_endpoint": "tcp://127.0.0.1:41003"}  # fmt: skip


def test_a_new_template_is_a_new_hash():
    a = {"metadata": {"labels": {"x": "1"}}, "spec": {"containers": [{"name": "c", "command": ["a"]}]}}
    b = {"metadata": {"labels": {"x": "1"}}, "spec": {"containers": [{"name": "c", "command": ["b"]}]}}
    assert template_hash(a) == template_hash(dict(a)) != template_hash(b)


def test_device_requests_are_recorded_not_enforced(tmp_path):
    limits = {"aws.amazon.com/neuroncore": "8", "vpc.amazonaws.com/efa": "1", "memory": "1Gi"}
    pod = {"spec": {"containers": [{"name": "server", "image": "img", "resources": {"limits": limits}}]}}
    status = pod_status(pod, local_pod(tmp_path))
    (devices,) = [c for c in status["conditions"] if c["type"] == "DevicesEnforced"]
    assert devices["status"] == "False" and "aws.amazon.com/neuroncore=8" in devices["message"]
    assert "vpc.amazonaws.com/efa=1" in devices["message"] and "memory" not in devices["message"]
    assert status["phase"] == "Pending" and status["containerStatuses"][0]["restartCount"] == 0


# ---- pod status (tests/e2e/test_kubelet_pods.py checks how kubectl prints it) ----


@pytest.mark.parametrize(("code", "phase", "reason"), [(0, "Succeeded", "Completed"), (3, "Failed", "Error")])
def test_a_finished_container_is_completed_or_error_as_the_kubelet_says(tmp_path, code, phase, reason):
    local = local_pod(tmp_path, "Never")
    local.instance, local.exit_code, local.message = 0, code, "why"
    status = pod_status(POD, local)
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert status["phase"] == phase
    assert (terminated["exitCode"], terminated["reason"], terminated["message"]) == (code, reason, "why")


def test_a_restarted_container_keeps_its_count_and_last_state(tmp_path):
    local = local_pod(tmp_path, "Always")
    local.instance, local.exit_code, local.finished_at = 0, 1, "2026-01-01T00:00:00Z"
    local.last_state, local.last_instance, local.restarts = local.terminated(), 0, 1
    local.backoff = 2.0
    status = pod_status(POD, local)
    container = status["containerStatuses"][0]
    assert status["phase"] == "Running" and container["restartCount"] == 1
    assert container["lastState"]["terminated"]["exitCode"] == 1
    assert container["lastState"]["terminated"]["reason"] == "Error"
    assert container["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert (
        "back-off 2s restarting failed container=server pod=p_ns(uid)"
        in container["state"]["waiting"]["message"]
    )


def test_a_signal_is_reported_as_the_runtime_does():
    assert exit_status(-15) == 143 and exit_status(-9) == 137 and exit_status(3) == 3


# ---- logs ----


def test_log_times_are_rfc3339_nano_fixed_and_read_back():
    ns = 1_767_225_600_000_000_010  # 2026-01-01T00:00:00.00000001Z
    assert format_time(ns) == "2026-01-01T00:00:00.000000010Z"
    assert parse_time(format_time(ns)) == ns
    assert parse_time("2026-01-01T00:00:00Z") == 1_767_225_600_000_000_000
    assert parse_time("2026-01-01T01:00:00.5+01:00") == 1_767_225_600_500_000_000
    with pytest.raises(ApiError):
        parse_time("yesterday")


def test_a_cri_line_round_trips():
    line = cri_line("stderr", b"hello world", False, 5)
    assert line == b"1970-01-01T00:00:00.000000005Z stderr F hello world\n"
    entry = parse_line(line)
    assert (entry.at_ns, entry.stream, entry.content) == (5, "stderr", b"hello world\n")
    assert parse_line(cri_line("stdout", b"part", True, 5)).content == b"part"  # a partial line: no newline
    assert parse_line(b"not a log line") is None


def log_of(*lines: tuple[int, str]) -> bytes:
    return b"".join(cri_line("stdout", text.encode(), False, at * 1_000_000_000) for at, text in lines)


LOG = log_of((100, "one"), (101, "two"), (105, "three"), (106, "four"))


def test_tail_since_timestamps_and_limit_as_the_kubelet_applies_them():
    assert select(LOG, LogOptions())[0] == b"one\ntwo\nthree\nfour\n"
    assert select(LOG, LogOptions(tail=2))[0] == b"three\nfour\n"
    assert select(LOG, LogOptions(tail=0))[0] == b""
    assert select(LOG, LogOptions(since_ns=105 * 10**9))[0] == b"three\nfour\n"
    # tail counts the file's lines before since filters them (pkg/kubelet/kuberuntime/logs: ReadLogs)
    assert select(LOG, LogOptions(tail=3, since_ns=106 * 10**9))[0] == b"four\n"
    assert select(LOG, LogOptions(tail=1, timestamps=True))[0] == b"1970-01-01T00:01:46.000000000Z four\n"
    assert select(LOG, LogOptions(limit=6))[0] == b"one\ntw"
    unfinished = LOG + b"1970-01-01T00:01:47.000000000Z stdout F fi"
    out, used = select(unfinished, LogOptions())
    assert out == b"one\ntwo\nthree\nfour\n" and used == len(LOG)  # a line being written is not read yet


def test_log_options_come_from_the_query_and_bad_ones_are_refused():
    options = LogOptions.from_query(
        {"follow": "true", "timestamps": "true", "tailLines": "5", "sinceSeconds": "10", "container": "c"},
        now_ns=100 * 10**9,
    )
    assert (options.follow, options.timestamps, options.tail, options.since_ns) == (True, True, 5, 90 * 10**9)
    assert options.container == "c" and not options.previous
    assert LogOptions.from_query({"sinceTime": "1970-01-01T00:01:40Z"}).since_ns == 100 * 10**9
    for bad in ({"tailLines": "x"}, {"tailLines": "-1"}, {"sinceSeconds": "0"},
                {"sinceSeconds": "1", "sinceTime": "1970-01-01T00:00:00Z"}):  # fmt: skip
        with pytest.raises(ApiError) as refused:
            LogOptions.from_query(bad)
        assert refused.value.code in (400, 422)


# ---- probes and Jobs ----


def test_probe_defaults_are_the_apis():
    probe = Probe.from_spec("readiness", {"httpGet": {"path": "/ready", "port": "http"}})
    assert (probe.period, probe.timeout, probe.initial_delay) == (10.0, 1.0, 0.0)
    assert (probe.success_threshold, probe.failure_threshold) == (1, 3)
    assert Probe.from_spec("liveness", None) is None


def test_a_probe_result_moves_only_after_its_thresholds():
    probe = Probe("readiness", {}, success_threshold=2, failure_threshold=3)
    streak = Streak(probe, False)
    assert [streak.record(ok) for ok in (True, False, True, True)] == [False, False, False, True]
    assert [streak.record(ok) for ok in (False, False, True, False, False, False)] == [
        True, True, True, True, True, False,
    ]  # fmt: skip


def test_a_finished_job_expires_after_its_ttl():
    done = [{"type": "Failed", "status": "True", "lastTransitionTime": "1970-01-01T00:01:40Z"}]
    job = {"spec": {"ttlSecondsAfterFinished": 30}, "status": {"conditions": done}}
    assert not expired(job, 129.9) and expired(job, 130.0)
    assert not expired({"spec": {}, "status": {"conditions": done}}, 1e12)  # no TTL: kept
    assert not expired({"spec": {"ttlSecondsAfterFinished": 0}, "status": {}}, 1e12)  # still running


def test_a_job_finishes_when_its_condition_says():
    job = {"status": {"conditions": [{"type": "Complete", "status": "True",
                                      "lastTransitionTime": "1970-01-01T00:01:40Z"}]}}  # fmt: skip
    assert finished_at(job) == 100.0
    assert finished_at({"status": {"active": 1}}) is None
    failed = {
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "lastTransitionTime": "1970-01-01T00:00:05Z"}]
        }
    }
    assert finished_at(failed) == 5.0
    untimed = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert finished_at(untimed) is None  # the TTL controller never deletes a Job it cannot date


def test_repeated_events_are_counted_on_one_event():
    async def scenario() -> list[dict]:
        cluster = ClusterClient(Store())
        pod = await cluster.create("", "v1", "pods", "default", {"metadata": {"name": "p"}, "spec": {}})
        recorder = Recorder(cluster, "kubelet")
        involved = reference(pod, "spec.containers{main}")
        for _ in range(3):
            recorder.record(
                involved,
                "Warning",
                "Unhealthy",
                "Readiness probe failed: HTTP probe failed with statuscode: 503",
            )
            await recorder.settle()
        recorder.record(involved, "Normal", "Started", "Started container main")
        await recorder.settle()
        return cluster.list("", "v1", "events")

    events = {e["reason"]: e for e in asyncio.run(scenario())}
    assert set(events) == {"Unhealthy", "Started"}
    unhealthy = events["Unhealthy"]
    assert (unhealthy["type"], unhealthy["count"], unhealthy["source"]) == (
        "Warning",
        3,
        {"component": "kubelet", "host": "local"},
    )
    assert unhealthy["involvedObject"]["fieldPath"] == "spec.containers{main}"
    assert unhealthy["involvedObject"]["kind"] == "Pod" and events["Started"]["count"] == 1


async def no_kill(_why: str) -> None:
    """A probe target's `kill` where no container runs."""


def test_a_refused_probe_says_so_in_the_kubelets_words():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario() -> tuple[tuple[bool, str], tuple[bool, str]]:
        target = Target(
            lambda: True, lambda: 0, lambda: 0.0, lambda name: port, "127.0.0.1", no_kill, lambda: None
        )
        prober = Prober({}, target)
        prober.start()
        try:
            http = await prober._check(Probe("readiness", {"httpGet": {"path": "/ready", "port": "http"}}))
            tcp = await prober._check(Probe("liveness", {"tcpSocket": {"port": "http"}}))
        finally:
            await prober.close()
        return http, tcp

    http, tcp = asyncio.run(scenario())
    where = f"127.0.0.1:{port}"
    assert http == (False, f'Get "http://{where}/ready": dial tcp {where}: connect: connection refused')
    assert tcp == (False, f"dial tcp {where}: connect: connection refused")


def _pod(name, *, node="local", phase="Running", ready=True, cost=None, ready_at="2026-01-01T00:00:00Z",
         restarts=0, created="2026-01-01T00:00:00Z"):  # fmt: skip
    meta = {"name": name, "creationTimestamp": created}
    if cost is not None:
        meta["annotations"] = {"controller.kubernetes.io/pod-deletion-cost": cost}
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_at}]
    status = {"phase": phase, "conditions": conditions, "containerStatuses": [{"restartCount": restarts}]}
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status}


@pytest.mark.parametrize(
    "first, second",
    [
        (_pod("a", node=None, phase="Pending", ready=False), _pod("b")),  # unscheduled first
        (_pod("a", phase="Pending", ready=False), _pod("b", phase="Running", ready=False)),
        (_pod("a", ready=False), _pod("b")),  # not ready before ready
        (_pod("a", cost="-5"), _pod("b")),  # the lower deletion cost first
        (_pod("a", cost="3"), _pod("b", cost="10")),
        (_pod("a", cost="not a number"), _pod("b", cost="1")),  # unreadable: 0
        (_pod("a", ready_at="2026-01-01T00:05:00Z"), _pod("b")),  # ready for a shorter time
        (_pod("a", restarts=3), _pod("b")),
        (_pod("a", created="2026-01-01T00:01:00Z"), _pod("b")),  # newer first
        (_pod("a", cost="-1", ready_at="2025-01-01T00:00:00Z"), _pod("b", ready_at="2026-01-01T00:05:00Z")),
    ],
)
def test_a_scale_down_takes_pods_in_the_replicaset_controllers_order(first, second):
    assert sorted([second, first], key=deletion_rank) == [first, second]
    assert sorted([first, second], key=deletion_rank) == [first, second]


def test_closing_a_prober_passes_on_a_cancellation_of_its_caller():
    """The kubelet stopping (its task cancelled) while it closes a pod's prober must stop, not go on as if
    nothing happened (the API server then never exited)."""

    async def scenario() -> asyncio.Task:
        target = Target(
            lambda: True, lambda: 0, lambda: 0.0, lambda name: None, "127.0.0.1", no_kill, lambda: None
        )
        prober = Prober({"readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 60}}, target)
        prober.start()
        await asyncio.sleep(0)  # the probe's worker runs
        closing = asyncio.get_running_loop().create_task(prober.close())
        await asyncio.sleep(0)  # close() has cancelled the worker and waits for it
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        return closing

    assert asyncio.run(scenario()).cancelled()
