"""Poisons (moe_verify/run/poison.py): the permute's uninitialised memory is 0xFF, so a
padding-scale
bug that leaves torch.empty garbage fails every run, not only on dirty pages; and the padding
poison (`verify(..., padding_poison=True)`, `run --poison-padding`): the golden's padding rows at
the largest e4m3 code (and scale where unspecified), so a GEMM that lets padding reach live rows
fails in isolated mode (FlashInfer #3650)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_verify.cli import main
from moe_verify.examples import accumulators
from moe_verify.run.inputs import make_inputs
from moe_verify.run.poison import (
    FP8_MAX_CODE,
    FP32_MAX,
    PACKED_MAX_WORD,
    POISON_BYTE,
    poison_padding,
    poisoned_allocations,
)
from moe_verify.run.runner import POISONED_STAGES, run_stage_into
from moe_verify.run.verify import verify
from moe_verify.spec import (
    GroupedLayout,
    Mode,
    MoEProblem,
    Recipe,
    ScaleFmt,
    Stage,
    StageContext,
    Status,
    Trace,
)
from optimized.backend import OptimizedBackend
from reference import ReferenceBackend
from reference.formats import dequantize_fp8_blocks
from tests.tester import field_bugs as fb

pytestmark = pytest.mark.cpu


def _all_poison(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(torch.uint8) == POISON_BYTE).all())


@pytest.mark.parametrize(
    "alloc",
    [
        lambda: torch.empty(3, 5),
        lambda: torch.empty_strided((5, 2), (1, 8), dtype=torch.int32),  # TMA-aligned packed
        lambda: torch.empty_like(torch.ones(4, dtype=torch.bfloat16)),
        lambda: torch.ones(2).new_empty(7, dtype=torch.float8_e4m3fn),
    ],
    ids=["empty", "empty_strided", "empty_like", "new_empty"],
)
def test_uninitialised_allocations_are_poisoned(alloc) -> None:
    originals = (torch.empty, torch.empty_strided, torch.empty_like, torch.Tensor.new_empty)
    with poisoned_allocations():
        t = alloc()
    storage = torch.tensor(t.untyped_storage().tolist(), dtype=torch.int64)  # gaps included
    assert bool((storage == POISON_BYTE).all()), storage.unique().tolist()
    now = (torch.empty, torch.empty_strided, torch.empty_like, torch.Tensor.new_empty)
    assert all(a is b for a, b in zip(now, originals, strict=True)), "allocators not restored"


def test_initialised_allocations_are_untouched() -> None:
    with poisoned_allocations():
        z = torch.zeros(4)
    assert bool((z == 0).all())


def test_the_permute_stage_runs_poisoned() -> None:
    """run_stage_into poisons exactly the stages with a padding contract on their scales."""
    assert POISONED_STAGES == {Stage.PERMUTE, Stage.DISPATCH}

    class Allocates:
        name = "allocates"
        buffer: torch.Tensor | None = None

        def permute(self, ctx):
            self.buffer = torch.empty(8, dtype=torch.float32)
            return {"buffer": self.buffer}

    original = torch.empty
    problem = MoEProblem()
    backend = Allocates()
    trace = Trace("allocates")
    run_stage_into(
        trace,
        backend,
        Stage.PERMUTE,
        problem,
        make_inputs(problem, "cpu"),
        Trace("up"),
        Mode.ISOLATED,
    )
    assert backend.buffer is not None and _all_poison(backend.buffer)
    assert torch.empty is original


class EmptyPaddingScales(OptimizedBackend):
    """permute: the permuted scales re-allocated with torch.empty and only the live rows copied
    in, as vLLM did before it zeroed them (vLLM PR #49784)."""

    name = "empty_padding_scales"

    def permute(self, ctx: StageContext) -> dict[str, object]:
        out = super().permute(ctx)
        live = out["m_indices"] >= 0
        scales = torch.empty_like(out["a_scale_perm"])
        scales[live] = out["a_scale_perm"][live]
        out["a_scale_perm"] = scales
        return out


def test_unzeroed_padding_scales_fail_every_time() -> None:
    problem = MoEProblem(
        tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32,
        scale_fmt="float32_ceil_ue8m0", grouped_layout="m_indices",
    )  # fmt: skip
    report = verify(problem, backend=EmptyPaddingScales(engine="triton"), mode="isolated")
    failing = {r.stage: [c.name for c in r.checks if not c.passed] for r in report.isolated or []}
    failing = {s: c for s, c in failing.items() if c}
    assert failing == {"permute": ["padding scales"]}, report.summary_line()


# -- the padding poison ----------------------------------------------------------------------------

# Four experts, top-2, A = 32: ~8 live rows per 32-row segment, so every expert has padding.
SMALL = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
PSUM = SMALL.replace(grouped_layout=GroupedLayout.PSUM)
LL = SMALL.replace(topology="ep:2+ll")


def _golden(problem: MoEProblem, rank: int = 0) -> Trace:
    return ReferenceBackend().run(problem, make_inputs(problem, "cpu"), rank)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "problem,scale",
    [
        (PSUM, FP32_MAX),  # gap and tail scales unspecified: the largest fp32
        (PSUM.replace(recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED), PACKED_MAX_WORD),
        # ^ packed UE8M0: byte 254 (2^127) in every slot of a padding row's words
        (SMALL.replace(grouped_layout=GroupedLayout.M_INDICES), 0.0),  # the contract fixes +0.0
        (SMALL, 0.0),  # grouped_layout auto: the backend may read m_indices, so +0.0 too
    ],
    ids=["psum", "psum-mxfp8-packed", "m_indices", "auto"],
)
def test_the_permute_padding_holds_the_largest_codes(problem: MoEProblem, scale: float) -> None:
    golden = _golden(problem)
    clean = golden[Stage.PERMUTE]
    perm = poison_padding(golden, problem)[Stage.PERMUTE]
    pad = clean["m_indices"] == -1
    assert bool(pad.any()), "the case must have padding rows"
    assert bool((_bytes(perm["a_perm"])[pad] == FP8_MAX_CODE).all())
    assert bool((perm["a_scale_perm"][pad] == scale).all())
    assert torch.equal(_bytes(perm["a_perm"])[~pad], _bytes(clean["a_perm"])[~pad])
    assert torch.equal(perm["a_scale_perm"][~pad], clean["a_scale_perm"][~pad])
    assert not bool((_bytes(clean["a_perm"])[pad] == FP8_MAX_CODE).any()), "golden untouched"


def test_the_batches_past_masked_m_hold_the_largest_codes_and_scales() -> None:
    golden = _golden(LL, rank=1)
    clean = golden[Stage.DISPATCH]
    d = poison_padding(golden, LL)[Stage.DISPATCH]
    rows = torch.arange(LL.ll_max_tokens)[None, :]
    pad = rows >= clean["masked_m"].long()[:, None]
    assert bool(pad.any()) and bool((~pad).any())
    assert bool((_bytes(d["a_batched"])[pad] == FP8_MAX_CODE).all())
    assert bool((d["a_scale_batched"][pad] == FP32_MAX).all())
    assert torch.equal(_bytes(d["a_batched"])[~pad], _bytes(clean["a_batched"])[~pad])
    assert torch.equal(d["a_scale_batched"][~pad], clean["a_scale_batched"][~pad])
    assert bool((clean["a_scale_batched"][pad] == 0).all()), "golden untouched"


# On ep:N+ll the Triton engine's row tiles span live rows and rows past masked_m: the interpreter
# warns that the poisoned ones overflow, and their products never reach an output.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "problem",
    [
        PSUM,  # vLLM's SM90 layout: gap rows and their huge scales are never read
        PSUM.replace(recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED),  # packed 2^127 bytes
        SMALL.replace(grouped_layout=GroupedLayout.M_INDICES),  # -1 rows computed as zero
        PSUM.replace(topology="ep:2"),  # each rank's own padding
        LL,  # the masked GEMM reads masked_m rows of each batch
    ],
    ids=lambda p: p.id,
)
def test_the_optimized_path_passes_under_the_padding_poison(
    problem: MoEProblem, record_report
) -> None:
    report = record_report(
        verify(problem, backend=OptimizedBackend(engine="triton"), mode="both", padding_poison=True)
    )
    assert report.passed, report.summary_line()
    padded = Stage.DISPATCH if problem.topology.kind == "ep+ll" else Stage.PERMUTE
    assert report.files["padding_poison"] == [padded]


class BatchedPaddingBleeds(OptimizedBackend):
    """gemm1 on the batched layout (FlashInfer #3650's bug, in a masked GEMM): each batch's
    last 128-row block is computed whole, rows past masked_m included, and the epilogue's shared
    tile adds their zero-gated products (0 x Inf = NaN where they overflowed) into the live rows.
    Random inputs leave those rows zero; under the padding poison the live rows turn NaN."""

    name = "batched_padding_bleeds"

    def gemm1(self, ctx: StageContext) -> dict[str, object]:
        p, up = ctx.problem, ctx.upstream
        out = super().gemm1(ctx)
        d = up["dispatch"]
        mm1 = out["mm1"].clone()
        w = ctx.shard.w13
        weights = dequantize_fp8_blocks(w.q, w.scale, w.block)
        for e, live in enumerate(d["masked_m"].tolist()):
            if 0 < live < mm1.shape[1]:
                rows = slice(live, mm1.shape[1])
                a, s = d["a_batched"][e, rows], d["a_scale_batched"][e, rows]
                bleed = (accumulators(a, s, weights[e], p.recipe.act_group) * 0.0).sum(dim=0)
                mm1[e, :live] = (mm1[e, :live].float() + bleed).to(torch.bfloat16)
        out["mm1"] = mm1
        return out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "problem,backend",
    [(PSUM, fb.PaddingInfBleedsIntoTile), (LL, BatchedPaddingBleeds)],
    ids=["psum-permute", "ll-dispatch"],
)
def test_a_gemm_that_lets_padding_reach_live_rows_fails_isolated_only(
    problem: MoEProblem, backend: type[OptimizedBackend], record_report
) -> None:
    """Isolated mode reads the poisoned golden: gemm1 fails, with NaN in live rows. Chained mode
    runs on the backend's own zero padding and passes: the poison does not reach it. Without the
    poison both modes pass (random inputs hide the bug)."""
    report = verify(problem, backend=backend(engine="triton"), mode="both", padding_poison=True)
    record_report(report)
    assert report.first_failure == "gemm1", report.summary_line()
    failing = {r.stage for r in report.isolated or [] if r.status.failing}
    assert failing - {Stage.REDUCE} == {"gemm1"}, sorted(failing)
    assert all(r.status is Status.PASS for r in report.chained or []), report.to_summary()
    assert "NaN" in "\n".join(report.failure_messages())
    plain = verify(problem, backend=backend(engine="triton"), mode="isolated")
    assert plain.passed, plain.summary_line()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(mode="chained"), ValueError, "only isolated mode"),
        (dict(padding_poison="yes"), TypeError, "padding_poison"),
    ],
    ids=["chained", "not-a-bool"],
)
def test_the_padding_poison_is_refused_where_it_would_not_hold(
    kwargs: dict, exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        verify(PSUM, **{"padding_poison": True, **kwargs})


def test_a_poisoned_failure_dumps_and_replays_poisoned(tmp_path: Path) -> None:
    """run.json records the padding poison, and `replay` runs the case under it again: the
    failure reproduces (a replay without the poison would pass, so it must not be dropped)."""
    from moe_verify.run.dump import load_case
    from moe_verify.run.verify import replay

    spec = "tests.tester.field_bugs:PaddingInfBleedsIntoTile"
    report = verify(
        PSUM, backend=spec, engine="triton", mode="isolated", padding_poison=True,
        dump_dir=tmp_path,
    )  # fmt: skip
    assert not report.passed and report.first_failure == "gemm1", report.summary_line()
    case = load_case(tmp_path)
    assert case.options is not None
    assert case.options.padding_poison and case.options.gemm_recipe is None
    again = replay(tmp_path)
    assert not again.passed and again.first_failure == "gemm1", again.summary_line()
    assert again.files.get("padding_poison") == ["permute"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "flags,code", [([], 0), (["--poison-padding"], 1)], ids=["unpoisoned", "poison-padding"]
)
def test_run_poison_padding_reaches_verify(
    flags: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "-T", "16", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32",
            "--grouped-layout", "psum", "--engine", "triton", "--mode", "isolated",
            "--backend", "tests.tester.field_bugs:PaddingInfBleedsIntoTile", *flags]  # fmt: skip
    assert main(argv) == code
    out = capsys.readouterr().out
    assert ("first failure: gemm1" in out) is bool(flags), out
