"""Nothing a user reads cites a file the user does not have.

The project was built from notes that are not part of the repository (a design file, a style
file, a machine-facts file, a reference folder of specs and field-bug lists, an article). A
citation of one of them points nowhere for everyone else: each must be a docs/ page, a public
source at a release, a public issue or PR, or the explanation itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Whitespace and comment leaders may split a citation over two lines.
GAP = r"[\s#*>-]*"
PRIVATE = re.compile(
    "|".join(
        (
            r"\b(?:DESIGN|STYLE|ENVIRONMENT)\.md\b",
            r"\bref/",  # the reference folder
            rf"\bref\.?{GAP}§",  # "ref §14.10": a section of the vLLM path notes
            r"§\s*\d",  # a bare "§5.2" numbers a section of those notes too (docs/ use links)
            rf"\bseed{GAP}article",
            r"(?-i:\banchors\b)",  # the field-bug lists ("anchors #6", anchors-2026-12.md)
            r"vllm-deepgemm-path|deepgemm-api",
        )
    ),
    re.IGNORECASE,
)


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", ".ci/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [p for p in out.splitlines() if p != SELF and (ROOT / p).is_file()]


def private_citations(paths: list[str]) -> list[str]:
    """`path:line: text` for every line of `paths` where a citation of a private file starts."""
    hits = []
    for path in paths:
        text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        starts = {text.count("\n", 0, m.start()) + 1 for m in PRIVATE.finditer(text)}
        hits += [f"{path}:{n}: {lines[n - 1].strip()}" for n in sorted(starts)]
    return hits


def test_the_pattern_finds_each_kind_of_citation() -> None:
    for text in (
        'DESIGN.md "Legitimate recipes"',
        "(STYLE.md)",
        "shared/ENVIRONMENT.md",
        "ref/deepgemm-api.md §1.5",
        "it ignores stride(1) (ref §14.10)",
        "the seed\n    # article's layout",
        "vLLM's workspace pattern, anchors\n    #2",
        "deepgemm-api §2.3",
        "the colmajor kernel (§5.2)",
    ):
        assert PRIVATE.search(text), text
    for text in ("reference/moe.py", "torch.manual_seed(0)", "href/x", "Anchors of"):
        assert not PRIVATE.search(text), text


def test_no_tracked_file_cites_a_private_file() -> None:
    hits = private_citations(_tracked())
    assert not hits, f"{len(hits)} citations of files users do not have:\n" + "\n".join(hits)
