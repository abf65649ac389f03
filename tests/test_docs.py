"""Documentation stays inside the repository: links resolve, no citations of outside files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# design notes that live outside the repository (split so this file does not match itself)
OUTSIDE = re.compile("DESIGN" + r"\.md|dsv4" + "_arch|xllm" + "_dspark|dspark" + "_official")


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("xspec", "tests"):
        files += sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.md"))
    return files


def test_no_citation_of_files_outside_the_repository() -> None:
    hits = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in _files()
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []


def test_markdown_links_resolve() -> None:
    for f in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", f.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (f.parent / target).exists(), f"{f.name} links to missing {target}"
    assert all(
        (ROOT / "docs" / n).is_file()
        for n in ("architecture.md", "checkpoints.md", "npu.md", "metrics.md")
    )


def test_the_docs_are_a_manual() -> None:
    """The README is the door (quickstart, usage, the config table, links: no table row
    over ~200 characters); docs/adaptive.md is a feature page, not a notebook; no page
    keeps a measurement history; no page runs past ~400 lines."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 180
    assert max(len(line) for line in readme if line.startswith("|")) <= 200
    assert len((ROOT / "docs" / "adaptive.md").read_text(encoding="utf-8").splitlines()) <= 250
    assert list((ROOT / "docs").glob("*history*")) == []
    pages = {
        f.name: len(f.read_text(encoding="utf-8").splitlines())
        for f in (ROOT / "docs").glob("*.md")
    }
    assert {name: n for name, n in pages.items() if n > 400} == {}
