"""SM90 tier: `moe-verify run --sanitize` pinpoints planted kernel bugs on the H200.

Each planted backend is the optimized path with one small Triton kernel added after one stage: a
store one element past a 16-float tensor (no page fault, so a plain run passes; only memcheck
sees it, and only with PyTorch's caching allocator off), the far store of
tests/tester/gpu_fault_backends.py (a hardware fault), a shared-memory race (every thread of
four warps stores its own value to one shared word and reads it back, no barrier between; Triton
never emits that itself, so the race is written in PTX), and a read of a never-written allocation
(initcheck's). The sanitizer must name the planted kernel, the stage it ran in and the case; the
correct backend's case must have 0 errors under each of the four tools.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from moe_verify.sanitize.report import SanitizeReport
from moe_verify.sanitize.run import sanitize_run
from moe_verify.spec import MoEProblem, StageContext
from optimized.backend import OptimizedBackend
from tests.tester.gpu_fault_backends import FAULT_SEED

pytestmark = pytest.mark.sm90

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.gpu.test_sm90_sanitize"
CASE = MoEProblem(tokens=16, hidden=256, intermediate=256, num_experts=4, topk=2)
FLAGS = ["-T", "16", "-H", "256", "-I", "256", "-E", "4", "-k", "2", "--engine", "triton"]
FLAGS += ["--mode", "isolated"]
# A sanitized case of this size ran in about 11 s on the H200 (docs/sanitize.md, "The
# slowdown"); racecheck is slower. The bound is for a hang, not a measurement.
TIMEOUT_S = 600.0


@triton.jit
def _store_one_past(ptr, n):
    # An off-by-one bound: index n of an n-element tensor. The address lies in the allocation's
    # rounding slack, so the GPU does not fault and the plain run passes.
    tl.store(ptr + n, 1.0)


@triton.jit
def _racy_shared_kernel(out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    # A cross-warp sum, so the kernel is given shared memory (Triton's global_smem).
    total = tl.sum(offs.to(tl.float32), axis=0)
    seen = tl.inline_asm_elementwise(
        "st.shared.b32 [global_smem], $1;\n\tld.shared.b32 $0, [global_smem];",
        "=r,r",
        [offs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(out_ptr + offs, seen + total.to(tl.int32))


@triton.jit
def _read_unwritten(src_ptr, out_ptr):
    # Reads memory nobody wrote: torch.empty, with PyTorch's caching allocator off a fresh
    # cudaMalloc. Any value is "fine" to a plain run; only initcheck sees it.
    tl.store(out_ptr, tl.load(src_ptr))


class OnePastTheEndInPermute(OptimizedBackend):
    """permute, then a store one element past a small tensor."""

    name = "one-past-the-end-in-permute"

    def permute(self, ctx: StageContext):
        out = super().permute(ctx)
        buf = torch.zeros(16, device="cuda")
        _store_one_past[(1,)](buf, buf.numel())
        return out


class SharedRaceInActQuant(OptimizedBackend):
    """act_quant, then a kernel whose threads race on one shared-memory word."""

    name = "shared-race-in-act-quant"

    def act_quant(self, ctx: StageContext):
        out = super().act_quant(ctx)
        buf = torch.zeros(128, dtype=torch.int32, device="cuda")
        _racy_shared_kernel[(1,)](buf, BLOCK=128, num_warps=4)
        return out


class UnwrittenReadInGemm2(OptimizedBackend):
    """gemm2, then a kernel that reads a never-written allocation."""

    name = "unwritten-read-in-gemm2"

    def gemm2(self, ctx: StageContext):
        out = super().gemm2(ctx)
        src, dst = torch.empty(16, device="cuda"), torch.zeros(1, device="cuda")
        _read_unwritten[(1,)](src, dst)
        return out


def _sanitize(tool: str, extra: list[str], baseline: bool = False) -> SanitizeReport:
    return sanitize_run([*FLAGS, *extra], tool, TIMEOUT_S, baseline=baseline, cwd=ROOT)


def _planted(
    record_property: Callable[[str, object], None], tool: str, extra: list[str], baseline: bool
) -> SanitizeReport:
    report = _sanitize(tool, extra, baseline)
    record_property("sanitize_summary", report.to_summary())
    assert report.errors >= 1 and report.first is not None, report.to_summary()
    assert report.case == CASE.replace(seed=_seed(extra)).id, report.to_summary()
    assert report.exit_code == 1, report.to_summary()
    return report


def _seed(extra: list[str]) -> int:
    return int(extra[extra.index("--seed") + 1]) if "--seed" in extra else CASE.seed


def test_an_off_by_one_store_is_pinpointed_by_memcheck_alone(record_property) -> None:
    extra = ["--backend", f"{MODULE}:OnePastTheEndInPermute"]
    report = _planted(record_property, "memcheck", extra, baseline=True)
    assert report.first.kernel_base == "_store_one_past", report.to_summary()
    assert report.where.stage == "permute", report.to_summary()
    assert "out of bounds" in (report.first.address or ""), report.to_summary()
    # without the sanitizer the same case passes: nothing else would have found it
    assert report.baseline_rc == 0, report.to_summary()


def test_a_far_store_is_pinpointed_by_memcheck(record_property) -> None:
    extra = ["--backend", "tests.tester.gpu_fault_backends:IllegalAddressInGemm1"]
    report = _planted(record_property, "memcheck", [*extra, "--seed", str(FAULT_SEED)], False)
    assert report.first.kernel_base == "_store_far", report.to_summary()
    assert report.where.stage == "gemm1", report.to_summary()


def test_a_shared_memory_race_is_pinpointed_by_racecheck(record_property) -> None:
    extra = ["--backend", f"{MODULE}:SharedRaceInActQuant"]
    report = _planted(record_property, "racecheck", extra, baseline=False)
    assert report.first.kernel_base == "_racy_shared_kernel", report.to_summary()
    # racecheck does not stop the run: the stage is the breadcrumb's when the error came
    assert report.where.stage == "act_quant", report.to_summary()


def test_an_unwritten_read_is_pinpointed_by_initcheck(record_property) -> None:
    extra = ["--backend", f"{MODULE}:UnwrittenReadInGemm2"]
    report = _planted(record_property, "initcheck", extra, baseline=True)
    # Another kernel first would be a read of unwritten memory by the optimized path itself
    # (test_the_correct_backend_is_clean[initcheck] says so too): a finding, not this fault.
    assert report.first.kernel_base == "_read_unwritten", report.to_summary()
    # initcheck does not stop the run: the stage is the breadcrumb's when the error came
    assert report.where.stage == "gemm2", report.to_summary()
    assert report.baseline_rc == 0, report.to_summary()


# Each tool's slowdown on a correct case is recorded (docs/gpu-results.md). A read of padding rows
# nothing wrote shows up here first: initcheck's first H200 run found the suite's own act_quant
# comparison doing it (fixed in ce2a754).
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "initcheck", "synccheck"])
def test_the_correct_backend_is_clean(tool: str, record_property) -> None:
    report = _sanitize(tool, [], baseline=True)
    record_property("sanitize_summary", report.to_summary())
    assert report.errors == 0 and report.failure is None, report.to_summary()
    assert report.child_rc == 0 and report.exit_code == 0, report.to_summary()
    assert report.slowdown is not None, report.to_summary()
