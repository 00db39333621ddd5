"""docs/implementations.md against the registry: its findings table is `moe-verify findings
--markdown`'s, every finding it names exists (or was retired), each entry has one section that
names its engine and stages and no release of its engine the registry does not list, and the
stage table's "finding N" cells sit in that finding's engine column and stage row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_verify.findings import table
from moe_verify.findings.registry import ENGINES, FINDINGS, RETIRED, Finding, finding

pytestmark = pytest.mark.cpu

DOC = Path(__file__).resolve().parents[2] / "docs" / "implementations.md"
BEGIN = "<!-- findings table: moe-verify findings --markdown -->"
END = "<!-- end findings table -->"
MENTION = re.compile(r"\b[Ff]indings? (\d+)(?:\s*(?:to|-|and)\s*(\d+))?")
HEADING = re.compile(r"^(#{2,3}) Finding (\d+)\b.*$", re.M)
VERSION = r"v?\d+\.\d+(?:\.\d+)?"
# "vLLM 0.32.0", "LMDeploy v0.17.0 and 0.18.0", "vLLM 0.32.0, 0.33.0 and 0.34.0"
RELEASES = re.compile(rf"\b({'|'.join(ENGINES.values())}) ({VERSION}(?:(?:,? and |, ){VERSION})*)")


def text() -> str:
    return DOC.read_text()


def sections() -> dict[int, str]:
    """finding id -> its section: the heading to the next heading of its level or above."""
    doc, out = text(), {}
    for m in HEADING.finditer(doc):
        level = len(m.group(1))
        end = re.compile(rf"^#{{1,{level}}} ", re.M).search(doc, m.end())
        out.setdefault(int(m.group(2)), []).append(doc[m.start() : end.start() if end else None])
    return {k: "\n".join(v) if len(v) == 1 else "" for k, v in out.items()}


def releases_named(section: str, f: Finding) -> set[str]:
    named = set()
    for m in RELEASES.finditer(section):
        if m.group(1) == f.engine_name:
            named.update(v.lstrip("v") for v in re.findall(VERSION, m.group(2)))
    return named


def listed(release: str, f: Finding) -> bool:
    """'0.32' names 0.32.x; '0.32.0' names itself."""
    known = (*f.seen_in, *f.fixed_in)
    return any(r == release or r.startswith(release + ".") for r in known)


def test_the_table_is_the_registrys() -> None:
    doc = text()
    assert doc.count(BEGIN) == 1 and doc.count(END) == 1
    block = doc[doc.index(BEGIN) + len(BEGIN) : doc.index(END)].strip()
    assert block == table.to_markdown(FINDINGS), (
        "docs/implementations.md's findings table is not the registry's: replace it with the "
        "output of `moe-verify findings --markdown`"
    )


def test_every_finding_named_exists() -> None:
    for m in MENTION.finditer(text()):
        for n in filter(None, m.groups()):
            assert int(n) in {f.id for f in FINDINGS} | set(RETIRED), f"{m.group(0)!r}: no such id"


@pytest.mark.parametrize("f", FINDINGS, ids=lambda f: f"finding{f.id}")
def test_each_finding_has_its_section(f: Finding) -> None:
    section = sections().get(f.id)
    assert section, f"no single '## Finding {f.id}' or '### Finding {f.id}' section"
    assert f.engine_name in section, f"finding {f.id}'s section does not name {f.engine_name}"
    for stage in f.stages:
        assert stage.value in section, f"finding {f.id}'s section does not name its stage {stage}"
    wrong = sorted(r for r in releases_named(section, f) if not listed(r, f))
    assert not wrong, f"finding {f.id}'s section names {f.engine_name} {wrong}: not in the registry"


def stage_table() -> list[list[str]]:
    """The rows of the first table (stage | one column per engine), cells stripped."""
    lines = [line for line in text().splitlines() if line.startswith("| ")]
    head = lines[0]
    rows = [head, *[line for line in lines[2:] if line.count("|") == head.count("|")]]
    rows = rows[: next((i for i, r in enumerate(rows) if r.startswith("| finding")), len(rows))]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows]


def test_the_stage_tables_findings_are_in_their_column_and_row() -> None:
    head, *rows = stage_table()
    engines = [next((e for e, name in ENGINES.items() if name in h), None) for h in head]
    seen = 0
    for row in rows:
        stages = row[0].replace(" ", "").split("/")
        for engine, cell in zip(engines, row, strict=True):
            for m in MENTION.finditer(cell):
                f = finding(int(m.group(1)))
                assert f.engine == engine, f"{row[0]}: finding {f.id} in the {engine} column"
                assert set(stages) & set(f.stages), f"finding {f.id} in the {row[0]} row"
                seen += 1
    assert seen, "the stage table names no finding: did its layout change?"


def test_the_section_check_can_fail() -> None:
    """A section naming a release the registry does not list is caught."""
    f = finding(6)
    assert releases_named("LMDeploy 0.16.0 and 0.18.0", f) == {"0.16.0", "0.18.0"}
    assert not listed("0.16.0", f) and listed("0.18", f)
