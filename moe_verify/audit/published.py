"""Figures published for a real checkpoint's weight requantization to UE8M0, which
`moe-verify audit-e8m0` reports its own measurements beside (source: a comment on vLLM PR #58157).

Both are taken on the dequantized weights, as the audit takes them: W from the checkpoint's fp32
block scales, W_e8m0 after vLLM's `requant_weight_ue8m0_inplace`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRequant:
    """Relative Frobenius error ||W_e8m0 - W||_F / ||W||_F and 1 - cos(W_e8m0, W) over a
    checkpoint's requantized tensors, as published."""

    source: str
    model: str
    rel_frobenius_mean: float
    rel_frobenius_min: float
    rel_frobenius_max: float
    one_minus_cos_mean: float
    one_minus_cos_max: float
    note: str


# The one real checkpoint with published requantization figures. "Flat across layer types" is what
# makes a per-kind comparison meaningful: a kind far from these is not the format's usual cost.
QWEN38_FLASH_NEXT = PublishedRequant(
    source="vLLM PR #58157 comment (jschmied, 2026-09-22)",
    model="Qwen3.8-Flash-Next FP8 block-scaled: 40 of its 157 FP8_PB_WO tensors, GB10",
    rel_frobenius_mean=0.02645,
    rel_frobenius_min=0.02575,
    rel_frobenius_max=0.02715,
    one_minus_cos_mean=3.50e-4,
    one_minus_cos_max=3.69e-4,
    note="flat across 7 layer families and shapes (512, 2560) to (12288, 2560): about one more "
    "e4m3 rounding of every weight, systematic to the format",
)
