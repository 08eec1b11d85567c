"""The README is a front page and every relative link in the README and docs/ resolves.

Read from the files alone (no server): a link to a file must name one that exists, and a
`#anchor` must name a heading of that file as GitHub renders it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target may carry a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (where `#` and `[x](y)` are not markup)."""
    lines: list[str] = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text, lowercased, with
    punctuation dropped and each space a hyphen."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found: list[str] = []
    for line in prose_lines(path):
        # NOTE: `[x](y)` inside inline code is text, not a link.
        line = INLINE_CODE.sub("", line)
        found += [m.group(1) for m in LINK.finditer(line)]
    return found


def test_slug_follows_github() -> None:
    assert slug("Checking a machine: doctor") == "checking-a-machine-doctor"
    assert slug("Single-stream decode on CPU: what the llm worker does, and the levers") == (
        "single-stream-decode-on-cpu-what-the-llm-worker-does-and-the-levers")
    assert slug("The `max_tokens` of *Claude* [models](x.md)") == "the-max_tokens-of-claude-models"
    assert slug("Embeddings: HTTP vs in-process") == "embeddings-http-vs-in-process"


def test_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    # The two commands a newcomer needs, as the README promises them.
    assert "make run    # sets up .venv and starts the server" in text
    assert "make test   # sets up .venv and runs the test suite" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken: list[str] = []
    for target in links(page):
        if not target or EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_performance_doc_reads_as_a_document() -> None:
    """What to expect and how to measure it, not a lab notebook (issue 45): the history of
    the experiments is in git."""
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert not re.search(r"\b(session|stop|note) \d+\b|\bbranch \w+", text, re.I)


def test_no_file_holds_a_machine_path() -> None:
    """No path of one particular machine (a home or work folder) in any tracked file."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    machine = re.compile(r"/(root|work)/|/home/[a-z]")
    found = []
    for name in filter(None, listed):
        path = ROOT / name
        if path.suffix in {".gguf", ".bin", ".png", ".wav", ".flac", ".onnx"} or \
                not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1)
                  if machine.search(line)]
    assert found == []


def test_every_command_is_in_the_operating_guide() -> None:
    """Each `npx-supervisor` command is shown in docs/operating.md's command line (issue 46:
    `launch` was not)."""
    import click

    from npu_proxy.supervisor.cli import main

    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    missing = [name for name in main.list_commands(click.Context(main))
               if f"npx-supervisor {name}" not in text]
    assert missing == []
