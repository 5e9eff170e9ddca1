"""The process kubelet's pure parts: how a container's command and paths become a local process's, and what
a pod's status says (Neuron device requests recorded, not enforced)."""

from __future__ import annotations

from pathlib import Path

from neuronfleet.localcluster.kubelet import template_hash
from neuronfleet.localcluster.processes import LocalPod, map_path, pod_status, rewrite_command


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


def test_a_new_template_is_a_new_hash():
    a = {"metadata": {"labels": {"x": "1"}}, "spec": {"containers": [{"name": "c", "command": ["a"]}]}}
    b = {"metadata": {"labels": {"x": "1"}}, "spec": {"containers": [{"name": "c", "command": ["b"]}]}}
    assert template_hash(a) == template_hash(dict(a)) != template_hash(b)


def test_device_requests_are_recorded_not_enforced(tmp_path):
    limits = {"aws.amazon.com/neuroncore": "8", "vpc.amazonaws.com/efa": "1", "memory": "1Gi"}
    pod = {"spec": {"containers": [{"name": "server", "image": "img", "resources": {"limits": limits}}]}}
    local = LocalPod("ns", "p", "uid", tmp_path, tmp_path / "log", {}, {}, restart_always=True)
    status = pod_status(pod, local)
    (devices,) = [c for c in status["conditions"] if c["type"] == "DevicesEnforced"]
    assert devices["status"] == "False" and "aws.amazon.com/neuroncore=8" in devices["message"]
    assert "vpc.amazonaws.com/efa=1" in devices["message"] and "memory" not in devices["message"]
    assert status["phase"] == "Pending" and status["containerStatuses"][0]["restartCount"] == 0
