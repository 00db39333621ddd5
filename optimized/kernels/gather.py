"""Weighted unpermute + top-k reduce of GEMM2's output (stage `gather`, vLLM's `ep_gather`).

For each token t: acc = 0 (fp32); for k ascending, if the (mapped) expert id of slot (t, k) is >= 0,
acc = acc + fp32(mm2[inv_perm[t, k]]) * w[t, k], each product and sum rounded in fp32; the token's
row is acc rounded once to bf16 (RNE). Tokens with no live slot get exact zeros. The kernel is
launched without FMA contraction, so the GPU accumulates exactly as written above (vLLM's kernel may
fuse into FMAs; the result is then not bitwise that sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.kernels._validate import (
    any_true,
    check_flag,
    check_inner_contiguous,
    check_range,
    check_same_device,
    check_shape,
    check_signed_ids,
    check_tensor,
    output_buffer,
    range_violations,
    unexplained,
)
from optimized.triton_compat import interpreter_mode


@triton.jit
def _ep_gather_kernel(
    mm2_ptr,
    ids_ptr,
    w_ptr,
    inv_ptr,
    map_ptr,
    out_ptr,
    M,
    H,
    M_SUM,
    num_global,
    stride_am,
    stride_om,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    stride_pt,
    stride_pk,
    TOPK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_T tokens x BLOCK_D columns; each live slot reads one mm2 row segment."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tokens < M
    tokens = tokens.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        eid = tl.load(ids_ptr + tokens * stride_it + k * stride_ik, mask=tok_ok, other=-1)
        if HAS_MAP:
            # -1 stays -1 (no expert); an id inside the table goes through the global -> local
            # map. A stale positive id (CUDA-graph padding rows) must never index past the table
            # (vLLM test_expert_map_bounds): it is skipped.
            in_map = tok_ok & (eid >= 0) & (eid < num_global)
            eid = tl.load(map_ptr + tl.where(in_map, eid, 0), mask=in_map, other=-1)
        live = tok_ok & (eid >= 0)
        row = tl.load(inv_ptr + tokens * stride_pt + k * stride_pk, mask=live, other=-1)
        # A slot the permute skipped has no row (-1): without validation nothing else bounds it.
        live = live & (row >= 0) & (row < M_SUM)
        w = tl.load(w_ptr + tokens * stride_wt + k * stride_wk, mask=live, other=0.0)
        src = mm2_ptr + row.to(tl.int64)[:, None] * stride_am + cols[None, :]
        mask = live[:, None] & col_ok[None, :]
        v = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        # A dead slot adds v * w = +0 * +0, which leaves acc unchanged: acc starts at +0 and an
        # RNE sum is never -0 unless both terms are, so x + 0 == x bit for bit here.
        acc += v * w[:, None]
    dst = out_ptr + tokens[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc.to(tl.bfloat16), mask=tok_ok[:, None] & col_ok[None, :])


def _tiles(m: int, h: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): a power-of-two column tile up to 1024 with a masked tail (H = 2880 runs
    as 3 tiles of 1024, 6% masked, instead of gcd(2880, 1024) = 64-wide tiles), and enough tokens
    per program for ~2K elements natively (3.9 TB/s on the H200, the copy rate, at H = 7168, k = 8)
    or ~16K under the interpreter, where programs are slow. No persistent loop: each program is
    short and independent, so a plain grid over tokens already keeps HBM busy."""
    block_d = min(triton.next_power_of_2(h), 1024)
    target = 16384 if interpreter_mode() else 2048
    block_t = max(1, min(triton.next_power_of_2(m), target // block_d))
    return block_t, block_d


def ep_gather(
    mm2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_perm: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """mm2 bf16 [M_sum, H], topk_ids int32/int64 [M, k], topk_weights fp32 [M, k], inv_perm int32
    [M, k], expert_map int32 [E_g] (global -> local id, -1 = remote) or None -> out bf16 [M, H].

    A slot is live iff its id (mapped through expert_map when given; -1 and ids past the table
    are never mapped) is >= 0 and its inv_perm entry is a row of mm2; inv_perm[t, k] of a live
    slot is the mm2 row holding that slot's expert output. With
    `validate` (the default) the id range and every live inv_perm entry are checked on the host
    before launch (one device sync); pass False inside CUDA-graph capture or benchmarks.
    """
    fn = "ep_gather"
    check_flag(fn, "validate", validate)
    check_tensor(fn, "mm2", mm2, (torch.bfloat16,), 2)
    check_tensor(fn, "topk_ids", topk_ids, None, 2)
    check_signed_ids(fn, "topk_ids", topk_ids)
    m, topk = topk_ids.shape
    check_tensor(fn, "topk_weights", topk_weights, (torch.float32,), 2)
    check_shape(fn, "topk_weights", topk_weights, (m, topk), "topk_ids.shape [M, k]")
    check_tensor(fn, "inv_perm", inv_perm, (torch.int32,), 2)
    check_shape(fn, "inv_perm", inv_perm, (m, topk), "topk_ids.shape [M, k]")
    check_inner_contiguous(fn, "mm2", mm2)
    others = {"topk_ids": topk_ids, "topk_weights": topk_weights, "inv_perm": inv_perm}
    if expert_map is not None:
        check_tensor(fn, "expert_map", expert_map, (torch.int32,), 1)
        check_inner_contiguous(fn, "expert_map", expert_map)
        others["expert_map"] = expert_map
    check_same_device(fn, "mm2", mm2, **others)
    m_sum, h = mm2.shape

    if validate and m * topk:
        num_global = expert_map.shape[0] if expert_map is not None else 0
        if expert_map is not None:
            # clamped, so an id out of range (named below) reads no memory outside the map
            in_map = (topk_ids >= 0) & (topk_ids < num_global)
            if num_global:
                mapped = expert_map[topk_ids.clamp(min=0, max=num_global - 1).long()]
                live = in_map & (mapped >= 0)
            else:
                live = in_map
            id_rule = [range_violations(topk_ids, -1, num_global)]
        else:
            live, id_rule = topk_ids >= 0, []
        # Both rules in one host read; only a violation reads more, to name it.
        if any_true(*id_rule, range_violations(inv_perm, 0, m_sum, where=live)):
            if expert_map is not None:
                check_range(
                    fn, "topk_ids", topk_ids, -1, num_global,
                    f"with an expert_map of {num_global} global experts an id must be -1 (no "
                    "expert) or a global expert in [0, E_g); any other id reads expert_map out "
                    "of bounds",
                )  # fmt: skip
            check_range(
                fn, "inv_perm", inv_perm, 0, m_sum,
                f"a live slot's inv_perm must be a row of mm2 (M_sum = {m_sum}); the kernel "
                "would read outside mm2",
                where=live,
            )  # fmt: skip
            unexplained(fn)

    out = output_buffer("ep_gather", "out", out, (m, h), torch.bfloat16, mm2.device)
    if m == 0 or h == 0:
        return out
    block_t, block_d = _tiles(m, h)
    grid = (triton.cdiv(m, block_t), triton.cdiv(h, block_d))
    has_map = expert_map is not None
    _ep_gather_kernel[grid](
        mm2, topk_ids, topk_weights, inv_perm, expert_map if has_map else topk_ids, out,
        m, h, m_sum, expert_map.shape[0] if has_map else 0, mm2.stride(0), out.stride(0),
        topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        inv_perm.stride(0), inv_perm.stride(1),
        TOPK=topk, HAS_MAP=has_map, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
