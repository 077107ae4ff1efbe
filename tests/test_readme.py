"""The README stays a five-minute read that starts with the two commands, and no link in it or in
docs/ leads nowhere: pages are moved and renamed, and a dead link is what a newcomer hits first."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are code, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def link_targets(page: Path) -> list[str]:
    text = prose(page.read_text())
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    anchors, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in link_targets(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target}: no such heading")
    return broken


def test_readme_is_under_200_lines():
    assert len(README.read_text().splitlines()) < 200


def test_readme_gives_the_two_commands_and_make_has_them():
    blocks = "\n".join(FENCE.findall(README.read_text()))
    commands = {line.strip() for line in blocks.splitlines()}
    assert {"make demo", "make test"} <= commands
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no `{target}` target"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in link_targets(README)}
    unlinked = [p.relative_to(ROOT).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md links none of: {unlinked}"


def test_every_relative_link_resolves():
    broken = {page.relative_to(ROOT).as_posix(): b for page in PAGES if (b := broken_links(page))}
    assert not broken


def test_a_dead_link_and_a_missing_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [dead](gone.md) "
        "[no anchor](there.md#elsewhere) `[code](not-a-link.md)` [web](https://example.com)\n"
    )
    assert broken_links(page) == ["gone.md: no such file", "there.md#elsewhere: no such heading"]
