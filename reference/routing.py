"""Routers: which experts each token goes to, and with what weight (vLLM 0.32 fused_moe/router/).

All return (topk_ids int32 [M, k], topk_weights fp32 [M, k]). Ties between equal scores go to
the lower expert id, as vLLM's kernels do.
"""

from __future__ import annotations

import torch

from reference.validate import require


def _topk_lowest_id_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; equal scores keep the lower index first (stable sort)."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def softmax_topk(
    logits: torch.Tensor, topk: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over all experts in fp32, keep the top k, optionally divide by their sum."""
    require(logits.dim() == 2, "router_logits", "[M, E]", f"shape {tuple(logits.shape)}")
    require(1 <= topk <= logits.shape[1], "topk", f"in [1, {logits.shape[1]}]", str(topk))
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = _topk_lowest_id_first(probs, topk)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.float()


def grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores; select by score + bias within the best groups.

    Group score = sum of the top-2 biased scores of the group (max without a bias). Experts outside
    the kept groups are masked to -inf. Weights are the *unbiased* scores of the chosen experts,
    renormalized, then multiplied by routed_scaling_factor (once).
    """
    num_tokens, num_experts = logits.shape
    require(
        num_experts % num_expert_group == 0,
        "num_expert_group",
        f"a divisor of E={num_experts}",
        str(num_expert_group),
    )
    scores = torch.sigmoid(logits.float())
    biased = scores if bias is None else scores + bias.float().unsqueeze(0)
    per_group = biased.view(num_tokens, num_expert_group, -1)
    if bias is None:
        group_score = per_group.max(dim=-1).values
    else:
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    _, kept = _topk_lowest_id_first(group_score, topk_group)
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, num_experts)
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    _, ids = _topk_lowest_id_first(masked, topk)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return ids.to(torch.int32), weights.float()


def router_weighted_input(hidden: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """hidden [M, H] with each row multiplied by its token's one router weight (top-1), in the
    hidden states' dtype: out = fl(x · fl(w)), w rounded to that dtype first and the product of
    the two rounded once (for bf16, exact in fp32 before that rounding). vLLM 0.32.0 applies the
    weight on the input so (`a1 * topk_weights.to(a1.dtype)`, fused_moe/prepare_finalize/
    no_dp_ep.py, deepep_ht.py, deepep_ll.py; docs/stage-contract.md#router-weight)."""
    require(hidden.dim() == 2, "hidden", "[M, H]", f"shape {tuple(hidden.shape)}")
    require(
        topk_weights.shape == (hidden.shape[0], 1),
        "topk_weights",
        f"[M, 1] = [{hidden.shape[0]}, 1] (the weight on the input is top-1 only)",
        f"shape {tuple(topk_weights.shape)}",
    )
    w = topk_weights.to(hidden.dtype).float()
    return (hidden.float() * w).to(hidden.dtype)
