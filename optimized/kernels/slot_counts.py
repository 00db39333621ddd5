"""Align stage of the optimized path: count the live (token, k) slots per local expert
(`count_expert_tokens`) and size the permuted buffer the scatter fills (M_sum: `aligned_m_sum_exact`
when the counts are known on the host, `aligned_m_sum_upper_bound` when they are not). The
permute itself is `optimized.kernels.scatter`'s.

Slot semantics (shared by the count and the scatter kernels, `local_expert_ids`): a slot (t, k) is
live when its id, mapped through `expert_map` if one is given (an id of exactly -1 stays -1), is in
[0, E_l). The host validation (`check_ids`) rejects ids below -1 and ids past the expert range
instead of silently skipping them; the kernels still skip any id they cannot place, so no input
can make them access memory out of bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
import triton
import triton.language as tl

from moe_verify.spec import round_up
from optimized.kernels._validate import (
    any_true,
    check_flag,
    check_inner_contiguous,
    check_range,
    check_same_device,
    check_signed_ids,
    check_tensor,
    fail,
    range_violations,
    unexplained,
)
from optimized.triton_compat import interpreter_mode


def _check_count(fn: str, name: str, value: object, low: int) -> None:
    """An int >= low; a float or bool count would round or read as 0/1 silently."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{fn}: {name} must be an int >= {low}, got {value!r} ({type(value).__name__})"
        )
    if value < low:
        fail(fn, f"{name} must be an int >= {low}, got {value}")


# int32: the layout tensors DeepGEMM and vLLM index rows with.
INT32_MAX = 2**31 - 1


def aligned_m_sum_upper_bound(
    num_tokens: int, topk: int, num_local_experts: int, alignment: int
) -> int:
    """Rows of the permuted buffer when per-expert counts are unknown on the host (TP, EP).

    round_up(M*k + min(M*k, E_l) * (A - 1), A): every live slot gets a row, and each expert that
    receives at least one slot (at most min(M*k, E_l) of them) wastes at most A - 1 padding rows.
    Slots routed to remote experts are counted in M*k too, so under EP the bound is loose.
    """
    fn = "aligned_m_sum_upper_bound"
    for name, value, low in (
        ("num_tokens", num_tokens, 0),
        ("topk", topk, 0),
        ("num_local_experts", num_local_experts, 0),
        ("alignment", alignment, 1),
    ):
        _check_count(fn, name, value, low)
    slots = num_tokens * topk
    rows = round_up(slots + min(slots, num_local_experts) * (alignment - 1), alignment)
    if rows > INT32_MAX:  # the layout's m_indices, psum ends and inv_perm are int32
        fail(
            fn, f"{rows} rows do not fit int32: num_tokens={num_tokens} x topk={topk} is too large"
        )
    return rows


def aligned_m_sum_exact(counts: torch.Tensor | Sequence[int], alignment: int) -> int:
    """sum_e round_up(count_e, A): the exact rows when counts are known on the host (DeepEP HT)."""
    fn = "aligned_m_sum_exact"
    _check_count(fn, "alignment", alignment, 1)
    if isinstance(counts, torch.Tensor) and (counts.dtype.is_floating_point or counts.dim() != 1):
        fail(fn, f"counts must be a 1-D integer tensor, got {counts.dtype} {list(counts.shape)}")
    values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    for e, c in enumerate(values):
        _check_count(fn, f"counts[{e}]", c, 0)
    rows = sum(round_up(int(c), alignment) for c in values)
    if rows > INT32_MAX:  # as in aligned_m_sum_upper_bound
        fail(fn, f"{rows} rows do not fit int32: counts sum to {sum(values)}, too many")
    return rows


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def local_expert_ids(
    ids_ptr, stride_it, stride_ik, t, k, mask, map_ptr, num_global, num_local, HAS_MAP: tl.constexpr
):
    """Local expert of slots (t, k); -1 where the slot is skipped (masked, -1, unplaceable)."""
    raw = tl.load(
        ids_ptr + t.to(tl.int64) * stride_it + k.to(tl.int64) * stride_ik, mask=mask, other=-1
    )
    if HAS_MAP:
        in_map = mask & (raw >= 0) & (raw < num_global)
        idx = tl.where(in_map, raw, 0).to(tl.int64)
        eid = tl.load(map_ptr + idx, mask=in_map, other=-1)
    else:
        eid = raw
    live = mask & (eid >= 0) & (eid < num_local)
    return tl.where(live, eid, -1).to(tl.int32)


@triton.jit
def _count_kernel(
    ids_ptr,
    stride_it,
    stride_ik,
    map_ptr,
    counts_ptr,
    num_slots,
    num_global,
    num_local,
    TOPK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per BLOCK slots; atomics make the histogram order-independent (integers, so
    # the result is deterministic even though the add order is not).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    eid = local_expert_ids(
        ids_ptr,
        stride_it,
        stride_ik,
        offs // TOPK,
        offs % TOPK,
        mask,
        map_ptr,
        num_global,
        num_local,
        HAS_MAP,
    )
    live = eid >= 0
    tl.atomic_add(counts_ptr + tl.where(live, eid, 0), 1, mask=live, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Host side: validation and launch


def check_ids(
    fn: str,
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None,
    validate: bool,
) -> None:
    """Dtypes and shapes always; the id range (a device sync) only with `validate`."""
    check_flag(fn, "validate", validate)
    if not isinstance(num_local_experts, int) or num_local_experts < 0:
        # 0 is legal: with more EP ranks than experts some ranks host none (every slot skipped).
        fail(fn, f"num_local_experts must be an int >= 0, got {num_local_experts!r}")
    check_tensor(fn, "topk_ids", topk_ids, None, 2)
    check_signed_ids(fn, "topk_ids", topk_ids)
    if expert_map is not None:
        check_tensor(fn, "expert_map", expert_map, (torch.int32,), 1)
        check_inner_contiguous(fn, "expert_map", expert_map)
        check_same_device(fn, "topk_ids", topk_ids, expert_map=expert_map)
    if validate and any_true(*id_violations(topk_ids, num_local_experts, expert_map)):
        explain_ids(fn, topk_ids, num_local_experts, expert_map)


def id_violations(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> list[torch.Tensor]:
    """The id-range rules `explain_ids` names, as device masks for a caller's batched read."""
    masks = []
    if expert_map is not None:
        masks.append(range_violations(expert_map, -1, num_local_experts))
    bound = expert_map.numel() if expert_map is not None else num_local_experts
    masks.append(range_violations(topk_ids, -1, bound))
    return masks


def explain_ids(
    fn: str, topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> NoReturn:
    """Raise naming the first id-range rule broken (after `id_violations` flagged one)."""
    if expert_map is not None and expert_map.numel():
        check_range(
            fn, "expert_map", expert_map, -1, num_local_experts,
            f"a global expert maps to a local expert in [0, num_local_experts="
            f"{num_local_experts}) or to -1 (hosted on another rank)",
        )  # fmt: skip
    if expert_map is not None:
        num_global = expert_map.numel()
        check_range(
            fn, "topk_ids", topk_ids, -1, num_global,
            f"with an expert_map of {num_global} global experts an id must be -1 (no expert) or "
            "a global expert in [0, E_g); any other id would read expert_map out of bounds",
        )  # fmt: skip
    else:
        check_range(
            fn, "topk_ids", topk_ids, -1, num_local_experts,
            f"without an expert_map an id must be -1 (no expert) or a local expert in "
            f"[0, num_local_experts={num_local_experts}); a larger id would bump a row cursor "
            "out of bounds",
        )  # fmt: skip
    unexplained(fn)


def launch_count(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None,
    counts: torch.Tensor,
) -> None:
    """Add each local expert's live slots of `topk_ids` into `counts` (int32 [E_l], zeroed by the
    caller), unchecked: `count_expert_tokens` checks first, and the scatter's validation recounts
    through it to compare with the counts it was given."""
    num_slots = topk_ids.numel()
    if num_slots == 0 or num_local_experts == 0:
        return
    block = (
        1024 if not interpreter_mode() else max(16, triton.next_power_of_2(min(num_slots, 4096)))
    )
    _count_kernel[(triton.cdiv(num_slots, block),)](
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        expert_map if expert_map is not None else counts,
        counts,
        num_slots,
        expert_map.numel() if expert_map is not None else 0,
        num_local_experts,
        TOPK=topk_ids.shape[1],
        HAS_MAP=expert_map is not None,
        BLOCK=block,
    )


def count_expert_tokens(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Live (token, k) slots per local expert.

    topk_ids:    signed int32/int64 [M, k] (any strides); -1 = no expert. Global ids when
                 `expert_map` is given.
    expert_map:  int32 [E_global], global id -> local id, or -1 for an expert on another rank.
    returns:     int32 [E_l].
    validate:    check the id range on the host (a device sync; pass False under CUDA-graph
                 capture: the kernel then skips ids it cannot place instead of raising).
    """
    check_ids("count_expert_tokens", topk_ids, num_local_experts, expert_map, validate)
    counts = torch.zeros(num_local_experts, dtype=torch.int32, device=topk_ids.device)
    launch_count(topk_ids, num_local_experts, expert_map, counts)
    return counts
