"""Real multi-process runs (moe_verify/distributed/): two gloo ranks under torchrun on the CPU.

The backends below are deliberately wrong on rank 1 only; the workers import them by module path
(`--backend tests.distributed.test_torchrun:SwapsTokensOnRank1`), so the report must name rank 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_verify.distributed.launch import failed_ranks
from moe_verify.distributed.worker import _reduce_result
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_golden
from moe_verify.spec import MoEProblem, StageContext, StageSkipped, Trace
from optimized.backend import OptimizedBackend
from reference.moe import ReferenceBackend
from reference.topology import rank_partial, reduce_ranks

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
# Tiny enough for the Triton interpreter: one torchrun launch of two ranks takes ~10 s on 2 cores.
SMALL = ["-T", "8", "-H", "128", "-I", "256", "-E", "4", "-k", "2"]
LAUNCH_TIMEOUT_S = 240


class SwapsTokensOnRank1(OptimizedBackend):
    """Rank 1's gather writes every token's row into the next token (a misrouted combine)."""

    name = "swaps-tokens-on-rank1"

    def gather(self, ctx: StageContext) -> dict[str, object]:
        outputs = super().gather(ctx)
        if ctx.rank == 1:
            outputs = {**outputs, "out": outputs["out"].roll(1, dims=0)}
        return outputs


class SharedTwiceOnRank1(OptimizedBackend):
    """Rank 1's shared-expert output counted twice (the runner bug class: shared reduced twice)."""

    name = "shared-twice-on-rank1"

    def shared(self, ctx: StageContext) -> dict[str, object]:
        outputs = super().shared(ctx)
        if ctx.rank == 1:
            outputs = {**outputs, "out": (outputs["out"].float() * 2).to(torch.bfloat16)}
        return outputs


class RaisesOnRank1(OptimizedBackend):
    """Rank 1's gemm1 raises: a stage error on that rank, while rank 0 goes on to the collective."""

    name = "raises-on-rank1"

    def gemm1(self, ctx: StageContext) -> dict[str, object]:
        if ctx.rank == 1:
            raise RuntimeError("deliberate failure on rank 1")
        return super().gemm1(ctx)


class DiesOnRank1(OptimizedBackend):
    """Rank 1's process dies in gemm1 without a Python error (as an illegal memory access)."""

    name = "dies-on-rank1"

    def gemm1(self, ctx: StageContext) -> dict[str, object]:
        if ctx.rank == 1:
            os._exit(3)
        return super().gemm1(ctx)


class HangsOnRank1(OptimizedBackend):
    """Rank 1 never finishes gemm1 (as a deadlocked kernel)."""

    name = "hangs-on-rank1"

    def gemm1(self, ctx: StageContext) -> dict[str, object]:
        if ctx.rank == 1:
            time.sleep(LAUNCH_TIMEOUT_S)
        return super().gemm1(ctx)


def _launch(
    tmp_path: Path,
    topology: str,
    backend: str = "optimized",
    extra: tuple[str, ...] = (),
    mode: str = "chained",
    **env: str,
) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "moe_verify.cli", "run", "--launcher", "torchrun"]
    cmd += ["--topology", topology, *SMALL, *extra, "--mode", mode, "--backend", backend]
    cmd += ["--json", str(report)]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    return proc, json.loads(report.read_text()) if report.exists() else None


def _results(report: dict, stage: str) -> list[dict]:
    return [r for r in report["chained"] if r["stage"] == stage]


# Each topology's reduce is a different real collective: TP sums I-shard partials, EP sums
# expert-disjoint partials (tokens with no local expert are zero rows on that rank).
@pytest.mark.parametrize("topology", ["tp:2", "ep:2"])
def test_two_gloo_ranks_match_the_golden(tmp_path: Path, topology: str) -> None:
    """Every stage is reported per rank and the reduce is checked; rank 0 prints the report's
    summary, as `moe-verify run` does in process, and nothing else."""
    from tolerance.report import Report

    proc, report = _launch(tmp_path, topology)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["passed"]
    assert report["backend"] == "optimized@torchrun-gloo"
    for stage in ("route", "permute", "gemm1", "gemm2", "gather"):
        assert sorted(r["rank"] for r in _results(report, stage)) == [0, 1], stage
    (reduce,) = _results(report, "reduce")
    assert reduce["status"] == "pass"
    assert {c["name"] for c in reduce["checks"]} >= {"elementwise", "per-token", "ranks agree"}
    assert "verdict PASS" in proc.stdout
    assert proc.stdout.strip() == Report.from_dict(report).to_summary().strip()


def test_torchrun_with_v_prints_the_full_table(tmp_path: Path) -> None:
    """-v: rank 0 prints the full table (every check of every rank, with the limits' reasons),
    as `moe-verify run -v` does in process, and nothing else."""
    from tolerance.report import Report

    proc, report = _launch(tmp_path, "tp:2", extra=("-v",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None
    assert proc.stdout.strip() == Report.from_dict(report).to_table().strip()


# Shared experts take the runner's two finishes: tp:2 adds each rank's shared partial before the
# all-reduce; ep:2+ht all-reduces the shared partials apart from the combined routed output.
@pytest.mark.parametrize("topology", ["tp:2", "ep:2+ht"])
def test_shared_experts_under_torchrun_match_the_golden(tmp_path: Path, topology: str) -> None:
    proc, report = _launch(tmp_path, topology, extra=("--shared-experts", "1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["passed"]
    shared = {r["rank"]: r["status"] for r in _results(report, "shared")}
    assert shared == {0: "pass", 1: "pass"}
    (reduce,) = _results(report, "reduce")
    assert reduce["status"] == "pass"


def test_a_shared_expert_bug_on_one_rank_is_named(tmp_path: Path) -> None:
    backend = f"{__name__}:SharedTwiceOnRank1"
    proc, report = _launch(tmp_path, "tp:2", backend, extra=("--shared-experts", "1"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["failed_ranks"] == [1]
    assert report["first_failure"] == "shared"
    assert {r["rank"]: r["status"] for r in _results(report, "shared")} == {0: "pass", 1: "fail"}
    assert _results(report, "reduce")[0]["status"] == "fail"


@pytest.mark.parametrize(
    ("backend", "exit_code"),
    [("optimized", 0), ("tests.tester.field_bugs:PaddingInfBleedsIntoTile", 1)],
    ids=["correct", "padding-inf-bleeds"],
)
def test_the_padding_poison_reaches_every_rank(tmp_path: Path, backend: str, exit_code: int):
    """--poison-padding under torchrun: each rank's golden has its padding rows poisoned before
    the isolated stages read them, so the field bug that lets padding reach live rows fails at
    gemm1 on its ranks, and the correct GEMM passes the same poison."""
    extra = ("--grouped-layout", "psum", "--poison-padding")
    proc, report = _launch(tmp_path, "ep:2", backend, extra, mode="isolated")
    assert proc.returncode == exit_code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None
    if exit_code:
        assert report["first_failure"].startswith("gemm1"), report["first_failure"]
        failed = {
            r["rank"] for r in report["isolated"] if r["stage"] == "gemm1" and r["status"] == "fail"
        }
        assert failed, report["isolated"]


def test_a_wrong_rank_is_named_dumped_on_every_rank_and_replayed(tmp_path: Path) -> None:
    """One launch for both checks (--dump-dir changes nothing the naming checks read): rank 1
    is named, every rank's trace is dumped, and the dump replays in one process."""
    from moe_verify.run.dump import load_trace
    from moe_verify.run.verify import replay

    backend = f"{__name__}:SwapsTokensOnRank1"
    dumps = tmp_path / "dumps"
    proc, report = _launch(tmp_path, "tp:2", backend, extra=("--dump-dir", str(dumps)))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and not report["passed"]
    assert report["failed_ranks"] == [1]
    assert report["first_failure"] == "gather"
    assert {r["rank"]: r["status"] for r in _results(report, "gather")} == {0: "pass", 1: "fail"}
    assert _results(report, "reduce")[0]["status"] == "fail"
    assert "gather@r1" in proc.stdout
    (case,) = dumps.iterdir()
    assert sorted(p.name for p in case.iterdir()) == [
        "chained_r0.safetensors",
        "chained_r1.safetensors",
        "golden_r0.safetensors",
        "golden_r1.safetensors",
        "inputs.safetensors",
        "problem.json",
        "report.json",
        "run.json",
    ]
    assert load_trace(case / "chained_r1.safetensors").rank == 1
    assert not json.loads((case / "report.json").read_text())["passed"]
    # The dump re-runs in one process (emulated ranks) and fails where the torchrun run did.
    again = replay(case, backend=backend, mode="chained")
    assert again.first_failure == "gather" and again.failed_ranks == [1]


def test_a_bug_on_the_last_of_four_ranks_is_named(tmp_path: Path) -> None:
    """Four gloo ranks, ep:4 over six experts (ranks 0 and 1 hold two, ranks 2 and 3 one): only
    rank 3 drops its expert's slots, and only rank 3 is blamed."""
    backend = "tests.tester.wrong_backends:LastExpertDroppedOnLastRank"
    extra = ("-E", "6", "-T", "16")
    proc, report = _launch(tmp_path, "ep:4", backend, extra)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["failed_ranks"] == [3], report and report["failed_ranks"]
    assert report["first_failure"] == "gather"
    gather = {r["rank"]: r["status"] for r in _results(report, "gather")}
    assert gather == {0: "pass", 1: "pass", 2: "pass", 3: "fail"}, gather
    assert "gather@r3" in proc.stdout


def test_a_fused_group_is_judged_and_named_on_every_rank(tmp_path: Path) -> None:
    """quant_input fused into permute (moe_verify/examples/fused.py), one scale halved: each
    rank's permute row carries the group, and the first failure names it."""
    backend = "moe_verify.examples.fused:QuantizingScatterHalvesAScale"
    proc, report = _launch(tmp_path, "ep:2", backend)  # chained: the report's rows
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["first_failure"] == "permute"
    permute = _results(report, "permute")
    assert {r["group"] for r in permute} == {"quant_input+permute"}, permute
    assert not _results(report, "quant_input")
    assert "permute@r0 in quant_input+permute" in proc.stdout


def test_a_rank_that_raises_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    proc, report = _launch(tmp_path, "ep:2", f"{__name__}:RaisesOnRank1")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # an error, not a fail
    assert report is not None and report["failed_ranks"] == [1]
    gemm1 = {r["rank"]: r for r in _results(report, "gemm1")}
    assert gemm1[0]["status"] == "pass" and gemm1[1]["status"] == "error"
    assert "deliberate failure on rank 1" in gemm1[1]["reason"]
    (reduce,) = _results(report, "reduce")
    assert reduce["status"] == "skip" and "rank(s) [1]" in reduce["reason"]


@pytest.mark.slow
def test_a_rank_that_dies_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    proc, report = _launch(tmp_path, "ep:2", f"{__name__}:DiesOnRank1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert report is None
    assert "failed rank(s): [1]" in proc.stderr
    assert "rank 1: exit 3" in proc.stderr and "gemm1" in proc.stderr


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_after_the_timeout(tmp_path: Path) -> None:
    start = time.perf_counter()
    proc, _ = _launch(tmp_path, "ep:2", f"{__name__}:HangsOnRank1", MOE_VERIFY_DIST_TIMEOUT_S="8")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "failed rank(s): [1]" in proc.stderr
    assert "Ranks 1 failed to pass monitoredBarrier" in proc.stderr
    assert time.perf_counter() - start < LAUNCH_TIMEOUT_S / 2


# Long enough for rank 0's local work (every rank's golden) on a loaded 2-core machine: the test
# passed with 2 s beside a 2-worker pytest run (2026-12-06); 8 s keeps four times that, and the
# test waits it out.
RANK_CASE_TIMEOUT_S = 8


def test_a_rank_that_hangs_past_the_case_timeout_is_an_error_of_its_stage(tmp_path: Path) -> None:
    timeout = ("--case-timeout", str(RANK_CASE_TIMEOUT_S))
    proc, report = _launch(tmp_path, "ep:2", f"{__name__}:HangsOnRank1", extra=timeout)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None and report["failed_ranks"] == [1]
    gemm1 = {r["rank"]: r for r in _results(report, "gemm1")}
    assert gemm1[0]["status"] == "pass" and gemm1[1]["status"] == "error"
    assert f"timed out after {RANK_CASE_TIMEOUT_S} s" in gemm1[1]["reason"]


# In-process checks of the pieces a healthy run cannot exercise.


def _shared_problem(topology: str) -> MoEProblem:
    return MoEProblem(
        tokens=8,
        hidden=128,
        intermediate=256,
        num_experts=4,
        topk=2,
        topology=topology,
        shared_experts=1,
    )


# The reduce stage is compared within a GEMM's bound, which would let a wrong rounding order
# pass; here the one definition of the reduce (reference.topology, which the torchrun worker
# all-reduces too) must equal the runner's two finishes written out, bit for bit: routed + shared
# in bf16 on each rank before the sum (tp, ep), or the shared sum rounded on its own and added
# after the combine (ep+ht, ep+ll).
@pytest.mark.parametrize("topology", ["tp:2", "ep:2", "ep:2+ht", "ep:2+ll"])
def test_the_reduce_is_the_runners_finish_bit_for_bit(topology: str) -> None:
    p = _shared_problem(topology)
    inputs = make_inputs(p, "cpu")
    traces = [run_golden(ReferenceBackend(), p, inputs, r) for r in range(2)]
    bf16 = torch.bfloat16
    routed = []
    for t in traces:
        out, index = t["gather"]["out"].float(), t["route"].get("token_index")
        full = torch.zeros(p.tokens, p.hidden)
        routed.append(full.index_add_(0, index, out) if index is not None else full + out)
    shared = [t["shared"]["out"].float() for t in traces]
    if topology.endswith(("+ht", "+ll")):
        combined = (routed[0] + routed[1]).to(bf16).float()
        want = (combined + (shared[0] + shared[1]).to(bf16).float()).to(bf16)
    else:
        finals = [(r + s).to(bf16).float() for r, s in zip(routed, shared, strict=True)]
        want = (finals[0] + finals[1]).to(bf16)
    assert torch.equal(reduce_ranks(traces, p).view(torch.int16), want.view(torch.int16))
    parts = [rank_partial(t, p) for t in traces]  # what each torchrun rank all-reduces
    assert all((x.shared is not None) == topology.endswith(("+ht", "+ll")) for x in parts)


def test_a_misshaped_shared_output_is_named_not_all_reduced() -> None:
    p = _shared_problem("ep:2+ht")
    trace = run_golden(ReferenceBackend(), p, make_inputs(p, "cpu"), 1)
    bad = Trace(trace.backend, trace.rank)
    for stage, outs in trace.items():
        bad.add(stage, {**outs, "out": outs["out"][:-1]} if stage == "shared" else outs)
    with pytest.raises(StageSkipped, match=r"shared out of rank 1 is \(7, 128\), not \(8, 128\)"):
        rank_partial(bad, p)
    rank_partial(trace, p)


def test_a_dump_from_a_rank_with_nothing_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 failed before comparing (no traces, no inputs kept): the dump still gets the
    problem, the report and the inputs (rebuilt from the seed), and says what it lacks."""
    import torch.distributed as dist

    from moe_verify.distributed.worker import RankContext, RankWork, _dump
    from tolerance.report import Report

    p = MoEProblem(tokens=8, hidden=128, intermediate=256, num_experts=4, topk=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo", None)
        _dump(tmp_path / "d", p, RankWork({}, {}), ctx, Report(p, "x", "chained", chained=[]))
    finally:
        dist.destroy_process_group()
    case = tmp_path / "d" / p.id
    assert sorted(f.name for f in case.iterdir()) == [
        "inputs.safetensors",
        "problem.json",
        "report.json",
    ]
    assert "(incomplete: rank 0: no traces (it failed before comparing))" in capsys.readouterr().out


def test_ranks_agree_fails_when_a_rank_holds_other_bits() -> None:
    p = MoEProblem(tokens=4, hidden=128, intermediate=256, num_experts=2, topology="tp:2")
    out = torch.randn(4, 128).to(torch.bfloat16)
    result = _reduce_result(p, out, out.clone(), ["a", "a"], "chained", "x")
    assert result.status == "pass"
    result = _reduce_result(p, out, out.clone(), ["a", "b"], "chained", "x")
    assert result.status == "fail"
    (agree,) = [c for c in result.checks if c.name == "ranks agree"]
    assert not agree.passed and agree.worst is not None and agree.worst.rank == 1


def test_the_rank_that_never_reached_the_exchange_is_blamed() -> None:
    def failure(code: int) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code)

    reached = {"stage": "exchange: barrier after the local work"}
    notes = {0: reached, 1: {"stage": "gemm1", "mode": "chained"}}
    assert failed_ranks(notes, {0: failure(-signal.SIGTERM), 1: failure(3)}) == [1]
    both = {0: reached, 1: reached}
    assert failed_ranks(both, {0: failure(-signal.SIGTERM), 1: failure(1)}) == [1]
    setup = {0: {"stage": "setup", "error": "bad flag"}, 1: {"stage": "setup", "error": "bad flag"}}
    assert failed_ranks(setup, {0: failure(-signal.SIGTERM), 1: failure(2)}) == [0, 1]
