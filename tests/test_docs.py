"""The README is the front door: short, every doc reachable from it, and every relative link resolving."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path):
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    missing = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_is_short_and_reaches_every_doc():
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 250, "README.md: keep it <= 250 lines"
    linked = {(readme.parent / t).resolve() for t in _relative_links(readme)}
    unlinked = [str(d.relative_to(ROOT)) for d in DOCS if d != readme and d.resolve() not in linked]
    assert not unlinked, f"README.md does not link to {unlinked}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -e ".[dev]" && python -m pytest -q\n' in readme
    assert 'python -m pip install -q -e ".[dev]"' in ci
    assert 'python -m pytest -q "$@"' in ci and "\nrun_tests\n" in ci
