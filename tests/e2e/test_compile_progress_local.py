"""Compile progress in local mode (`neuronfleet up`), end to end: while the real compile of the SmolLM2 sample
runs, the real `kubectl get neuronmodels` shows its phase in the Progress column, `kubectl get -o yaml` has
status.compileProgress and the Compiled condition's message carries it; the operator (which only reads the
compile pod's log) writes it at the throttled rate, as every status version a `kubectl get -w` saw says; Ready
clears it.

The operator runs with NEURONFLEET_PROGRESS_SECONDS=3 (default 15, unit-tested in
tests/unit/test_compile_progress.py) so that a compile of a few tens of seconds shows several updates."""

from __future__ import annotations

import calendar
import itertools
import json
import os
import subprocess
import threading
import time

import pytest
import yaml
from support import ROOT, kubectl_path, local_mode

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
EVERY = 3.0  # the operator's progress cadence in this test (seconds)

pytestmark = pytest.mark.real_model


class Versions:
    """Every version of one object a `kubectl get NAME -w -o json` prints."""

    def __init__(self, cluster, kind: str, name: str) -> None:
        k = cluster.kubectl
        self.process = subprocess.Popen(
            [kubectl_path(), "--kubeconfig", str(k.kubeconfig), "--cache-dir", str(k.cache_dir), "get", kind,
             name, "-w", "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.seen: list[dict] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder, buffer = json.JSONDecoder(), ""
        for line in self.process.stdout:
            buffer += line
            try:
                obj, end = decoder.raw_decode(buffer.lstrip())
            except ValueError:
                continue
            self.seen.append(obj)
            buffer = buffer.lstrip()[end:]

    def stop(self) -> list[dict]:
        self.process.terminate()
        self.process.wait()
        self._thread.join(10)
        return self.seen


def test_a_running_compile_shows_its_progress_in_kubectl_at_a_throttled_rate(tmp_path):
    env = {**os.environ, "NEURONFLEET_PROGRESS_SECONDS": str(EVERY)}
    with local_mode(tmp_path / "state", env=env) as cluster:
        cluster.kubectl("apply", "-f", str(SAMPLE))
        versions = Versions(cluster, "neuronmodel", "smollm2")
        try:
            shown: list[tuple[list[str], dict]] = []

            def progress_shown():
                table = cluster.kubectl("get", "neuronmodels").stdout.splitlines()
                header, row = table[0].split(), table[1].split()
                column = header.index("PROGRESS")
                model = yaml.safe_load(cluster.kubectl("get", "neuronmodel", "smollm2", "-o", "yaml").stdout)
                status = model.get("status") or {}
                if status.get("phase") == "Compiling" and row[column] in ("download", "convert", "validate"):
                    shown.append((row[column : column + 4], status))
                return shown or status.get("phase") == "Ready"

            cluster.wait("the Progress column during the compile", progress_shown)
            assert shown, "the model was Ready before any progress showed: the compile was not watched"
            cells, status = shown[0]
            progress = status["compileProgress"]
            assert cells[0] == progress["phase"] and " ".join(cells).startswith(
                progress["text"].split(" ")[0]
            )
            assert progress["text"].startswith(progress["phase"]) and progress["startedAt"]
            compiled = next(c for c in status["conditions"] if c["type"] == "Compiled")
            assert compiled["reason"] == "Compiling" and compiled["message"].endswith(progress["text"])
            cluster.wait("Ready", lambda: cluster.get("nm", "smollm2")["status"].get("phase") == "Ready")
        finally:
            seen = versions.stop()
        final = cluster.get("nm", "smollm2")["status"]
        assert "compileProgress" not in final  # Ready cleared it
        table = cluster.kubectl("get", "neuronmodels").stdout.splitlines()
        assert table[1].split()[table[0].split().index("PROGRESS")] != progress["phase"]

    # the writes: each distinct progress a watcher saw came at least EVERY s after the one before, unless its
    # phase changed; and the model's versions during the compile are about one per EVERY s, not one a second
    updates = []
    for obj in seen:
        p = (obj.get("status") or {}).get("compileProgress")
        if p and (not updates or p["updatedAt"] != updates[-1]["updatedAt"]):
            updates.append(p)
    assert len(updates) >= 2, updates
    for before, after in itertools.pairwise(updates):
        if before["phase"] == after["phase"]:
            assert stamp(after) - stamp(before) >= EVERY - 1, (before, after)  # (timestamps in whole seconds)
    compiling = [o for o in seen if (o.get("status") or {}).get("phase") == "Compiling"]
    versions_while = {o["metadata"]["resourceVersion"] for o in compiling}
    seconds = stamp(updates[-1]) - stamp(updates[0])
    print(f"compile progress: {len(updates)} updates, {len(versions_while)} versions in ~{seconds:.0f} s: "
          + "; ".join(u["text"] for u in updates))  # fmt: skip
    assert len(versions_while) <= seconds / EVERY + 8  # (+ the other status changes of a compile)


def stamp(progress: dict) -> int:
    """When the operator wrote a compileProgress (its updatedAt), in epoch seconds."""
    return calendar.timegm(time.strptime(progress["updatedAt"][:19], "%Y-%m-%dT%H:%M:%S"))
