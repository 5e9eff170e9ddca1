"""Compile progress in local mode (`neuronfleet up` in the foreground), end to end: while the real compile of
the SmolLM2 sample runs, the real `kubectl get neuronmodels` shows its phase in the Progress column, `kubectl
get -o yaml` has status.compileProgress and the Compiled condition's message carries it, and `up` prints it;
the operator (which only reads the compile pod's log) writes it at the throttled rate, as every status version
a `kubectl get -w` saw says; Ready clears it.

The operator runs with NEURONFLEET_PROGRESS_SECONDS=1.5 (default 15; it reads the log every 1.2 s then), so
that a compile of a few seconds shows updates; how many depends on the machine's speed (a fast one finishes
this compile within one interval), so the rate is checked on whatever updates came, and proven on its own in
tests/unit/test_compile_progress.py."""

from __future__ import annotations

import calendar
import itertools
import json
import re
import subprocess
import threading
import time

import pytest
import yaml
from support import ROOT, LocalCluster, Process, kubectl_path, neuronfleet_command

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
PHASES = ("download", "convert", "validate")  # what the embedded engine's compile reports
EVERY = 1.5  # the operator's progress cadence in this test (seconds)

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


def test_a_running_compile_shows_its_progress_in_kubectl_and_up_at_a_throttled_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURONFLEET_PROGRESS_SECONDS", str(EVERY))  # (the operator inherits it from `up`)
    state = tmp_path / "state"
    up = Process([*neuronfleet_command(), "up", "--state", str(state)], tmp_path / "up.log")  # foreground
    try:
        up.wait_until(lambda: "[up] ready" in up.output(), "neuronfleet up")
        cluster = LocalCluster(state)
        cluster.kubectl("apply", "-f", str(SAMPLE))
        versions = Versions(cluster, "neuronmodel", "smollm2")
        try:
            shown: list[tuple[str, dict]] = []

            def progress_shown():
                row = columns(cluster.kubectl("get", "neuronmodels").stdout)
                model = yaml.safe_load(cluster.kubectl("get", "neuronmodel", "smollm2", "-o", "yaml").stdout)
                status = model.get("status") or {}
                text = (status.get("compileProgress") or {}).get("text")
                # (the table and the object are read one after the other: a write may come between)
                if row["PROGRESS"].split(" ")[0] in PHASES and row["PROGRESS"] == text:
                    shown.append((row["PROGRESS"], status))
                return shown or status.get("phase") == "Ready"

            cluster.wait("the Progress column during the compile", progress_shown)
            assert shown, "the model was Ready before any progress showed: the compile was not watched"
            _, status = shown[0]
            progress = status["compileProgress"]
            assert status["phase"] == "Compiling"
            assert progress["text"].startswith(progress["phase"]) and progress["startedAt"]
            compiled = next(c for c in status["conditions"] if c["type"] == "Compiled")
            assert compiled["reason"] == "Compiling" and compiled["message"].endswith(progress["text"])
            cluster.wait("Ready", lambda: cluster.get("nm", "smollm2")["status"].get("phase") == "Ready")
        finally:
            seen = versions.stop()
        final = cluster.get("nm", "smollm2")["status"]
        assert "compileProgress" not in final  # Ready cleared it
        assert columns(cluster.kubectl("get", "neuronmodels").stdout)["PROGRESS"] == ""
        # `up` in the foreground showed each progress its status had, as plain lines (its stderr is a file)
        lines = [x for x in up.output().splitlines() if x.startswith("[default/smollm2] ")]
        assert f"[default/smollm2] {progress['text']}" in lines, up.output()[-3000:]
    finally:
        assert up.stop() == 0

    # the writes: each distinct progress a watcher saw came at least EVERY s after the one before, unless its
    # phase changed; and the model's versions during the compile are about one per EVERY s, not one a second
    updates = []
    for obj in seen:
        p = (obj.get("status") or {}).get("compileProgress")
        if p and (not updates or p["updatedAt"] != updates[-1]["updatedAt"]):
            updates.append(p)
    assert updates, seen  # (at least the one `shown` above)
    # `up` follows a watch: every progress a watcher saw, it printed too, however often the operator wrote
    missing = [u["text"] for u in updates if f"[default/smollm2] {u['text']}" not in lines]
    assert not missing, (missing, lines)
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


def columns(table: str) -> dict[str, str]:
    """The first row of a `kubectl get` table by column name, cut where the header's columns start (a cell
    may hold spaces, or be empty)."""
    header, row = table.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {n: row[a:b].strip() for n, a, b in zip(header.split(), starts, ends, strict=True)}
