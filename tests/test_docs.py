"""The README is the front door (issue #29: it had grown to 800 lines of lab notebook): it stays short, links every
reference page in docs/, and no link in it or in docs/ points at a file that is not there."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_front_door_that_links_every_reference_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260, "the README is the front door: move reference to docs/"
    linked = {(REPO / target).resolve() for target in LINK.findall(readme)}
    pages = set((REPO / "docs").glob("*.md"))
    assert pages and {p.resolve() for p in pages} <= linked, sorted(p.name for p in pages if p.resolve() not in linked)


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken
