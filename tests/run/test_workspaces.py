"""Reused, poisoned workspaces: a kernel that leaves a promised element unwritten, or reads a
stale one, makes two poisons disagree (vLLM's NaN-poisoned-workspace check;
rtp-llm PR #1098, SGLang issue #33106)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import Side, run_chained
from moe_verify.run.verify import verify
from moe_verify.run.workspaces import GUARD_BYTES, Workspaces
from moe_verify.spec import MoEInputs, MoEProblem, Routing, ScaleFmt, StageContext, Trace
from optimized.backend import OptimizedBackend
from tolerance.stages.context import live_slots

pytestmark = pytest.mark.cpu

CASES = [
    MoEProblem(tokens=12, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32),
    MoEProblem(
        tokens=10,
        hidden=128,
        intermediate=256,
        num_experts=4,
        topk=3,
        alignment=32,
        routing=Routing.INVALID_SLOTS,
        scale_fmt=ScaleFmt.UE8M0_PACKED,
    ),
]


def _side(backend: OptimizedBackend, poison: int | None = None) -> Side:
    """The backend with the harness's workspaces (and a poison), as `--workspace` runs it."""
    return Side(backend, Workspaces(True, poison))


def _run(side: Side, problem: MoEProblem, inputs: MoEInputs) -> Trace:
    """Every stage chained on `side`, as `moe-verify run --mode chained` feeds them."""
    return run_chained(side, problem, inputs, 0)


def assert_two_poisons_agree_with_a_fresh_run(
    problem: MoEProblem, inputs: MoEInputs, engine: str
) -> None:
    """Workspaces reused across calls and poisoned before each (0x00, then 0xFF): every live row
    of every stage bitwise the fresh run's. tests/gpu/test_sm90_pipeline.py runs it on DeepGEMM."""
    fresh = OptimizedBackend(engine=engine).run(problem, inputs)
    assert fresh["gemm1"]["engine"] == engine
    for poison in (0x00, 0xFF):
        side = _side(OptimizedBackend(engine=engine), poison)
        _run(side, problem, inputs)  # a first call leaves its values in the workspaces
        trace = _run(side, problem, inputs)
        assert torch.equal(trace["gather"]["out"], fresh["gather"]["out"]), poison
        # Rows keyed by (token, k): on a GPU ep_scatter orders a segment's rows by atomics.
        slots = live_slots(fresh, trace)
        for stage, name in (("gemm1", "mm1"), ("gemm2", "mm2"), ("act_quant", "a2q")):
            got = trace[stage][name][slots.other_rows].view(torch.uint8)
            want = fresh[stage][name][slots.gold_rows].view(torch.uint8)
            assert torch.equal(got, want), (stage, name, poison)


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_two_poisons_agree_bitwise_with_a_fresh_run(problem: MoEProblem) -> None:
    assert_two_poisons_agree_with_a_fresh_run(problem, make_inputs(problem, "cpu"), "triton")


def test_workspaces_are_reused_across_calls() -> None:
    problem = CASES[0]
    inputs = make_inputs(problem, "cpu")
    side = _side(OptimizedBackend(engine="triton"))
    _run(side, problem, inputs)
    buffers = {k: v.data_ptr() for k, v in side.buffers.buffers.items()}
    _run(side, problem, inputs)
    assert buffers and {k: v.data_ptr() for k, v in side.buffers.buffers.items()} == buffers


def test_a_kernel_that_skips_rows_is_caught_by_the_poison() -> None:
    problem = CASES[0]
    inputs = make_inputs(problem, "cpu")

    class SkipsLastToken(OptimizedBackend):
        """ep_gather that never writes the last token's row (an off-by-one grid)."""

        def gather(self, ctx: StageContext):
            out = super().gather(ctx)["out"]
            if ctx.buffers.poison is not None:
                out[-1].view(torch.uint8).fill_(ctx.buffers.poison)
            return {"out": out}

    outs = [_run(_side(SkipsLastToken(engine="triton"), b), problem, inputs) for b in (0x00, 0xFF)]
    assert not torch.equal(
        outs[0]["gather"]["out"].view(torch.int16), outs[1]["gather"]["out"].view(torch.int16)
    )


class WritesPastItsOutput(OptimizedBackend):
    """gemm1 then writes `spill` bf16 elements just past its output workspace (or, negative,
    just before it): a grid that overruns the last block without faulting."""

    name = "writes-past-its-output"
    spill = 8

    def gemm1(self, ctx: StageContext):
        out = super().gemm1(ctx)
        ((key, buf),) = [(k, b) for k, b in ctx.buffers.buffers.items() if k[0] == "mm1"]
        flat = buf.view(-1)
        if self.spill > 0:
            torch.as_strided(flat, (self.spill,), (1,), flat.storage_offset() + flat.numel())[:] = 1
        else:
            torch.as_strided(flat, (-self.spill,), (1,), flat.storage_offset() + self.spill)[:] = 1
        return out


@pytest.mark.parametrize(("spill", "where"), [(8, "after"), (-3, "before")])
def test_a_write_outside_a_workspace_fails_its_stage_by_name(spill: int, where: str) -> None:
    backend = WritesPastItsOutput(engine="triton")
    backend.spill = spill
    report = verify(CASES[0], backend=backend, mode="isolated", workspace=True, poison=[0])
    failing = {r.stage: r for r in report.isolated if r.status != "pass"}
    # an out-of-bounds write that did not fault is a failed check of gemm1, not an error
    assert list(failing) == ["gemm1"] and failing["gemm1"].status == "fail"
    reason = failing["gemm1"].reason
    assert f"gemm1 changed {2 * abs(spill)} bytes of the guard band {where} workspace" in reason
    nearest = "+0 past its end" if spill > 0 else "-1 before its start"
    assert "'mm1' (torch.bfloat16 (" in reason and f"nearest at byte {nearest}" in reason


class OverrunsThenRaises(WritesPastItsOutput):
    """The overrun, then an error of the stage's own: both reach the report, at gemm1."""

    name = "overruns-then-raises"

    def gemm1(self, ctx: StageContext):
        super().gemm1(ctx)
        raise ValueError("the kernel's own failure")


def test_a_stage_that_overruns_and_raises_reports_both_at_that_stage() -> None:
    backend = OverrunsThenRaises(engine="triton")
    report = verify(CASES[0], backend=backend, mode="isolated", workspace=True)
    failing = {r.stage: r for r in report.isolated if r.status != "pass"}
    assert list(failing) == ["gemm1"]
    reason = failing["gemm1"].reason
    assert "ValueError: the kernel's own failure; and gemm1 changed 16 bytes" in reason


def test_guard_bands_keep_the_workspace_aligned_and_intact() -> None:
    side = _side(OptimizedBackend(engine="triton"), 0xFF)
    _run(side, CASES[0], make_inputs(CASES[0], "cpu"))
    spaces = side.buffers
    assert spaces.buffers and spaces.buffers.keys() == spaces.guarded.keys()
    for key, buf in spaces.buffers.items():
        whole = spaces.guarded[key]
        assert buf.is_contiguous() and buf.data_ptr() == whole.data_ptr() + GUARD_BYTES
        assert buf.data_ptr() % 16 == 0  # TMA's alignment for DeepGEMM's output
    assert spaces.guard_hits() == ""  # the poison filled the workspaces, never their guards


# -- the two-poison run: verify(..., workspace=True, poison=[a, b]) -----------------------------

TWO_POISONS = [0x00, 0xFF]


def _poison_checks(report, mode: str) -> dict[str, list]:
    return {
        r.stage: [c for c in r.checks if c.name.startswith("poison ")]
        for r in getattr(report, mode)
        if any(c.name.startswith("poison ") for c in r.checks)
    }


def test_a_two_poison_run_of_a_correct_backend_passes_with_every_check_run() -> None:
    report = verify(
        CASES[0], backend="optimized", engine="triton", mode="both", workspace=True,
        poison=TWO_POISONS,
    )  # fmt: skip
    assert report.passed, report.summary_line()
    for mode in ("isolated", "chained"):
        checks = _poison_checks(report, mode)
        stages = {"route", "quant_input", "permute", "gemm1", "act_quant", "gemm2", "gather"}
        assert set(checks) == stages, (mode, sorted(checks))
        assert all(
            c.passed and c.name == "poison 0x00 vs 0xff" for cs in checks.values() for c in cs
        )


class ReversesSegmentsUnderOnePoison(OptimizedBackend):
    """permute: the live rows of every expert segment in reverse order when the poison is 0xFF,
    as a GPU's atomics may order them in one run and not the other: legitimate, so the two runs
    must still agree (rows are keyed by (token, k), never by position)."""

    name = "reverses-segments-under-one-poison"

    def permute(self, ctx: StageContext):
        out = super().permute(ctx)
        if getattr(ctx.buffers, "poison", None) != 0xFF:
            return out
        m = out["m_indices"]
        new = torch.arange(m.shape[0])
        for e in m[m >= 0].unique():
            rows = (m == e).nonzero()[:, 0]
            new[rows] = rows.flip(0)
        moved = {}
        for key in ("a_perm", "a_scale_perm"):
            src = out[key]
            dst = src.clone()
            dst.view(torch.uint8)[new] = src.view(torch.uint8)
            moved[key] = dst
        inv = out["inv_perm"]
        moved["inv_perm"] = torch.where(inv >= 0, new[inv.clamp(min=0).long()].to(inv.dtype), inv)
        return {**out, **moved}


def test_rows_ordered_differently_by_the_two_runs_still_agree() -> None:
    report = verify(
        CASES[0], backend="tests.run.test_workspaces:ReversesSegmentsUnderOnePoison",
        engine="triton", mode="both", workspace=True, poison=TWO_POISONS,
    )  # fmt: skip
    assert report.passed, report.summary_line()


class LeavesTheLastTokenUnwritten(OptimizedBackend):
    """gather never writes the last token's row (an off-by-one grid): with a workspace, that row
    holds whatever the poison left there."""

    name = "leaves-the-last-token-unwritten"

    def gather(self, ctx: StageContext):
        out = super().gather(ctx)["out"]
        poison = getattr(ctx.buffers, "poison", None)
        if poison is not None:
            out[-1].view(torch.uint8).fill_(poison)
        return {"out": out}


def test_a_row_left_unwritten_fails_the_two_poison_check_at_its_stage() -> None:
    report = verify(
        CASES[0], backend="tests.run.test_workspaces:LeavesTheLastTokenUnwritten",
        engine="triton", mode="isolated", workspace=True, poison=TWO_POISONS,
    )  # fmt: skip
    assert report.first_failure == "gather", report.summary_line()
    failed = _poison_checks(report, "isolated")["gather"]
    assert [c.passed for c in failed] == [False]
    assert failed[0].detail.startswith("1 of ") and failed[0].worst.token == CASES[0].tokens - 1


def test_poisons_without_workspaces_are_refused() -> None:
    with pytest.raises(ValueError, match=r"poison: a byte 0..255 with workspace=True"):
        verify(CASES[0], backend=OptimizedBackend(engine="triton"), poison=TWO_POISONS)


def test_the_harness_gives_a_backend_already_built_its_workspaces() -> None:
    """Workspaces are the harness's, not the backend's: an instance gets them too."""
    backend = OptimizedBackend(engine="triton")
    report = verify(CASES[0], backend=backend, workspace=True, poison=TWO_POISONS)
    assert report.passed and report.files["poison"] == ["0x00", "0xff"]
