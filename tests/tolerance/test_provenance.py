"""The provenance check of a tagged permute: each live slot's row names the token it holds."""

from __future__ import annotations

import pytest

from moe_verify.spec import Stage, Status
from tests.tolerance.synthetic import build_golden, clone_trace, slot_row, tiny_problem
from tolerance.compare import StageResult, compare_stage
from tolerance.policy import PROVENANCE_REASON
from tolerance.provenance import with_provenance

pytestmark = pytest.mark.cpu


def test_tagged_rows_in_place_pass() -> None:
    problem = tiny_problem()
    golden = build_golden(problem, provenance=True)
    result = with_provenance(compare_stage("permute", golden, golden, problem), golden, rank=0)
    assert result.status is Status.PASS
    check = result.checks[-1]
    assert (check.name, check.passed, check.value, check.reason) == (
        "provenance",
        True,
        0,
        PROVENANCE_REASON,
    )


def test_a_row_holding_another_token_fails_and_names_it() -> None:
    problem = tiny_problem()
    golden = build_golden(problem, provenance=True)
    other = clone_trace(golden)
    # Token 1's slot k=1 (expert 0) gets token 0's bytes: misrouted, not just reordered.
    a_perm = other["permute"]["a_perm"]
    a_perm[slot_row(golden, 1, 1)] = golden["permute"]["a_perm"][slot_row(golden, 0, 0)]
    result = with_provenance(compare_stage("permute", golden, other, problem), other, rank=3)
    assert result.status is Status.FAIL
    check = result.checks[-1]
    assert (check.name, check.passed, check.value) == ("provenance", False, 1)
    w = check.worst
    assert (w.token, w.k, w.expert, w.rank, w.golden, w.other) == (1, 1, 0, 3, 1, 0)
    assert "(t=1, k=1, e=0) holds token 0" in check.detail


def test_an_errored_permute_stays_an_error() -> None:
    problem = tiny_problem()
    golden = build_golden(problem, provenance=True)
    other = clone_trace(golden)
    other["permute"]["a_perm"][slot_row(golden, 1, 1)] = golden["permute"]["a_perm"][0]
    errored = StageResult(Stage.PERMUTE, Status.ERROR, [], "RuntimeError: boom")
    assert with_provenance(errored, other, rank=0).status is Status.ERROR


def test_other_stages_come_back_unchanged() -> None:
    problem = tiny_problem()
    golden = build_golden(problem, provenance=True)
    result = compare_stage("gemm1", golden, golden, problem)
    assert with_provenance(result, golden, rank=0) is result
