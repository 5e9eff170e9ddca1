"""Progress from the real commands, as separate processes: `neuronfleet compile` prints progress lines on
stdout (what the operator reads from the compile pod's log) whose bytes grow to the total, phase by phase,
for a Hugging Face folder and for the real SmolLM2 GGUF file, and a person's plain lines on stderr (not a
terminal); `neuronfleet model import-gguf` shows the same plain lines."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from support import CEILING, make_tiny_llama, neuronfleet_command

from neuronfleet.contract import PROGRESS_PREFIX, parse_progress
from neuronfleet.runtime.model.gguf_import import default_gguf_path


def write_config(path, uri: str) -> None:
    config = {
        "compileHash": "abc123", "engine": "embedded", "instanceType": "cpu",
        "model": {"uri": uri, "revision": None}, "dtype": "float32", "sequenceLength": 64,
        "maxInputLength": 32, "batchSize": 1,
    }  # fmt: skip
    path.write_text(json.dumps(config))


def progress_lines(stdout: str) -> list:
    lines = [line for line in stdout.splitlines() if line.startswith(PROGRESS_PREFIX)]
    return [parse_progress(line) for line in lines]


def compile_(tmp_path, uri: str) -> subprocess.CompletedProcess:
    write_config(tmp_path / "compile.json", uri)
    out = tmp_path / "artifacts" / "abc123"
    run = subprocess.run(
        [*neuronfleet_command(), "compile", "--config", str(tmp_path / "compile.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=CEILING,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run


def check_phases(updates: list, convert_total: int) -> None:
    assert all(u is not None for u in updates)  # every progress line parses
    phases = [u.phase for u in updates]
    assert phases[0] == "convert" and phases[-1] == "validate"
    assert phases == sorted(phases, key=["convert", "validate"].index)  # one after the other, never back
    assert updates[0].bytesTotal is None  # reading the source, its size not known yet
    convert = [u for u in updates if u.phase == "convert" and u.bytesTotal is not None]
    done = [u.bytesDone for u in convert]
    assert done == sorted(done) and done[0] == 0 and done[-1] == convert_total
    assert {u.bytesTotal for u in convert} == {convert_total} and convert[-1].filesDone == convert[
        -1
    ].filesTotal
    elapsed = [u.elapsed for u in updates]
    assert elapsed == sorted(elapsed)


def test_compile_of_a_folder_prints_progress_that_grows_to_the_weights_size(tmp_path):
    model = make_tiny_llama(tmp_path / "src")
    run = compile_(tmp_path, f"file://{model}")
    updates = progress_lines(run.stdout)
    check_phases(updates, sum(f.stat().st_size for f in model.glob("*.safetensors")))
    assert "[compile] convert 100%" in run.stderr and "[compile] validate" in run.stderr  # a person's lines
    assert "\r" not in run.stderr  # (stderr is no terminal here)


@pytest.mark.real_model
def test_compile_of_the_real_smollm2_gguf_prints_progress_that_grows_to_its_tensors_size(tmp_path):
    from gguf import GGUFReader

    gguf = default_gguf_path()
    tensors = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)
    run = compile_(tmp_path, f"file://{gguf}")
    updates = progress_lines(run.stdout)
    check_phases(updates, tensors)
    assert (
        len([u for u in updates if u.phase == "convert"]) >= 2
    )  # (throttled: at most one per 2 s, and ends)
    assert (tmp_path / "artifacts" / "abc123" / "manifest.json").is_file()


@pytest.mark.real_model
def test_import_gguf_shows_plain_progress_lines_off_a_terminal(tmp_path):
    run = subprocess.run(
        [*neuronfleet_command(), "model", "import-gguf", "--out", str(tmp_path / "m"), "--dtype", "float32"],
        capture_output=True, text=True, timeout=CEILING,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("[import] ")]
    assert re.match(r"\[import\] convert 0% 0(\.0)?/[0-9.]+MB \d+s$", lines[0]), lines
    assert re.match(r"\[import\] convert 100% ([0-9.]+)/\1MB \d+s$", lines[-1]), lines
    assert not run.stdout  # (no machine lines: nothing reads them)
