"""A grouped GEMM whose padding rows' overflow bleeds into live rows (a wrong kernel, for the
demo): FlashInfer PR #3650."""

from __future__ import annotations

import torch

from moe_verify.spec import Recipe, StageContext, round_up
from optimized.backend import OptimizedBackend, Outputs
from reference.formats import dequantize_fp8_blocks


def accumulators(
    a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, group: int
) -> torch.Tensor:
    """fp32 [rows, N]: sum over K groups of (codes @ weight^T) x the row's scale of that group,
    the scale applied after each partial dot as DeepGEMM promotes; fp32 a_scale [rows, K/group],
    dequantized weight fp32 [N, K]."""
    acc = torch.zeros(a.shape[0], weight.shape[0], device=a.device)
    for g in range(a.shape[1] // group):
        cols = slice(g * group, (g + 1) * group)
        acc += (a[:, cols].float() @ weight[:, cols].T) * a_scale[:, g : g + 1]
    return acc


class PaddingInfBleedsIntoTile(OptimizedBackend):
    """gemm1 (FlashInfer PR #3650): the grouped GEMM computes each expert's padding rows too
    (every row of its last aligned tile), its epilogue zeroes them by multiplying with their 0
    gate, and the persistent epilogue's shared staging tile adds that product into the tile's
    live rows: harmless while a padding accumulator is finite, NaN (0 x Inf) in every column
    where it overflowed.

    Qwen3.5-397B FP8 (H100) "token salad", GSM8K 1.14%: padding rows accumulated over stale FP8
    input until Inf. Random synthetic inputs never trip it (a fresh scatter's padding rows are
    zero); under the padding poison (`verify(..., padding_poison=True)`, `--poison-padding`:
    stale 448 codes and huge psum gap scales) gemm1 must catch it, as NaN in live rows of the
    experts whose segment has padding. The correct GEMM never reads a psum gap row and computes a
    -1 row as zero, so it passes under the same poison.
    """

    name = "padding_inf_bleeds_into_tile"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        if p.recipe is not Recipe.FP8_BLOCK:
            raise ValueError(f"{self.name} models fp8_block scales only, got {p.recipe}")
        out = super().gemm1(ctx)
        mm1 = out["mm1"].clone()
        perm, align = up["permute"], up["align"]
        w = ctx.shard.w13
        weights = dequantize_fp8_blocks(w.q, w.scale, w.block)
        group = p.recipe.act_group
        tile = align["alignment"]
        for e, count in enumerate(align["counts"].tolist()):
            start = int(perm["expert_start"][e])
            end, stop = start + count, start + round_up(count, tile)
            if end == stop:  # a full last tile: no padding row shares it
                continue
            rows = slice(end, stop)
            acc = accumulators(perm["a_perm"][rows], perm["a_scale_perm"][rows], weights[e], group)
            bleed = (acc * 0.0).sum(dim=0)  # the epilogue's gate, through the shared tile
            live = slice(stop - tile, end)
            mm1[live] = (mm1[live].float() + bleed).to(torch.bfloat16)
        out["mm1"] = mm1
        return out
