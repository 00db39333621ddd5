"""Un-permute and reduce over top-k: the weighted fp32 gather with one final rounding, as vLLM's
`ep_gather` (fused_moe/deep_gemm_utils.py) computes it."""

from __future__ import annotations

import torch

from reference.layout import local_expert_ids
from reference.validate import require, require_tensor


def gather(
    mm2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_perm: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = bf16( Σ_k over live slots, k ascending, fp32(mm2[inv_perm[t,k]]) · w[t,k] ).

    A slot is live when its (mapped) expert id is >= 0. Tokens with no live slot are exact zeros.
    """
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
        term = mm2[rows].float() * topk_weights[:, k].float().unsqueeze(1)
        acc += torch.where(live[:, k].unsqueeze(1), term, torch.zeros_like(term))
    return acc.to(torch.bfloat16)
