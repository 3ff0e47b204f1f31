"""The README is a front page and the docs' links hold: size, relative links, anchors (GitHub-style slugs).

What this is not: a check of the pages' content or of external (http) links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12_000
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and HTML comments (headings and links there do not count)."""
    return HTML_COMMENT.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a Markdown page; repeated headings get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """Link and image targets in a page's prose that are not URLs (http, https, mailto)."""
    prose = INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_slug_is_githubs():
    assert slug("From Python: `spectr.generate`") == "from-python-spectrgenerate"
    assert slug("Splitting the target over GPUs (`model.device_map`)") == "splitting-the-target-over-gpus-modeldevice_map"
    assert slug("DEFAULT_PACK_BELOW") == "default_pack_below"


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}: move detail to docs/"


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file does not exist, or whose #anchor is no heading of that page."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_negative_control_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n", encoding="utf-8")
    page.write_text("[ok](other.md#a-section) [bad anchor](other.md#nope) [gone](missing.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n", encoding="utf-8")
    assert relative_links(page) == ["other.md#a-section", "other.md#nope", "missing.md"]
    assert broken_links(page) == ["other.md#nope: no heading #nope in other.md", "missing.md: no such file"]


def test_readme_links_the_docs():
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README) if t.startswith("docs/")}
    assert len(linked) >= 3, f"README.md links {sorted(linked)} of docs/; at least 3 pages"
    assert all((ROOT / "docs" / name).exists() for name in linked)
