"""Every path the user-facing documents give into bench/ resolves: the README's sources, the
docs, bench/README.md and the record index bench/results/README.md (whose records are replaced
when a benchmark is re-run, so a stale path is the likely failure), and their relative links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", RESULTS / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]

# bench/... paths and record names (`2026-12-03-h200-run18/report.md`), not after a `git show
# <commit>:` (history) and not placeholders such as <path>.
PATH = re.compile(r"(?<![\w:/.-])((?:bench/)[\w./{},*-]+|20\d\d-\d\d-\d\d-[\w.-]+(?:/[\w./{},*-]*)?)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def expand(token: str) -> list[str]:
    """`a.{md,json}` -> a.md, a.json (one brace group at a time)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand(token[:m.start()] + alt + token[m.end():])]


def exists(path: str, base: Path) -> bool:
    path = path.rstrip(".,;:")
    for root in (REPO, base, RESULTS):
        if "*" in path and list(root.glob(path)):
            return True
        if (root / path).exists():
            return True
    return False


def missing(doc: Path) -> list[str]:
    text = doc.read_text()
    out = []
    for m in PATH.finditer(text):
        for p in expand(m.group(1)):
            if not exists(p, doc.parent):
                out.append(p)
    if doc == RESULTS / "README.md":  # the record column of the index: names relative to its first
        for row in text.splitlines():
            cells = row.split(" | ")
            if not row.startswith("| ") or len(cells) < 4 or cells[1].startswith("record"):
                continue
            names = [x for t in re.findall(r"`([^`]+)`", cells[1]) for x in expand(t)]
            folder = names[0].split("/")[0] if names and "/" in names[0] else ""
            out += [n for n in names if not (exists(n, RESULTS) or exists(f"{folder}/{n}", RESULTS))]
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" not in target and not (doc.parent / target).exists():
            out.append(target)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_paths_into_bench_resolve(doc: Path) -> None:
    assert missing(doc) == [], f"{doc.relative_to(REPO)} names paths that do not exist"


def test_expand() -> None:
    assert expand("a{,_b}.{txt,json}") == ["a.txt", "a.json", "a_b.txt", "a_b.json"]
