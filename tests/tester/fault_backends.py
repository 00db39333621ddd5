"""Backends that misbehave rather than compute wrong: they raise, crash, hang, exit, write where
they must not, or return what the stage contract forbids. The harness must turn each into a
result of the stage it happened in (a failed check or an error), and keep going.

Each is the optimized path with one stage hook (the public method named after the stage)
overridden, and faults only on cases whose `problem.seed == FAULT_SEED`, so a sweep over seeds 0
and 1 shows the other case still runs and passes. `EXPECTED` says what each must become: a
failed check (exit 1) or an error (exit 2), and at which stage.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from moe_verify.spec import MoEProblem, Stage, StageContext, Status
from optimized.backend import OptimizedBackend

FAULT_SEED = 1
# The byte a poisoned workspace is filled with: 0xFFFF is a NaN in bf16, so a row left unwritten
# is NaN in a live row, which always fails.
POISON = 0xFF

Outputs = dict[str, object]


def _faults(problem: MoEProblem) -> bool:
    return problem.seed == FAULT_SEED


class RaisesInGemm1(OptimizedBackend):
    """gemm1 raises, as a kernel wrapper refusing its inputs does."""

    name = "raises-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if _faults(p):
            raise RuntimeError("deliberate fault in gemm1")
        return super().gemm1(ctx)


class WrongShapeMm1(OptimizedBackend):
    """gemm1 returns mm1 one row short of M_sum (a grid that drops the last block)."""

    name = "wrong-shape-mm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().gemm1(ctx)
        if _faults(p):
            out["mm1"] = out["mm1"][:-1]
        return out


class WrongDtypeMm1(OptimizedBackend):
    """gemm1 returns mm1 as float32 instead of bf16 (the epilogue's cast forgotten)."""

    name = "wrong-dtype-mm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().gemm1(ctx)
        if _faults(p):
            out["mm1"] = out["mm1"].float()
        return out


class NanInLiveRow(OptimizedBackend):
    """gemm1 writes NaN into the first live row of mm1 (an uninitialised accumulator)."""

    name = "nan-in-live-row"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        out = super().gemm1(ctx)
        if _faults(p):
            live = (up["permute"]["m_indices"] >= 0).nonzero()[0, 0]
            mm1 = out["mm1"].clone()
            mm1[live] = float("nan")
            out["mm1"] = mm1
        return out


class SegfaultsInGemm1(OptimizedBackend):
    """gemm1 dies of SIGSEGV, as a host-side out-of-bounds read in a C extension does."""

    name = "segfaults-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if _faults(p):
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().gemm1(ctx)


class AbortsInGemm1(OptimizedBackend):
    """gemm1 aborts (SIGABRT), as a failed C++ assertion (TORCH_CHECK in a destructor) does."""

    name = "aborts-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if _faults(p):
            os.abort()
        return super().gemm1(ctx)


class HangsInGemm1(OptimizedBackend):
    """gemm1 never returns (a deadlock: a spin on a flag nobody sets, seen from the host)."""

    name = "hangs-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        while _faults(p):
            time.sleep(3600)
        return super().gemm1(ctx)


class ExitsZeroInGemm1(OptimizedBackend):
    """gemm1 calls exit(0), as a library that "handles" an error by exiting does: never a pass."""

    name = "exits-zero-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if _faults(p):
            raise SystemExit(0)
        return super().gemm1(ctx)


class RaisesKeyboardInterruptInGemm1(OptimizedBackend):
    """gemm1 raises KeyboardInterrupt itself: nobody pressed Ctrl-C, so it is the stage's error."""

    name = "raises-keyboard-interrupt-in-gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if _faults(p):
            raise KeyboardInterrupt
        return super().gemm1(ctx)


class ScalesUpstreamInPlace(OptimizedBackend):
    """act_quant computes its outputs right, then scales the mm1 it was handed in place (an
    in-place SiLU on the GEMM's output buffer): in isolated mode that buffer is the golden's."""

    name = "scales-upstream-in-place"

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        out = super().act_quant(ctx)
        if _faults(p):
            up["gemm1"]["mm1"].mul_(2)
        return out


class OverrunsWorkspace(OptimizedBackend):
    """gemm1 then writes 8 bf16 elements just past its output workspace (a grid that overruns
    the last block without faulting); the guard band after the workspace catches it."""

    name = "overruns-workspace"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().gemm1(ctx)
        if _faults(p):
            (buf,) = [b for k, b in ctx.buffers.buffers.items() if k[0] == "mm1"]
            flat = buf.view(-1)
            torch.as_strided(flat, (8,), (1,), flat.storage_offset() + flat.numel())[:] = 1
        return out


class LeavesRowUnwritten(OptimizedBackend):
    """gather never writes token 0's row of its output workspace (an off-by-one grid), which
    keeps the poison the workspace was filled with."""

    name = "leaves-row-unwritten"

    def gather(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().gather(ctx)
        poison = getattr(ctx.buffers, "poison", None)  # the harness's workspaces (--poison)
        if _faults(p) and poison is not None:
            out["out"][0].view(torch.uint8).fill_(poison)
        return out


class FaultsBySeed(OptimizedBackend):
    """gemm1 faults by the case's seed, so one sweep mixes faults across its workers: a case of
    SEGFAULT_SEED dies of SIGSEGV, HANG_SEED never returns, EXIT_SEED calls exit(0) inside the
    stage, HARD_EXIT_SEED calls os._exit(0) (the process ends at once with status 0, no Python
    cleanup: `moe-verify run` cannot survive it, only a sweep's worker contains it); every other
    case runs normally."""

    name = "faults-by-seed"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        if p.seed in (OOM_ONCE_SEED, OOM_ALWAYS_SEED):
            runs = Path(os.environ[ATTEMPTS_DIR_VAR])
            runs.mkdir(parents=True, exist_ok=True)
            attempt = len(list(runs.glob(f"{p.seed}-*"))) + 1
            (runs / f"{p.seed}-{attempt}").touch()
            if p.seed == OOM_ALWAYS_SEED or attempt == 1:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 2.00 GiB (deliberate, run {attempt})"
                )
        if p.seed == SEGFAULT_SEED:
            os.kill(os.getpid(), signal.SIGSEGV)
        while p.seed == HANG_SEED:
            time.sleep(3600)
        if p.seed == EXIT_SEED:
            raise SystemExit(0)
        if p.seed == HARD_EXIT_SEED:
            os._exit(0)
        return super().gemm1(ctx)


SEGFAULT_SEED, HANG_SEED, EXIT_SEED, HARD_EXIT_SEED = 11, 12, 13, 14
OOM_ONCE_SEED, OOM_ALWAYS_SEED = 15, 16
ATTEMPTS_DIR_VAR = "MOE_VERIFY_TEST_ATTEMPTS"


# class name -> (the case status it must give, the stage it must be blamed on)
EXPECTED: dict[str, tuple[Status, Stage]] = {
    "RaisesInGemm1": (Status.ERROR, Stage.GEMM1),
    "WrongShapeMm1": (Status.FAIL, Stage.GEMM1),
    "WrongDtypeMm1": (Status.FAIL, Stage.GEMM1),
    "NanInLiveRow": (Status.FAIL, Stage.GEMM1),
    "SegfaultsInGemm1": (Status.ERROR, Stage.GEMM1),
    "AbortsInGemm1": (Status.ERROR, Stage.GEMM1),
    "HangsInGemm1": (Status.ERROR, Stage.GEMM1),
    "ExitsZeroInGemm1": (Status.ERROR, Stage.GEMM1),
    "RaisesKeyboardInterruptInGemm1": (Status.ERROR, Stage.GEMM1),
    "ScalesUpstreamInPlace": (Status.FAIL, Stage.ACT_QUANT),
    "OverrunsWorkspace": (Status.FAIL, Stage.GEMM1),
    "LeavesRowUnwritten": (Status.FAIL, Stage.GATHER),
}
# The faults that end the process: only a subprocess survives them.
CRASHES = ("SegfaultsInGemm1", "AbortsInGemm1")
