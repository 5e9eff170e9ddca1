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


def anchors(markdown: str) -> set[str]:
    """The #anchors GitHub makes of a document's headings (outside code blocks): lowercased, punctuation but
    '-' and '_' dropped, spaces made '-', a repeated one numbered -1, -2, ..."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def headings(markdown: str) -> set[str]:
    return {re.sub(r"[`*]", "", h).strip() for h in re.findall(r"^#{1,6}\s+(.*)$", markdown, re.M)}


def test_every_link_between_the_documents_leads_somewhere():
    """Every relative link of README.md and docs/*.md leads to a file, and its #anchor (or a same-document
    #anchor) to a heading of that document; every benchmark results file named is kept."""
    dead = []
    for doc in DOCUMENTS:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                dead.append(f"{doc.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                dead.append(f"{doc.relative_to(ROOT)} -> {target} (no such heading)")
        for named in RESULT.findall(doc.read_text()):
            if not list(ROOT.glob(named)):
                dead.append(f"{doc.relative_to(ROOT)} names {named}")
    assert not dead, dead


# A section named in words: `docs/security.md, "The compile cache"`, `README "Container images"`
SECTION = re.compile(r"(README|[\w/-]+\.md)(?:'s)?,? \"([^\"]+)\"")
NAMING_SECTIONS = [*DOCUMENTS, *sorted((ROOT / "crds" / "samples").glob("*.yaml")),
                   ROOT / "charts" / "neuronfleet" / "values.yaml", ROOT / "Dockerfile"]  # fmt: skip


def test_every_section_named_in_words_is_a_heading_of_that_document():
    """A reference by a section's name (the README's "What runs where") names a heading that exists, or a
    region the README's tables are written into (`<!-- name: begin -->`)."""
    dead = []
    for doc in NAMING_SECTIONS:
        for file, section in SECTION.findall(doc.read_text()):
            target = ROOT / ("README.md" if file == "README" else file)
            if not target.exists() and (doc.parent / file).exists():
                target = doc.parent / file
            text = target.read_text() if target.exists() else ""
            region = f"<!-- {section.lower().replace(' ', '-')}: begin -->"
            if section not in headings(text) and region not in text:
                dead.append(f"{doc.relative_to(ROOT)} names {file}, {section!r}")
    assert not dead, dead


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of a document: not code, tables, headings, lists, images or comments, nor a
    paragraph that leads into a code block or a list (it may end in "or", or "the operator", before it)."""
    out, lines, fenced = [], [], False
    for line in [*markdown.splitlines(), ""]:
        stripped = line.strip()
        if line.startswith("```"):
            fenced, lines = not fenced, []
            if out and out[-1] is None:
                del out[-2:]
            continue
        indented_code = line.startswith("    ") and not lines
        if fenced or indented_code or stripped.startswith(("#", "|", "<!--", "![", "-", "*", "1.")):
            if not fenced and stripped.startswith(("-", "*", "1.")) and out and out[-1] is None:
                del out[-2:]  # (it leads into this list)
            lines = []
        elif stripped:
            lines.append(stripped)
        elif lines:
            out += [" ".join(lines), None]  # (None: it just ended; a fence or list next takes it back)
            lines = []
    return [p for p in out if p is not None]


def test_no_paragraph_of_the_docs_ends_mid_sentence():
    """Each prose paragraph ends with a full stop (or a colon before what it introduces), possibly inside a
    closing bracket or quote: none is cut off mid-sentence."""
    cut = [
        f"{doc.relative_to(ROOT)}: ...{text[-70:]}"
        for doc in DOCUMENTS
        for text in paragraphs(doc.read_text())
        if not re.search(r"[.:!?][)`\"*_]*$", text)
    ]
    assert not cut, cut
