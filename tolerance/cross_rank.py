"""Checks across the ranks of a real torch.distributed run, beyond each rank's own comparison."""

from __future__ import annotations

import dataclasses

from moe_verify.spec import Status
from tolerance.policy import RANKS_AGREE_REASON
from tolerance.results import CheckResult, StageResult, Worst


def with_ranks_agree(result: StageResult, digests: list[str]) -> StageResult:
    """`result` (rank 0's all-reduced output against the golden) plus a "ranks agree" check:
    every rank's digest of its all-reduced output equals rank 0's. A disagreement fails a result
    that passed; the worst coordinates name the first rank that differs."""
    differ = [q for q, d in enumerate(digests) if d != digests[0]]
    agree = CheckResult(
        "ranks agree",
        not differ,
        len(differ),
        0,
        RANKS_AGREE_REASON,
        Worst(rank=differ[0]) if differ else None,
        f"rank(s) {differ} hold other bits than rank 0" if differ else "every rank holds rank 0's",
        beyond={"ranks": len(differ)},
    )
    status = result.status
    if differ and status is Status.PASS:
        status = Status.FAIL
    return dataclasses.replace(result, checks=[*result.checks, agree], status=status)
