"""SM90 tier: the whole FP8-block pipeline through DeepGEMM against the golden, stage by stage.

Each case runs isolated (every optimized stage fed the golden's inputs) and chained. GEMM stages
must report that DeepGEMM really ran where TritonOrDeepGemm selects it (a path assertion: a
silent fallback to Triton would otherwise pass). MX recipes run every stage natively with their
GEMMs on the Triton engine; DeepGEMM's MX GEMMs are SM100-only and are checked to skip with it.

Every new DeepGEMM GEMM shape (N, K, experts) is a JIT compile (about 9 s on the H200), so the
tests that force DeepGEMM on made-up problems (the masked and grouped layouts, poisoned
workspaces, the direct calls) all use one small shape, moe_verify/sweep/cases.py GPU_SHAPE, as the
graph
and production-op tests do: their kernels compile once for the tier.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Recipe
from moe_verify.sweep.cases import GPU_SHAPE, pipeline, preset

pytestmark = pytest.mark.sm90


def _size(p: MoEProblem) -> tuple[object, ...]:
    return (p.tokens, p.hidden, p.intermediate, p.num_experts, p.topk, p.recipe, p.scale_fmt,
            str(p.topology))  # fmt: skip


# The pipeline rows the nightly sweep (moe_verify/sweep/nightly.py: DeepSeek-V3 EP8-local at full
# size,
# T = 1, 128 and 4096, both SM90 formats) runs at the same size are left to it.
NIGHTLY_SIZES = {_size(p) for p in preset("nightly")}
CASES = [p for p in pipeline() if _size(p) not in NIGHTLY_SIZES]


def _engines(problem: MoEProblem) -> list[str]:
    """auto (what vLLM's TritonOrDeepGemm picks) for every case; for FP8-block cases that it
    sends to Triton (T < A, I_p <= 512 with fp32 scales) also DeepGEMM forced, so the DeepGEMM
    path is checked at every shape."""
    if problem.recipe is not Recipe.FP8_BLOCK:
        return ["triton"]
    small = problem.tokens < problem.alignment or problem.intermediate_per_rank <= 512
    return ["auto", "deepgemm"] if small and not problem.scale_fmt.is_ue8m0 else ["auto"]


PARAMS = [pytest.param(p, e, id=f"{p.id}-{e}") for p in CASES for e in _engines(p)]


def _expected_engine(problem: MoEProblem) -> str:
    """What vLLM's TritonOrDeepGemmExperts picks on SM90 for this case."""
    from optimized.deepgemm import choose_engine

    return choose_engine(problem, problem.tokens).engine


@pytest.mark.parametrize(("problem", "engine"), PARAMS)
def test_pipeline_matches_golden(problem: MoEProblem, engine: str, record_report) -> None:
    from optimized.backend import OptimizedBackend

    report = record_report(verify(problem, backend=OptimizedBackend(engine=engine), mode="both"))
    assert report.passed, report.summary_line()
    expected = engine if engine != "auto" else _expected_engine(problem)
    for mode in ("isolated", "chained"):
        for stage in ("gemm1", "gemm2"):
            assert report.engine(stage, mode) == expected, (
                f"{problem.id} {mode} {stage}: ran {report.engine(stage, mode)}, "
                f"TritonOrDeepGemm selects {expected}"
            )


@pytest.mark.parametrize("recipe", [Recipe.MXFP8, Recipe.MXFP4_W4A8], ids=str)
def test_deepgemm_mx_gemms_skip_on_sm90_with_the_reason(recipe: Recipe) -> None:
    from optimized.backend import OptimizedBackend

    fmt = recipe.allowed_scale_fmts[0]
    problem = MoEProblem(
        tokens=64, hidden=512, intermediate=512, num_experts=4, topk=2, recipe=recipe, scale_fmt=fmt
    )
    report = verify(problem, backend=OptimizedBackend(engine="deepgemm"), mode="isolated")
    status = {r.stage: r for r in report.isolated}
    assert status["gemm1"].status == "skip" and "SM100-only" in status["gemm1"].reason
    assert status["quant_input"].status == "pass" and status["act_quant"].status == "pass"


def test_our_ue8m0_packing_matches_deepgemms_packer() -> None:
    from optimized import deepgemm
    from optimized.kernels.quant import pack_ue8m0_from_fp32
    from reference.formats import pack_ue8m0, ue8m0_bytes

    gen = torch.Generator(device="cuda").manual_seed(0)
    for mn, groups in ((1, 4), (5, 7), (130, 56), (4096, 18)):
        exps = torch.randint(100, 140, (mn, groups), generator=gen, device="cuda")
        scale = torch.pow(2.0, (exps - 127).float())
        theirs = deepgemm.pack_ue8m0_reference(scale)
        ours = pack_ue8m0_from_fp32(scale)
        golden = pack_ue8m0(ue8m0_bytes(scale))
        assert theirs.stride() == ours.stride() == golden.stride(), (mn, groups)
        assert torch.equal(theirs, ours) and torch.equal(theirs, golden), (mn, groups)


def test_alignment_scope_restores_the_global_value() -> None:
    from optimized import deepgemm

    before = deepgemm.current_alignment()
    with deepgemm.alignment_scope(64):
        assert deepgemm.current_alignment() == 64
    assert deepgemm.current_alignment() == before
    with pytest.raises(RuntimeError, match="boom"), deepgemm.alignment_scope(256):
        raise RuntimeError("boom")
    assert deepgemm.current_alignment() == before


def test_first_deepgemm_call_runs_in_a_subprocess() -> None:
    from optimized import deepgemm

    ok, why = deepgemm.probe_first_call()
    assert ok, why


# DeepEP low-latency layout through DeepGEMM's masked GEMM, from a few rows per batch (T = 20:
# M_max is the 128-row capacity, MoEProblem.ll_max_tokens) to several blocks; four experts per
# rank (GPU_SHAPE).
LL_CASES = [
    MoEProblem(tokens=t, topk=4, topology="ep:2+ll", **GPU_SHAPE) for t in (20, 64, 200)
] + [
    MoEProblem(
        tokens=40,
        topk=2,
        topology="ep:4+ll",
        scale_fmt="float32_ceil_ue8m0",
        **{**GPU_SHAPE, "num_experts": 16},
    )  # four ranks
]


@pytest.mark.parametrize("problem", LL_CASES, ids=lambda p: p.id)
def test_masked_deepgemm_matches_golden(problem: MoEProblem, record_report) -> None:
    from optimized.backend import OptimizedBackend

    report = record_report(
        verify(problem, backend=OptimizedBackend(engine="deepgemm"), mode="both")
    )
    assert report.passed_strict, report.summary_line()
    for mode in ("isolated", "chained"):
        assert report.engine("gemm1", mode) == report.engine("gemm2", mode) == "deepgemm"


@pytest.mark.parametrize("scale_fmt", ["float32", "float32_ceil_ue8m0"])
def test_poisoned_workspaces_agree_with_a_fresh_run(scale_fmt: str) -> None:
    """Workspaces reused across calls and poisoned before each (vLLM's workspace pattern; rtp-llm PR
    #1098, SGLang issue #33106): every live row of every stage must be bitwise the fresh run's under
    both poisons."""
    from moe_verify.run.inputs import make_inputs
    from tests.run.test_workspaces import assert_two_poisons_agree_with_a_fresh_run

    problem = MoEProblem(tokens=300, topk=4, scale_fmt=scale_fmt, **GPU_SHAPE)
    assert_two_poisons_agree_with_a_fresh_run(problem, make_inputs(problem, "cuda"), "deepgemm")


def test_bad_layouts_are_refused_before_deepgemm_and_the_context_survives() -> None:
    """A misrouting m_indices or an oversized masked_m must raise before launch (no IMA), and the
    next valid call must still run: the CUDA context is not poisoned."""
    from moe_verify.spec import QuantizedWeight
    from optimized import deepgemm
    from optimized.kernels._validate import InvalidKernelInput

    def operands(g: int, m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.ones(m, k // 128, device="cuda")
        w = QuantizedWeight(
            torch.randn(g, n, k, device="cuda").to(torch.float8_e4m3fn),
            torch.ones(g, n // 128, k // 128, device="cuda"),
            (128, 128),
        )
        return a, sa, w

    # The GEMMs that run: GPU_SHAPE's gemm2 (N = H, K = I, 8 experts), rows on experts 0 and 1.
    h, i, experts = GPU_SHAPE["hidden"], GPU_SHAPE["intermediate"], GPU_SHAPE["num_experts"]
    a1, sa1, w1 = operands(experts, 256, h, i)
    good = torch.tensor([0] * 128 + [1] * 128, dtype=torch.int32, device="cuda")
    before = deepgemm.m_grouped_gemm(a1, sa1, 128, w1, w1.scale, good, 128, use_ue8m0=False)
    bad = good.clone()
    bad[200] = experts  # an expert id past the weights: DeepGEMM would read outside b
    with pytest.raises(InvalidKernelInput, match="outside"):
        deepgemm.m_grouped_gemm(a1, sa1, 128, w1, w1.scale, bad, 128, use_ue8m0=False)
    # The masked calls are refused before launch (nothing compiles): two groups of 128 rows.
    g, m, n, k = 2, 256, 256, 256
    a, sa, w = operands(g, m, n, k)
    counts = torch.tensor([3, 129], dtype=torch.int32, device="cuda")
    with pytest.raises(InvalidKernelInput, match="masked_m"):
        deepgemm.m_grouped_gemm_masked(
            a.view(g, 128, k), sa.view(g, 128, -1), w, w.scale, counts, 64, use_ue8m0=False
        )
    with pytest.raises(InvalidKernelInput, match="fills 128 rows"):  # DeepGEMM issue 268
        deepgemm.m_grouped_gemm_masked(
            a[:40].view(g, 20, k),
            sa[:40].view(g, 20, -1),
            w,
            w.scale,
            torch.full((g,), 20, dtype=torch.int32, device="cuda"),
            20,
            use_ue8m0=False,
        )
    after = deepgemm.m_grouped_gemm(a1, sa1, 128, w1, w1.scale, good, 128, use_ue8m0=False)
    torch.cuda.synchronize()
    assert bool(before.isfinite().all()) and bool(before.abs().amax() > 0)
    assert torch.equal(after, before), "the same GEMM gave other bits after the refused calls"


# -- the two grouped layouts through DeepGEMM ------------------------------------------------------

# GPU_SHAPE with T >= A (eight experts on every rank); each row names the edge it exercises.
LAYOUT_CASES = [
    MoEProblem(tokens=300, topk=4, **GPU_SHAPE),  # fp32
    MoEProblem(
        tokens=300,
        topk=4,
        scale_fmt="float32_ceil_ue8m0",
        routing="empty_middle",
        **GPU_SHAPE,
    ),  # vLLM's SM90 E8M0 format; an empty expert: its psum end is its start
    MoEProblem(
        tokens=200,
        topk=4,
        topology="ep:2",
        routing="invalid_slots",
        **{**GPU_SHAPE, "num_experts": 16},
    ),  # remote experts and -1 slots: a long tail past the last segment
]


@pytest.mark.parametrize("layout", ["m_indices", "psum"])
@pytest.mark.parametrize("problem", LAYOUT_CASES, ids=lambda p: p.id)
def test_both_grouped_layouts_pass_through_deepgemm(
    problem: MoEProblem, layout: str, record_report
) -> None:
    """m_indices and psum (DeepGEMM's use_psum_layout=True, what vLLM 0.32 runs on SM90) both
    pass isolated and chained, with DeepGEMM running both GEMMs in the layout forced."""
    from moe_verify.run.inputs import make_inputs
    from optimized.backend import OptimizedBackend

    forced = problem.replace(grouped_layout=layout)
    report = record_report(verify(forced, backend=OptimizedBackend(engine="deepgemm"), mode="both"))
    assert report.passed_strict, report.summary_line()
    for mode in ("isolated", "chained"):
        assert report.engine("gemm1", mode) == report.engine("gemm2", mode) == "deepgemm"
    trace = OptimizedBackend(engine="deepgemm").run(forced, make_inputs(forced, "cuda"))
    assert trace["gemm1"]["layout"] == trace["gemm2"]["layout"] == layout
    assert trace["act_quant"]["layout"] == layout


def test_auto_layout_is_psum_on_sm90() -> None:
    from optimized.deepgemm import choose_grouped_layout

    assert choose_grouped_layout(LAYOUT_CASES[0]).layout == "psum"


def test_deepgemm_psum_rows_equal_m_indices_rows_and_skip_nan_gaps() -> None:
    """One GEMM in both layouts on the same operands: the live rows are bit for bit equal, though
    the gap rows of A hold NaN bytes and their scales garbage (psum never reads them as live)."""
    from moe_verify.spec import QuantizedWeight
    from optimized import deepgemm

    n, k, a_ = GPU_SHAPE["hidden"], GPU_SHAPE["intermediate"], 128
    counts = (100, 0, 130, 0, 0, 0, 0, 0)  # expert 1 empty, expert 2 over one block, 3-7 empty
    g = len(counts)
    ends, m_indices, start = [], [], 0
    for e, c in enumerate(counts):
        ends.append(start + c)
        m_indices += [e] * c + [-1] * (-c % a_)
        start += -(-c // a_) * a_
    m_indices += [-1] * a_  # a tail block past the last segment
    m_sum = len(m_indices)
    layout = torch.tensor(m_indices, dtype=torch.int32, device="cuda")
    live = layout >= 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(m_sum, k, device="cuda", generator=gen) * 8).to(torch.float8_e4m3fn)
    sa = torch.rand(m_sum, k // 128, device="cuda", generator=gen) + 0.5
    w = QuantizedWeight(
        (torch.randn(g, n, k, device="cuda", generator=gen) * 8).to(torch.float8_e4m3fn),
        torch.rand(g, n // 128, k // 128, device="cuda", generator=gen) * 1e-2,
        (128, 128),
    )
    a_psum, sa_psum = a.clone(), sa.clone()
    a_psum.view(torch.uint8)[~live] = 0x7F  # NaN bytes
    sa_psum[~live] = float("nan")
    by_rows = deepgemm.m_grouped_gemm(a, sa, 128, w, w.scale, layout, a_, use_ue8m0=False)
    by_ends = deepgemm.m_grouped_gemm(
        a_psum,
        sa_psum,
        128,
        w,
        w.scale,
        torch.tensor(ends, dtype=torch.int32, device="cuda"),
        a_,
        use_ue8m0=False,
        use_psum_layout=True,
    )
    torch.cuda.synchronize()
    assert bool(by_rows[live].isfinite().all()) and bool(by_rows[live].abs().amax() > 0)
    assert torch.equal(by_ends[live].view(torch.int16), by_rows[live].view(torch.int16))


def test_bad_psum_layout_is_refused_before_deepgemm() -> None:
    from moe_verify.spec import QuantizedWeight
    from optimized import deepgemm
    from optimized.kernels._validate import InvalidKernelInput

    g, m, n, k = 2, 256, 256, 256
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(m, k // 128, device="cuda")
    w = QuantizedWeight(
        torch.randn(g, n, k, device="cuda").to(torch.float8_e4m3fn),
        torch.ones(g, n // 128, k // 128, device="cuda"),
        (128, 128),
    )
    for ends, words in (([100, 120], "below the start"), ([100, 300], "past the buffer")):
        layout = torch.tensor(ends, dtype=torch.int32, device="cuda")
        with pytest.raises(InvalidKernelInput, match=words):
            deepgemm.m_grouped_gemm(
                a, sa, 128, w, w.scale, layout, 128, use_ue8m0=False, use_psum_layout=True
            )
