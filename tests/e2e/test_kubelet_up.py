"""`neuronfleet up` in the foreground stops everything it started when it gets SIGTERM or SIGHUP, as on
Ctrl-C: the API server, the operator and every pod process are gone, and the state folder says stopped. While
it runs, it is closed to other users: the state folder is 0700, what holds a secret in it 0600 (a pod's
Secret volume too), and the API server refuses a request without the kubeconfig's token."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from support import CEILING, HTTP_TIMEOUT, Kubectl, Process, neuronfleet_command

from neuronfleet.localcluster.tls import Access


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_status(state: Path) -> subprocess.CompletedProcess:
    command = [*neuronfleet_command(), "status", "--state", str(state)]
    return subprocess.run(command, capture_output=True, text=True, timeout=CEILING)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


SLEEP = [sys.executable, "-c", "import time; time.sleep(3600)"]
SECRET = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sleeper-key", "namespace": "default"},
          "data": {"key": "czNjcmV0"}}  # fmt: skip
SLEEPER = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "sleeper", "namespace": "default"},
    "spec": {
        "replicas": 1,
        "selector": {"matchLabels": {"app": "sleeper"}},
        "template": {
            "metadata": {"labels": {"app": "sleeper"}},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "python",
                        "command": SLEEP,
                        "volumeMounts": [{"name": "key", "mountPath": "/var/run/key"}],
                    }
                ],
                "volumes": [{"name": "key", "secret": {"secretName": "sleeper-key"}}],
            },
        },
    },
}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_up_in_the_foreground_stops_all_it_started_on(sig, tmp_path):
    state = tmp_path / "state"
    up = Process([*neuronfleet_command(), "up", "--state", str(state)], tmp_path / "up.log")
    try:
        up.wait_until(lambda: "running in the foreground" in up.output(), "up to run in the foreground")
        pids = json.loads((state / "pids.json").read_text())
        assert set(pids) == {"apiserver", "operator"} and all(alive(p) for p in pids.values())
        kubectl = Kubectl(state / "kubeconfig", state / "kubectl-cache")
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([SECRET, SLEEPER]))
        pid_files = lambda: list((state / "node" / "pods").glob("default_sleeper-*/pid"))  # noqa: E731
        up.wait_until(lambda: pid_files() and pid_files()[0].read_text(), "the pod's process")
        pod = int(pid_files()[0].read_text())
        assert alive(pod)
        # closed to other users of the machine: no way in without the token, nothing of it readable
        api = Access.read(state / "kubeconfig")
        request = urllib.request.Request(api.url + "/api/v1/secrets")  # (the CA trusted, no token)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=api.context)
        assert refused.value.code == 401 and json.loads(refused.value.read())["reason"] == "Unauthorized"
        up.wait_until(lambda: (state / "objects.json").exists(), "the objects' snapshot")
        assert mode(state) == 0o700
        for private in ("kubeconfig", "tokens.csv", "apiserver.key", "objects.json", "logs/operator.log",
                        "logs/apiserver.log"):  # fmt: skip
            assert mode(state / private) == 0o600, private
        volume = pid_files()[0].parent / "volumes" / "key"
        assert (
            mode(volume) == 0o700
            and mode(volume / "key") == 0o600
            and (volume / "key").read_text() == "s3cret"
        )
        for folder in ("node", "node/pods", "node/logs", "node/volumes"):
            assert mode(state / folder) == 0o700, folder
        listed = run_status(state)
        assert listed.returncode == 0, listed.stderr
        (line,) = [line for line in listed.stdout.splitlines() if "default_sleeper-" in line]
        assert (Path(line.split(" logs ")[1]) / "0.log").is_file()  # where the pod's log is, as it says

        up.signal(sig)
        assert up.wait() == 0, up.output()
    finally:
        if up.poll() is None:
            up.kill()
    left = {name: pid for name, pid in {**pids, "pod": pod}.items() if alive(pid)}
    assert not left, f"still running after {sig.name}: {left}\n{up.output()}"
    assert f"{sig.name}: stopping" in up.output()
    assert not (state / "pids.json").exists() and not (state / "url").exists()
    status = run_status(state)
    assert status.returncode != 0 and "no local fleet" in status.stderr + status.stdout


def test_a_second_signal_does_not_cut_the_clean_up_short(tmp_path: Path):
    """A second SIGTERM while stopping does not cut the clean-up short."""
    state = tmp_path / "state"
    up = Process([*neuronfleet_command(), "up", "--state", str(state)], tmp_path / "up.log")
    try:
        up.wait_until(lambda: "running in the foreground" in up.output(), "up to run in the foreground")
        pids = json.loads((state / "pids.json").read_text())
        up.signal(signal.SIGTERM)
        up.wait_until(lambda: "SIGTERM: stopping" in up.output(), "up to begin stopping")
        up.signal(signal.SIGTERM)
        assert up.wait() == 0, up.output()
    finally:
        if up.poll() is None:
            up.kill()
    assert not [pid for pid in pids.values() if alive(pid)], up.output()
