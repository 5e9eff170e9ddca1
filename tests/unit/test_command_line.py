"""The command line as a newcomer meets it: `--version`, help that describes the tool (not its code), and
`serve --help` with each option's default."""

from __future__ import annotations

import os
import re
import subprocess

from support import neuronfleet_command

from neuronfleet import __version__
from neuronfleet.contract import ServeConfig


def run(*args: str) -> str:
    wide = {**os.environ, "COLUMNS": "1000"}  # one line per option: no word cut at a hyphen
    command = [*neuronfleet_command(), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=wide)
    return done.stdout


def test_version_and_a_top_level_help_for_users():
    assert run("--version").strip() == f"neuronfleet {__version__}"
    text = " ".join(run("--help").split())
    assert "runs LLM inference fleets on AWS Neuron" in text and "Start with `neuronfleet up`" in text
    assert "parses arguments" not in text  # what the code does is the module docstring's business


def test_serve_help_shows_every_default_worth_saying():
    text = run("serve", "--help")
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])  # one entry per option
    described = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in options if entry.strip()}
    for name in ("slots", "max_seq_len", "port", "max_waiting", "grace_period", "routing"):
        default = ServeConfig.model_fields[name].default
        flag = "--" + name.replace("_", "-")
        assert described[flag].endswith(f"(default: {default})"), described[flag]
    assert "(default: None)" not in text and "(default: False)" not in text
