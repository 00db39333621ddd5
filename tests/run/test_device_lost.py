"""A stage that leaves the GPU unusable (a sticky illegal memory access) ends the case with the
stage named, instead of the next stage's harness code failing on the dead context and taking the
blame (seen on the H200: an IMA planted in gemm1 surfaced as a crash in act_quant)."""

from __future__ import annotations

import pytest

from moe_verify.run import runner
from moe_verify.run.runner import DeviceLost
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, StageContext
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu

PROBLEM = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)


class FaultsInGemm1(OptimizedBackend):
    name = "faults-in-gemm1"

    def gemm1(self, ctx: StageContext):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_lost_device_ends_the_case_naming_the_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_device_lost", lambda: True)
    with pytest.raises(DeviceLost, match=r"rank 0 isolated gemm1 left the GPU unusable") as info:
        verify(PROBLEM, backend=FaultsInGemm1(engine="triton"), mode="isolated")
    assert PROBLEM.id in str(info.value) and "illegal memory access" in str(info.value)


def test_a_usable_device_keeps_the_error_at_its_stage() -> None:
    report = verify(PROBLEM, backend=FaultsInGemm1(engine="triton"), mode="isolated")
    failing = [r for r in report.isolated if r.status.failing]
    assert [r.stage for r in failing] == ["gemm1"] and failing[0].status == "error"
