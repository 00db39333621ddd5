"""DeepGEMM's psum grouped layout (`use_psum_layout=True`, docs/stage-contract.md#grouped-layouts),
shared by the grouped GEMM and act_quant: decoding it per row inside a kernel, and validating it on
the host.

expert_ends int32 [E]: expert e owns rows [start_e, end_e) with start_0 = 0 and
start_e = round_up(end_{e-1}, A). Rows [end_e, round_up(end_e, A)) (the gap) and rows from
round_up(end_{E-1}, A) on (the tail) belong to no expert: kernels skip them, leaving them
unspecified, as DeepGEMM and vLLM 0.32's act_quant kernels do.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import triton
import triton.language as tl

from moe_verify.spec import round_up
from optimized.kernels._validate import any_true, fail, unexplained


@triton.jit
def psum_row_experts(ends_ptr, rows, row_mask, num_experts, alignment, BLOCK_E: tl.constexpr):
    """int32 [BLOCK_M]: the expert owning each row, -1 for gap and tail rows (and masked rows).

    Every program reads all E ends and recomputes the starts: no program depends on another.
    """
    es = tl.arange(0, BLOCK_E)
    real = es < num_experts
    ends = tl.load(ends_ptr + es, mask=real, other=0)
    prev = tl.load(ends_ptr + es - 1, mask=real & (es > 0), other=0)
    starts = tl.cdiv(prev, alignment) * alignment
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :]) & real[None, :]
    expert = tl.max(tl.where(inside, es[None, :], -1), 1)
    return tl.where(row_mask, expert, -1)


def block_experts(num_experts: int) -> int:
    """BLOCK_E for `psum_row_experts`: every expert's end in one vector."""
    return max(16, triton.next_power_of_2(max(num_experts, 1)))


def segment_starts(ends: torch.Tensor, alignment: int) -> torch.Tensor:
    """Each expert's first row under the psum layout: 0, then the previous end rounded up to A."""
    return torch.cat([ends.new_zeros(1), round_up(ends[:-1], alignment)])


def expert_ends_violations(
    expert_ends: torch.Tensor, m_sum: int, alignment: int
) -> list[torch.Tensor]:
    """The psum rules `check_expert_ends` names, as device masks for a caller's batched read:
    an end below its expert's start, and a last segment, rounded up to A, past M_sum."""
    if expert_ends.numel() == 0:
        return []
    ends = expert_ends.to(torch.int64)
    starts = segment_starts(ends, alignment)
    return [ends < starts, (round_up(ends[-1:], alignment) > m_sum)]


def check_expert_ends(fn: str, expert_ends: torch.Tensor, m_sum: int, alignment: int) -> None:
    """The psum rule (one device sync): end_e >= start_e (DeepGEMM's block count underflows on
    a smaller end), and the last segment, rounded up to A, fits in M_sum."""
    if any_true(*expert_ends_violations(expert_ends, m_sum, alignment)):
        explain_expert_ends(fn, expert_ends, m_sum, alignment)


def explain_expert_ends(fn: str, expert_ends: torch.Tensor, m_sum: int, alignment: int) -> NoReturn:
    """Raise naming the psum rule broken (after `expert_ends_violations` flagged one)."""
    ends = expert_ends.to(torch.int64)
    starts = segment_starts(ends, alignment)
    bad = ends < starts
    if bool(bad.any()):
        e = int(bad.nonzero()[0])
        fail(
            fn,
            f"expert_ends[{e}] = {int(ends[e])} is below the start of expert {e}'s rows, "
            f"{int(starts[e])} (0, or expert_ends[{e - 1}] rounded up to the alignment "
            f"{alignment}): psum ends are cumulative, and DeepGEMM's block count underflows on "
            "a smaller end",
        )
    last = round_up(int(ends[-1]), alignment)
    if last > m_sum:
        fail(
            fn,
            f"expert_ends[-1] = {int(ends[-1])}, rounded up to the alignment {alignment}, is "
            f"{last} > M_sum = {m_sum}: the last expert's rows would run past the buffer",
        )
    unexplained(fn)


def psum_live_rows(expert_ends: torch.Tensor, m_sum: int, alignment: int) -> torch.Tensor:
    """bool [m_sum]: the rows some expert owns (gap and tail rows False), on the host side."""
    ends = expert_ends.to(torch.int64)
    starts = segment_starts(ends, alignment)
    row = torch.arange(m_sum, device=ends.device)[:, None]
    return ((row >= starts[None, :]) & (row < ends[None, :])).any(dim=1)
