"""Fused stage groups judged end to end: a backend that computes several stages in one method
passes when right, and when wrong fails at the group, named with it and with the token
(moe_verify/examples/fused.py; docs/stage-contract.md#fused-stage-groups)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.cli import main
from moe_verify.examples.fused import (
    FusedForward,
    FusedForwardSwapsExperts,
    QuantizingScatter,
    QuantizingScatterHalvesAScale,
)
from moe_verify.run.verify import verify
from moe_verify.spec import (
    FusedGroup,
    MoEProblem,
    Outputs,
    Routing,
    Stage,
    StageContext,
    Status,
    Topology,
    TopologyKind,
)
from tolerance.report import Report

pytestmark = pytest.mark.cpu

SHAPE = dict(hidden=128, intermediate=128, num_experts=8, topk=2, alignment=32)
CASES = [
    MoEProblem(tokens=8, **SHAPE),  # tp1, every expert live
    MoEProblem(tokens=1, **SHAPE),  # T = 1: the smallest layout
    # ep:2: each rank's group sees its shard of the experts; -1 slots left to skip
    MoEProblem(
        tokens=12, topology=Topology(TopologyKind.EP, 2), routing=Routing.INVALID_SLOTS, **SHAPE
    ),
    MoEProblem(
        tokens=9, topology=Topology(TopologyKind.TP, 2), **{**SHAPE, "intermediate": 256}
    ),  # tp:2, odd T
]
SCATTER = "quant_input+permute"
FORWARD = "route..gather (8 stages)"


def results(report: Report, mode: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in getattr(report, mode) or []:
        out.setdefault(str(r.stage), []).append(r)
    return out


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_quant_input_fused_into_permute_passes(problem: MoEProblem) -> None:
    report = verify(problem, backend=QuantizingScatter(engine="triton"), mode="both")
    assert report.passed_strict, report.summary_line()
    for mode in ("isolated", "chained"):
        by_stage = results(report, mode)
        assert Stage.QUANT_INPUT not in by_stage  # kept inside the group: judged at permute
        assert all(r.group == SCATTER for r in by_stage[Stage.PERMUTE])
        assert all(r.group is None for r in by_stage[Stage.ALIGN] + by_stage[Stage.GEMM1])


@pytest.mark.parametrize("problem", CASES[:3], ids=lambda p: p.id)
def test_a_halved_scale_fails_at_the_group_naming_token_and_group(problem: MoEProblem) -> None:
    report = verify(problem, backend=QuantizingScatterHalvesAScale(engine="triton"), mode="both")
    first = report.first_failing_result
    assert first is not None and first.stage == Stage.PERMUTE and first.group == SCATTER
    failed = first.failed_checks[0]
    assert failed.name == "a_scale_perm rows"
    assert failed.worst is not None and failed.worst.token is not None
    assert failed.worst.column == 0  # the first scale group
    rank = "@r0" if problem.topology.size > 1 else ""
    line = report.summary_line()
    assert f"first failure: permute{rank} in {SCATTER} [isolated]" in line, line
    # isolated: every stage after the group is fed the golden's permute and passes
    assert {r.stage for r in report.isolated if r.status is not Status.PASS} == {Stage.PERMUTE}


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_a_fused_forward_is_judged_on_its_output(problem: MoEProblem) -> None:
    report = verify(problem, backend=FusedForward(engine="triton"), mode="both")
    assert report.passed_strict, report.summary_line()
    for mode in ("isolated", "chained"):
        by_stage = results(report, mode)
        reduce = {Stage.REDUCE} if problem.topology.size > 1 else set()  # across ranks
        assert set(by_stage) == {Stage.GATHER} | reduce
        assert all(r.group == FORWARD for r in by_stage[Stage.GATHER])


def test_a_wrong_fused_forward_fails_naming_the_group() -> None:
    report = verify(CASES[0], backend=FusedForwardSwapsExperts(engine="triton"), mode="both")
    first = report.first_failing_result
    assert first is not None and first.stage == Stage.GATHER and first.group == FORWARD
    assert first.failed_checks[0].worst.token == 0
    assert f"first failure: gather in {FORWARD} [isolated]" in report.summary_line()
    assert all(r.status is Status.FAIL for r in report.chained)


class RaisesInside(QuantizingScatter):
    name = "raises-inside"

    def quantize_and_scatter(self, ctx: StageContext) -> dict[str, Outputs]:
        raise RuntimeError("scatter kernel failed to launch")


class BreaksTheContract(QuantizingScatter):
    name = "breaks-the-contract"

    def quantize_and_scatter(self, ctx: StageContext) -> dict[str, Outputs]:
        permuted = super().quantize_and_scatter(ctx)[Stage.PERMUTE]
        return {Stage.PERMUTE: {**permuted, "a_perm": permuted["a_perm"].to(torch.bfloat16)}}


@pytest.mark.parametrize(
    ("backend", "status", "says"),
    [
        (RaisesInside, Status.ERROR, "RuntimeError: scatter kernel failed to launch"),
        (BreaksTheContract, Status.FAIL, "permute.a_perm dtype"),
    ],
    ids=["raises", "contract"],
)
def test_a_group_that_raises_or_breaks_the_contract_fails_at_its_last_stage(
    backend: type, status: Status, says: str
) -> None:
    report = verify(CASES[0], backend=backend(engine="triton"), mode="both")
    for mode in ("isolated", "chained"):
        by_stage = results(report, mode)
        (permute,) = by_stage[Stage.PERMUTE]
        assert permute.status is status and permute.group == SCATTER
        assert says in permute.reason + " ".join(c.detail for c in permute.checks), permute
    # chained: what comes after the group does not run on nothing
    assert all(r.status is Status.SKIP for r in results(report, "chained")[Stage.GEMM1])


def test_an_exposed_stage_inside_a_group_is_judged_by_the_chained_bounds() -> None:
    """gemm1 and act_quant in one method, both exposed: act_quant's input was the kernel's own
    gemm1, so in isolated mode too it is held to act_quant's chained bounds."""
    from moe_verify.spec import StageDelegate, call_stage
    from optimized import OptimizedBackend

    class Gemm1ActQuant(StageDelegate):
        fused_groups = (FusedGroup("gemm1_act", (Stage.GEMM1, Stage.ACT_QUANT)),)

        def __init__(self) -> None:
            super().__init__(OptimizedBackend(engine="triton"), "gemm1-act")

        def gemm1_act(self, ctx: StageContext) -> dict[str, Outputs]:
            mm1 = call_stage(self.inner, Stage.GEMM1, ctx)
            up = ctx.upstream.only(ctx.upstream.stages)
            up.add(Stage.GEMM1, mm1)
            act = call_stage(self.inner, Stage.ACT_QUANT, ctx.replace(upstream=up))
            return {Stage.GEMM1: mm1, Stage.ACT_QUANT: act}

    report = verify(CASES[0], backend=Gemm1ActQuant(), mode="isolated")
    assert report.passed_strict, report.summary_line()
    by_stage = results(report, "isolated")
    (act,) = by_stage[Stage.ACT_QUANT]
    (gemm1,) = by_stage[Stage.GEMM1]
    assert act.group == gemm1.group == "gemm1+act_quant"
    assert any("chained" in c.reason for c in act.checks), [c.reason for c in act.checks]
    assert not any("chained" in c.reason for c in gemm1.checks)


@pytest.mark.parametrize("command", ["graph", "bench"])
def test_production_mode_refuses_a_fused_backend_by_name(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
    extra = ["--production"] if command == "bench" else []
    code = main([command, *tiny, *extra, "--backend", "moe_verify.examples.fused:FusedForward"])
    err = capsys.readouterr().err
    assert code == 2
    assert "declares the fused group route..gather (8 stages)" in err, err
    assert "does not run fused groups yet" in err, err


def test_the_cli_names_the_group_in_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
    backend = "moe_verify.examples.fused:QuantizingScatterHalvesAScale"
    assert main(["run", *tiny, "--engine", "triton", "--backend", backend]) == 1
    out = capsys.readouterr().out
    assert f"permute in {SCATTER}" in out and "quant_input " not in out, out
