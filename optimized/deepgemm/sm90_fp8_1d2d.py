"""SM90 (Hopper): DeepGEMM's 1D2D FP8 kernels (sm90_fp8_gemm_1d2d.cuh), 128x128-block FP8 weights
with fp32 scales, read as they are.

Everything UE8M0-packed, per-32 (MXFP8) or FP4 is SM100's (`sm100_ue8m0`).
"""

from __future__ import annotations

import torch

from moe_verify.spec import MoEProblem, Recipe, ScaleFmt

# SM90 1D2D kernels need BLOCK_M in {64, 128, 256} (DeepGEMM 2.6.1 sm90_fp8_gemm_1d2d.cuh's
# WAVE_BLOCK_M assert; 192 or 224 fail in the JIT compile).
SM90_LEGAL_ALIGNMENTS = (64, 128, 256)


def unsupported(problem: MoEProblem) -> str | None:
    """Why the SM90 kernels cannot run `problem`'s GEMMs, or None when they can."""
    if problem.recipe is not Recipe.FP8_BLOCK:
        return f"{problem.recipe} GEMMs (per-32 / FP4, packed UE8M0) are SM100-only"
    if problem.scale_fmt is ScaleFmt.UE8M0_PACKED:
        return "packed UE8M0 scales feed SM100 GEMMs only (SM90 reads fp32 scales)"
    if problem.alignment not in SM90_LEGAL_ALIGNMENTS:
        return f"alignment {problem.alignment} is not a legal SM90 BLOCK_M {SM90_LEGAL_ALIGNMENTS}"
    return None


def weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """The weight scales the 1D2D kernel reads: fp32 [E, N/128, K/128] as they are."""
    return scale.contiguous()
