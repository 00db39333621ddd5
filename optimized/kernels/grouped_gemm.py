"""Triton m-grouped contiguous GEMM over DeepGEMM's layout and scales (the TritonOrDeepGemm engine).

    d[r, n] = bf16_RNE( sum_kb ( sum_{k in kb} a[r, k] * b[e, n, k] ) * SA(r, kb) * SB(e, n, kb) )
    with e the expert of row r, fp32 accumulation, and the scales applied per K group after each
    partial dot (as DeepGEMM promotes per 128-K block).

Grouped layouts (DeepGEMM's two, docs/stage-contract.md#grouped-layouts):
  m_indices  int32 [M_sum]: e = m_indices[r], -1 on padding. Rows with -1 are written as exact
             zeros (DeepGEMM leaves them unspecified; zeros keep padding deterministic).
  psum       int32 [E] expert_ends (`use_psum_layout=True`): expert e owns rows
             [round_up(end_{e-1}, A), end_e), end_{-1} = 0. Gap rows [end_e, round_up(end_e, A))
             and the tail are neither read nor written: unspecified, as DeepGEMM leaves them.

Formats (K-major everywhere):
  a        fp8 e4m3 [M_sum, K]; a_scale fp32 [M_sum, K/a_group] with any strides (row-major,
           column-major, TMA-aligned (1, round_up(M_sum, 4))), or int32 packed UE8M0
           [M_sum, ceil(K/a_group/4)] (byte j of word p = group 4p + j; any strides, DeepGEMM's
           are (1, round_up(M_sum, 4))).
  b        fp8 [E, N, K] + fp32 b_scale [E, ceil(N/128), K/128]           b_block (128, 128)
           fp8 [E, N, K] + uint8 E8M0 b_scale [E, N, K/32]                b_block (1, 32), MXFP8
           uint8 (or int8) [E, N, K/2] packed E2M1 + uint8 E8M0 [E, N, K/32]  b_block (1, 32), MXFP4
  E8M0 byte x means 2^(x-127): byte 0 is 2^-127 (not 0), byte 255 is NaN.

Tiling: each program owns BLOCK_M rows x BLOCK_N columns. BLOCK_M defaults to the largest power of
two dividing the alignment (capped at 128), so every block lies inside one aligned segment: one
expert, read from the block's first row as DeepGEMM's scheduler does, then -1 rows. When BLOCK_M
does not divide the alignment (alignments that are not a multiple of 16, or an explicit block_m),
the kernel switches to a per-row path: it loops over the distinct experts present in the block and
keeps each row's result from its own expert, so a block may straddle segments safely.

Math per weight format:
  fp8 blocks  tl.dot on fp8 operands per activation group (128 K: DeepGEMM's SM90 1D2D scheme),
              promoted as DeepGEMM promotes: acc = fma(part, fp32(SA * SB), acc). Hopper's fp8
              MMA accumulates each chunk at reduced precision, as DeepGEMM's does, so on SM90
              the result is the tensor-core recipe's (reference/hardware/tensor_core.py) bit for
              bit; under the CPU interpreter tl.dot is exact and the result is fp32 math's.
  E8M0 (1,32) Triton on SM90 has no per-32 block-scaled MMA and no E2M1 operand, so the weights
              are upcast (E2M1 decoded) and multiplied by their E8M0 scale, a power of two, which
              is exact barring bf16 overflow or underflow; per-32 E8M0 activation scales are folded
              into the activations the same way. One bf16 dot per chunk; fp32 activation scales
              are applied after it. The only rounding left is the fp32 accumulation and the
              final bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch
import triton
import triton.language as tl

from optimized.kernels._validate import (
    any_true,
    check_flag,
    check_group,
    check_inner_contiguous,
    check_multiple,
    check_range,
    check_same_device,
    check_shape,
    check_tensor,
    fail,
    output_buffer,
    range_violations,
    unexplained,
)
from optimized.kernels.e8m0 import e8m0_to_fp32, word_byte
from optimized.kernels.psum import block_experts, check_expert_ends, psum_row_experts
from optimized.triton_compat import interpreter_mode

# Weight formats (constexpr B_FMT).
_B_FP8_BLOCK = 0  # fp8 weights, fp32 scale per 128x128 block
_B_FP8_MX = 1  # fp8 weights, E8M0 scale per row and 32 K
_B_FP4_MX = 2  # packed E2M1 weights, E8M0 scale per row and 32 K

_MX_GROUP = 32
_FP8_BLOCK = 128
_A_GROUPS = (32, 64, 128)


@triton.jit
def _e2m1_to_fp32(code):
    """E2M1 codes (int32 0..15, bit 3 = sign) -> fp32: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    mag = code & 7
    # mag >= 2: exponent (mag >> 1) - 1, mantissa bit = mag & 1; mag == 1 is 0.5; mag == 0 is 0.
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 126 << 23, 0))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _a_scale(sa_ptr, stride_sam, stride_sak, rows64, row_mask, group, A_PACKED: tl.constexpr):
    """Activation scale of `rows` for K group `group`, fp32 [BLOCK_M]."""
    if A_PACKED:
        word = tl.load(
            sa_ptr + rows64 * stride_sam + (group // 4) * stride_sak, mask=row_mask, other=0
        )
        return e8m0_to_fp32(word_byte(word, group % 4))
    else:
        return tl.load(sa_ptr + rows64 * stride_sam + group * stride_sak, mask=row_mask, other=0.0)


@triton.jit
def _expert_tile(
    expert,
    a_ptr,
    stride_am,
    sa_ptr,
    stride_sam,
    stride_sak,
    b_ptr,
    stride_be,
    stride_bn,
    sb_ptr,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    rows64,
    row_mask,
    cols,
    col_mask,
    K,
    A_GROUP: tl.constexpr,
    A_PACKED: tl.constexpr,
    B_FMT: tl.constexpr,
    CHUNK_K: tl.constexpr,
    A_PRESCALE: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = dequant(a)[rows] @ dequant(b[expert])[cols]^T."""
    e64 = expert.to(tl.int64)
    cols64 = cols.to(tl.int64)
    a_rows = a_ptr + rows64[:, None] * stride_am
    b_cols = b_ptr + e64 * stride_be + cols64[None, :] * stride_bn
    sb_base = sb_ptr + e64 * stride_sbe
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, CHUNK_K):
        ks = k0 + tl.arange(0, CHUNK_K)
        a = tl.load(a_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
        if B_FMT == 0:
            # fp8 x fp8 on the tensor cores; both scales after the partial dot (DeepGEMM 1D2D).
            b = tl.load(b_cols + ks[:, None], mask=col_mask[None, :], other=0.0)
            part = tl.dot(a, b)
            sb = tl.load(
                sb_base + (cols64 // 128) * stride_sbn + (k0 // 128) * stride_sbk,
                mask=col_mask,
                other=0.0,
            )
            sa = _a_scale(sa_ptr, stride_sam, stride_sak, rows64, row_mask, k0 // A_GROUP, A_PACKED)
            # DeepGEMM's promotion, to the bit: one fp32 product of the two scales, then a
            # single-rounding FMA into the accumulator
            # (reference/hardware/tensor_core.py `promote`).
            acc = tl.fma(part, sa[:, None] * sb[None, :], acc)
        else:
            # Per-32 E8M0 weight scales vary along K inside the chunk: fold them (powers of two,
            # so exactly) into the weights, upcast to the MMA dtype, one dot per chunk.
            groups = k0 // 32 + tl.arange(0, CHUNK_K // 32)
            sbyte = tl.load(
                sb_base + cols64[None, :] * stride_sbn + groups[:, None] * stride_sbk,
                mask=col_mask[None, :],
                other=127,
            )
            sb = e8m0_to_fp32(sbyte.to(tl.int32))[:, None, :]
            a = a.to(tl.float32)
            if A_PRESCALE:
                # E8M0 activation scales per 32: fold them into the activations too.
                sa = _a_scale(
                    sa_ptr, stride_sam, stride_sak, rows64[:, None], row_mask[:, None],
                    groups[None, :], A_PACKED,
                )  # fmt: skip
                a = tl.reshape(tl.reshape(a, [BLOCK_M, CHUNK_K // 32, 32]) * sa[:, :, None],
                               [BLOCK_M, CHUNK_K])  # fmt: skip
            if B_FMT == 1:
                b = tl.load(b_cols + ks[:, None], mask=col_mask[None, :], other=0.0)
                b = tl.reshape(tl.reshape(b.to(tl.float32), [CHUNK_K // 32, 32, BLOCK_N]) * sb,
                               [CHUNK_K, BLOCK_N])  # fmt: skip
                part = tl.dot(a.to(MMA_DTYPE), b.to(MMA_DTYPE))
            else:
                # Byte i of a packed row holds elements 2i (low nibble) and 2i+1 (high nibble):
                # split the activations into even and odd columns rather than interleave weights.
                half = k0 // 2 + tl.arange(0, CHUNK_K // 2)
                packed = tl.load(b_cols + half[:, None], mask=col_mask[None, :], other=0)
                packed = packed.to(tl.int32)
                w_even = tl.reshape(
                    tl.reshape(_e2m1_to_fp32(packed & 0xF), [CHUNK_K // 32, 16, BLOCK_N]) * sb,
                    [CHUNK_K // 2, BLOCK_N],
                )
                w_odd = tl.reshape(
                    tl.reshape(_e2m1_to_fp32(packed >> 4), [CHUNK_K // 32, 16, BLOCK_N]) * sb,
                    [CHUNK_K // 2, BLOCK_N],
                )
                a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, CHUNK_K // 2, 2]))
                part = tl.dot(a_even.to(MMA_DTYPE), w_even.to(MMA_DTYPE))
                part = tl.dot(a_odd.to(MMA_DTYPE), w_odd.to(MMA_DTYPE), acc=part)
            if not A_PRESCALE:
                sa = _a_scale(
                    sa_ptr, stride_sam, stride_sak, rows64, row_mask, k0 // A_GROUP, A_PACKED
                )
                part = part * sa[:, None]
            acc += part
    return acc


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    stride_am,
    sa_ptr,
    stride_sam,
    stride_sak,
    b_ptr,
    stride_be,
    stride_bn,
    sb_ptr,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    layout_ptr,
    d_ptr,
    stride_dm,
    M,
    N,
    K,
    num_experts,
    alignment,
    A_GROUP: tl.constexpr,
    A_PACKED: tl.constexpr,
    B_FMT: tl.constexpr,
    CHUNK_K: tl.constexpr,
    A_PRESCALE: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    ONE_EXPERT_PER_BLOCK: tl.constexpr,
    PSUM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row blocks share each column block while it is hot in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if PSUM:
        row_expert = psum_row_experts(layout_ptr, rows, row_mask, num_experts, alignment, BLOCK_E)
        # Gap rows are not even read: their A rows and scales may hold anything.
        row_mask = row_expert >= 0
    else:
        row_expert = tl.load(layout_ptr + rows, mask=row_mask, other=-1)
        row_expert = tl.where((row_expert >= 0) & (row_expert < num_experts), row_expert, -1)
    out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if ONE_EXPERT_PER_BLOCK:
        # The block lies inside one aligned segment: its expert is the first row's (a -1 first
        # row means the whole block is padding and nothing is computed). Under psum the live
        # rows are a prefix of the block, all of one expert.
        if PSUM:
            expert = tl.max(row_expert, 0)
        else:
            expert = tl.load(layout_ptr + pid_m * BLOCK_M)
        if (expert >= 0) & (expert < num_experts):
            tile = _expert_tile(
                expert, a_ptr, stride_am, sa_ptr, stride_sam, stride_sak, b_ptr, stride_be,
                stride_bn, sb_ptr, stride_sbe, stride_sbn, stride_sbk, rows64, row_mask, cols,
                col_mask, K, A_GROUP, A_PACKED, B_FMT, CHUNK_K, A_PRESCALE, MMA_DTYPE, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
            out = tl.where((row_expert == expert)[:, None], tile, 0.0)
    else:
        # Per-row experts: visit the distinct experts of the block in increasing order.
        pending = tl.where(row_expert >= 0, row_expert, num_experts)
        expert = tl.min(pending, 0)
        while expert < num_experts:
            tile = _expert_tile(
                expert, a_ptr, stride_am, sa_ptr, stride_sam, stride_sak, b_ptr, stride_be,
                stride_bn, sb_ptr, stride_sbe, stride_sbn, stride_sbk, rows64, row_mask, cols,
                col_mask, K, A_GROUP, A_PACKED, B_FMT, CHUNK_K, A_PRESCALE, MMA_DTYPE, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
            out = tl.where((row_expert == expert)[:, None], tile, out)
            expert = tl.min(tl.where(pending > expert, pending, num_experts), 0)

    d_ptrs = d_ptr + rows64[:, None] * stride_dm + cols[None, :]
    tl.store(d_ptrs, out.to(tl.bfloat16), mask=row_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class _Tiles:
    """Launch shape besides BLOCK_M (which follows the alignment)."""

    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def _pick_tiles(fmt: int, block_m: int) -> _Tiles:
    if interpreter_mode():
        # Fewer, larger programs: the interpreter's cost is per program and per op.
        return _Tiles(block_n=64, num_warps=4, num_stages=1)
    # Measured on the H200 (8 experts x 512 rows, N=4096, K=7168, BLOCK_M=128): fp8 blocks 628
    # TFLOPS with (128, 8 warps) (BLOCK_N 256 or 4 warps spill: ~170); MXFP8 250 with
    # (128, 4 warps); MXFP4 185 with (64, 4 warps) against 162 with (128, 8 warps).
    if fmt == _B_FP8_BLOCK:
        return _Tiles(128, 8 if block_m >= 128 else 4, 3)
    if fmt == _B_FP8_MX:
        return _Tiles(128, 4, 3)
    return _Tiles(64, 4, 3)


def _chunking(fmt: int, a_group: int, a_packed: bool, k: int) -> tuple[int, bool]:
    """K elements per partial dot, and whether activation scales are folded in before it.

    fp8 block weights: one fp8 dot per activation group (<= 128), both scales after it.
    E8M0 weights: folded into the weights per 32, so a chunk spans one activation group, whose
    scale is applied after the dot; except for per-32 E8M0 activation scales, which are powers of
    two and are folded in too, so the chunk can grow to 128 (fp32 scales are not: folding one
    into the bf16 operand would round it).
    """
    if fmt == _B_FP8_BLOCK:
        return min(a_group, _FP8_BLOCK), False
    if a_packed and a_group == _MX_GROUP:
        chunk = 128
        while k % chunk:
            chunk //= 2
        return chunk, True
    return a_group, False


def default_block_m(alignment: int) -> int:
    """The rows of a block by default: the largest power of two dividing `alignment`, within
    [16, 128] (tl.dot needs M >= 16)."""
    block = 1
    while alignment % (block * 2) == 0 and block < 128:
        block *= 2
    return max(block, 16)


def m_indices_violations(
    m_indices: torch.Tensor, num_experts: int, alignment: int
) -> list[torch.Tensor]:
    """The m_indices rules `_check_m_indices` names, as device masks for a batched read: a value
    outside [-1, E), and an aligned block that is not one expert on a prefix of rows then -1."""
    if m_indices.numel() == 0:
        return []
    blocks = m_indices.view(-1, alignment)
    live = blocks != -1
    # Each aligned block: one expert (its first row's) on a prefix of rows, then only -1.
    broken = (live & (blocks != blocks[:, :1])).any(1)
    broken |= (live[:, 1:] & ~live[:, :-1]).any(1)
    return [range_violations(m_indices, -1, num_experts), broken]


def _check_m_indices(fn: str, m_indices: torch.Tensor, num_experts: int, alignment: int) -> None:
    """Values in [-1, E) and DeepGEMM's segment rule (one device sync)."""
    if any_true(*m_indices_violations(m_indices, num_experts, alignment)):
        explain_m_indices(fn, m_indices, num_experts, alignment)


def explain_m_indices(
    fn: str, m_indices: torch.Tensor, num_experts: int, alignment: int
) -> NoReturn:
    """Raise naming the m_indices rule broken (after `m_indices_violations` flagged one)."""
    check_range(
        fn, "m_indices", m_indices, -1, num_experts,
        f"a row's expert must be in [0, E={num_experts}) or -1 (padding); another value would "
        "select a weight outside b",
    )  # fmt: skip
    _, broken = m_indices_violations(m_indices, num_experts, alignment)
    if bool(broken.any()):
        blocks = m_indices.view(-1, alignment)
        first, live = blocks[:, :1], blocks != -1
        b = int(broken.nonzero()[0])
        lo = b * alignment
        experts = sorted(set(blocks[b][live[b]].tolist()))
        fail(
            fn,
            f"m_indices rows {lo}..{lo + alignment - 1} (aligned block {b}, alignment "
            f"{alignment}) must hold one expert on a prefix of rows followed only by -1 rows; "
            f"found experts {experts} (first row {int(first[b, 0])}). Every expert segment must "
            "start at a multiple of the alignment, or DeepGEMM computes rows with the wrong expert",
        )
    unexplained(fn)


def _check_inputs(
    fn: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_block: tuple[int, int],
    grouped_layout: torch.Tensor,
    alignment: int,
    use_psum_layout: bool,
) -> int:
    """Shapes, dtypes, strides and groups (no device sync); returns the weight format code."""
    check_flag(fn, "use_psum_layout", use_psum_layout)
    check_tensor(fn, "a", a, (torch.float8_e4m3fn,), 2)
    check_inner_contiguous(fn, "a", a)
    m_sum, k = a.shape
    check_group(fn, a_group, _A_GROUPS)
    check_multiple(fn, "a.shape[1] (K)", k, a_group)
    groups = k // a_group
    check_tensor(fn, "a_scale", a_scale, (torch.float32, torch.int32), 2)
    if a_scale.dtype == torch.float32:
        check_shape(fn, "a_scale", a_scale, (m_sum, groups), "fp32 [M_sum, K/a_group]")
    else:
        check_shape(
            fn, "a_scale", a_scale, (m_sum, triton.cdiv(groups, 4)),
            "int32 packed UE8M0 [M_sum, ceil(K/a_group/4)]",
        )  # fmt: skip

    b_block = tuple(b_block)
    if b_block not in ((_FP8_BLOCK, _FP8_BLOCK), (1, _MX_GROUP)):
        fail(fn, f"b_block must be (128, 128) or (1, 32), got {b_block}")
    check_tensor(fn, "b", b, (torch.float8_e4m3fn, torch.uint8, torch.int8), 3)
    check_inner_contiguous(fn, "b", b)
    e, n, kb = b.shape
    if b.dtype == torch.float8_e4m3fn:
        fmt = _B_FP8_BLOCK if b_block == (_FP8_BLOCK, _FP8_BLOCK) else _B_FP8_MX
        if kb != k:
            fail(fn, f"b has K={kb} but a has K={k}")
    else:
        fmt = _B_FP4_MX
        if b_block != (1, _MX_GROUP):
            fail(fn, f"packed E2M1 weights (uint8 b) take b_block (1, 32), got {b_block}")
        if 2 * kb != k:
            fail(fn, f"packed E2M1 b holds {kb} bytes = {2 * kb} elements per row, a has K={k}")
    if n == 0 or n % 16 != 0:
        fail(fn, f"N={n} (b.shape[1]) must be a positive multiple of 16")
    check_multiple(fn, "a.shape[1] (K)", k, b_block[1])
    if fmt == _B_FP8_BLOCK:
        check_tensor(fn, "b_scale", b_scale, (torch.float32,), 3)
        check_shape(
            fn, "b_scale", b_scale, (e, triton.cdiv(n, _FP8_BLOCK), k // _FP8_BLOCK),
            "fp32 [E, ceil(N/128), K/128]",
        )  # fmt: skip
    else:
        check_tensor(fn, "b_scale", b_scale, (torch.uint8, torch.float8_e8m0fnu), 3)
        check_shape(fn, "b_scale", b_scale, (e, n, k // _MX_GROUP), "E8M0 bytes [E, N, K/32]")

    name = "expert_ends" if use_psum_layout else "m_indices"
    check_tensor(fn, name, grouped_layout, (torch.int32,), 1)
    if use_psum_layout:
        check_shape(fn, name, grouped_layout, (e,), "[E] (one cumulative end per expert)")
    else:
        check_shape(fn, name, grouped_layout, (m_sum,), "[M_sum] (one expert per row of a)")
    if not grouped_layout.is_contiguous():
        fail(fn, f"{name} must be contiguous")
    if not isinstance(alignment, int) or alignment < 1 or m_sum % alignment != 0:
        fail(fn, f"M_sum={m_sum} must be a multiple of alignment={alignment!r} (an int >= 1)")
    check_same_device(fn, "a", a, a_scale=a_scale, b=b, b_scale=b_scale, **{name: grouped_layout})
    return fmt


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_block: tuple[int, int],
    grouped_layout: torch.Tensor,
    alignment: int,
    *,
    use_psum_layout: bool = False,
    block_m: int | None = None,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """m-grouped contiguous GEMM: d[r] = dequant(a[r]) @ dequant(b[e(r)])^T, bf16.

    a          fp8 e4m3 [M_sum, K], K-major.
    a_scale    fp32 [M_sum, K/a_group] (any strides) or int32 packed UE8M0
               [M_sum, ceil(K/a_group/4)] (any strides).
    a_group    K elements per activation scale: 32, 64 or 128.
    b, b_scale see the module docstring; b_block (128, 128) or (1, 32).
    alignment  rows per aligned segment block (DeepGEMM's BLOCK_M / mk alignment): validates the
               layout and picks the tile height.
    grouped_layout  as DeepGEMM's: int32 m_indices [M_sum], the expert of each row, -1 on
               padding, segments aligned to `alignment`; or, with `use_psum_layout`, int32
               expert_ends [E], expert e on rows [round_up(end_{e-1}, A), end_e).
    returns    bf16 [M_sum, N]; rows with m_indices == -1 are exact zeros; under psum, gap and
               tail rows are left as they were (unspecified).
    block_m    tile height (power of two >= 16); default: the largest power of two dividing
               `alignment`, capped at 128. One that does not divide `alignment` takes the
               per-row expert path (correct, slower).
    validate   scan the layout on the host (range and segment rule, or the psum rule; a device
               sync): pass False under CUDA-graph capture, where the kernel still treats an
               out-of-range expert as a -1 row. Shape, dtype and stride checks always run.
    """
    fn = "grouped_gemm"
    check_flag(fn, "validate", validate)
    fmt = _check_inputs(
        fn, a, a_scale, a_group, b, b_scale, b_block, grouped_layout, alignment, use_psum_layout
    )
    if validate and use_psum_layout:
        check_expert_ends(fn, grouped_layout, a.shape[0], alignment)
    elif validate:
        _check_m_indices(fn, grouped_layout, b.shape[0], alignment)
    if block_m is None:
        block_m = default_block_m(alignment)
    if not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        fail(fn, f"block_m must be a power of two >= 16, got {block_m!r}")

    m_sum, k = a.shape
    num_experts, n = b.shape[0], b.shape[1]
    d = output_buffer(fn, "out", out, (m_sum, n), torch.bfloat16, a.device)
    if m_sum == 0:
        return d
    if num_experts == 0:
        # A rank that hosts no expert: every row is padding (-1 or no psum segment), whose
        # output this kernel defines as zero.
        return d.zero_()

    chunk, prescale = _chunking(fmt, a_group, a_scale.dtype == torch.int32, k)
    tiles = _pick_tiles(fmt, block_m)
    # vLLM passes E2M1 as int8 and E8M0 scales may come as float8_e8m0fnu: same bytes.
    if b.dtype == torch.int8:
        b = b.view(torch.uint8)
    b_scale_view = b_scale.view(torch.uint8) if b_scale.dtype == torch.float8_e8m0fnu else b_scale
    grid = (triton.cdiv(m_sum, block_m) * triton.cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        a.stride(0),
        a_scale,
        a_scale.stride(0),
        a_scale.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        b_scale_view,
        b_scale_view.stride(0),
        b_scale_view.stride(1),
        b_scale_view.stride(2),
        grouped_layout,
        d,
        d.stride(0),
        m_sum,
        n,
        k,
        num_experts,
        alignment,
        A_GROUP=a_group,
        A_PACKED=a_scale.dtype == torch.int32,
        B_FMT=fmt,
        CHUNK_K=chunk,
        A_PRESCALE=prescale,
        # The interpreter's tl.dot reads bf16 operands as raw uint16 integers; fp32 holds the
        # same exact values (fp8 activations, scaled E2M1 weights), so it is used there instead.
        MMA_DTYPE=tl.float32 if interpreter_mode() else tl.bfloat16,
        ONE_EXPERT_PER_BLOCK=alignment % block_m == 0,
        PSUM=use_psum_layout,
        BLOCK_E=block_experts(num_experts),
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return d
