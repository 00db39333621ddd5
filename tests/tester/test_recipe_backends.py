"""Test-the-tester for legitimate recipes: a backend on another legitimate recipe than the
golden's passes in both modes and the report names the recipe; one that declares a recipe it does
not compute, or computes an arithmetic no kernel uses, fails at that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Stage, Topology
from optimized.backend import OptimizedBackend
from tests.tester import recipe_backends as rb

pytestmark = pytest.mark.cpu

# fp32 scales, where vLLM's two input quantizers differ in most groups (and at ties in codes);
# A = 32, one 128-column group per row, as the wrong-backend cases.
BASE = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
# The batched low-latency layout: act_quant there may also be vLLM's bf16 CUDA kernel.
LL = BASE.replace(topology=Topology.parse("ep:2+ll"))


@dataclass(frozen=True)
class Legit:
    backend: type[OptimizedBackend]
    problem: MoEProblem
    stage: str
    recipe: str

    @property
    def id(self) -> str:
        return f"{self.backend.name}-{self.problem.topology}"


LEGIT = [
    Legit(rb.TritonReciprocalQuant, BASE, Stage.QUANT_INPUT, "triton_reciprocal"),
    Legit(rb.TritonReciprocalQuant, LL, Stage.QUANT_INPUT, "triton_reciprocal"),  # dispatch
    Legit(rb.Bf16StepsActQuant, LL, Stage.ACT_QUANT, "bf16_steps"),
]


@pytest.mark.parametrize("legit", LEGIT, ids=lambda c: c.id)
def test_legitimate_recipe_passes_and_is_named(legit: Legit, record_report) -> None:
    report = record_report(
        verify(legit.problem, backend=legit.backend(engine="triton"), mode="both")
    )
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for mode in ("isolated", "chained"):
        assert report.recipes(mode)[legit.stage] == legit.recipe, report.recipes(mode)
    assert f"{legit.stage} {legit.recipe}" in report.summary_line()
    for text in (report.to_table(), report.to_markdown(), report.to_summary()):
        rows = [line for line in text.splitlines() if line.lstrip("| ").startswith(legit.stage)]
        assert rows and all(f"({legit.recipe})" in row for row in rows), rows


@dataclass(frozen=True)
class Miss:
    backend: type[OptimizedBackend]
    problem: MoEProblem
    stage: str
    declared: str | None  # the recipe the failing stage is held to (its declaration), if any


MISSES = [
    # declares the CUDA division, computes the Triton reciprocal: 1-ulp scales, tie codes
    Miss(rb.DeclaresCudaComputesTriton, BASE, Stage.QUANT_INPUT, "cuda_division"),
    Miss(rb.Bf16InverseQuant, BASE, Stage.QUANT_INPUT, None),  # amax x bf16(1/448)
    Miss(rb.DeclaresColmajorComputesBf16Steps, LL, Stage.ACT_QUANT, "colmajor"),
    Miss(rb.Fp32ScaleBf16Steps, LL, Stage.ACT_QUANT, None),  # bf16 steps but an fp32 scale
    # vLLM's bf16 CUDA kernel runs on the batched layout only: on the contiguous one it is a bug
    Miss(rb.Bf16StepsActQuant, BASE, Stage.ACT_QUANT, None),
]


@pytest.mark.parametrize("miss", MISSES, ids=lambda m: f"{m.backend.name}-{m.problem.topology}")
def test_near_miss_fails_at_its_stage(miss: Miss, record_report) -> None:
    report = record_report(
        verify(miss.problem, backend=miss.backend(engine="triton"), mode="isolated")
    )
    assert not report.passed
    culprit = report.first_failing_result
    assert culprit is not None and culprit.stage == miss.stage, report.summary_line()
    assert culprit.status == "fail" and culprit.recipe == miss.declared
    failing = {r.stage for r in report.results if r.status.failing}
    assert failing == {miss.stage}, report.summary_line()
    failed = [c for r in report.results if r.status.failing for c in r.failed_checks]
    assert any(c.worst is not None and c.worst.token is not None for c in failed)
    held = f"against the declared recipe {miss.declared}" if miss.declared else "the closest"
    assert all(held in c.detail for c in failed)
