"""What the engine tiers' findings tests (tests/adapters/test_*_findings.py) share: the entries of
an engine as pytest parameters, and the two assertions every entry gets on the installed release.

- The check, run on the installed kernels, agrees with the registry (moe_verify/findings/
  verdict.py `judge`: seen on a listed release, or the message saying what to record).
- The same check, run on the kernels with the entry's bug taken out (a defect) or put in (a
  control), disagrees: each check can fail.
"""

from __future__ import annotations

import pytest

from moe_verify.findings.registry import Finding, for_engine
from moe_verify.findings.verdict import Observation, judge


def entries(engine: str) -> list:
    return [pytest.param(f, id=f"finding{f.id}") for f in for_engine(engine)]


def assert_agrees(finding: Finding, release: str, obs: Observation) -> None:
    verdict = judge(finding, release, obs)
    assert verdict is None, verdict


def assert_turned(finding: Finding, release: str, obs: Observation) -> None:
    """`obs` is the check's run on kernels whose bug was taken out (a control: put in): the
    check must see the difference, and the tier would then fail with a message."""
    assert not obs.seen, f"{finding.label}'s check cannot tell: it still sees it ({obs.detail})"
    assert judge(finding, release, obs) is not None
