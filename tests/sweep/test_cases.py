"""The curated presets as `sweep --list` shows them: id and the edge each case exercises."""

from __future__ import annotations

import pytest

from moe_verify.cli import main
from moe_verify.sweep.cases import preset, preset_edges

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("name", ["smoke", "topology", "nightly"])
def test_every_listed_case_of_a_curated_preset_names_its_edge(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sweep --list` prints id and edge: each curated preset carries an edge per case."""
    edges = preset_edges(name)
    assert set(edges) == {p.id for p in preset(name)} and all(edges.values())
    assert main(["sweep", "--preset", name, "--list"]) == 0
    rows = capsys.readouterr().out.splitlines()[:-1]
    assert rows and all(len(row.split("  ")) > 1 for row in rows), rows


def test_a_preset_without_edges_says_so_in_its_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--preset", "dsv3-ep8", "--list"]) == 0
    assert "(its ids name the shapes: no edge column)" in capsys.readouterr().out
