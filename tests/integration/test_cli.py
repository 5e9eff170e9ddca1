"""The `neuronfleet` command line as a user runs it (subprocesses)."""

from __future__ import annotations

import subprocess

import pytest
from support import CEILING, neuronfleet_command


def neuronfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*neuronfleet_command(), *args], capture_output=True, text=True, timeout=CEILING)


@pytest.mark.real_model
def test_generate_chat_prints_only_the_answer(smollm2_dir):
    result = neuronfleet("generate", "--model", str(smollm2_dir), "--chat", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."


@pytest.mark.real_model
def test_generate_seeded_sampling_repeats(smollm2_dir):
    args = (
        "generate",
        "--model",
        str(smollm2_dir),
        "--temperature",
        "0.8",
        "--seed",
        "7",
        "--max-tokens",
        "12",
    )
    first, second = neuronfleet(*args, "Once upon a time"), neuronfleet(*args, "Once upon a time")
    assert first.returncode == 0 and first.stdout == second.stdout and first.stdout.strip()


def test_errors_are_clear_and_exit_2(tmp_path):
    result = neuronfleet("generate", "--model", str(tmp_path / "missing"), "hello")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "import-gguf" in result.stderr
    result = neuronfleet(
        "model", "import-gguf", "--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2 and "x.gguf" in result.stderr
    assert "Traceback" not in result.stderr
