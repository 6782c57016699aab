"""The README is a front page and docs/ the reference: the README stays short, its
set-up command is the one CI runs, every docs page is linked from it, and every
relative link in README.md and docs/*.md leads to a file that exists and, with an
#anchor, to a heading in it (GitHub's anchors)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted([README, *(REPO / "docs").glob("*.md")])
MAX_README_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without code blocks: a `#` there is a comment, a `[x](y)` is code."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings get; GitHub numbers repeats (-1, -2, ...)."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in _HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def links(page: Path) -> list[str]:
    """The page's link targets, outside code blocks and code spans."""
    return _LINK.findall(_CODE_SPAN.sub("", prose(page.read_text())))


def broken(page: Path) -> list[str]:
    """Why each relative link of ``page`` leads nowhere."""
    problems = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        name = f"{page.relative_to(REPO)}: {target}"
        if not file.exists():
            problems.append(f"{name}: no such file")
        elif not file.is_relative_to(REPO):
            problems.append(f"{name}: outside the repository")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(f"{name}: no heading #{anchor} in {file.relative_to(REPO)}")
    return problems


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md: {lines} lines; the reference goes in docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(README)}
    unlinked = [p.name for p in PAGES if p != README and p.resolve() not in linked]
    assert unlinked == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_readme_test_command_is_what_ci_runs() -> None:
    commands = re.findall(r"^```sh\n(python3 -m venv .*)\n```$", README.read_text(), re.M)
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line]
    assert len(commands) == 2, "the quick start's two commands: run the main job, test"
    assert commands[1] == ci[-1]


def test_the_link_checker_finds_what_is_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n\n## The API (`omni gateway`)\n\n## Twice\n## Twice\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#the-api-omni-gateway) [ok](b.md#twice-1) [ok](https://x/y#z)\n"
        "[gone](c.md) [no anchor](b.md#the-api) [self](#nowhere)\n"
        "`[in code](d.md)`\n```\n[in a block](e.md)\n# not a heading\n```\n"
    )
    assert broken(page) == [
        "a.md: c.md: no such file",
        "a.md: b.md#the-api: no heading #the-api in b.md",
        "a.md: #nowhere: no heading #nowhere in a.md",
    ]
