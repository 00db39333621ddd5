"""The two grouped layouts end to end: DeepGEMM's per-row m_indices and its psum expert_ends.

Both come from one permute plan; the GEMMs and act_quant read the one vLLM 0.32 would pick
(`deepgemm.choose_grouped_layout`) or the one the problem forces. On the CPU the choice is
m_indices, so each layout is exercised by forcing it. Also here: a legitimate M_sum other than
the golden's (the older vLLM bound) passes in both modes and the report names its formula.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import Side, run_chained
from moe_verify.run.verify import verify
from moe_verify.run.workspaces import Workspaces
from moe_verify.spec import (
    Activation,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    MSumRecipe,
    Recipe,
    Routing,
    ScaleFmt,
    StageContext,
    Topology,
    Trace,
    round_up,
)
from optimized import deepgemm
from optimized.backend import OptimizedBackend
from optimized.topology import ShardCache
from tolerance.stages.context import live_slots

pytestmark = pytest.mark.cpu

M_INDICES, PSUM = GroupedLayout.M_INDICES, GroupedLayout.PSUM
CEIL, PACKED = ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
# Four experts, top-2, A = 32: every segment has live rows and a gap (counts ~8 of 32 rows).
BASE = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
EP2, EP2_HT = Topology.parse("ep:2"), Topology.parse("ep:2+ht")

# Each row names the edge it exercises; every one runs in both modes.
CASES = [
    BASE.replace(grouped_layout=PSUM, routing=Routing.EMPTY_MIDDLE),  # an empty expert: end=start
    BASE.replace(grouped_layout=PSUM, scale_fmt=CEIL, topology=EP2, routing=Routing.INVALID_SLOTS),
    # ^ -1 slots and remote experts; fp32 powers of two
    BASE.replace(grouped_layout=PSUM, scale_fmt=PACKED, routing=Routing.EMPTY_FIRST),
    # ^ packed UE8M0 act scales, the first expert empty (its gap is its whole segment)
    BASE.replace(grouped_layout=PSUM, scale_fmt=PACKED, topology=EP2_HT),  # exact M_sum: no tail
    BASE.replace(grouped_layout=M_INDICES, scale_fmt=CEIL, topology=EP2),  # forced m_indices
]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_both_layouts_pass_isolated_and_chained(problem: MoEProblem, record_report) -> None:
    report = record_report(verify(problem, backend=OptimizedBackend(engine="triton"), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for results in (report.isolated, report.chained):
        layouts = {r.stage: r for r in results or [] if r.stage in ("gemm1", "gemm2")}
        assert layouts and all(r.status == "pass" for r in layouts.values())


def _run(problem: MoEProblem, inputs: MoEInputs, layout: GroupedLayout) -> Trace:
    return OptimizedBackend(engine="triton").run(problem.replace(grouped_layout=layout), inputs)


@pytest.mark.parametrize(
    "problem",
    [
        BASE.replace(routing=Routing.EMPTY_LAST, activation=Activation("swigluoai", 1.702, 1.0, 7)),
        BASE.replace(scale_fmt=PACKED, routing=Routing.INVALID_SLOTS, topk=3),
    ],
    ids=lambda p: p.id,
)
def test_live_rows_agree_bitwise_between_layouts(problem: MoEProblem) -> None:
    """One plan, two readings: every live (token, k) row of mm1, a2q and its scales, mm2 and the
    output are bit for bit the same whichever layout the kernels read."""
    inputs = make_inputs(problem, "cpu")
    rows, ends = _run(problem, inputs, M_INDICES), _run(problem, inputs, PSUM)
    assert rows["gemm1"]["layout"] == "m_indices" and ends["gemm1"]["layout"] == "psum"
    assert ends["act_quant"]["layout"] == "psum"
    assert torch.equal(rows["permute"]["expert_ends"], ends["permute"]["expert_ends"])
    slots = live_slots(rows, ends)
    for stage, name in (("gemm1", "mm1"), ("act_quant", "a2q"), ("gemm2", "mm2")):
        a = rows[stage][name][slots.gold_rows].view(torch.uint8)
        b = ends[stage][name][slots.other_rows].view(torch.uint8)
        assert torch.equal(a, b), (stage, name)
    s_rows, s_ends = rows["act_quant"]["a2q_scale"], ends["act_quant"]["a2q_scale"]
    a, b = s_rows[slots.gold_rows], s_ends[slots.other_rows]  # logical rows, any strides
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(
        rows["gather"]["out"].view(torch.int16), ends["gather"]["out"].view(torch.int16)
    )


def test_psum_leaves_gap_rows_unwritten_and_the_comparison_does_not_read_them() -> None:
    """Under two poisons the psum path's gap rows differ (nothing wrote them), and both runs
    still pass verification: what the layout leaves unspecified is never compared."""
    problem = BASE.replace(grouped_layout=PSUM)
    inputs = make_inputs(problem, "cpu")
    sides = [Side(OptimizedBackend(engine="triton"), Workspaces(True, b)) for b in (0x00, 0xFF)]
    traces = [run_chained(side, problem, inputs, 0) for side in sides]
    report = verify(
        problem, backend=sides[1].backend, mode="both", inputs=inputs, workspace=True, poison=[0xFF]
    )
    assert report.passed
    gap = traces[0]["permute"]["m_indices"] == -1
    for stage, name in (("gemm1", "mm1"), ("act_quant", "a2q"), ("gemm2", "mm2")):
        a, b = (t[stage][name][gap].view(torch.uint8) for t in traces)
        assert bool((a != b).all()), f"{stage}.{name}: psum gap rows were written"


@pytest.mark.parametrize("production", [False, True], ids=["verification", "production"])
def test_permute_zeroes_psum_padding_in_verification_only(production: bool) -> None:
    """Production mode's permute leaves the psum layout's padding rows as the workspace held
    them (nothing reads them; bytes saved); verification zeroes them, so a chained run does not
    depend on a fresh buffer's bytes. The live rows are the same either way."""
    problem = BASE.replace(grouped_layout=PSUM)
    inputs = make_inputs(problem, "cpu")
    backend = OptimizedBackend(engine="triton")
    up = run_chained(Side(backend, Workspaces()), problem, inputs, 0)
    upstream = {s: up[s] for s in ("route", "quant_input", "align")}
    ctx = StageContext(
        problem, inputs, upstream, buffers=Workspaces(True, 0x55), validate=not production,
        graph_safe=production, shard_of=ShardCache(),
    )  # fmt: skip
    out = backend.permute(ctx)
    dead = out["m_indices"] < 0
    assert bool(dead.any()) and bool((~dead).any())
    rows = out["a_perm"].view(torch.uint8)
    assert bool((rows[dead] == (0x55 if production else 0)).all())
    live = up["permute"]["inv_perm"] >= 0
    want = up["permute"]["a_perm"][up["permute"]["inv_perm"][live].long()].view(torch.uint8)
    assert torch.equal(rows[out["inv_perm"][live].long()], want)


class AllExpertsBoundAlign(OptimizedBackend):
    """A legitimate older align: M_sum = round_up(M*k + E_l*(A-1), A) (vLLM before 0.30)."""

    name = "all_experts_bound_align"

    def __init__(self, declare: bool) -> None:
        super().__init__(engine="triton")
        self.declare = declare

    def align(self, ctx: StageContext) -> dict[str, object]:
        p, up = ctx.problem, ctx.upstream
        out = super().align(ctx)
        ids = up["route"]["topk_ids"]
        e_l = out["counts"].numel()
        slots = ids.shape[0] * ids.shape[1]
        out["M_sum"] = round_up(slots + e_l * (p.alignment - 1), p.alignment)
        if self.declare:
            out["recipe"] = MSumRecipe.ALL_EXPERTS_BOUND.value
        return out


# T*k = 6 < E = 8, so the bounds differ: 192 (min-active) vs 256 (all experts).
DECODE = BASE.replace(tokens=3, num_experts=8)


@pytest.mark.parametrize("declare", [False, True], ids=["matched", "declared"])
@pytest.mark.parametrize("layout", [M_INDICES, PSUM], ids=str)
def test_older_m_sum_bound_passes_and_is_named(
    layout: GroupedLayout, declare: bool, record_report
) -> None:
    problem = DECODE.replace(grouped_layout=layout)
    report = record_report(verify(problem, backend=AllExpertsBoundAlign(declare), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for results in (report.isolated, report.chained):
        align = next(r for r in results or [] if r.stage == "align")
        assert align.recipe == "all_experts_bound", align


# -- the layout choice ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "problem", "want"),
    [
        (None, BASE, M_INDICES),  # no GPU: nothing to choose by
        (9, BASE, PSUM),  # SM90, any scale format
        (9, BASE.replace(scale_fmt=CEIL), PSUM),
        (9, BASE.replace(activation=Activation("swigluoai", 1.702, 1.0, 7.0)), PSUM),
        (10, BASE.replace(scale_fmt=PACKED), PSUM),  # SM100 with UE8M0 (packed)
        (10, BASE.replace(scale_fmt=CEIL), M_INDICES),  # SM100 without vLLM's UE8M0 format
        (9, BASE.replace(recipe=Recipe.MXFP8, scale_fmt=PACKED), M_INDICES),  # never for MXFP8
        (10, BASE.replace(recipe=Recipe.MXFP4_W4A8, scale_fmt=PACKED), M_INDICES),  # FP4 experts
        (10, BASE.replace(scale_fmt=CEIL, grouped_layout=PSUM), PSUM),  # forced wins
        (9, BASE.replace(grouped_layout=M_INDICES), M_INDICES),
    ],
    ids=lambda v: v.id if isinstance(v, MoEProblem) else str(v),
)
def test_layout_choice_follows_vllm_0_32(
    monkeypatch: pytest.MonkeyPatch, arch: int | None, problem: MoEProblem, want: GroupedLayout
) -> None:
    monkeypatch.setattr(deepgemm, "_gpu_arch_major", lambda: arch)
    choice = deepgemm.choose_grouped_layout(problem)
    assert choice.layout is want, choice.reason
