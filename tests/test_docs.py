"""Every relative link in the README, the changelog and docs/ points at a file that exists, and at a heading
that exists when it names one (GitHub's anchors)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), an optional "title" after the target.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a '#' there is a shell comment, a '[x](y)' is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (word characters, '-' and ' ' kept),
    spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading contributes its text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a page, with GitHub's -1, -2 … suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    links = []
    for line in prose_lines(page.read_text()):
        links += [target for target in LINK.findall(INLINE_CODE.sub("", line)) if not target.startswith(EXTERNAL)]
    return links


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("Decode steps (`--decode-step`)") == "decode-steps---decode-step"
    assert github_anchor("Where a streamed token's time goes (`bench/bench_token_path.py`, 2026-11-26 night)") == \
        "where-a-streamed-tokens-time-goes-benchbench_token_pathpy-2026-11-26-night"
    assert github_anchor("Two tiers: LMDB (L1) under a shared Redis (L2)") == "two-tiers-lmdb-l1-under-a-shared-redis-l2"


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n```\n# not a heading\n```\n<a id=\"x\"></a>\n")
    page.write_text("[ok](other.md#a-section) [html](other.md#x) [bad file](missing.md) [bad anchor](other.md#not-a-heading)\n"
                    "[self](#page) `[in code](nowhere.md)` [web](https://example.com/x.md)\n\n# Page\n"
                    "```\n[in a fence](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#not-a-heading (no heading with that anchor)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links {broken_links(page)}"


def test_the_readme_stays_a_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it <= 150 and move depth to docs/"
    first_screen = "\n".join(lines[:40])
    assert "make run" in first_screen and "make test" in first_screen, "the two commands belong on the first screen"


def test_the_readme_room_table_has_every_room_on_its_floor():
    from tests.test_layering import ROOM_FLOORS

    rows = [line.split("|") for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    floors = {}
    for row in rows:
        for name in re.findall(r"`([^`]+)`", row[1]):
            floors[name.removeprefix("inference_service/").rstrip("/").removesuffix(".py")] = row[2].strip()
    for room, floor in ROOM_FLOORS.items():
        assert floors.get(room) == str(floor), f"README's room table: inference_service/{room} on floor {floor}"
    # inference_service is there room by room (above).
    packages = [path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "inference_service"]
    missing = [package for package in packages if f"{package}/" not in floors and package not in floors]
    assert not missing, f"README's room table leaves out {missing}"
