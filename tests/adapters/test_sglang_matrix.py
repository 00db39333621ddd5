"""SGLang 0.5.23's installed DeepGEMM-runner kernels (under the Triton interpreter on a CPU) against
the golden through moe_verify.adapters.sglang, on a covering matrix, each row its own item, both
modes.

On a CPU SGLang's quant_input and act_quant are JIT-compiled CUDA and skip with that reason, so
chained mode stops at quant_input and isolated mode (the golden's upstream) judges SGLang's align
(counts, the tight M_sum), permute (pad_expert_counts + ep_scatter) and gather
(post_reorder_deepgemm); the GEMMs are the suite's Triton engine. Every (scale format, topology)
pair of fp32 and ceil-UE8M0 x tp:1, tp:2, ep:2, ep:4 appears once; routing edges, H and the
activation are spread over them, and a few rows add the size edges (T*k < E, T = 1).
"""

from __future__ import annotations

import pytest

from moe_verify.adapters.sglang import SglangBackend
from moe_verify.run.verify import verify
from moe_verify.spec import (
    Activation,
    MoEProblem,
    RoutedScalingRecipe,
    Routing,
    ScaleFmt,
    Stage,
    Status,
    Topology,
)
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.sglang

F32, CEIL = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0
SILU = Activation()
CLAMPED = Activation("silu", limit=1.5)  # SGLang's swiglu_limit on silu
OAI = Activation("swigluoai", 1.702, 1.0, 1.5)  # not on SGLang's DeepGEMM runner: act_quant skips


def case(
    fmt: ScaleFmt,
    topology: str,
    routing: Routing,
    *,
    act: Activation = SILU,
    hidden: int = 384,
    tokens: int = 12,
    topk: int = 2,
    experts: int = 8,
) -> MoEProblem:
    """I = 256; A = 128, DeepGEMM's SM90 contiguous-layout BLOCK_M, the one SGLang pads to."""
    return MoEProblem(
        tokens=tokens,
        hidden=hidden,
        intermediate=256,
        num_experts=experts,
        topk=topk,
        scale_fmt=fmt,
        activation=act,
        routing=routing,
        topology=Topology.parse(topology),
    )


MATRIX: list[MoEProblem] = [
    case(F32, "tp:1", Routing.SOFTMAX),  # T*k = 24: tight M_sum 1024 < min-active 1152
    case(CEIL, "tp:1", Routing.EMPTY_FIRST, act=OAI, hidden=1536),  # expert 0 empty
    case(F32, "tp:2", Routing.EMPTY_LAST, act=CLAMPED),  # last expert empty: the tail after it
    case(CEIL, "tp:2", Routing.INVALID_SLOTS),  # -1 slots, whole tokens with none (zeros)
    case(F32, "ep:2", Routing.EMPTY_MIDDLE, hidden=1536),  # expert_start 4 on rank 1
    case(CEIL, "ep:2", Routing.ONE_EXPERT, act=CLAMPED),  # one rank has no live row
    case(F32, "ep:4", Routing.DUPLICATES, tokens=5, topk=3),  # T*k = 15, duplicates
    case(CEIL, "ep:4", Routing.INVALID_SLOTS, act=OAI),  # -1 and remote slots
    case(CEIL, "tp:1", Routing.SOFTMAX, tokens=3),  # T*k = 6 < E: tight = min-active
    case(F32, "tp:1", Routing.SOFTMAX, tokens=1, topk=4),  # T = 1, T*k < E
    case(F32, "ep:2", Routing.SOFTMAX, tokens=3),  # T*k < E with an expert range
    case(CEIL, "tp:1", Routing.SKEW, tokens=4, experts=4, hidden=7168),  # DeepSeek-V3's H
    # grouped routing with routed_scaling_factor 2.5: SGLang's route leaves the weights unscaled
    # (declares scale_on_output) and post_reorder_deepgemm multiplies the fp32 sum by 2.5
    case(F32, "tp:1", Routing.GROUPED).replace(
        num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
]

SGLANG_STAGES = (Stage.ALIGN, Stage.PERMUTE, Stage.GATHER)
JIT_CUDA = (Stage.QUANT_INPUT, Stage.ACT_QUANT)


@pytest.fixture(scope="module")
def sglang_backend():
    from moe_verify.adapters.sglang import SglangBackend

    return SglangBackend()


def test_matrix_ids_are_unique() -> None:
    assert len({p.id for p in MATRIX}) == len(MATRIX)


@pytest.mark.parametrize("problem", MATRIX, ids=lambda p: p.id)
def test_sglang_matches_the_golden(problem: MoEProblem, sglang_backend, record_report) -> None:
    report = record_report(verify(problem, backend=sglang_backend, mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    isolated = report.isolated or []
    ran = {r.stage for r in isolated if r.status is Status.PASS}
    assert set(SGLANG_STAGES) <= ran, f"SGLang's stages did not all pass: {report.summary_line()}"
    align = [r for r in isolated if r.stage == Stage.ALIGN]
    assert all(r.recipe == "tight_bound" for r in align), [r.recipe for r in align]
    if sglang_backend.sglang.on_cuda:
        return
    for results in (report.isolated, report.chained):
        for r in results or []:
            if r.stage in JIT_CUDA:
                # swigluoai: DeepGemmRunnerCore refuses it before any kernel
                want = "asserts activation" if problem.activation.kind != "silu" else "CUDA"
                if r.stage == Stage.QUANT_INPUT or results is report.chained:
                    want = "CUDA"
                assert r.status is Status.SKIP and want in (r.reason or ""), (r.label, r.reason)


SCALED = [p for p in MATRIX if p.routed_scaling_factor != 1.0]
ON_OUTPUT = RoutedScalingRecipe.SCALE_ON_OUTPUT.value


class SglangWithSuiteQuant(SglangBackend):
    """SGLang's kernels with the suite's quant_input and act_quant in place of SGLang's JIT-CUDA
    ones, so that on a CPU chained mode reaches post_reorder_deepgemm on SGLang's own route."""

    name = label = "sglang+suite-quant"
    quant_input = OptimizedBackend.quant_input
    act_quant = OptimizedBackend.act_quant


@pytest.mark.parametrize("problem", SCALED, ids=lambda p: p.id)
def test_sglang_applies_the_routed_scaling_factor_on_output(
    problem: MoEProblem, record_report
) -> None:
    """Route declares scale_on_output (unscaled weights), and the gather is SGLang's kernel with
    the factor, judged in that reading, isolated (fed the golden's unscaled weights) and chained
    (its own route's)."""
    backend = SglangWithSuiteQuant()
    report = record_report(verify(problem, backend=backend, mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for mode in ("isolated", "chained"):
        ran = {r.stage for r in getattr(report, mode) or [] if r.status is Status.PASS}
        assert {Stage.ROUTE, Stage.GATHER} <= ran, (mode, report.summary_line())
        assert report.recipes(mode)[Stage.ROUTE] == ON_OUTPUT, report.recipes(mode)
    assert report.recipes("isolated")[Stage.GATHER].endswith(f"+{ON_OUTPUT}")
