"""Kernel faults that only a GPU can have: an illegal memory access and a kernel that never ends.

Each backend is the optimized path with its gemm1 followed by one planted Triton kernel, and
faults only on cases with `problem.seed == FAULT_SEED`, so a sweep shows the next case still runs
(in a fresh process: after an illegal memory access the CUDA context is unusable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_verify.spec import MoEProblem, StageContext
from optimized.backend import OptimizedBackend

FAULT_SEED = 1


@triton.jit
def _store_far(ptr, offset):
    # A store 2**40 elements past a small buffer: no page there, so the SM raises an illegal
    # address, as an unchecked expert id or row index would.
    tl.store(ptr + offset, 1.0)


@triton.jit
def _spin_until_set(flag_ptr):
    # Waits for a flag nothing ever sets: a kernel that never ends (a lost arrival in a
    # cross-block barrier, an expert count read as zero forever).
    while tl.load(flag_ptr, volatile=True) == 0:
        pass


def _faults(problem: MoEProblem) -> bool:
    return problem.seed == FAULT_SEED


class IllegalAddressInGemm1(OptimizedBackend):
    """gemm1, then a store far out of bounds: the illegal memory access the suite must contain."""

    name = "illegal-address-in-gemm1"

    def gemm1(self, ctx: StageContext):
        p = ctx.problem
        out = super().gemm1(ctx)
        if _faults(p):
            buf = torch.zeros(16, device="cuda")
            _store_far[(1,)](buf, 2**40)
        return out


class KernelHangsInGemm1(OptimizedBackend):
    """gemm1, then a kernel that spins forever: only the case timeout can end it."""

    name = "kernel-hangs-in-gemm1"

    def gemm1(self, ctx: StageContext):
        p = ctx.problem
        out = super().gemm1(ctx)
        if _faults(p):
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            _spin_until_set[(1,)](flag)
        return out
