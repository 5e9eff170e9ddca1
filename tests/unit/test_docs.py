"""The documents a user reads agree with the tool: every command and every `serve` option is on
docs/command-line.md, and every link between the repository's documents leads somewhere."""

from __future__ import annotations

import argparse
import re

from support import ROOT

from neuronfleet.cli import build_parser
from neuronfleet.contract import ServeConfig, _spelling

COMMAND_LINE = (ROOT / "docs" / "command-line.md").read_text()
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"`(bench/results/[\w.*-]+)`")  # a benchmark's results file named as kept


def commands(parser: argparse.ArgumentParser, prefix: str = "neuronfleet") -> list[str]:
    """Every command line a user can type, as far as its subcommands go."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = commands(sub, f"{prefix} {name}")
                out += nested or [f"{prefix} {name}"]
    return out


def test_every_command_and_serve_option_is_on_the_command_line_page():
    missing = [
        c for c in commands(build_parser()) if f"{c} " not in COMMAND_LINE and f"{c}\n" not in COMMAND_LINE
    ]
    assert not missing, f"docs/command-line.md lacks {missing}"
    flags = [_spelling(name) for name in ServeConfig.model_fields]
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", COMMAND_LINE)]
    assert not missing, f"docs/command-line.md lacks serve's {missing}"


def test_every_link_between_the_documents_leads_to_a_file():
    dead = []
    for doc in DOCUMENTS:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                dead.append(f"{doc.relative_to(ROOT)} -> {target}")
        for named in RESULT.findall(doc.read_text()):
            if not list(ROOT.glob(named)):
                dead.append(f"{doc.relative_to(ROOT)} names {named}")
    assert not dead, dead
