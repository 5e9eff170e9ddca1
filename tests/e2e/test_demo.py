"""The README's first command, `scripts/demo.sh`, run as a newcomer runs it (set-up skipped: this suite's
`.venv` is the one it would make): its own local fleet, the sample applied with the real kubectl, Ready,
one chat request with no sampling fields, and the answer printed as text (the raw JSON only with --raw),
then the fleet stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from support import CEILING, ROOT

KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="the demo drives kubectl, which is not installed here")
def test_the_demo_prints_the_answer_as_text_and_stops_its_fleet(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "SETUP": "0", "STATE": str(state), "KUBECTL": KUBECTL}
    run = subprocess.run(
        ["bash", "scripts/demo.sh", "What is the capital of France?"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=CEILING,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "[demo] set-up" not in out  # SETUP=0
    for said in ("[demo] neuronfleet up:", "[demo] apply -> Ready", "[demo] the chat request:"):
        assert said in out, out
    answer = out.split("[demo] the chat request:", 1)[1]
    text = answer.split("\n", 1)[1].strip()
    assert "Paris" in text, text  # SmolLM2 at its sample's defaults (greedy): sensible
    assert not text.startswith("{") and '"choices"' not in out  # text, not the API's JSON
    counts = [line for line in out.splitlines() if line.startswith("[demo] ") and "prompt tokens" in line]
    assert len(counts) == 1 and counts[0].endswith("generated"), out
    assert out.strip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("[down]")]
    # the fleet is stopped (the script's trap): none of its processes runs any more
    pids = json.loads((state / "pids.json").read_text()) if (state / "pids.json").exists() else {}
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids.values()), pids
