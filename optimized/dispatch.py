"""The batched low-latency layout's dispatch (ep:N+ll), as DeepEP's low-latency dispatch lays it
out: each local expert's slots in token order in its own [max_tokens, H] batch. One
implementation, with no host sync, for verification and production mode alike."""

from __future__ import annotations

import torch

from moe_verify.spec import Outputs, ceil_div


def local_ids(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int
) -> torch.Tensor:
    """Local expert of every slot, -1 where it is skipped: -1, an id outside the map (a stale id
    in a CUDA-graph padding row must never index past it: vLLM test_expert_map_bounds), an
    expert on another rank, or a local id out of range. No host sync."""
    ids = topk_ids.long()
    if expert_map is not None:
        in_map = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(
            in_map, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1
        )
    return torch.where((ids >= 0) & (ids < num_local), ids, -1)


def batched_dispatch(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local: int,
    max_tokens: int,
    *,
    expected_m: int | None = None,
    a_out: torch.Tensor | None = None,
) -> Outputs:
    """Stands in for DeepEP's low-latency dispatch (a communication kernel, not under test):
    each local expert's slots numbered in token order into its [max_tokens, H] batch, with no
    host sync. A slot past an expert's capacity is dropped (its `slot` is -1) and masked_m is
    capped at the capacity, as a full receive buffer would.

    returns a_batched fp8 [E_l, max_tokens, H] (rows past masked_m zero), a_scale_batched
    [E_l, max_tokens, H/G], masked_m int32 [E_l], slot and slot_expert int32 [M, k] (-1 where
    skipped), expected_m (the host hint the masked GEMM takes; None: the mean batch, one host
    read, as verification mode may afford), batch_m_indices int32
    [E_l * max_tokens] (the batches as one contiguous layout, -1 past masked_m).
    """
    m, h = a1q.shape
    device = a1q.device
    local = local_ids(topk_ids, expert_map, num_local)
    flat = local.flatten()
    live = flat >= 0
    if num_local == 0:
        one_hot = torch.zeros(flat.numel(), 0, dtype=torch.int64, device=device)
        slot = torch.full_like(flat, -1)
    else:
        one_hot = torch.nn.functional.one_hot(flat.clamp(min=0), num_local) * live[:, None]
        before = torch.cumsum(one_hot, dim=0) - one_hot
        slot = torch.where(live, before.gather(1, flat.clamp(min=0)[:, None]).squeeze(1), -1)
    slot = torch.where(slot < max_tokens, slot, -1)
    live = slot >= 0
    masked_m = one_hot.sum(dim=0).clamp(max=max_tokens).to(torch.int32)
    rows = num_local * max_tokens
    # Skipped slots write into one trash row past the batches, so no index is data-dependent.
    dest = torch.where(live, flat.clamp(min=0) * max_tokens + slot.clamp(min=0), rows)
    token = torch.arange(m * local.shape[1], device=device) // max(local.shape[1], 1)
    a_b = torch.zeros(rows + 1, h, dtype=torch.uint8, device=device)
    a_b.index_copy_(0, dest, a1q.view(torch.uint8)[token])
    s_b = torch.zeros(rows + 1, a1q_scale.shape[1], dtype=a1q_scale.dtype, device=device)
    s_b.index_copy_(0, dest, a1q_scale[token])
    a_view = a_b[:rows]
    if a_out is not None:
        a_out.view(torch.uint8).copy_(a_view)
        a_view = a_out.view(torch.uint8)
    if expected_m is None:
        expected_m = max(1, ceil_div(int(masked_m.sum()), max(num_local, 1)))
    return {
        "a_batched": a_view.view(torch.float8_e4m3fn).view(num_local, max_tokens, h),
        "a_scale_batched": s_b[:rows].view(num_local, max_tokens, a1q_scale.shape[1]),
        "masked_m": masked_m,
        "slot": slot.view_as(local).to(torch.int32),
        "slot_expert": torch.where(live, flat, -1).view_as(local).to(torch.int32),
        "expected_m": expected_m,
        "batch_m_indices": batch_m_indices(masked_m, max_tokens),
    }


def batch_m_indices(masked_m: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The batches as one contiguous grouped layout: int32 [E_l * max_tokens], the batch's
    expert on its first masked_m rows, -1 after (what the Triton engine's grouped GEMM reads)."""
    rows = torch.arange(max_tokens, device=masked_m.device)[None, :]
    experts = torch.arange(masked_m.numel(), device=masked_m.device, dtype=torch.int32)[:, None]
    return torch.where(rows < masked_m[:, None], experts, -1).reshape(-1).to(torch.int32)
