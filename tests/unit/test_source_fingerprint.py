"""`neuronfleet source-fingerprint`: the same source gives the same fingerprint, a replaced or added file a
new one, a missing source the words the operator retries on; the command leaves it as the termination
message the operator reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from neuronfleet.contract import SOURCE_UNAVAILABLE, TERMINATION_LOG_ENV
from neuronfleet.runtime.artifacts.compile_artifacts import SourceUnavailable
from neuronfleet.runtime.artifacts.source_fingerprint import source_fingerprint


def test_a_folder_and_a_file_change_their_fingerprint_when_their_files_change(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    first = source_fingerprint(f"file://{folder}")
    assert first == source_fingerprint(f"file://{folder}") and first.startswith("files:2:")
    (folder / "model.safetensors").write_bytes(b"y" * 101)  # replaced
    second = source_fingerprint(f"file://{folder}")
    assert second != first
    (folder / "tokenizer.json").write_text("{}")  # added
    assert source_fingerprint(f"file://{folder}") not in (first, second)
    mount = tmp_path / "mount"  # where the claim is mounted: pvc://claim/m.gguf is mount/m.gguf
    mount.mkdir()
    (mount / "m.gguf").write_bytes(b"GGUF")
    one = source_fingerprint("pvc://claim/m.gguf", model_mount=str(mount))
    os.utime(mount / "m.gguf", ns=(1, 1))
    assert source_fingerprint("pvc://claim/m.gguf", model_mount=str(mount)) != one


def test_a_missing_source_is_unavailable_in_the_operators_words(tmp_path):
    with pytest.raises(SourceUnavailable, match=f"^{SOURCE_UNAVAILABLE} pvc://claim/none: not found"):
        source_fingerprint("pvc://claim/none", model_mount=str(tmp_path))


def test_the_command_leaves_the_fingerprint_as_its_termination_message(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    log = tmp_path / "termination-log"
    env = {**os.environ, TERMINATION_LOG_ENV: str(log)}
    cli = [
        sys.executable,
        "-P",
        "-m",
        "neuronfleet.cli",
        "source-fingerprint",
        "--uri",
        f"file://{tmp_path}/m.gguf",
    ]
    run = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(log.read_text()) == {"fingerprint": run.stdout.strip()}
    missing = subprocess.run([*cli[:-1], "file:///nowhere"], capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and log.read_text().startswith(
        f"neuronfleet source-fingerprint: {SOURCE_UNAVAILABLE}"
    )
