"""align's legitimate M_sum formulas and the two grouped layouts (m_indices, psum expert_ends) in
the comparison: what passes (another valid M_sum, a longer or shorter buffer, psum gap rows
holding anything) and that each check can fail, on the hand-built traces of synthetic.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_verify.spec import Mode, MoEProblem, Status, Trace
from tests.tolerance.synthetic import ALIGNMENT, build_golden, clone_trace, slot_row, tiny_problem
from tolerance import StageResult, compare, compare_stage
from tolerance.stages.layouts import psum_row_experts

pytestmark = pytest.mark.cpu

PROBLEMS = {
    "fp8_block-float32": tiny_problem(),  # fp32 permuted scales
    "mxfp8-packed": tiny_problem("mxfp8", "ue8m0_packed"),  # packed permuted scales
}
# synthetic.py's routing: counts [2, 2, 3, 0] in 8-row segments, so M_sum 24 exactly and 40 by
# either bound (min(M*k = 8, E = 4) = E: the two bounds coincide).
EXACT, BOUND = 24, 40


@pytest.fixture(params=list(PROBLEMS), ids=list(PROBLEMS))
def problem(request: pytest.FixtureRequest) -> MoEProblem:
    return PROBLEMS[request.param]


@pytest.fixture
def golden(problem: MoEProblem) -> Trace:
    return build_golden(problem)


@pytest.fixture
def other(golden: Trace) -> Trace:
    return clone_trace(golden)


def _stage(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str, mode: Mode = Mode.ISOLATED
) -> StageResult:
    return compare_stage(stage, golden, other, problem, mode=mode)


def _failed(result: StageResult) -> dict[str, object]:
    return {c.name: c for c in result.failed_checks}


def _resize_permute(trace: Trace, m_sum: int) -> None:
    """Give `trace`'s permute (and the stages after it) m_sum rows: rows past the old end are
    padding (m_indices -1, zero data and scales), rows cut off must have been padding."""

    def resize(x: torch.Tensor) -> torch.Tensor:
        rows = min(m_sum, x.shape[0])
        if x.dim() == 1:
            out = torch.full((m_sum,), -1, dtype=x.dtype)
        elif x.dtype == torch.int32:  # packed UE8M0: MN-major, TMA-aligned
            out = torch.zeros((m_sum, x.shape[1]), dtype=x.dtype)
            out = out.t().contiguous().t() if m_sum % 4 == 0 else out
        else:
            out = torch.zeros((m_sum, *x.shape[1:]), dtype=x.dtype)
        out[:rows] = x[:rows]
        return out

    trace["align"]["M_sum"] = m_sum
    for stage, name in (
        ("permute", "a_perm"),
        ("permute", "a_scale_perm"),
        ("permute", "m_indices"),
        ("gemm1", "mm1"),
        ("act_quant", "a2q"),
        ("act_quant", "a2q_scale"),
        ("gemm2", "mm2"),
    ):
        trace[stage][name] = resize(trace[stage][name])


# -- align ----------------------------------------------------------------------------------------


def test_exact_m_sum_names_its_formula(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    result = _stage(golden, other, problem, "align")
    assert result.status == Status.PASS and result.recipe == "exact_counts"


def test_upper_bound_m_sum_passes_naming_both_bounds(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["align"]["M_sum"] = BOUND
    result = _stage(golden, other, problem, "align")
    assert result.status == Status.PASS
    assert result.recipe == "min_active_bound = all_experts_bound"


def test_declared_recipe_passes_and_is_named(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["align"].update({"M_sum": BOUND, "recipe": "all_experts_bound"})
    result = _stage(golden, other, problem, "align")
    assert result.status == Status.PASS and result.recipe == "all_experts_bound"


@pytest.mark.parametrize(
    ("declared", "m_sum", "words"),
    [
        ("all_experts_bound", EXACT, "declares 'all_experts_bound' (= 40)"),  # valid, not its own
        ("largest_power_of_two", BOUND, "is not a legitimate M_sum formula"),
    ],
    ids=["declared-formula-not-matched", "declared-unknown-recipe"],
)
def test_declared_recipe_must_be_met(
    golden: Trace, other: Trace, problem: MoEProblem, declared: str, m_sum: int, words: str
) -> None:
    other["align"].update({"M_sum": m_sum, "recipe": declared})
    result = _stage(golden, other, problem, "align")
    failed = _failed(result)
    assert set(failed) == {"M_sum recipe"} and words in failed["M_sum recipe"].detail
    assert result.recipe is None


@pytest.mark.parametrize(
    ("m_sum", "check"),
    [(EXACT + 1, "M_sum % alignment"), (EXACT - ALIGNMENT, "M_sum fits segments")],
    ids=["not-a-multiple-of-A", "below-the-exact-sum"],
)
def test_invalid_m_sum_fails_and_names_no_recipe(
    golden: Trace, other: Trace, problem: MoEProblem, m_sum: int, check: str
) -> None:
    other["align"]["M_sum"] = m_sum
    result = _stage(golden, other, problem, "align")
    assert check in _failed(result) and result.recipe is None


# -- permute: m_indices per segment, psum ends, both layouts one plan ----------------------------


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("m_sum", [BOUND, EXACT + ALIGNMENT], ids=["bound", "one-more-block"])
def test_longer_buffer_passes_every_stage(
    golden: Trace, other: Trace, problem: MoEProblem, m_sum: int, mode: Mode
) -> None:
    _resize_permute(other, m_sum)
    results = compare(golden, other, problem, mode=mode)
    assert all(r.status == Status.PASS for r in results), [
        (r.stage, [c.detail for c in r.failed_checks]) for r in results if r.failed_checks
    ]


def test_shorter_golden_buffer_passes_permute(problem: MoEProblem) -> None:
    # The golden at the bound, the tested side exact: the segments are the same rows.
    golden, other = build_golden(problem), build_golden(problem)
    _resize_permute(golden, BOUND)
    golden["align"]["M_sum"] = BOUND
    assert _stage(golden, other, problem, "permute").status == Status.PASS


def test_buffer_below_the_segments_fails_m_indices(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    _resize_permute(other, EXACT - ALIGNMENT)  # expert 2's segment cut off
    check = _failed(_stage(golden, other, problem, "permute"))["m_indices"]
    assert "local expert 2's segment" in check.detail


def test_m_indices_wrong_in_one_segment_fails_naming_it(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    m = other["permute"]["m_indices"]
    m[slot_row(golden, 1, 0)] = 1  # a live row of expert 2's segment (rows 16..23) says 1
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert "1 of 5 expert segments" in failed["m_indices"].detail
    assert "local expert 2's segment" in failed["m_indices"].detail
    assert {"m_indices", "layouts agree", "expert rows"} <= set(failed)


def test_tail_row_past_the_golden_buffer_must_be_padding(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    _resize_permute(other, BOUND)
    other["permute"]["m_indices"][BOUND - 1] = 3
    check = _failed(_stage(golden, other, problem, "permute"))["m_indices"]
    assert "the tail past the segments" in check.detail and check.worst.row == BOUND - 1


@pytest.mark.parametrize("step", [1, -1], ids=["one-gap-row-live", "last-live-row-dropped"])
def test_expert_ends_off_by_one_fails(
    golden: Trace, other: Trace, problem: MoEProblem, step: int
) -> None:
    other["permute"]["expert_ends"][2] += step  # expert 2: 3 live rows of its 8
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert set(failed) == {"expert_ends", "layouts agree"}
    assert "local expert 2" in failed["expert_ends"].detail
    assert failed["layouts agree"].worst.row == 16 + 3 + min(step, 0)


def test_forced_layout_must_be_the_one_reported(golden: Trace, other: Trace) -> None:
    problem = tiny_problem().replace(grouped_layout="psum")
    golden, other = build_golden(problem), clone_trace(build_golden(problem))
    other["permute"]["layout"] = "m_indices"
    other["gemm1"]["layout"] = "psum"
    assert set(_failed(_stage(golden, other, problem, "permute"))) == {"layout"}
    assert _stage(golden, other, problem, "gemm1").status == Status.PASS
    del other["gemm1"]["layout"]
    check = _failed(_stage(golden, other, problem, "gemm1"))["layout"]
    assert "no layout entry" in check.detail


# -- what each layout promises for padding rows ---------------------------------------------------


def _garbage_padding_scales(trace: Trace) -> int:
    """Write a value no padding contract allows (fp32 0.3, not a power of two, or a 0xFF byte)
    into a padding row."""
    row = int(torch.nonzero(trace["permute"]["m_indices"] == -1)[0, 0])
    scale = trace["permute"]["a_scale_perm"]
    scale[row, 0] = 0xFF if scale.dtype == torch.int32 else 0.3
    return row


def test_padding_scales_are_checked_under_m_indices(problem: MoEProblem) -> None:
    if problem.scale_fmt == "float32":  # plain fp32 padding scales are unspecified
        problem = problem.replace(scale_fmt="float32_ceil_ue8m0")  # the packer's powers of two
    golden = build_golden(problem)
    other = clone_trace(golden)
    row = _garbage_padding_scales(other)
    other["permute"]["layout"] = "m_indices"
    check = _failed(_stage(golden, other, problem, "permute"))["padding scales"]
    assert check.worst.row == row


def test_psum_gap_rows_may_hold_anything(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    _garbage_padding_scales(other)
    other["permute"]["layout"] = "psum"  # DeepGEMM's psum SFA packer skips gap rows
    result = _stage(golden, other, problem, "permute")
    assert result.status == Status.PASS
    assert "padding scales" not in {c.name for c in result.checks}


# -- GEMM rows keyed through the layout the GEMM read ---------------------------------------------


@pytest.mark.parametrize("layout", ["m_indices", "psum"])
def test_chained_slot_on_a_row_the_layout_leaves_unspecified_fails_keying(
    golden: Trace, other: Trace, problem: MoEProblem, layout: str
) -> None:
    # Token 3's slot moved to its segment's first gap row (row 16 + 3): the data moves with it,
    # but neither layout gives that row an output (m_indices -1 there; psum: past expert 2's end).
    old, gap = slot_row(golden, 3, 0), 16 + 3
    for stage, name in (("gemm1", "mm1"),):
        other[stage][name][gap] = other[stage][name][old]
    other["permute"]["inv_perm"][3, 0] = gap
    other["gemm1"]["layout"] = layout
    failed = _failed(_stage(golden, other, problem, "gemm1", Mode.CHAINED))
    assert set(failed) == {"layout rows"}
    check = failed["layout rows"]
    assert (check.worst.token, check.worst.k, check.worst.other) == (3, 0, -1)
    # Isolated, the GEMM read the golden's permute: the moved slot is not its concern.
    assert _stage(golden, other, problem, "gemm1").status == Status.PASS


# -- rows a layout leaves unspecified are never read -----------------------------------------------

# Ops that only make a view or read the rows they are given an index of: the comparison may apply
# these to a tested tensor whose padding rows a kernel never wrote.
_VIEW_OR_INDEX = {
    "aten.view.dtype",
    "aten.view.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.t.default",
    "aten.index.Tensor",
}


class _Reads(TorchDispatchMode):
    """Every op (by name) that takes a tensor sharing storage with one of `watched` (its views
    included: they share it)."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        for a in [*args, *kwargs.values()]:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages:
                self.ops.add(str(func))
        return func(*args, **kwargs)


def test_act_quant_reads_no_padding_row_of_the_tested_side(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # act_quant's padding rows are unspecified (optimized/backend.py writes live rows only):
    # compute-sanitizer's initcheck reported the comparison reading them on the H200 (2432
    # uninitialized 4-byte reads of a2q_scale, docs/gpu-results.md). Only views and a gather of
    # the live rows may touch the tested tensors.
    watched = [other["act_quant"]["a2q"], other["act_quant"]["a2q_scale"]]
    with _Reads(watched) as reads:
        result = _stage(golden, other, problem, "act_quant")
    assert result.status == Status.PASS
    assert "aten.index.Tensor" in reads.ops  # the live rows were read, through an index
    assert reads.ops <= _VIEW_OR_INDEX, sorted(reads.ops - _VIEW_OR_INDEX)


def test_act_quant_scales_that_are_not_rows_fail_their_shape_check(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # Checked before any row is picked, so the failure shows the tensor the kernel returned.
    scale = other["act_quant"]["a2q_scale"]
    other["act_quant"]["a2q_scale"] = scale.reshape(-1).contiguous()
    check = _failed(_stage(golden, other, problem, "act_quant"))["a2q_scale shape"]
    assert f"{tuple(other['act_quant']['a2q_scale'].shape)}" in check.detail


# -- how padding rows are marked ------------------------------------------------------------------


def _segment_experts(trace: Trace) -> torch.Tensor:
    """int64 [M_sum]: the local expert whose aligned segment holds each row, -1 past the last."""
    counts = trace["align"]["counts"].to(torch.int64)
    padded = (counts + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    out = torch.full((trace["permute"]["m_indices"].numel(),), -1, dtype=torch.int64)
    out[: int(padded.sum())] = torch.repeat_interleave(torch.arange(counts.numel()), padded)
    return out


def test_padding_rows_may_hold_their_segments_expert(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # LMDeploy's ep_scatter_fp8 marks a whole aligned segment with its expert; DeepGEMM reads a
    # tile's expert from its first row and computes every row of it, so the padding is unread.
    segment = _segment_experts(golden)
    m = other["permute"]["m_indices"]
    owned = (m == -1) & (segment >= 0)
    assert bool(owned.any())
    m[owned] = segment[owned].to(m.dtype)
    result = _stage(golden, other, problem, "permute")
    assert result.status == Status.PASS, result.failed_checks
    assert result.recipe == "segment_owned_padding"


def test_padding_rows_holding_another_expert_fail(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    segment = _segment_experts(golden)
    m = other["permute"]["m_indices"]
    owned = (m == -1) & (segment >= 0)
    m[owned] = ((segment[owned] + 1) % problem.num_experts).to(m.dtype)  # the neighbour's
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert {"m_indices", "padding m_indices"} <= set(failed)


def test_tail_rows_must_hold_minus_one(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    _resize_permute(other, BOUND)  # a tail of BOUND - EXACT rows past the last segment
    other["permute"]["m_indices"][EXACT:] = 2  # the last live expert's id, past its segment
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert {"m_indices", "padding m_indices"} <= set(failed)
    assert "tail" in failed["m_indices"].detail


def test_psum_only_permute_is_read_through_its_expert_ends(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # A psum kernel (vLLM's deepgemm_moe_permute(use_psum_layout=True)) builds no m_indices.
    del other["permute"]["m_indices"]
    other["permute"]["layout"] = "psum"
    result = _stage(golden, other, problem, "permute")
    assert result.status == Status.PASS, result.failed_checks
    checks = {c.name: c for c in result.checks}
    assert "read from its psum expert_ends" in checks["m_indices"].detail
    other["permute"]["expert_ends"][1] -= 1  # expert 1's last live row falls into its gap
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert set(failed) == {"m_indices", "expert_ends", "expert rows"}, failed


def _rows_by_hand(ends: list[int], m_sum: int, a: int) -> list[int]:
    rows, start = [-1] * m_sum, 0
    for e, end in enumerate(ends):
        rows[start:end] = [e] * (end - start)
        start = -(-end // a) * a
    return rows


@pytest.mark.parametrize(
    "counts",
    [[3, 0, 5, 130], [0, 0, 7], [128, 1], [0], [2, 0, 0, 0]],
    ids=["empty-middle-and-a-full-block", "empty-first", "exact-block", "all-empty", "empty-last"],
)
def test_psum_ends_read_per_row(counts: list[int]) -> None:
    a = 128
    padded = [-(-c // a) * a for c in counts]
    starts = [sum(padded[:e]) for e in range(len(counts))]
    ends = [s + c for s, c in zip(starts, counts, strict=True)]
    m_sum = sum(padded) + a  # one block of tail padding
    got = psum_row_experts(torch.tensor(ends, dtype=torch.int32), m_sum, a)
    assert got.tolist() == _rows_by_hand(ends, m_sum, a)
