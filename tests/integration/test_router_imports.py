"""A started router (`neuronfleet serve --role router`, as the operator runs it) has imported no torch: the
router's image and memory carry no model code."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import free_port

ROUTER = """
import os, signal, sys, threading, time, urllib.request

from neuronfleet.cli import main

def report_once_serving():
    while True:
        try:
            with urllib.request.urlopen("http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    heavy = sorted(m for m in ("torch", "safetensors") if m in sys.modules)
    print("IMPORTED", ",".join(heavy) or "-", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report_once_serving, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.real_model
def test_a_started_router_has_not_imported_torch(smollm2_dir, tmp_path):
    """`neuronfleet serve --role router` as the operator starts it, serving: torch is not in its modules."""
    (tmp_path / "token").write_text("s3cret")
    port = free_port()
    args = [
        *("serve", "--role", "router", "--model", str(smollm2_dir), "--port", str(port)),
        *("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"),
        *("--internal-token-file", str(tmp_path / "token"), "--max-seq-len", "256", "--grace-period", "1"),
    ]
    proc = subprocess.run(
        [sys.executable, "-P", "-c", ROUTER.format(port=port), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED -" in proc.stdout, proc.stdout + proc.stderr
