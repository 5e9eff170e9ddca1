"""A started router (`neuronfleet serve --role router`, as the operator runs it) has imported no torch: the
router's image and memory carry no model code."""

from __future__ import annotations

import pytest
from support import free_port, serve_and_report_imports


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
    proc = serve_and_report_imports(args, port, ("torch", "safetensors"))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED -" in proc.stdout, proc.stdout + proc.stderr


def test_a_started_front_door_has_not_imported_model_code():
    """`neuronfleet serve --role router --unified ...` (the front door to unified pods of any engine), serving
    with holding on: no torch, no weights reader, no tokenizer."""
    port = free_port()
    args = [
        *("serve", "--role", "router", "--unified", "http://127.0.0.1:9", "--port", str(port)),
        *("--hold-requests", "4", "--grace-period", "1"),
    ]
    proc = serve_and_report_imports(args, port, ("torch", "safetensors", "tokenizers", "transformers"))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED -" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.real_model
def test_a_front_door_given_the_model_loads_its_tokenizer_and_no_model_code(smollm2_dir):
    """With --model (to route by the token blocks the pods cache) it reads the tokenizer only: still no torch
    and no weights reader."""
    port = free_port()
    args = [
        *("serve", "--role", "router", "--unified", "http://127.0.0.1:9", "--port", str(port)),
        *("--model", str(smollm2_dir), "--grace-period", "1"),
    ]
    proc = serve_and_report_imports(args, port, ("torch", "safetensors", "transformers"))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED -" in proc.stdout, proc.stdout + proc.stderr
