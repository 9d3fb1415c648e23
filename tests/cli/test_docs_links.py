"""The README and docs/ as a reader follows them: every relative link leads somewhere, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOC_PAGES = sorted((REPO / "docs").glob("*.md"))
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def prose(markdown: str) -> str:
    """The text a renderer turns into links: code blocks dropped, inline code emptied (a link may wrap it)."""
    return INLINE_CODE.sub("code", FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, a repeated id numbered -1, -2, ..."""
    ids: set[str] = set()
    repeats: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeats[slug] = repeats.get(slug, -1) + 1
        ids.add(slug if repeats[slug] == 0 else f"{slug}-{repeats[slug]}")
    return ids


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text())) if not EXTERNAL.match(target)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {destination.name})")
    return broken


@pytest.mark.parametrize("page", [README, *DOC_PAGES], ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    assert broken_links(page) == []


def test_the_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_links_every_docs_page():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in relative_links(README)}
    assert DOC_PAGES and [page.name for page in DOC_PAGES if page.resolve() not in linked] == []


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Some `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#some-code-heading) [ok](#page) [gone](missing.md) "
                    "[no heading](other.md#nothing)\n```\n[in a code block](absent.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nothing (no heading #nothing in other.md)"]
