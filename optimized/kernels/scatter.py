"""Permute stage of the optimized path: scatter rows into the aligned contiguous layout the
m-grouped GEMM consumes (the idea of vLLM's `ep_scatter`), from the per-expert counts and the
M_sum of the align stage (`optimized.kernels.slot_counts`).

Layout produced (one rank, `E_l` local experts, alignment `A`):
    expert e owns rows [start_e, start_e + round_up(count_e, A)) of the permuted buffer, with
    start_e = sum_{i<e} round_up(count_i, A); its live rows are [start_e, start_e + count_e) and
    the rest of the segment, plus every row past the last segment up to m_sum, is padding.
    Both of DeepGEMM's grouped layouts of it come out of the same kernel: m_indices (the expert
    of each row, -1 on padding) and the psum expert_ends (start_e + count_e per expert, as vLLM
    0.32's ep_scatter writes them with use_psum_layout=True).

Slot semantics are the count kernel's (`slot_counts.local_expert_ids`, `slot_counts.check_ids`):
a slot (t, k) is live when its id, mapped through `expert_map` if one is given, is in [0, E_l);
the host validation rejects ids it cannot place, and the kernels skip them, never accessing memory
out of bounds.

Differences from vLLM, on purpose: `inv_perm` is -1 for skipped slots (vLLM leaves it
uninitialised), fp32 scales are copied honouring both strides (vLLM ignores stride(1)), padding
rows of `a_perm` are zero (vLLM leaves garbage, possibly NaN patterns, which DeepGEMM then
multiplies) unless the caller asks otherwise (`zero_padding=False`: production mode's psum layout,
whose consumers skip them), packed UE8M0 pad bytes and padding rows are 0, and every offset that
scales with rows is 64-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch
import triton
import triton.language as tl

from moe_verify.spec import round_up
from optimized.kernels._validate import (
    any_true,
    check_flag,
    check_inner_contiguous,
    check_multiple,
    check_same_device,
    check_shape,
    check_tensor,
    fail,
    output_buffer,
    unexplained,
)
from optimized.kernels.e8m0 import pack_word
from optimized.kernels.slot_counts import (
    INT32_MAX,
    aligned_m_sum_exact,
    check_ids,
    explain_ids,
    id_violations,
    launch_count,
    local_expert_ids,
)
from optimized.triton_compat import interpreter_mode

# A UE8M0 int32 word packs four E8M0 exponent bytes (DeepGEMM's MN-major packed layout).
_GROUPS_PER_WORD = 4
_MXFP8_GROUP = 32


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _segments_kernel(
    counts_ptr,
    start_ptr,
    ends_ptr,
    cursor_ptr,
    m_indices_ptr,
    out_ptr,
    stride_om,
    scale_ptr,
    lead,
    scale_cols,
    H,
    m_sum,
    num_local,
    ALIGN: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Program e < E_l writes expert e's start, psum end (start + count) and row cursor. Program
    # E_l + j lays out rows [j * BLOCK_R, (j + 1) * BLOCK_R): the m_indices of each (the expert
    # whose live rows hold it, else -1) and zeros for the dead ones (segment padding and the
    # tail past the last segment) in the MN-major scale storage (int32 words, [scale_cols,
    # lead]: its TMA tail rows m_sum..lead-1 too) and, with ZERO_ROWS, in a_perm. Spreading the
    # rows over programs keeps one expert's padding (up to A - 1 rows of H bytes) off a single
    # program's critical path. Every program recomputes the prefix sum from the counts: none
    # reads what another one writes.
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_local
    # Clamps keep an unvalidated call (negative counts, segments past m_sum) inside the buffers.
    counts = tl.maximum(tl.load(counts_ptr + experts, mask=real, other=0), 0)
    padded = tl.cdiv(counts, ALIGN) * ALIGN
    starts = tl.cumsum(padded, 0) - padded
    if pid < num_local:
        mine = experts == pid
        start = tl.sum(tl.where(mine, starts, 0), 0)
        count = tl.sum(tl.where(mine, counts, 0), 0)
        tl.store(start_ptr + pid, start)
        tl.store(ends_ptr + pid, tl.minimum(start + count, m_sum))
        tl.store(cursor_ptr + pid, start)
    else:
        rows = (pid - num_local) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_buf = rows < m_sum
        live_ends = tl.minimum(starts + counts, m_sum)
        inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < live_ends[None, :])
        expert = tl.max(tl.where(inside & real[None, :], experts[None, :], -1), 1)
        tl.store(m_indices_ptr + rows, expert.to(tl.int32), mask=in_buf)
        scale_dead = (rows < lead) & (expert < 0)
        for c0 in range(0, scale_cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            words = scale_ptr + c.to(tl.int64)[None, :] * lead + rows[:, None]
            zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
            tl.store(words, zeros, mask=scale_dead[:, None] & (c < scale_cols)[None, :])
        dead = in_buf & (expert < 0)
        if ZERO_ROWS and tl.max(dead.to(tl.int32), 0) > 0:
            zero = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.uint8)
            row_base = out_ptr + rows.to(tl.int64)[:, None] * stride_om
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                tl.store(row_base + cols[None, :], zero, mask=dead[:, None] & (cols < H)[None, :])


@triton.jit
def _scatter_kernel(
    a_ptr,
    stride_am,
    scale_ptr,
    stride_sm,
    stride_sk,
    ids_ptr,
    stride_it,
    stride_ik,
    map_ptr,
    counts_ptr,
    start_ptr,
    cursor_ptr,
    out_ptr,
    stride_om,
    out_scale_ptr,
    stride_osm,
    stride_osk,
    inv_perm_ptr,
    num_tokens,
    m_sum,
    H,
    SK,
    num_global,
    num_local,
    TOPK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PACK_UE8M0: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Persistent over tokens: each token's k slots claim their rows together (one vector atomic),
    # then the token's row is read once per column tile and written to all of its live rows.
    slots = tl.arange(0, BLOCK_K)
    slot_mask = slots < TOPK
    # The token index is int64 (t * stride can pass 2^31 for large M*H).
    for t64 in range(tl.program_id(0).to(tl.int64), num_tokens, tl.num_programs(0)):
        tvec = tl.zeros([BLOCK_K], dtype=tl.int64) + t64
        eid = local_expert_ids(
            ids_ptr,
            stride_it,
            stride_ik,
            tvec,
            slots,
            slot_mask,
            map_ptr,
            num_global,
            num_local,
            HAS_MAP,
        )
        live = eid >= 0
        safe = tl.where(live, eid, 0)
        row = tl.atomic_add(cursor_ptr + safe, 1, mask=live, sem="relaxed")
        # A claim past the segment end means counts disagree with topk_ids (rejected on the host
        # when validating); drop it rather than write into the next expert or past m_sum (which
        # an unvalidated segment may cross too).
        seg_end = tl.load(start_ptr + safe, mask=live, other=0) + tl.load(
            counts_ptr + safe, mask=live, other=0
        )
        live = live & (row < seg_end) & (row < m_sum)
        row = tl.where(live, row, -1)
        tl.store(inv_perm_ptr + t64 * TOPK + slots, row, mask=slot_mask)
        row64 = row.to(tl.int64)

        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            x = tl.load(a_ptr + t64 * stride_am + cols, mask=cmask)
            dst = out_ptr + row64[:, None] * stride_om + cols[None, :]
            tl.store(
                dst,
                tl.broadcast_to(x[None, :], [BLOCK_K, BLOCK_H]),
                mask=live[:, None] & cmask[None, :],
            )

        if PACK_UE8M0:
            # Word p of a row holds E8M0 bytes of groups 4p..4p+3 (quant.pack_word's layout, the
            # quantizers' too); bytes past the last group are 0.
            lane = tl.arange(0, 4)
            for p0 in range(0, tl.cdiv(SK, 4), BLOCK_S):
                words = p0 + tl.arange(0, BLOCK_S)
                groups = words[:, None] * 4 + lane[None, :]
                gmask = groups < SK
                b = tl.load(scale_ptr + t64 * stride_sm + groups * stride_sk, mask=gmask, other=0)
                packed = pack_word(b, 4)
                dst = (
                    out_scale_ptr
                    + row64[:, None] * stride_osm
                    + words.to(tl.int64)[None, :] * stride_osk
                )
                wmask = live[:, None] & (words < tl.cdiv(SK, 4))[None, :]
                tl.store(dst, tl.broadcast_to(packed[None, :], [BLOCK_K, BLOCK_S]), mask=wmask)
        else:
            # fp32 scales travel as their int32 bit patterns: a copy, never a float operation.
            for s0 in range(0, SK, BLOCK_S):
                groups = s0 + tl.arange(0, BLOCK_S)
                gmask = groups < SK
                s = tl.load(scale_ptr + t64 * stride_sm + groups * stride_sk, mask=gmask)
                dst = out_scale_ptr + row64[:, None] * stride_osm + groups[None, :] * stride_osk
                tl.store(
                    dst,
                    tl.broadcast_to(s[None, :], [BLOCK_K, BLOCK_S]),
                    mask=live[:, None] & gmask[None, :],
                )


# ---------------------------------------------------------------------------------------------
# Host side: validation and launch


def _check_scatter_inputs(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    num_local_experts: int,
    alignment: int,
    m_sum: int,
    expert_map: torch.Tensor | None,
    validate: bool,
) -> None:
    fn = "ep_scatter"
    validate = check_flag(fn, "validate", validate)
    check_ids(fn, topk_ids, num_local_experts, expert_map, validate=False)  # the values: below
    check_tensor(fn, "a1q", a1q, (torch.float8_e4m3fn,), 2)
    check_inner_contiguous(fn, "a1q", a1q)
    m, h = a1q.shape
    if topk_ids.shape[0] != m:
        fail(fn, f"topk_ids has {topk_ids.shape[0]} rows but a1q has M={m} tokens")
    check_tensor(fn, "a1q_scale", a1q_scale, (torch.float32, torch.uint8, torch.float8_e8m0fnu), 2)
    if a1q_scale.shape[0] != m:
        fail(
            fn, f"a1q_scale must have one row per token (M={m}), got shape {tuple(a1q_scale.shape)}"
        )
    sk = a1q_scale.shape[1]
    if a1q_scale.dtype == torch.float32:
        if sk == 0 or h % sk != 0:
            fail(
                fn,
                f"a1q_scale (fp32) has {sk} groups per row, which does not divide H={h}: it must "
                "be [M, H/G] with one scale per group of G columns",
            )
    else:
        check_multiple(fn, "a1q.shape[1] (H)", h, _MXFP8_GROUP)
        check_shape(fn, "a1q_scale", a1q_scale, (m, h // _MXFP8_GROUP), "E8M0 bytes [M, H/32]")
    check_tensor(fn, "counts", counts, (torch.int32,), 1)
    check_shape(fn, "counts", counts, (num_local_experts,), "[num_local_experts]")
    check_inner_contiguous(fn, "counts", counts)
    check_same_device(fn, "a1q", a1q, a1q_scale=a1q_scale, topk_ids=topk_ids, counts=counts)
    if not isinstance(alignment, int) or alignment < 1:
        fail(fn, f"alignment must be an int >= 1, got {alignment!r}")
    if not isinstance(m_sum, int) or m_sum < 0 or m_sum % alignment != 0:
        fail(
            fn,
            f"m_sum={m_sum!r} must be a non-negative multiple of alignment={alignment}: every "
            "expert segment starts on a multiple of the alignment and the GEMM tiles M by it",
        )
    if not validate:
        return
    # Every value rule on the device, read back once; only a violation reads more, to name it.
    actual = torch.zeros_like(counts)
    launch_count(topk_ids, num_local_experts, expert_map, actual)  # skips ids it cannot place
    rows = (counts.clamp(min=0).to(torch.int64) + alignment - 1) // alignment * alignment
    violations = [
        *id_violations(topk_ids, num_local_experts, expert_map),
        counts < 0,
        (rows.sum() > min(m_sum, INT32_MAX)).reshape(1),  # aligned_m_sum_exact's two limits
        actual != counts,
    ]
    if any_true(*violations):
        if any_true(*id_violations(topk_ids, num_local_experts, expert_map)):
            explain_ids(fn, topk_ids, num_local_experts, expert_map)
        _explain_counts(fn, counts, actual, alignment, m_sum)


def _explain_counts(
    fn: str, counts: torch.Tensor, actual: torch.Tensor, alignment: int, m_sum: int
) -> NoReturn:
    """Raise naming the first counts rule broken (after the batched read flagged one)."""
    host_counts = counts.tolist()
    if any(c < 0 for c in host_counts):
        fail(fn, f"counts must be >= 0, got {host_counts}")
    need = aligned_m_sum_exact(host_counts, alignment)
    if m_sum < need:
        fail(
            fn,
            f"m_sum={m_sum} is smaller than sum_e round_up(counts[e], alignment={alignment}) = "
            f"{need}: the expert segments would not fit",
        )
    if not torch.equal(actual, counts):
        diff = (actual != counts).nonzero().flatten().tolist()
        e = diff[0]
        fail(
            fn,
            f"counts disagree with topk_ids for {len(diff)} expert(s): counts[{e}] = "
            f"{host_counts[e]} but topk_ids routes {int(actual[e])} live slot(s) to local expert "
            f"{e}; the row cursor would run past the segment (misrouting, or an out-of-bounds "
            "write)",
        )
    unexplained(fn)


@dataclass(frozen=True)
class _CopyLaunch:
    """Launch shape of the row copy: columns per tile, warps, and persistent programs."""

    block_h: int
    num_warps: int
    programs: int


def _copy_launch(num_tokens: int, h: int, device: torch.device) -> _CopyLaunch:
    if device.type != "cuda":
        # The interpreter's cost is per op: few programs, wide tiles.
        return _CopyLaunch(min(triton.next_power_of_2(h), 4096), 4, min(num_tokens, 16))
    # H200, CUDA-graph timed, T=4096 k=8 E=32 H=7168 A=128: 108 us with fp32 scales (2.7 TB/s
    # counting rows read, live rows and padding written), 130 us with packed UE8M0; tiles of
    # 1024-4096 columns, 4 or 8 warps and 8 or 16 programs per SM were all within 5%.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return _CopyLaunch(min(triton.next_power_of_2(h), 2048), 4, min(num_tokens, 8 * sms))


@dataclass(frozen=True)
class Scattered:
    """What `ep_scatter` returns: the permuted rows and where each slot went. The layout fields
    are named and meant as in the golden's permute plan (`reference.layout.PermutePlan`).

    a_perm        fp8 [m_sum, H]; padding rows are zero (unwritten with zero_padding=False).
    a_scale_perm  fp32 [m_sum, H/G] with strides (1, round_up(m_sum, 4)) (MN-major, TMA-aligned,
                  as DeepGEMM reads it), padding rows 0.0; or, for E8M0 input, int32
                  [m_sum, ceil(H/32/4)] with strides (1, round_up(m_sum, 4)), byte j of word p =
                  group 4p + j, pad bytes and padding rows 0.
    m_indices     int32 [m_sum], local expert of each row, -1 on padding.
    inv_perm      int32 [M, k], row of slot (t, k), -1 where the slot is skipped.
    expert_start  int32 [E_l], first row of each expert's segment (a multiple of alignment).
    expert_ends   int32 [E_l], expert_start + counts: the psum grouped layout (DeepGEMM's
                  use_psum_layout=True), the same plan as m_indices.
    Row order inside a segment depends on atomic order: compare through inv_perm, never by row.
    """

    a_perm: torch.Tensor
    a_scale_perm: torch.Tensor
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    expert_start: torch.Tensor
    expert_ends: torch.Tensor


def ep_scatter(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    num_local_experts: int,
    alignment: int,
    m_sum: int,
    expert_map: torch.Tensor | None = None,
    *,
    validate: bool = True,
    a_perm_out: torch.Tensor | None = None,
    zero_padding: bool = True,
) -> Scattered:
    """Scatter token rows into per-expert segments aligned to `alignment` rows.

    a1q:        fp8 e4m3 [M, H], rows contiguous.
    a1q_scale:  fp32 [M, H/G] (any strides), or uint8 E8M0 bytes [M, H/32] (MXFP8, any strides).
    topk_ids:   signed int32/int64 [M, k] (any strides); global ids when `expert_map` is given.
    counts:     int32 [E_l], live slots per local expert (`count_expert_tokens`).
    m_sum:      rows of the permuted buffer, a multiple of `alignment` and >= the exact sum.
    returns     a `Scattered` (the permuted rows, their scales, m_indices, inv_perm,
                expert_start and expert_ends; layouts in its docstring).
    validate: run the host value checks: id range, counts against topk_ids, m_sum against the
              counts (device syncs and one extra count kernel; pass False under CUDA-graph
              capture). Shape, dtype and stride checks always run.
    zero_padding: write zeros into a_perm's padding rows. The m_indices layout needs it (its
              GEMM multiplies every row of a tile, padding included, and garbage bytes there can
              be NaN patterns); the psum layout's consumers skip those rows, so False leaves them
              as they were (1/9 of the rows at DeepSeek-V3 EP8-local T=4096, all but a few at
              decode sizes). Padding scales are written either way (DeepGEMM's SM100 packer
              reads every row's).
    """
    _check_scatter_inputs(
        a1q, a1q_scale, topk_ids, counts, num_local_experts, alignment, m_sum, expert_map, validate
    )
    check_flag("ep_scatter", "zero_padding", zero_padding)
    device = a1q.device
    m, h = a1q.shape
    topk = topk_ids.shape[1]
    pack = a1q_scale.dtype != torch.float32
    sk = a1q_scale.shape[1]

    a_perm = output_buffer("ep_scatter", "a_perm_out", a_perm_out, (m_sum, h), a1q.dtype, device)
    # Scales MN-major with TMA-aligned columns over a full [columns, round_up(m_sum, 4)] storage:
    # the layout DeepGEMM reads (packed UE8M0 on SM100; fp32 on SM90, which then does not
    # transpose them again on every call). The TMA tail rows m_sum..lead-1 exist too.
    lead = round_up(m_sum, 4)
    scale_cols = triton.cdiv(sk, _GROUPS_PER_WORD) if pack else sk
    storage_dtype = torch.int32 if pack else torch.float32
    if m_sum == 0 or num_local_experts == 0:
        # No rows, or only padding rows (a rank that hosts no expert): every slot is skipped.
        storage = torch.zeros((scale_cols, lead), dtype=storage_dtype, device=device)
        if zero_padding:
            a_perm.view(torch.uint8).zero_()
        return Scattered(
            a_perm,
            storage.t()[:m_sum],
            torch.full((m_sum,), -1, dtype=torch.int32, device=device),
            torch.full((m, topk), -1, dtype=torch.int32, device=device),
            torch.zeros(num_local_experts, dtype=torch.int32, device=device),
            torch.zeros(num_local_experts, dtype=torch.int32, device=device),
        )

    # Written in full by the kernels: the segments kernel every m_indices entry, every start and
    # end, and the scales of every dead row (padding, tail, TMA tail); the scatter kernel every
    # inv_perm entry and the scales of every live row. No prefill launch. a_perm's padding rows
    # only with zero_padding.
    storage = torch.empty((scale_cols, lead), dtype=storage_dtype, device=device)
    a_scale_perm = storage.t()[:m_sum]
    m_indices = torch.empty((m_sum,), dtype=torch.int32, device=device)
    inv_perm = torch.empty((m, topk), dtype=torch.int32, device=device)
    expert_start = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    expert_ends = torch.empty_like(expert_start)
    a_bytes = a1q.view(torch.uint8)
    out_bytes = a_perm.view(torch.uint8)
    scale_words = storage.view(torch.int32)
    cursor = torch.empty_like(expert_start)
    interp = interpreter_mode()
    zero_cols = min(triton.next_power_of_2(max(h, 1)), 4096 if interp else 1024)
    launch = _copy_launch(m, max(h, 1), device)
    block_r = 256 if interp else 32
    _segments_kernel[(num_local_experts + triton.cdiv(lead, block_r),)](
        counts,
        expert_start,
        expert_ends,
        cursor,
        m_indices,
        out_bytes,
        out_bytes.stride(0),
        scale_words,
        lead,
        scale_cols,
        h,
        m_sum,
        num_local_experts,
        ALIGN=alignment,
        ZERO_ROWS=zero_padding,
        BLOCK_E=max(16, triton.next_power_of_2(num_local_experts)),
        BLOCK_R=block_r,
        BLOCK_H=zero_cols,
        BLOCK_C=max(2, triton.next_power_of_2(min(scale_cols, 64))),
        num_warps=4,
    )
    if m == 0 or h == 0:
        inv_perm.fill_(-1)  # no scatter kernel runs to write it
        return Scattered(a_perm, a_scale_perm, m_indices, inv_perm, expert_start, expert_ends)

    if pack:
        scale_src = a1q_scale.view(torch.uint8)
        block_s = max(2, triton.next_power_of_2(min(triton.cdiv(sk, _GROUPS_PER_WORD), 64)))
        scale_dst = a_scale_perm
    else:
        scale_src = a1q_scale.view(torch.int32)
        block_s = max(2, triton.next_power_of_2(min(sk, 256)))
        scale_dst = a_scale_perm.view(torch.int32)
    _scatter_kernel[(launch.programs,)](
        a_bytes,
        a_bytes.stride(0),
        scale_src,
        scale_src.stride(0),
        scale_src.stride(1),
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        expert_map if expert_map is not None else counts,
        counts,
        expert_start,
        cursor,
        out_bytes,
        out_bytes.stride(0),
        scale_dst,
        scale_dst.stride(0),
        scale_dst.stride(1),
        inv_perm,
        m,
        m_sum,
        h,
        sk,
        expert_map.numel() if expert_map is not None else 0,
        num_local_experts,
        TOPK=topk,
        HAS_MAP=expert_map is not None,
        PACK_UE8M0=pack,
        BLOCK_K=max(2, triton.next_power_of_2(topk)),
        BLOCK_H=launch.block_h,
        BLOCK_S=block_s,
        num_warps=launch.num_warps,
    )
    return Scattered(a_perm, a_scale_perm, m_indices, inv_perm, expert_start, expert_ends)
