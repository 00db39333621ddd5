"""A stage an adapter runs with the suite's own code says so in the report's stage column.

No engine is needed: `SuiteOnly` is an AdaptedBackend that adapts no stage, so route and shared
are AdaptedBackend's (the suite's, marked) and every other stage is OptimizedBackend's (unmarked:
a plain OptimizedBackend has no "[suite]" anywhere, so the mark is the adapter's, not the run's).
"""

from __future__ import annotations

import pytest

from moe_verify import verify
from moe_verify.adapters.common import AdaptedBackend
from moe_verify.spec import SUITE_CODE, MoEProblem
from optimized import OptimizedBackend

pytestmark = pytest.mark.cpu

PROBLEM = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)


class SuiteOnly(AdaptedBackend):
    label = "suite-only"

    def __init__(self) -> None:
        super().__init__("0.0")


def test_the_suites_routing_in_an_adapter_is_marked_in_the_stage_column() -> None:
    report = verify(PROBLEM, SuiteOnly(), "isolated")
    assert report.passed, report.to_table()
    assert report.engine("route") == SUITE_CODE
    assert "route [suite]" in report.to_table()
    assert "route [suite]" in report.to_markdown()
    # the stages the adapter leaves to OptimizedBackend's kernels are not marked as the suite's
    assert report.engine("permute") is None
    assert "permute [suite]" not in report.to_table()


def test_the_optimized_backend_itself_is_not_marked() -> None:
    report = verify(PROBLEM, OptimizedBackend(), "isolated")
    assert report.passed, report.to_table()
    assert report.engine("route") is None
    assert "[suite]" not in report.to_table()


def test_the_mark_survives_the_json_report() -> None:
    from tolerance import Report

    report = verify(PROBLEM, SuiteOnly(), "isolated")
    again = Report.from_dict(report.to_dict())
    assert again.engine("route") == SUITE_CODE
    assert "route [suite]" in again.to_table()
