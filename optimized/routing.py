"""Routing on the optimized side: fused-style top-k with torch ops on the device (not a Triton
kernel: routing is not what the DeepGEMM path optimizes, but it is ours, independent of the golden).
"""

from __future__ import annotations

import torch

from moe_verify.spec import MoEInputs, MoEProblem, Placement, Routing
from optimized.topology import replica_table


def select_experts(problem: MoEProblem, inputs: MoEInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]) for the problem's routing mode."""
    if inputs.topk_ids is not None and inputs.topk_weights is not None:
        ids, weights = inputs.topk_ids, inputs.topk_weights
    elif problem.routing is Routing.GROUPED:
        ids, weights = _grouped(problem, inputs.router_logits, inputs.score_bias)
    else:
        probs = torch.softmax(inputs.router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, problem.topk, dim=-1)
        if problem.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if problem.topology.placement is Placement.EXPLICIT:
        ids = _to_physical(problem, ids)
    return ids.to(torch.int32), weights.float()


def _grouped(
    problem: MoEProblem, logits: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    groups = problem.num_expert_group
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    grouped = choice.view(tokens, groups, experts // groups)
    if bias is None:
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(problem.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
    keep = keep.repeat_interleave(experts // groups, dim=1)
    ids = choice.masked_fill(~keep, float("-inf")).topk(problem.topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if problem.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * problem.routed_scaling_factor


def _to_physical(problem: MoEProblem, ids: torch.Tensor) -> torch.Tensor:
    """EPLB replica choice by the token's multiplicative hash (vLLM's logical -> physical map)."""
    table, counts = replica_table(problem, ids.device)
    token = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)[:, None]
    safe = ids.long().clamp(min=0)
    replica = ((token * 2654435769) % (1 << 32)) % counts[safe]
    physical = table[safe, replica]
    return torch.where(ids < 0, -1, physical)


def apply_router_weight_on_input(hidden: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """hidden [M, H] times each token's one router weight (top-1: topk_weights [M, 1]), in the
    hidden states' dtype, as vLLM 0.32.0's prepare does before quantizing
    (fused_moe/prepare_finalize/no_dp_ep.py: `a1 * topk_weights.to(a1.dtype)`); the gather then
    sums with weight 1 (docs/stage-contract.md#router-weight)."""
    if topk_weights.dim() != 2 or topk_weights.shape != (hidden.shape[0], 1):
        raise ValueError(
            f"apply_router_weight_on_input: topk_weights must be [M, 1] = [{hidden.shape[0]}, 1] "
            f"(the weight goes on the input for top-1 routing only), got "
            f"{tuple(topk_weights.shape)}"
        )
    return hidden * topk_weights.to(hidden.dtype)
