"""The device smoke script (tests/device/neuron_smoke.py) with the backend swapped (`--device cpu`: aot_eager,
no device), so that the proof a Trn2 will run one day cannot rot: the real compile, then the pod path (the
cache copied, its key checked, every bucket warmed once, then nothing compiled: a recompile would raise), and
greedy answers equal op by op in float32. One slot keeps it to six graphs."""

from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_the_smoke_script_passes_with_the_backend_swapped(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "device" / "neuron_smoke.py"), "--device", "cpu",
         "--slots", "1", "--out", str(tmp_path / "smoke")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(run.stdout[run.stdout.index("{\n") :])
    assert report["buckets_warmed"] == 6  # decode at 2 lengths, prefill at 2 prompt x 2 context buckets
    assert all(report["checks"].values()) and len(report["checks"]) == 3
    assert report["answers"] == report["reference"] and all(len(a) == 16 for a in report["answers"])
