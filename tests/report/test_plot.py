"""The picture of a failure (moe_verify/report/error_measure.py measures, moe_verify/report/plot.py
draws):
one PNG per failing (mode, stage), and each kind of bug with its own shape: a misrouted expert
lights one segment, a scale bug one column block, a rank bug one rank panel. Asserted on the
ErrorMap data, then on the files.

The planted bugs are the golden with one stage wrong, so every other stage (and every other row
of the wrong stage) matches it bit for bit and the shape of the error is exactly the bug's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from moe_verify.report.error_map import ErrorMap
from moe_verify.report.error_measure import MAX_COLUMNS, MAX_ROWS, error_maps
from moe_verify.report.plot import write_plots
from moe_verify.run.inputs import make_inputs
from moe_verify.run.verify import verify_rank
from moe_verify.spec import (
    Mode,
    MoEProblem,
    Recipe,
    ScaleFmt,
    Stage,
    StageContext,
    Trace,
)
from reference import ReferenceBackend
from reference.topology import placement

pytestmark = pytest.mark.cpu

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Outputs = dict[str, object]


def _with(up: Trace, stage: str, **entries: object) -> Trace:
    """A copy of `up` whose `stage` has `entries` replaced; `up` itself is left untouched."""
    out = Trace(up.backend, up.rank)
    for name, outputs in up.items():
        out.add(name, {**outputs, **entries} if name == stage else outputs)
    return out


def _first_expert(up: Trace) -> int:
    """The local expert of the first live permuted row."""
    m = up["permute"]["m_indices"]
    return int(m[m >= 0][0])


class WrongExpertSegment(ReferenceBackend):
    """gemm1: the rows of one expert's segment (the first live one) multiplied by the next local
    expert's weights, as a grouped GEMM that reads a segment's expert from the wrong entry."""

    name = "wrong_expert_segment"

    def gemm1(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        m = up["permute"]["m_indices"].clone()
        e = _first_expert(up)
        m[m == e] = (e + 1) % len(up["align"]["counts"])
        return super().gemm1(ctx.replace(upstream=_with(up, "permute", m_indices=m)))


class HalfScaleGroup(ReferenceBackend):
    """quant_input: every token's scale of one group (`GROUP`) stored at half its value (an
    E8M0 byte one exponent low), the codes left as they were: one column block wrong."""

    name = "half_scale_group"
    GROUP = 1

    def quant_input(self, ctx: StageContext) -> Outputs:
        out = dict(super().quant_input(ctx))
        scale = out["a1q_scale"].clone()
        if scale.dtype == torch.uint8:
            scale[:, self.GROUP] -= 1
        else:
            scale[:, self.GROUP] /= 2
        out["a1q_scale"] = scale
        return out


class FarScaleGroup(HalfScaleGroup):
    """HalfScaleGroup on a group past the first MAX_COLUMNS, so the picture must merge groups."""

    name = "far_scale_group"
    GROUP = 201


class UnweightedGatherOnRank1(ReferenceBackend):
    """gather, rank 1 only: every slot weighted 1 instead of its router weight, as a kernel that
    reads the weights through a rank-local offset that is right on rank 0 only."""

    name = "unweighted_gather_on_rank1"

    def gather(self, ctx: StageContext) -> Outputs:
        up, rank = ctx.upstream, ctx.rank
        if rank != 1:
            return super().gather(ctx)
        ones = torch.ones_like(up["route"]["topk_weights"])
        return super().gather(ctx.replace(upstream=_with(up, "route", topk_weights=ones)))


class MSumNotAligned(ReferenceBackend):
    """align: M_sum one row past a multiple of the alignment (a host int: nothing to picture)."""

    name = "m_sum_not_aligned"

    def align(self, ctx: StageContext) -> Outputs:
        out = dict(super().align(ctx))
        out["M_sum"] += 1
        return out


class Gemm2Raises(ReferenceBackend):
    """gemm2 raises: an error, with no output to picture."""

    name = "gemm2_raises"

    def gemm2(self, ctx: StageContext) -> Outputs:
        raise RuntimeError("planted: gemm2 raised")


# Two 128-wide column blocks; alignment 64 keeps M_sum (320 rows) under MAX_ROWS, so the
# misrouted segment is pictured row for row.
TINY = MoEProblem(tokens=8, hidden=256, intermediate=128, num_experts=4, topk=2, alignment=64)
BUGS = {
    # the three shapes of the issue, each on the smallest problem that shows it
    "misrouted-expert": (WrongExpertSegment, TINY),
    "scale": (HalfScaleGroup, TINY),
    "rank": (UnweightedGatherOnRank1, TINY.replace(topology="ep:2")),
}
# Where each bug's picture is read: the stage that names the culprit (isolated mode).
CULPRIT = {"misrouted-expert": Stage.GEMM1, "scale": Stage.QUANT_INPUT, "rank": Stage.GATHER}


@functools.cache
def _verified(
    backend: type[ReferenceBackend], problem: MoEProblem, modes: tuple[Mode, ...]
) -> tuple[tuple[ErrorMap, ...], dict[tuple[Mode, int], list[str]]]:
    """Every rank verified as `verify` does it: the maps of the stages failing per (mode, rank),
    and those failing stages."""
    inputs = make_inputs(problem)
    tested, golden = backend(), ReferenceBackend()
    maps, failing = [], {}
    for rank in range(problem.topology.size):
        verdict = verify_rank(problem, inputs, tested, golden, rank, modes)
        for mode, results in verdict.results.items():
            failing[(mode, rank)] = [r.stage for r in results if r.status.failing]
            maps += error_maps(problem, verdict.run, mode, failing[(mode, rank)])
    return tuple(maps), failing


def _map(maps: tuple[ErrorMap, ...], mode: Mode, stage: str, rank: int = 0) -> ErrorMap:
    (found,) = [m for m in maps if (m.mode, m.stage, m.rank) == (mode, stage, rank)]
    return found


def _rank_map(problem: MoEProblem, backend: type[ReferenceBackend], rank: int) -> ErrorMap:
    """`stage` gather of one rank pictured whether or not it failed there."""
    inputs = make_inputs(problem)
    verdict = verify_rank(problem, inputs, backend(), ReferenceBackend(), rank, (Mode.ISOLATED,))
    (found,) = error_maps(problem, verdict.run, Mode.ISOLATED, [Stage.GATHER])
    return found


@pytest.mark.parametrize("bug", list(BUGS))
def test_one_png_per_failing_stage(bug: str, tmp_path: Path) -> None:
    backend, problem = BUGS[bug]
    maps, failing = _verified(backend, problem, (Mode.ISOLATED, Mode.CHAINED))
    files = write_plots(problem, maps, tmp_path)
    expected = {(str(mode), s) for (mode, _), stages in failing.items() for s in stages}
    assert (Mode.ISOLATED, CULPRIT[bug]) in expected
    assert {(m.mode, m.stage) for m in maps} == expected
    assert sorted(files) == sorted(tmp_path / f"{problem.id}-{m}-{s}.png" for m, s in expected)
    for path in files:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, path


def test_misrouted_expert_lights_one_segment() -> None:
    backend, problem = BUGS["misrouted-expert"]
    maps, _ = _verified(backend, problem, (Mode.ISOLATED,))
    m = _map(maps, Mode.ISOLATED, Stage.GEMM1)
    golden = ReferenceBackend().run(problem, make_inputs(problem), 0)
    expert = placement(problem)[0][_first_expert(golden)]
    assert m.row_bin == 1 and m.lit_experts() == (expert,)
    (seg,) = [s for s in m.segments if s.expert == expert]
    lit_rows = m.lit.any(dim=1).nonzero().flatten()
    assert set(lit_rows.tolist()) == set(range(seg.start, seg.end))
    padding = golden["permute"]["m_indices"] < 0
    assert bool(torch.isnan(m.error[padding]).all()) and not bool(
        torch.isnan(m.error[~padding]).any()
    )


def test_scale_bug_lights_one_column_block() -> None:
    backend, problem = BUGS["scale"]
    maps, _ = _verified(backend, problem, (Mode.ISOLATED,))
    m = _map(maps, Mode.ISOLATED, Stage.QUANT_INPUT)
    assert m.col_bin == problem.recipe.act_group
    assert m.lit_columns() == (HalfScaleGroup.GROUP,)
    assert bool(m.lit[:, HalfScaleGroup.GROUP].all())  # every token's scale of that group


def test_rank_bug_lights_one_rank_panel(tmp_path: Path) -> None:
    backend, problem = BUGS["rank"]
    maps, failing = _verified(backend, problem, (Mode.ISOLATED,))
    assert Stage.GATHER not in failing[(Mode.ISOLATED, 0)]
    assert _map(maps, Mode.ISOLATED, Stage.GATHER, rank=1).lit.any()
    # rank 0 pictured although it passes: its panel is dark
    assert not _rank_map(problem, backend, 0).lit.any()
    (path,) = write_plots(problem, [m for m in maps if m.stage == Stage.GATHER], tmp_path)
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_three_bugs_draw_three_different_pictures(tmp_path: Path) -> None:
    pictures, shapes = [], []
    for bug, (backend, problem) in BUGS.items():
        maps, _ = _verified(backend, problem, (Mode.ISOLATED,))
        m = _map(maps, Mode.ISOLATED, CULPRIT[bug], 1 if bug == "rank" else 0)
        shapes.append((m.stage, m.rank, m.lit_experts(), m.lit_columns()))
        (path,) = write_plots(problem, [m], tmp_path / bug)
        pictures.append(path.read_bytes())
    assert len(set(shapes)) == 3 and len(set(pictures)) == 3


def test_many_rows_are_binned() -> None:
    problem = TINY.replace(tokens=300)  # M_sum 896 rows, over MAX_ROWS
    maps, _ = _verified(WrongExpertSegment, problem, (Mode.ISOLATED,))
    m = _map(maps, Mode.ISOLATED, Stage.GEMM1)
    assert m.rows > MAX_ROWS and m.row_bin > 1 and m.error.shape[0] <= MAX_ROWS
    golden = ReferenceBackend().run(problem, make_inputs(problem), 0)
    assert m.lit_experts() == (placement(problem)[0][_first_expert(golden)],)


def test_many_column_groups_are_merged() -> None:
    # mxfp8: 32-wide groups, 320 of them, merged three to a column cell
    problem = MoEProblem(
        tokens=4,
        hidden=32 * 320,
        intermediate=128,
        num_experts=4,
        topk=2,
        recipe=Recipe.MXFP8,
        scale_fmt=ScaleFmt.UE8M0_PACKED,
    )
    maps, _ = _verified(FarScaleGroup, problem, (Mode.ISOLATED,))
    m = _map(maps, Mode.ISOLATED, Stage.QUANT_INPUT)
    assert m.error.shape[1] <= MAX_COLUMNS and m.col_bin == 32 * 3
    assert m.lit_columns() == (FarScaleGroup.GROUP // 3,)


@pytest.mark.parametrize(
    ("backend", "stage"), [(MSumNotAligned, Stage.ALIGN), (Gemm2Raises, Stage.GEMM2)]
)
def test_stage_without_a_tensor_gets_no_picture(
    backend: type[ReferenceBackend], stage: str, tmp_path: Path
) -> None:
    maps, failing = _verified(backend, TINY, (Mode.ISOLATED,))
    assert failing[(Mode.ISOLATED, 0)] == [stage]
    assert maps == ()
    assert write_plots(TINY, maps, tmp_path) == [] and not any(tmp_path.iterdir())


def test_missing_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    maps, _ = _verified(*BUGS["scale"], (Mode.ISOLATED,))
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'moe-verify\[plot\]'"):
        write_plots(TINY, maps, tmp_path)


def test_error_maps_needs_a_mode_that_ran() -> None:
    inputs = make_inputs(TINY)
    verdict = verify_rank(TINY, inputs, HalfScaleGroup(), ReferenceBackend(), 0, (Mode.ISOLATED,))
    with pytest.raises(ValueError, match="mode: expected one the rank ran.*got 'chained'"):
        error_maps(TINY, verdict.run, Mode.CHAINED, [Stage.QUANT_INPUT])


# -- wired in: verify(plot_dir=...) and sweep(plot_dir=...) -------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def test_verify_writes_a_picture_of_each_failing_stage_and_names_it(tmp_path: Path) -> None:
    from moe_verify.run.verify import verify

    report = verify(TINY, backend=WrongExpertSegment(), mode="isolated", plot_dir=tmp_path)
    assert report.first_failure == "gemm1"
    files = [Path(f) for f in report.files["plots"]]
    assert [f.name for f in files] == [f"{TINY.id}-isolated-gemm1.png"]
    assert files[0].read_bytes().startswith(PNG)


def test_a_passing_case_draws_nothing(tmp_path: Path) -> None:
    from moe_verify.run.verify import verify

    report = verify(TINY, backend="golden", mode="isolated", plot_dir=tmp_path / "plots")
    assert report.passed and "plots" not in report.files
    assert not (tmp_path / "plots").exists() or not any((tmp_path / "plots").iterdir())


def test_a_sweep_draws_its_failing_cases(tmp_path: Path) -> None:
    from moe_verify.sweep.sweep import sweep

    summary = sweep(
        [TINY],
        backend=f"{__name__}:WrongExpertSegment",
        mode="isolated",
        out_dir=tmp_path / "out",
        isolate=False,
        plot_dir=tmp_path / "plots",
    )
    assert summary.exit_code == 1
    assert [p.name for p in (tmp_path / "plots").iterdir()] == [f"{TINY.id}-isolated-gemm1.png"]
