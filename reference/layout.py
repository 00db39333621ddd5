"""The expert-contiguous layouts: aligned M_sum, the permute plan, and the batched (masked) layout.

Golden semantics of vLLM's compute_aligned_M / ep_scatter / batched dispatch (vLLM 0.32
fused_moe/deep_gemm_utils.py and experts/batched_deep_gemm_moe.py). Slots are placed in (token, k)
order inside each expert's segment, which makes the golden deterministic; kernels may place them
in any order, so comparisons go through each side's own inv_perm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_verify.spec import MAX_EXPERTS, MSumRecipe, round_up
from reference.validate import require, require_expert_map, require_int


def validate_topk_ids(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> None:
    """Ids must be signed, 2-D, and in range; -1 is the only negative id ever allowed."""
    require_int("num_local_experts", num_local_experts, 0, MAX_EXPERTS)
    require_expert_map(expert_map, num_local_experts)
    require_ids(topk_ids)
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    bound = num_local_experts if expert_map is None else expert_map.numel()
    what = "local experts" if expert_map is None else "global experts (expert_map length)"
    require(lo >= -1, "topk_ids", "ids >= -1 (-1 = no expert)", f"min id {lo}")
    require(hi < bound, "topk_ids", f"ids < {bound} {what}", f"max id {hi}")


def require_ids(topk_ids: object) -> None:
    """A signed integer [M, k] tensor of expert ids (-1: no expert)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(
            f"topk_ids: expected a 2-D [M, k] int32/int64 tensor, got {type(topk_ids).__name__}"
        )
    require(
        topk_ids.dim() == 2, "topk_ids", "a 2-D [M, k] tensor", f"shape {tuple(topk_ids.shape)}"
    )
    require(
        topk_ids.dtype in (torch.int32, torch.int64),
        "topk_ids",
        "signed int32/int64 (the scatter asserts is_signed; -1 means no expert)",
        f"dtype {topk_ids.dtype}",
    )


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int64 [M, k]: each slot's local expert, -1 when the slot is empty or the expert is remote.

    Ids past the end of `expert_map` (stale ones in a padding row) are refused: map only ids that
    index it (`validate_topk_ids` checks both)."""
    require_ids(topk_ids)
    require_expert_map(expert_map)
    ids = topk_ids.long()
    if expert_map is None:
        return ids.clamp(min=-1)
    if ids.numel():
        hi = int(ids.max())
        require(
            hi < expert_map.numel(),
            "topk_ids",
            f"ids < {expert_map.numel()} global experts (expert_map length)",
            f"max id {hi}",
        )
    mapped = expert_map.long().to(ids.device)[ids.clamp(min=0)]
    return torch.where(ids >= 0, mapped, torch.full_like(ids, -1))


def expert_counts(local_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int32 [E_l]: live (token, k) slots per local expert."""
    require_int("num_local_experts", num_local_experts, 0, MAX_EXPERTS)
    require(
        isinstance(local_ids, torch.Tensor)
        and not local_ids.dtype.is_floating_point
        and local_ids.dtype != torch.bool,
        "local_ids",
        "an integer tensor of local expert ids (-1: none)",
        f"{getattr(local_ids, 'dtype', type(local_ids).__name__)}",
    )
    live = local_ids[local_ids >= 0]
    return torch.bincount(live, minlength=num_local_experts).to(torch.int32)


def _require_counts(counts: object, name: str = "counts") -> torch.Tensor:
    """Per-expert counts (or row ends): a 1-D integer tensor of values >= 0."""
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D integer tensor, got {type(counts).__name__}")
    require(
        counts.dim() == 1 and not counts.dtype.is_floating_point and counts.dtype != torch.bool,
        name,
        "a 1-D integer tensor (one value per local expert)",
        f"{counts.dtype} of shape {list(counts.shape)}",
    )
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"{name}: expected values >= 0, got {counts.tolist()}")
    return counts


def _require_sizes(
    num_tokens: object, topk: object, num_local_experts: object, alignment: object
) -> None:
    require_int("num_tokens", num_tokens, 0)
    require_int("topk", topk, 0)
    require_int("num_local_experts", num_local_experts, 0)
    require_int("alignment", alignment, 1)


# DeepGEMM's layout tensors (m_indices, psum ends) and vLLM's row indices are int32.
INT32_MAX = 2**31 - 1


def _int32_rows(fn: str, rows: int, culprit: str) -> int:
    """`rows`, or a ValueError saying which sizes (`culprit`) are too large when it does not fit
    int32."""
    if rows > INT32_MAX:
        raise ValueError(
            f"{fn}: {rows} rows do not fit int32 (DeepGEMM's m_indices and psum ends): {culprit}"
        )
    return rows


def _too_many_slots(num_tokens: int, topk: int) -> str:
    return f"num_tokens={num_tokens} x topk={topk} is too large"


def _require_rows(name: str, value: object) -> int:
    """A row count of the permuted buffer: an int >= 0 that int32 row indices can reach."""
    require_int(name, value, 0)
    require(
        value <= INT32_MAX,
        name,
        f"at most {INT32_MAX} rows (int32: DeepGEMM's m_indices and psum ends)",
        str(value),
    )
    return value


def aligned_m_sum_exact(counts: torch.Tensor, alignment: int) -> int:
    """Σ_e round_up(count_e, A): the exact-count path (DeepEP HT, CPU counts known)."""
    require_int("alignment", alignment, 1)
    c = _require_counts(counts).long()
    rows = int(round_up(c, alignment).sum())
    return _int32_rows(
        "aligned_m_sum_exact", rows, f"counts summing to {int(c.sum())} are too many"
    )


def aligned_m_sum_upper_bound(
    num_tokens: int, topk: int, num_local_experts: int, alignment: int
) -> int:
    """round_up(M·k + min(M·k, E_l)·(A-1), A): the bound used when counts are not on the host
    (vLLM >= 0.30).

    Safe because Σ round_up(n_e, A) <= Σ n_e + #active·(A-1) and #active <= min(M·k, E_l).
    """
    _require_sizes(num_tokens, topk, num_local_experts, alignment)
    slots = num_tokens * topk
    rows = round_up(slots + min(slots, num_local_experts) * (alignment - 1), alignment)
    return _int32_rows("aligned_m_sum_upper_bound", rows, _too_many_slots(num_tokens, topk))


def aligned_m_sum_all_experts_bound(
    num_tokens: int, topk: int, num_local_experts: int, alignment: int
) -> int:
    """round_up(M·k + E_l·(A-1), A): older vLLM's bound, every local expert charged A-1 rows.

    Never below `aligned_m_sum_upper_bound` (equal once M·k >= E_l): as safe, looser at decode.
    """
    _require_sizes(num_tokens, topk, num_local_experts, alignment)
    rows = round_up(num_tokens * topk + num_local_experts * (alignment - 1), alignment)
    return _int32_rows("aligned_m_sum_all_experts_bound", rows, _too_many_slots(num_tokens, topk))


def aligned_m_sum_tight_bound(
    num_tokens: int, topk: int, num_local_experts: int, alignment: int
) -> int:
    """A·(m + (M·k - m) // A) with m = min(M·k, E_l): the largest Σ round_up(n_e, A) over every
    routing of M·k slots (SGLang 0.5.23's compact layout, `_get_compact_all_tokens`).

    Tight: each of at most m nonempty experts costs one block for its first row, and the other
    M·k - m rows fill at most (M·k - m) // A more whole blocks. Never above the min-active bound,
    which rounds that quotient up."""
    _require_sizes(num_tokens, topk, num_local_experts, alignment)
    slots = num_tokens * topk
    active = min(slots, num_local_experts)
    rows = alignment * (active + (slots - active) // alignment)
    return _int32_rows("aligned_m_sum_tight_bound", rows, _too_many_slots(num_tokens, topk))


def aligned_m_sum_recipes(
    num_tokens: int, topk: int, counts: torch.Tensor, alignment: int
) -> dict[MSumRecipe, int]:
    """Every legitimate M_sum of one rank: both upper bounds and the exact sum (E_l local
    experts, one count each)."""
    e_l = _require_counts(counts).numel()
    return {
        MSumRecipe.MIN_ACTIVE_BOUND: aligned_m_sum_upper_bound(num_tokens, topk, e_l, alignment),
        MSumRecipe.ALL_EXPERTS_BOUND: aligned_m_sum_all_experts_bound(
            num_tokens, topk, e_l, alignment
        ),
        MSumRecipe.EXACT_COUNTS: aligned_m_sum_exact(counts, alignment),
        MSumRecipe.TIGHT_BOUND: aligned_m_sum_tight_bound(num_tokens, topk, e_l, alignment),
    }


@dataclass(frozen=True)
class PermutePlan:
    """Where each (token, k) slot lives in the expert-contiguous buffer, and both grouped layouts
    DeepGEMM reads it through.

    m_indices     int32 [m_sum]  local expert of each row, -1 on padding (the per-row layout)
    expert_ends   int32 [E_l]    start_e + count_e, the end of each expert's live rows (the psum
                                 layout: expert e's rows are [round_up(end_{e-1}, A), end_e))
    inv_perm      int32 [M, k]   row of each live slot, -1 for skipped slots
    expert_start  int32 [E_l]    first row of each expert's segment (multiple of alignment)
    counts        int32 [E_l]    live slots per expert
    m_sum         rows of the buffer (aligned segments plus the tail padding)
    alignment     A, the segment alignment used
    """

    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    expert_start: torch.Tensor
    counts: torch.Tensor
    m_sum: int
    alignment: int
    expert_ends: torch.Tensor


def permute_plan(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    alignment: int,
    expert_map: torch.Tensor | None = None,
    m_sum: int | None = None,
) -> PermutePlan:
    """Lay each expert's slots out contiguously, every segment starting on a multiple of A.

    m_sum defaults to the upper bound (the path without host counts); pass the exact sum for the
    HT path. Segment e spans [start_e, start_e + count_e); rows up to the next segment are padding.
    """
    require_int("alignment", alignment, 1)
    if m_sum is not None:
        _require_rows("m_sum", m_sum)
    validate_topk_ids(topk_ids, num_local_experts, expert_map)
    num_tokens, topk = topk_ids.shape
    local = local_expert_ids(topk_ids, expert_map)
    counts = expert_counts(local, num_local_experts)
    exact = aligned_m_sum_exact(counts, alignment)
    if m_sum is None:
        m_sum = aligned_m_sum_upper_bound(num_tokens, topk, num_local_experts, alignment)
    require(m_sum % alignment == 0, "m_sum", f"a multiple of alignment {alignment}", str(m_sum))
    require(m_sum >= exact, "m_sum", f">= Σ round_up(count_e, A) = {exact}", str(m_sum))

    padded = round_up(counts.long(), alignment)
    start = torch.cumsum(padded, 0) - padded  # exclusive prefix sum
    device = topk_ids.device

    flat = local.reshape(-1)
    live = flat >= 0
    # Rank of each live slot within its expert, in (token, k) order: a stable sort by expert.
    order = torch.argsort(torch.where(live, flat, num_local_experts), stable=True)
    sorted_experts = flat[order]
    n_live = int(live.sum())
    rank_in_expert = torch.arange(n_live, device=device) - _run_start(
        sorted_experts[:n_live], counts.to(device)
    )
    rows = start.to(device)[sorted_experts[:n_live]] + rank_in_expert

    inv_flat = torch.full((num_tokens * topk,), -1, dtype=torch.int64, device=device)
    inv_flat[order[:n_live]] = rows
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=device)
    m_indices[rows] = sorted_experts[:n_live].to(torch.int32)
    return PermutePlan(
        m_indices=m_indices,
        inv_perm=inv_flat.view(num_tokens, topk).to(torch.int32),
        expert_start=start.to(torch.int32).to(device),
        counts=counts.to(device),
        m_sum=m_sum,
        alignment=alignment,
        expert_ends=(start + counts.long()).to(torch.int32).to(device),
    )


def m_indices_from_expert_ends(
    expert_ends: torch.Tensor, m_sum: int, alignment: int
) -> torch.Tensor:
    """The psum layout read back per row: int32 [m_sum], e on [round_up(end_{e-1}, A), end_e)
    (end_{-1} = 0), -1 on every other row (each segment's gap rows and the tail).

    This is how DeepGEMM's scheduler walks `use_psum_layout=True` (DeepGEMM 2.6.1
    `m_grouped_fp8_gemm_nt_contiguous`, csrc/apis/gemm.hpp; docs/stage-contract.md#grouped-layouts).
    """
    _require_rows("m_sum", m_sum)
    require_int("alignment", alignment, 1)
    _require_counts(expert_ends, "expert_ends")
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=expert_ends.device)
    start = 0
    for e, end in enumerate(expert_ends.tolist()):
        m_indices[start:end] = e
        start = round_up(end, alignment)
    return m_indices


def _run_start(sorted_experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each entry of an expert-sorted list, the list position where its expert's run begins."""
    run_start = torch.cumsum(counts.long(), 0) - counts.long()
    return run_start[sorted_experts]


def permute_rows(x: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    """[M, D] -> [m_sum, D]: row inv_perm[t,k] holds x[t]; padding rows are zero."""
    out = torch.zeros((plan.m_sum, *x.shape[1:]), dtype=x.dtype, device=x.device)
    tokens = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(plan.inv_perm)
    live = plan.inv_perm >= 0
    if x.dtype.is_floating_point and x.element_size() == 1:
        out.view(torch.uint8)[plan.inv_perm[live].long()] = x.view(torch.uint8)[tokens[live]]
    else:
        out[plan.inv_perm[live].long()] = x[tokens[live]]
    return out


@dataclass(frozen=True)
class BatchedPlan:
    """The masked layout of DeepEP low-latency dispatch: one [max_tokens, ...] batch per expert.

    masked_m  int32 [E_l]    rows used in each expert's batch
    slot      int32 [M, k]   row of (t, k) inside its expert's batch, -1 for skipped slots
    """

    masked_m: torch.Tensor
    slot: torch.Tensor
    local_ids: torch.Tensor
    max_tokens: int


def batched_plan(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    max_tokens: int,
    expert_map: torch.Tensor | None = None,
) -> BatchedPlan:
    """Slots of each local expert numbered 0.. in (token, k) order; must fit in max_tokens."""
    require_int("max_tokens", max_tokens, 0)
    validate_topk_ids(topk_ids, num_local_experts, expert_map)
    local = local_expert_ids(topk_ids, expert_map)
    counts = expert_counts(local, num_local_experts)
    busiest = int(counts.max()) if counts.numel() else 0
    require(
        busiest <= max_tokens,
        "max_tokens",
        f">= the busiest expert's {busiest} slots",
        str(max_tokens),
    )
    flat = local.reshape(-1)
    live = flat >= 0
    order = torch.argsort(torch.where(live, flat, num_local_experts), stable=True)
    n_live = int(live.sum())
    sorted_experts = flat[order][:n_live]
    rank = torch.arange(n_live, device=flat.device) - _run_start(sorted_experts, counts)
    slot = torch.full_like(flat, -1)
    slot[order[:n_live]] = rank
    return BatchedPlan(counts, slot.view_as(local).to(torch.int32), local, max_tokens)
