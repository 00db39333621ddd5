"""Kernels with the engines' signatures, written here from the math (no engine code), for the
repro scripts to be pointed at (`--kernel correct_kernels:NAME`): the right ones must make a
script exit 0, the wrong ones (each a bug of the kind the script is about) exit 1.

Imports torch only: the scripts run them where moe-verify cannot be imported.
"""

from __future__ import annotations

import torch


def count_expert_num_tokens(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """int32 [E_l]: slots per local expert; only ids inside the map (or [0, E_l) without one)
    count, as vLLM's count must (vllm-project/vllm#50845)."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    bound = expert_map.numel() if expert_map is not None else num_local_experts
    ids = ids[(ids >= 0) & (ids < bound)]
    if expert_map is not None:
        ids = expert_map.to(torch.int64)[ids]
        ids = ids[ids >= 0]
    return torch.bincount(ids, minlength=num_local_experts)[:num_local_experts].to(torch.int32)


def count_wrapping_ids(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """Wrong: an id past the map wraps around to the map's start (one past the map reads entry 0):
    an unbounded read that lands on a local expert."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = ids[ids >= 0]
    if expert_map is not None:
        ids = expert_map.to(torch.int64)[ids % expert_map.numel()]
        ids = ids[ids >= 0]
    return torch.bincount(ids % num_local_experts, minlength=num_local_experts).to(torch.int32)


def count_ignoring_the_map(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """Wrong: global ids counted as if they were local (the map ignored)."""
    return count_expert_num_tokens(topk_ids, num_local_experts, None)


def ep_gather(
    input_tensor: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_topk_weight: torch.Tensor,
    input_index: torch.Tensor,
    output_tensor: torch.Tensor,
) -> None:
    """LMDeploy's ep_gather signature: each token's sum over slots with an id >= 0 of weight times
    input[input_index], in fp32, rounded once into output_tensor."""
    rows = input_tensor.float()[input_index.clamp(min=0).to(torch.int64)]
    terms = rows * recv_topk_weight.float().unsqueeze(-1)
    live = (recv_topk_ids >= 0).unsqueeze(-1)
    output_tensor.copy_(torch.where(live, terms, 0.0).sum(dim=1))


def ep_gather_bf16(
    input_tensor: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_topk_weight: torch.Tensor,
    input_index: torch.Tensor,
    output_tensor: torch.Tensor,
) -> None:
    """Wrong: the same sum accumulated in bf16, each product and partial sum rounded."""
    acc = torch.zeros_like(output_tensor, dtype=torch.bfloat16)
    for k in range(recv_topk_ids.shape[1]):
        row = input_tensor[input_index[:, k].clamp(min=0).to(torch.int64)].to(torch.bfloat16)
        term = row * recv_topk_weight[:, k, None].to(torch.bfloat16)
        acc = torch.where((recv_topk_ids[:, k] >= 0)[:, None], acc + term, acc)
    output_tensor.copy_(acc)


def count_importing_moe_verify(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """Imports moe-verify when called: where the scripts run, that must fail."""
    import moe_verify  # noqa: F401

    return count_expert_num_tokens(topk_ids, num_local_experts, expert_map)
