"""One wrong variant of an engine's kernels, the problem it runs, and the stage it must fail at:
the case type of the three adapters' wrong-variant tests."""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.spec import STAGES, MoEProblem
from tolerance import Report


@dataclass(frozen=True)
class Expect:
    variant: type
    problem: MoEProblem
    stage: str

    @property
    def id(self) -> str:
        return self.variant.__name__

    def overridden(self) -> list[str]:
        """The stages the variant overrides: it must be exactly the one it is expected to fail."""
        return [s for s in STAGES if s in vars(self.variant)]


def assert_fails_at_its_stage(expect: Expect, report: Report) -> None:
    """The variant's isolated run fails a check (it does not raise) at its stage, and blames
    that stage alone."""
    assert not report.passed, f"{expect.id} passed verification: {report.summary_line()}"
    culprit = report.first_failing_result
    assert culprit is not None and report.first_failure == expect.stage, report.summary_line()
    assert culprit.status == "fail", (
        f"{expect.id}: {culprit.label} raised instead of failing a check: {culprit.reason}"
    )
    failing = {r.stage for r in report.isolated or [] if r.status.failing}
    assert failing == {expect.stage}, f"isolated mode must blame {expect.stage} alone: {failing}"
