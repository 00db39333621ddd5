"""Un-permute and reduce over top-k: the weighted fp32 gather with one final rounding, as vLLM's
`ep_gather` (fused_moe/deep_gemm_utils.py) computes it, each step rounded as the recipe says
(moe_verify.spec.GatherRecipe: the product and the sum rounded apart, or one FMA); with a
`scale`, the fp32 sum multiplied by it before the rounding, as SGLang's post_reorder_deepgemm
applies routed_scaling_factor (moe_verify.spec.RoutedScalingRecipe.SCALE_ON_OUTPUT)."""

from __future__ import annotations

import torch

from moe_verify.spec import GatherRecipe
from reference.hardware.tensor_core import fma_fp32
from reference.layout import local_expert_ids
from reference.validate import require, require_tensor


def gather(
    mm2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_perm: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    recipe: GatherRecipe = GatherRecipe.MUL_ADD,
    scale: float = 1.0,
) -> torch.Tensor:
    """out[t] = bf16( fl(Σ_k over live slots, k ascending, fp32(mm2[inv_perm[t,k]]) · w[t,k]) ·
    scale ).

    A slot is live when its (mapped) expert id is >= 0. Tokens with no live slot are exact zeros.
    Each step is acc = fl(acc + fl(x · w)) (MUL_ADD) or acc = fma(x, w, acc) (FMA) in fp32; a
    `scale` other than 1 multiplies the fp32 sum once (one fp32 rounding) before the bf16 one.
    """
    require(
        recipe in list(GatherRecipe),
        "recipe",
        f"one of {[str(r) for r in GatherRecipe]}",
        repr(recipe),
    )
    recipe = GatherRecipe(recipe)
    require_tensor("topk_weights", topk_weights, (torch.float32,), 2)
    require(
        topk_weights.shape == topk_ids.shape == inv_perm.shape,
        "topk_weights/topk_ids/inv_perm",
        "equal [M, k] shapes",
        f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}, {tuple(inv_perm.shape)}",
    )
    live = local_expert_ids(topk_ids, expert_map) >= 0
    num_tokens, topk = topk_ids.shape
    acc = torch.zeros(num_tokens, mm2.shape[1], dtype=torch.float32, device=mm2.device)
    if mm2.shape[0] == 0:  # no rows on this rank (no local expert): every slot is skipped
        require(not bool(live.any()), "inv_perm", "no live slot when mm2 has no rows", "live")
        return acc.to(torch.bfloat16)
    for k in range(topk):  # fixed k order: the kernel's fp32 summation order
        rows = inv_perm[:, k].long().clamp(min=0)
        x, w = mm2[rows].float(), topk_weights[:, k].float().unsqueeze(1)
        if recipe is GatherRecipe.FMA:
            step = fma_fp32(x, w.expand_as(x), acc)
        else:
            step = acc + x * w
        acc = torch.where(live[:, k].unsqueeze(1), step, acc)
    if scale != 1.0:
        acc = acc * torch.tensor(scale, dtype=torch.float32)
    return acc.to(torch.bfloat16)
