"""SM90 tier for topologies: DeepSeek-V3 at full scale with EP8 emulated on one H200, through
DeepGEMM where TritonOrDeepGemm picks it (E8M0 on: always). Each case runs eight rank-sized
verifications: 3-28 s each on the H200 since comparisons run on the GPU (140-240 s before), and
all three pass there (docs/gpu-results.md)."""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem
from moe_verify.sweep.cases import dsv3_ep8

pytestmark = [pytest.mark.sm90, pytest.mark.slow]


@pytest.mark.parametrize("problem", dsv3_ep8(), ids=lambda p: p.id)
def test_dsv3_ep8_emulated(problem: MoEProblem, record_report) -> None:
    report = record_report(verify(problem, mode="both"))
    assert report.passed_strict, report.summary_line()
    ranks = {r.rank for r in report.isolated if r.rank is not None}
    assert ranks == set(range(8))
    # TritonOrDeepGemm picks DeepGEMM at this scale on every rank: contiguous for ep:8 and
    # ep:8+ht, the masked GEMM for ep:8+ll (BatchedDeepGemmExperts).
    for mode in ("isolated", "chained"):
        engines = {r.engine for r in getattr(report, mode) if r.stage in ("gemm1", "gemm2")}
        assert engines == {"deepgemm"}, (mode, engines)
