"""The other half of test-the-tester: the correct optimized backend must pass every check.

A suite that rejects the wrong backends but also the right one proves nothing. The default tier
runs the SMOKE cases on three seeds, each (case, seed) its own item; the slow tier sweeps twenty
seeds per case and lists every seed that failed (calibration data for the policy table).
"""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem
from moe_verify.sweep.cases import SMOKE
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu

QUICK_SEEDS = range(3)
SWEEP_SEEDS = range(20)


def _check(problem: MoEProblem) -> list[str]:
    """Failure lines of one verification (empty when it passed)."""
    report = verify(problem, backend=OptimizedBackend(engine="triton"), mode="both")
    return [] if report.passed else [report.summary_line(), *report.failure_messages()]


@pytest.mark.parametrize(
    "problem", [p.replace(seed=s) for p in SMOKE for s in QUICK_SEEDS], ids=lambda p: p.id
)
def test_correct_backend_passes(problem: MoEProblem, record_report) -> None:
    report = record_report(verify(problem, backend=OptimizedBackend(engine="triton"), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])


@pytest.mark.slow
@pytest.mark.parametrize("case", SMOKE, ids=lambda p: p.id)
def test_correct_backend_passes_every_seed(case: MoEProblem) -> None:
    failures = {seed: _check(case.replace(seed=seed)) for seed in SWEEP_SEEDS}
    failed = {seed: lines for seed, lines in failures.items() if lines}
    assert not failed, f"{len(failed)} of {len(SWEEP_SEEDS)} seeds failed: {sorted(failed)}\n" + (
        "\n".join(line for lines in failed.values() for line in lines)
    )
