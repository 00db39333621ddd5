"""The curated presets as `sweep --list` shows them: id and the edge each case exercises."""

from __future__ import annotations

import pytest

from moe_verify.cli import main
from moe_verify.sweep.cases import PRESETS, preset, preset_edges

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_listed_case_of_every_preset_names_its_edge(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sweep --list` promises id and edge (its --help): every preset carries an edge per case,
    and every row prints one."""
    cases = preset(name)
    edges = preset_edges(name)
    assert set(edges) == {p.id for p in cases} and all(edges.values()), name
    assert main(["sweep", "--preset", name, "--list"]) == 0
    *rows, count = capsys.readouterr().out.splitlines()
    assert count.startswith(f"{len(cases)} cases of {name};"), count
    assert [row.split()[0] for row in rows] == [p.id for p in cases]
    for row, case in zip(rows, cases, strict=True):
        assert row[len(case.id) :].strip() == edges[case.id], row
