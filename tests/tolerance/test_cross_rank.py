"""The "ranks agree" check of a real torchrun reduce: every rank must hold rank 0's bits."""

from __future__ import annotations

import pytest

from moe_verify.spec import Stage, Status
from tolerance.compare import CheckResult, StageResult
from tolerance.cross_rank import with_ranks_agree
from tolerance.policy import RANKS_AGREE_REASON

pytestmark = pytest.mark.cpu


def _reduce(status: Status) -> StageResult:
    passed = status is Status.PASS
    return StageResult(Stage.REDUCE, status, [CheckResult("per-token", passed, 0.0, 1.0, "r")])


def test_ranks_holding_the_same_bits_pass() -> None:
    result = with_ranks_agree(_reduce(Status.PASS), ["d0", "d0", "d0"])
    assert result.status is Status.PASS
    agree = result.checks[-1]
    assert (agree.name, agree.passed, agree.value, agree.worst) == ("ranks agree", True, 0, None)
    assert agree.reason == RANKS_AGREE_REASON
    assert agree.detail == "every rank holds rank 0's"
    assert [c.name for c in result.checks] == ["per-token", "ranks agree"]


def test_a_rank_holding_other_bits_fails_and_is_named() -> None:
    result = with_ranks_agree(_reduce(Status.PASS), ["d0", "d0", "d2", "d3"])
    assert result.status is Status.FAIL
    agree = result.checks[-1]
    assert (agree.passed, agree.value, agree.worst.rank) == (False, 2, 2)
    assert agree.detail == "rank(s) [2, 3] hold other bits than rank 0"


@pytest.mark.parametrize("status", [Status.FAIL, Status.ERROR])
def test_disagreement_keeps_a_status_that_was_not_a_pass(status: Status) -> None:
    assert with_ranks_agree(_reduce(status), ["d0", "d1"]).status is status
