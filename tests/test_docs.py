"""The documentation: README's size and test command, every relative link of README.md and docs/*.md,
docs/benchmarks.md generated from bench/results, bench/NOTES.md's index, and the README's performance
table against the result file it names."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NOTES = ROOT / "bench" / "NOTES.md"
README_LIMIT = 12_000  # bytes of UTF-8 (·, ≥ and the like count 2-3): what a newcomer reads on arrival
TEST_COMMAND = "python -m pytest -q"  # CI runs the README's command unchanged

LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXPERIMENT_RE = re.compile(r"^## (\d+)\. ", re.MULTILINE)


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def outside_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list[str]:
    """The link targets of a markdown file that point into the repository (no scheme, no bare anchor)."""
    targets = LINK_RE.findall(outside_code(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md has {size} bytes, the limit is {README_LIMIT}"


def test_readme_has_the_test_command() -> None:
    assert TEST_COMMAND in README.read_text()


def test_docs_exist() -> None:
    for name in ("design.md", "families.md", "benchmarks.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path) -> None:
    missing = []
    for target in relative_links(path):
        file_part = target.split("#", 1)[0]
        if file_part and not (path.parent / file_part).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_benchmarks_doc_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "make_docs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_notes_index_lists_every_experiment() -> None:
    text = NOTES.read_text()
    headings = {int(n) for n in EXPERIMENT_RE.findall(text)}
    assert headings, "bench/NOTES.md has no numbered experiment headings"
    start = text.index("## Index")
    end = text.index("\n## ", start + 1)
    rows = re.findall(r"^\|\s*\[?(\d+)\]?", text[start:end], flags=re.MULTILINE)
    indexed = [int(n) for n in rows]
    assert len(indexed) == len(set(indexed)), "an experiment is listed twice in the index"
    assert set(indexed) == headings, (f"index misses {sorted(headings - set(indexed))}, "
                                      f"lists unknown {sorted(set(indexed) - headings)}")


def test_notes_index_links_reach_their_headings() -> None:
    """Each index row links to its experiment's heading anchor (GitHub's slug of the heading)."""
    text = NOTES.read_text()
    slugs = {}
    for m in re.finditer(r"^## ((\d+)\. .*)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        slugs[int(m.group(2))] = slug
    for n, anchor in re.findall(r"^\| \[(\d+)\]\(#([^)]*)\)", text, flags=re.MULTILINE):
        assert slugs[int(n)] == anchor, f"index row {n} links to #{anchor}, the heading's anchor is #{slugs[int(n)]}"


def test_readme_performance_figures_come_from_the_named_result_file() -> None:
    """Every row of the README's performance table is the bf16 row of bench/results/fa_sweep_h200.md
    with the same head dim, mask and N, figure for figure."""
    readme = README.read_text()
    section = readme[readme.index("## Performance"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    assert "bench/results/fa_sweep_h200.md" in section and "H200" in section
    results = {}
    for line in (ROOT / "bench" / "results" / "fa_sweep_h200.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 13 and cells[0] == "bf16":
            dtype, d, causal, n, fa2_sm80, _, _, pick, _, fa2, _, cudnn, ratio = cells
            results[(d, causal, n)] = (pick, fa2_sm80, fa2, cudnn, ratio)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if re.match(r"^\| \d+ \| [NY] \|", line)]
    assert rows, "no rows found in the README's performance table"
    for d, causal, n, *figures in rows:
        assert results.get((d, causal, n)) == tuple(figures), f"README row d{d} {causal} N={n}: {figures}"
