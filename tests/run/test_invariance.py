"""Metamorphic invariance (`verify_invariance`, `run --invariance`): the tested side run twice with
only a hint or a capacity changed must agree bit for bit at every stage, a check named after the
setting and the pair (tolerance/invariance.py). CPU tier, Triton engine."""

from __future__ import annotations

import pytest
import torch

from moe_verify.cli import main
from moe_verify.run.inputs import make_inputs
from moe_verify.run.verify import verify_invariance
from moe_verify.spec import (
    BATCHED_STAGES,
    LL_BLOCK_ROWS,
    Mode,
    MoEProblem,
    Stage,
    StageContext,
    Status,
    Trace,
)
from optimized import OptimizedBackend
from optimized.kernels import slot_counts
from reference import ReferenceBackend
from tolerance.invariance import INVARIANCES, agreement

pytestmark = pytest.mark.cpu

BASE = dict(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2)
LL = MoEProblem(**BASE, topology="ep:2+ll")


def _bump_first_live_mm1(out: dict, dispatch: dict) -> dict:
    """`out` with one element of mm1 [E_l, max_tokens, 2I] moved by one bf16 ulp, in the row of
    the first live (token, k) slot of the batches; unchanged when the rank has none."""
    live = (dispatch["slot"] >= 0).nonzero()
    if not len(live):
        return out
    t, k = (int(v) for v in live[0])
    e, row = int(dispatch["slot_expert"][t, k]), int(dispatch["slot"][t, k])
    mm1 = out["mm1"].clone()
    mm1.view(torch.int16)[e, row, 0] += 1
    return {**out, "mm1": mm1}


class CapacityDependentGemm1(OptimizedBackend):
    """Wrong on purpose: gemm1 moves one live element by one bf16 ulp when the permuted buffer
    holds more rows than the segments need (the upper-bound M_sum), the way DeepGEMM #331's output
    changed with buffer capacity alone. Well inside gemm1's tolerance of the golden, so only the
    m_sum invariance can catch it."""

    name = "capacity_dependent_gemm1"

    def gemm1(self, ctx: StageContext):
        upstream = ctx.upstream
        out = super().gemm1(ctx)
        align = upstream["align"]
        need = slot_counts.aligned_m_sum_exact(align["counts"], align["alignment"])
        if align["M_sum"] > need:
            mm1 = out["mm1"].clone()
            row = int(upstream["permute"]["inv_perm"][0, 0])
            mm1.view(torch.int16)[row, 0] += 1
            out = {**out, "mm1": mm1}
        return out


class CapacityDependentMaskedGemm1(OptimizedBackend):
    """Wrong on purpose: the batched gemm1 moves one live element by one bf16 ulp when a batch
    spans more than one 128-row block (the capacity, DeepEP's max_tokens, not the rows in it),
    as a masked GEMM whose schedule follows M_max instead of masked_m would. Well inside gemm1's
    tolerance of the golden, so only the ll_capacity invariance can catch it."""

    name = "capacity_dependent_masked_gemm1"

    def gemm1(self, ctx: StageContext):
        upstream = ctx.upstream
        out = super().gemm1(ctx)
        dispatch = upstream["dispatch"]
        if dispatch["a_batched"].shape[1] > LL_BLOCK_ROWS:
            out = _bump_first_live_mm1(out, dispatch)
        return out


@pytest.mark.parametrize(
    "kind,topology,alignment",
    [
        ("alignment", "tp:1", 64),  # 64 vs 128: other segment starts, same rows
        ("alignment", "ep:2", 128),  # from 128 down to 64, expert_map in play
        ("m_sum", "tp:1", 32),  # upper bound vs exact: padding rows only
        ("m_sum", "ep:2", 64),  # the bound counts remote slots too
        ("ll_capacity", "ep:2+ll", 128),  # 128 vs 256 rows per batch: rows past masked_m only
        ("ll_capacity", "ep:2:round_robin+ll", 128),  # interleaved experts, same batches
    ],
    ids=lambda v: str(v),
)
def test_the_optimized_path_is_invariant(kind: str, topology: str, alignment: int) -> None:
    problem = MoEProblem(**BASE, topology=topology, alignment=alignment)
    report = verify_invariance(problem, kind, engine="triton", mode="both")
    assert report.passed, report.to_summary()
    checked = [
        c for _, results in report.modes() for r in results for c in r.checks
        if c.name.startswith(f"invariance {kind}:")
    ]  # fmt: skip
    assert checked, "the invariance check must run"
    placed = Stage.DISPATCH if problem.topology.kind == "ep+ll" else Stage.PERMUTE
    for _, res in report.modes():  # each mode compares its permuted stages, batched ones too
        compared = {r.stage for r in res if any(c.name.startswith("invariance") for c in r.checks)}
        assert compared >= {placed, "gemm1", "act_quant", "gemm2", "gather"}


def test_a_capacity_dependent_gemm_fails_only_the_invariance() -> None:
    problem = MoEProblem(**BASE, alignment=32)
    report = verify_invariance(
        problem, "m_sum", backend="tests.run.test_invariance:CapacityDependentGemm1",
        engine="triton", mode="chained",
    )  # fmt: skip
    # Chained: each run's gemm1 reads its own permute, so the capacity reaches it (isolated, both
    # runs' gemm1 read the golden's one layout: the m_sum pair then tests align and permute).
    assert not report.passed
    assert report.first_failure == "gemm1"
    gemm1 = next(r for r in report.results if r.stage == "gemm1")
    assert gemm1.status is Status.FAIL
    failed = [c for c in gemm1.checks if not c.passed]
    assert [c.name for c in failed] == ["invariance m_sum: upper bound vs exact"]
    assert failed[0].value == 1 and "1 of" in failed[0].detail
    assert failed[0].worst is not None and failed[0].worst.token == 0


@pytest.mark.parametrize("mode", ["isolated", "chained"])
def test_a_capacity_dependent_masked_gemm_fails_only_the_ll_capacity_invariance(mode: str) -> None:
    """Either mode: the second run has its own golden (the problem changed), so in isolated mode
    too its gemm1 reads batches of 256 rows; a batched gemm1 used to go uncompared there."""
    report = verify_invariance(
        LL, "ll_capacity", backend="tests.run.test_invariance:CapacityDependentMaskedGemm1",
        engine="triton", mode=mode,
    )  # fmt: skip
    assert not report.passed
    assert report.first_failure == "gemm1"
    failing = [r for r in report.results if r.status.failing]
    assert {r.stage for r in failing} == {"gemm1"}, report.to_summary()
    for r in failing:
        failed = [c for c in r.checks if not c.passed]
        assert [c.name for c in failed] == ["invariance ll_capacity: 128 vs 256 rows"]
        assert failed[0].value == 1 and "1 of" in failed[0].detail
        assert failed[0].worst is not None and failed[0].worst.token is not None


def _golden_ll(problem: MoEProblem, rank: int = 0) -> Trace:
    return ReferenceBackend().run(problem, make_inputs(problem, "cpu"), rank)


@pytest.mark.parametrize("stage", BATCHED_STAGES, ids=str)
def test_batched_traces_of_two_capacities_agree_row_for_row(stage: str) -> None:
    """The golden at 128 and at 256 rows per batch: the same live rows in batches of two sizes,
    each keyed through its own dispatch."""
    first, second = _golden_ll(LL), _golden_ll(LL.replace(ll_capacity=256))
    assert first[Stage.DISPATCH]["a_batched"].shape[1] == LL_BLOCK_ROWS
    assert second[Stage.DISPATCH]["a_batched"].shape[1] == 2 * LL_BLOCK_ROWS
    check = agreement(
        stage, first, second, "128 vs 256 rows", (first, second), INVARIANCES["ll_capacity"]
    )
    assert check is not None, f"{stage} was not compared"
    assert check.passed and check.detail.startswith("0 of "), check.detail


def test_two_dispatches_that_order_a_batch_differently_agree() -> None:
    """A run's dispatch is keyed through its own slots, even in isolated mode (where the later
    stages are keyed through the golden's): DeepEP numbers a batch's rows by arrival, so two
    runs may place the same (token, k) at different rows of its expert's batch."""
    golden = _golden_ll(LL)
    d = golden[Stage.DISPATCH]
    e = int(d["masked_m"].argmax())
    assert int(d["masked_m"][e]) >= 2
    swap = torch.arange(d["a_batched"].shape[1])
    swap[[0, 1]] = swap[[1, 0]]
    slot = d["slot"].clone()
    moved = (d["slot_expert"] == e) & (slot < 2) & (slot >= 0)
    slot[moved] = 1 - slot[moved]
    a, scales = d["a_batched"].clone(), d["a_scale_batched"].clone()
    a.view(torch.uint8)[e] = d["a_batched"].view(torch.uint8)[e, swap]
    scales[e] = d["a_scale_batched"][e, swap]
    other = Trace(golden.backend, golden.rank)
    for name, outs in golden.items():
        if name == Stage.DISPATCH:
            outs = {**outs, "a_batched": a, "a_scale_batched": scales, "slot": slot}
        other.add(name, outs)
    check = agreement(
        Stage.DISPATCH, golden, other, "0x00 vs 0xff", (golden, golden), INVARIANCES["poison"]
    )
    assert check is not None and check.passed, check.detail if check else None


def test_batched_agreement_catches_a_gemm1_difference_in_isolated_mode() -> None:
    """Isolated mode keys a stage through the golden's layouts, which on ep:N+ll have a dispatch
    and no permute: the batched gemm1 must still be compared (it used to be skipped)."""
    golden = _golden_ll(LL)
    tested = _golden_ll(LL)
    other = Trace(tested.backend, tested.rank)
    for name, outs in tested.items():
        if name == Stage.GEMM1:
            outs = _bump_first_live_mm1(outs, tested[Stage.DISPATCH])
        other.add(name, outs)
    check = agreement(
        Stage.GEMM1, tested, other, "mean batch vs 8", (golden, golden), INVARIANCES["expected_m"]
    )
    assert check is not None and not check.passed, "the batched gemm1 was not compared"
    assert check.name == "invariance expected_m: mean batch vs 8"
    assert check.value == 1 and check.worst is not None and check.worst.token is not None


@pytest.mark.parametrize(
    "kind,topology,alignment,engine,backend,match",
    [
        ("poison", "tp:1", 128, "triton", "optimized", "--poison A --poison B"),
        ("capacity", "tp:1", 128, "triton", "optimized", "expected one of"),
        ("alignment", "tp:1", 32, "triton", "optimized", "alignment is 32"),
        ("m_sum", "ep:2+ht", 128, "triton", "optimized", "no upper-bound M_sum"),
        ("expected_m", "ep:2+ll", 128, "triton", "optimized", "needs --engine deepgemm"),
        ("ll_capacity", "ep:2", 128, "triton", "optimized", "has no batches"),
        ("num_sms", "tp:1", 128, "auto", "optimized", "needs --engine deepgemm"),
        ("m_sum", "tp:1", 128, "triton", "golden", "a setting of optimized.OptimizedBackend's"),
    ],
    ids=lambda v: str(v),
)
def test_settings_without_a_second_legal_value_are_refused(
    kind: str, topology: str, alignment: int, engine: str, backend: str, match: str
) -> None:
    problem = MoEProblem(**BASE, topology=topology, alignment=alignment)
    with pytest.raises(ValueError, match=match):
        verify_invariance(problem, kind, backend=backend, engine=engine, mode=Mode.ISOLATED)


@pytest.mark.parametrize(
    "flags,label",
    [
        (["--alignment", "64", "--invariance", "alignment"], "invariance alignment: 64 vs 128"),
        (
            ["--topology", "ep:2+ll", "--invariance", "ll_capacity"],
            "invariance ll_capacity: 128 vs 256 rows",
        ),
    ],
    ids=["alignment", "ll_capacity"],
)
def test_the_cli_runs_an_invariance(
    flags: list[str], label: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2",
            "--engine", "triton", "--mode", "isolated", *flags]  # fmt: skip
    assert main(argv) == 0
    assert label in capsys.readouterr().out
    for refused in (["--poison", "0"], ["--poison-padding"]):
        assert main([*argv, *refused]) == 2
        assert "not supported with --invariance" in capsys.readouterr().err


# -- the capacity as a problem setting -------------------------------------------------------------


def test_the_capacity_sizes_the_batches_and_names_the_case() -> None:
    assert LL.ll_max_tokens == LL_BLOCK_ROWS and "cap" not in LL.id
    wide = LL.replace(ll_capacity=384)
    assert wide.ll_max_tokens == 384 and wide.id == f"{LL.id}-cap384"
    assert MoEProblem.from_dict(wide.to_dict()) == wide
    older = {k: v for k, v in wide.to_dict().items() if k not in ("ll_capacity", "tiny_tokens")}
    assert MoEProblem.from_dict(older) == LL  # a file from before the field: the default


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(topology="ep:2", ll_capacity=256), "topology ep2 has no batches"),
        (dict(topology="tp:1", ll_capacity=128), "topology tp1 has no batches"),
        (dict(ll_capacity=200), "multiple of the 128-row block"),
        (dict(tokens=300, ll_capacity=256), "at least 384"),
        (dict(ll_capacity=-128), "MoEProblem.ll_capacity"),
    ],
    ids=["ep", "tp", "not-whole-blocks", "too-small", "negative"],
)
def test_a_capacity_the_layout_cannot_take_is_refused(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LL.replace(**changes)
