"""The emulated topology sweep: every TP/EP layout, golden vs optimized per rank and reduced."""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem
from moe_verify.sweep.cases import TOPOLOGY

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("problem", TOPOLOGY, ids=lambda p: p.id)
def test_topology_matches_golden(problem: MoEProblem, record_report) -> None:
    report = record_report(verify(problem, mode="both", engine="triton"))
    assert report.passed, report.summary_line()
    ranks = {r.rank for r in report.isolated if r.rank is not None}
    assert ranks == set(range(problem.topology.size))  # every rank was compared
    assert any(r.stage == "reduce" and r.status == "pass" for r in report.isolated)
