"""Each failed check counts what lies beyond its bound, beside its worst coordinate: the elements
(codes, bytes) and the slots (token, k) or tokens holding them. A known number of bad elements is
planted in a copy of the golden, and the count must be found exactly: in the check, in its
one-line messages and in the JSON report."""

from __future__ import annotations

import json

import pytest
import torch

from moe_verify.spec import Mode, MoEProblem, Trace
from tests.tolerance.synthetic import build_golden, clone_trace, slot_row, tiny_problem
from tolerance import CheckResult, Report, compare

pytestmark = pytest.mark.cpu


@pytest.fixture
def problem() -> MoEProblem:
    return tiny_problem()


@pytest.fixture
def golden(problem: MoEProblem) -> Trace:
    return build_golden(problem)


def _failed(report: Report, stage: str, name: str) -> CheckResult:
    result = next(r for r in report.isolated or [] if r.stage == stage)
    return next(c for c in result.failed_checks if c.name == name)


def _report(problem: MoEProblem, golden: Trace, other: Trace) -> Report:
    results = compare(golden, other, problem, mode=Mode.ISOLATED)
    return Report(problem, "candidate", Mode.ISOLATED, isolated=results)


def _in_every_rendering(report: Report, text: str) -> None:
    assert any(text in line for line in report.failure_messages()), report.failure_messages()
    assert any(text in line for line in report.failure_lines()), report.failure_lines()


def test_a_gemm_counts_the_elements_and_slots_beyond_its_bound(
    problem: MoEProblem, golden: Trace
) -> None:
    other = clone_trace(golden)
    mm2 = other["gemm2"]["mm2"]
    planted = {(0, 0): [3, 9], (1, 0): [5], (2, 1): [0, 1, 2]}  # 6 elements in 3 slots
    for (t, k), cols in planted.items():
        mm2[slot_row(golden, t, k), cols] += 100.0
    report = _report(problem, golden, other)
    assert _failed(report, "gemm2", "elementwise").beyond == {"elements": 6, "slots": 3}
    assert _failed(report, "gemm2", "per-token").beyond == {"slots": 3}
    _in_every_rendering(report, "6 elements in 3 slots beyond")
    line = report.failure_lines()[0]  # beside the worst coordinate
    assert "elementwise" in line and ", 6 elements in 3 slots beyond at (token " in line


def test_nan_counts_the_elements_and_tokens_holding_them(
    problem: MoEProblem, golden: Trace
) -> None:
    other = clone_trace(golden)
    out = other["gather"]["out"]
    out[0, [4, 40]] = float("nan")
    out[2, 7] = float("inf")  # 3 elements in tokens 0 and 2
    report = _report(problem, golden, other)
    assert _failed(report, "gather", "nan_inf").beyond == {"elements": 3, "tokens": 2}
    _in_every_rendering(report, "3 elements in 2 tokens beyond")
    assert "gather: nan_inf 3 > 0, 3 elements in 2 tokens beyond at (token 0, " in "\n".join(
        report.failure_lines()
    )


def test_an_exact_check_counts_what_differs(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    a = other["permute"]["a_perm"].view(torch.uint8)
    a[slot_row(golden, 0, 0), [1, 2, 3]] ^= 1
    a[slot_row(golden, 2, 1), [10, 20]] ^= 1  # 5 bytes in 2 slots
    report = _report(problem, golden, other)
    check = _failed(report, "permute", "a_perm rows")
    assert (check.value, check.beyond) == (2, {"bytes": 5, "slots": 2})
    _in_every_rendering(report, "5 bytes in 2 slots beyond")
    assert report.summary_line().startswith(
        f"FAIL {problem.id} [candidate, isolated] first failure: permute (a_perm rows: 2 > 0, "
        "5 bytes in 2 slots beyond) at (token 0, k 0, "
    )


def test_one_of_a_unit_is_singular(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    other["gemm2"]["mm2"][slot_row(golden, 1, 1), 2] += 100.0
    report = _report(problem, golden, other)
    assert _failed(report, "gemm2", "elementwise").beyond_text() == "1 element in 1 slot beyond"


def test_the_counts_are_in_the_json_and_come_back(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    other["gather"]["out"][1, :3] = float("nan")
    report = _report(problem, golden, other)
    data = json.loads(report.to_json())
    gather = next(r for r in data["isolated"] if r["stage"] == "gather")
    nan_inf = next(c for c in gather["checks"] if c["name"] == "nan_inf")
    assert nan_inf["beyond"] == {"elements": 3, "tokens": 1}
    back = Report.from_dict(data)
    assert _failed(back, "gather", "nan_inf").beyond == {"elements": 3, "tokens": 1}
    assert back.to_dict() == report.to_dict()


def _slot(golden: Trace, t: int, k: int) -> str:
    return f"({t}, {k}, {int(golden['route']['topk_ids'][t, k])}, 0)"


def test_a_failure_names_the_first_failing_slots_and_how_many_more(
    problem: MoEProblem, golden: Trace
) -> None:
    """Beside the count, the first rows beyond the bound by (token, k, expert, rank), in row
    order; the rest counted."""
    other = clone_trace(golden)
    planted = [(0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]  # 5 slots: the first 4 named, 1 more
    for t, k in planted:
        other["gemm2"]["mm2"][slot_row(golden, t, k), 7] += 100.0
    report = _report(problem, golden, other)
    check = _failed(report, "gemm2", "elementwise")
    assert [(w.token, w.k) for w in check.first_rows] == planted[:4]
    named = ", ".join(_slot(golden, t, k) for t, k in planted[:4])
    want = f"slots (token, k, expert, rank): {named} and 1 more"
    assert check.rows_text() == want
    _in_every_rendering(report, want)


def test_failing_tokens_are_named_by_token_and_rank(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    other["gather"]["out"][[1, 3], 5] = float("nan")
    report = _report(problem, golden, other)
    check = _failed(report, "gather", "nan_inf")
    assert check.rows_text() == "tokens (token, rank): (1, 0), (3, 0)"
    _in_every_rendering(report, "tokens (token, rank): (1, 0), (3, 0)")


def test_an_exact_check_names_its_first_failing_slots(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    a = other["permute"]["a_perm"].view(torch.uint8)
    for t, k in [(1, 1), (3, 0)]:
        a[slot_row(golden, t, k), 4] ^= 1
    report = _report(problem, golden, other)
    named = f"slots (token, k, expert, rank): {_slot(golden, 1, 1)}, {_slot(golden, 3, 0)}"
    assert _failed(report, "permute", "a_perm rows").rows_text() == named
    _in_every_rendering(report, named)


def test_one_failing_row_is_named_by_the_worst_alone(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    other["gemm2"]["mm2"][slot_row(golden, 1, 1), 2] += 100.0
    check = _failed(_report(problem, golden, other), "gemm2", "elementwise")
    assert len(check.first_rows) == 1 and check.rows_text() == ""


def test_the_named_rows_are_in_the_json_and_come_back(problem: MoEProblem, golden: Trace) -> None:
    other = clone_trace(golden)
    other["gather"]["out"][[0, 2], 1] = float("nan")
    report = _report(problem, golden, other)
    data = json.loads(report.to_json())
    gather = next(r for r in data["isolated"] if r["stage"] == "gather")
    nan_inf = next(c for c in gather["checks"] if c["name"] == "nan_inf")
    assert [w["token"] for w in nan_inf["first_rows"]] == [0, 2]
    back = Report.from_dict(data)
    assert (
        _failed(back, "gather", "nan_inf").first_rows
        == _failed(report, "gather", "nan_inf").first_rows
    )
    assert back.to_dict() == report.to_dict()
