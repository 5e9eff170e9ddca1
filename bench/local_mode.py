"""What the local-mode benchmarks (autoscale_load.py, dashboard_snapshot.py) share: `neuronfleet` commands
from the project's environment, one local mode's API server and kubectl, and a main's common start
(matplotlib present, `--plot-only`, SIGTERM ending the run as Ctrl-C does, so that it cleans up)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronfleet.localcluster.tls import Access

ROOT = Path(__file__).resolve().parent.parent
NEURONFLEET = ROOT / ".venv" / "bin" / "neuronfleet"  # (the benchmarks run in bench/.venv-llamacpp)
RESULTS = ROOT / "bench" / "results"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


def neuronfleet(*args: str, env: dict[str, str] | None = None) -> None:
    """A `neuronfleet` command; its failure ends the run, saying what it printed."""
    run = subprocess.run([str(NEURONFLEET), *args], capture_output=True, text=True, timeout=300, env=env)
    if run.returncode:
        raise RuntimeError(f"neuronfleet {' '.join(args)} failed: {run.stderr.strip() or run.stdout.strip()}")


class LocalMode:
    """A local mode's API server (HTTPS, as its kubeconfig reaches it: URL, CA, token) and kubectl against
    its kubeconfig."""

    def __init__(self, state: Path) -> None:
        self.state, self.access = state, Access.read(state / "kubeconfig")

    def api(self, path: str, **query: str) -> dict[str, Any]:
        """GET an API path (`/apis/...`) as JSON."""
        q = "?" + urllib.parse.urlencode(query) if query else ""
        request = urllib.request.Request(self.access.url + path + q, headers=self.access.headers(None))
        with urllib.request.urlopen(request, timeout=10, context=self.access.context) as r:
            return json.loads(r.read())

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        config = ["--kubeconfig", str(self.state / "kubeconfig"), "--cache-dir", str(self.state / "kc")]
        run = subprocess.run(
            [KUBECTL, *config, *args], input=stdin, capture_output=True, text=True, timeout=120
        )
        if run.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {run.stderr.strip() or run.stdout.strip()}")
        return run.stdout

    def get(self, *args: str) -> dict[str, Any]:
        """`kubectl get ARGS -o json`."""
        return json.loads(self.kubectl("get", *args, "-o", "json"))


def start_main(
    parser: argparse.ArgumentParser, args: argparse.Namespace, plot: Callable[[dict, Path], None]
) -> bool:
    """A benchmark main's start: refuses to run without matplotlib; with `--plot-only JSON` draws that
    result's PNG again and returns True (nothing else to do); else makes SIGTERM end the run as Ctrl-C
    does (its `finally` cleans up) and returns False."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(
            "matplotlib is missing: `bash bench/setup_llamacpp.sh`, then bench/.venv-llamacpp/bin/python"
        )
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return True

    def terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    return False
