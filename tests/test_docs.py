"""The documentation as a reader meets it: README.md the front door, every reference page one
click away from it, no link that leads nowhere, and pages that describe the software as it is
(no dated diary entries; figures live in BENCHMARKS.md)."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import REPO_ROOT

DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "ARCHITECTURE.md", *DOCS]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DATE = re.compile(r"\b20\d\d-(0[1-9]|1[0-2])-[0-3]\d\b")


def test_readme_is_a_front_door():
    text = (REPO_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_screen = "\n".join(text.splitlines()[:40])
    assert "make run" in first_screen and "make test" in first_screen
    linked = {(REPO_ROOT / link).resolve() for link in LINK.findall(text)}
    unlinked = [page.name for page in [*DOCS, REPO_ROOT / "ARCHITECTURE.md", REPO_ROOT / "BENCHMARKS.md"]
                if page.resolve() not in linked]  # fmt: skip
    assert not unlinked, f"pages README.md does not link: {unlinked}"


def test_every_relative_link_resolves():
    broken = [
        f"{page.relative_to(REPO_ROOT)} -> {link}"
        for page in [*PAGES, REPO_ROOT / "BENCHMARKS.md"]
        for link in LINK.findall(page.read_text())
        if not link.startswith(("http://", "https://")) and not (page.parent / link).exists()
    ]
    assert not broken, broken


def test_size_limits():
    assert len((REPO_ROOT / "ARCHITECTURE.md").read_text().splitlines()) <= 300
    assert len((REPO_ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 200


def test_no_dated_entries_in_docs_or_source():
    sources = [*PAGES, *(REPO_ROOT / "pipeline").rglob("*.py"), *(REPO_ROOT / "pipeline").rglob("*.cpp")]
    dated = [
        f"{path.relative_to(REPO_ROOT)}: {m.group(0)}"
        for path in sources
        for m in DATE.finditer(path.read_text())
    ]
    assert not dated, dated


def test_outputs_tracks_only_placeholders_and_shown_images():
    tracked = subprocess.run(
        ["git", "ls-files", "outputs"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: no tracked files to check")
    shown = {
        str((page.parent / link).resolve().relative_to(REPO_ROOT))
        for page in [*PAGES, REPO_ROOT / "BENCHMARKS.md"]
        for link in LINK.findall(page.read_text())
        if (page.parent / link).resolve().is_relative_to(REPO_ROOT / "outputs")
    }
    extra = [path for path in tracked if not path.endswith(".gitkeep") and path not in shown]
    assert not extra, f"tracked under outputs/ but shown by no page: {extra}"
