"""FP8 group quantization and UE8M0 scale packing: Triton kernels mirroring reference/formats.py.

Recipes (vLLM 0.32 quantization/utils/fp8_utils.py, DeepGEMM 2.6.1 smxx_layout.hpp):
- `quantize_fp8_groups`: vLLM's CUDA per-token-group quant (`per_token_group_quant_fp8`); fp32
  scales, row-major or column-major (optionally TMA-aligned), optionally rounded up to a power of
  two (UE8M0).
- `quantize_fp8_groups_packed`: the same with ceil-UE8M0 scales written as DeepGEMM's packed int32
  layout (`per_token_group_quant_fp8_packed_for_deepgemm`): byte j of word p is group 4p+j,
  MN-major, stride (1, round_up(MN, 4)).
- `quantize_mxfp8`: FlashInfer/TRT-LLM MXFP8 (`mxfp8_quantize`): E8M0 bytes rounded toward +inf,
  1x32 groups.
- `pack_ue8m0`, `pack_ue8m0_from_fp32`: exponent bytes (or exact power-of-two fp32 scales) packed
  into that int32 layout (`get_mn_major_tma_aligned_packed_ue8m0_tensor`).

Every power-of-two rounding is done on the fp32 bits (exponent + (mantissa != 0), the E8M0 helpers
of optimized/kernels/e8m0.py), never through log2/ceil, so it is exact on every backend. Storage
rows MN..round_up(MN, 4)-1 of packed scales are not part of the tensor and are left unwritten, as
DeepGEMM's CUDA packer does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_verify.spec import ScaleFmt, ceil_div, round_up
from optimized.kernels._validate import (
    check_eps,
    check_flag,
    check_group,
    check_inner_contiguous,
    check_multiple,
    check_power_of_two_scales,
    check_scale_fmt,
    check_tensor,
    fail,
)
from optimized.kernels.e8m0 import pack_word, pow2_from_byte, ue8m0_byte, ue8m0_ceil_byte
from optimized.triton_compat import interpreter_mode

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_GROUPS = (32, 64, 128)


# ----------------------------------------------------------------------------------- jit helpers


@triton.jit
def divide_by_scale(x, s, POW2: tl.constexpr):
    """x / s for a [BLOCK_M, G, GROUP] tile and its [BLOCK_M, G] scales, rounded to nearest even.

    A power-of-two s (2^-126..2^126) divides exactly as a multiply by 2^-e built from its bits
    (cheap); any other s needs the IEEE division, several instructions per element. One IEEE
    reciprocal per group and Markstein's FMA correction per element give the same e4m3 codes
    (tests/optimized/test_divide.py), but with its fallback for tiny scales that form made
    act_quant slower on an H100 (docs/perf.md, 2026-12-06), so it is not used."""
    if POW2:
        inv = pow2_from_byte(254 - ue8m0_byte(s))
        return x * inv[:, :, None]
    return div_rn(x, s[:, :, None])


@triton.jit
def to_fp8_satfinite(v):
    """fp32 -> e4m3 with RNE, clamped to +-448 first (cvt.rn.satfinite); NaN stays NaN on the GPU
    and under the interpreter alike (a plain minimum/maximum drops NaN on the GPU only)."""
    v = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return v.to(tl.float8e4nv)


@triton.jit
def div_rn(a, b):
    """a / b rounded to nearest even; b (a tensor or a constant, never -0) broadcasts to a's shape.

    Triton's `/` on fp32 is div.full.f32 on NVIDIA GPUs (about 2 ulp): on the H200 it moved fp8
    codes against the golden's IEEE division."""
    return tl.math.div_rn(a, b + tl.zeros_like(a))


@triton.jit
def _cuda_group_scale(amax, eps, UE8M0: tl.constexpr):
    """The scale of one group from its max |x|: max(amax, eps)/448, optionally ceil-UE8M0 of the
    scale floored at 1e-10 (vLLM's CUDA kernels floor it there before rounding up)."""
    s = div_rn(tl.maximum(amax, eps), 448.0)
    if UE8M0:
        s = pow2_from_byte(ue8m0_ceil_byte(tl.maximum(s, 1e-10)))
    return s


@triton.jit
def group_tile(rows, M, K, GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    """Offsets and mask of this program's [BLOCK_M, GROUPS_PER_PROGRAM, GROUP] tile, and the
    [BLOCK_M, GROUPS_PER_PROGRAM] mask of groups that exist."""
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    group_ok = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    mask = group_ok[:, :, None] & (cols < K)[None, :, :]
    return groups, cols, group_ok, mask


# --------------------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_fp8_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    eps,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UE8M0: tl.constexpr,
    PACKED: tl.constexpr,
):
    """One program: BLOCK_M rows x GROUPS_PER_PROGRAM groups (one int32 word of 4 when PACKED)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, group_ok, mask = group_tile(rows, M, K, GROUP, GROUPS_PER_PROGRAM)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None, None] * stride_xm + cols[None, :, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    s = _cuda_group_scale(tl.max(tl.abs(x), axis=2), eps, UE8M0)
    q = to_fp8_satfinite(divide_by_scale(x, s, UE8M0))
    tl.store(q_ptr + rows[:, None, None] * stride_qm + cols[None, :, :], q, mask=mask)
    if PACKED:
        # s is a power of two: its exponent field is the UE8M0 byte; slots past the last group: 0.
        byte = tl.where(group_ok, ue8m0_byte(s), 0)
        word = pack_word(byte, GROUPS_PER_PROGRAM)
        s_ptrs = s_ptr + rows * stride_sm + tl.program_id(1).to(tl.int64) * stride_sg
        tl.store(s_ptrs, word, mask=rows < M)
    else:
        s_ptrs = s_ptr + rows[:, None] * stride_sm + groups.to(tl.int64)[None, :] * stride_sg
        tl.store(s_ptrs, s, mask=group_ok)


@triton.jit
def _quantize_mxfp8_kernel(
    x_ptr,
    q_ptr,
    e_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_em,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One program: BLOCK_M rows x GROUPS_PER_PROGRAM groups of 32; E8M0 bytes row-major."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, group_ok, mask = group_tile(rows, M, K, GROUP, GROUPS_PER_PROGRAM)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None, None] * stride_xm + cols[None, :, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    # SF = amax * rcp(448); its E8M0 code rounds toward +inf and saturates at 254 (255 is NaN).
    byte = tl.minimum(ue8m0_ceil_byte(amax * (1.0 / 448.0)), 254)
    # x * 2^(127-byte); byte <= 247 for any finite input, so the factor is a normal fp32.
    inv_scale = pow2_from_byte(254 - byte)
    inv_scale = tl.where(amax == 0.0, 0.0, inv_scale)
    q = to_fp8_satfinite(x * inv_scale[:, :, None])
    tl.store(q_ptr + rows[:, None, None] * stride_qm + cols[None, :, :], q, mask=mask)
    e_ptrs = e_ptr + rows[:, None] * stride_em + groups[None, :]
    tl.store(e_ptrs, byte.to(tl.uint8), mask=group_ok)


@triton.jit
def _pack_ue8m0_kernel(
    src_ptr,
    out_ptr,
    MN,
    G,
    stride_sb,
    stride_sm,
    stride_sg,
    stride_ob,
    stride_op,
    FROM_FP32: tl.constexpr,
    BLOCK_MN: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program: BLOCK_MN rows x BLOCK_P words of one batch (rows are the fast axis)."""
    batch = tl.program_id(2).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_MN + tl.arange(0, BLOCK_MN)).to(tl.int64)
    packs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    num_packs = tl.cdiv(G, 4)
    ok = (rows < MN)[:, None] & (packs < num_packs)[None, :]
    src = src_ptr + batch * stride_sb + rows[:, None] * stride_sm
    word = tl.zeros([BLOCK_MN, BLOCK_P], dtype=tl.uint32)
    for j in tl.static_range(4):
        g = packs * 4 + j
        mask = ok & (g < G)[None, :]
        if FROM_FP32:
            byte = ue8m0_byte(tl.load(src + g[None, :] * stride_sg, mask=mask, other=0.0))
        else:
            byte = tl.load(src + g[None, :] * stride_sg, mask=mask, other=0)
        word = word | (byte.to(tl.uint32) << (8 * j))
    out = out_ptr + batch * stride_ob + rows[:, None] + packs.to(tl.int64)[None, :] * stride_op
    tl.store(out, word.to(tl.int32, bitcast=True), mask=ok)


# ----------------------------------------------------------------------------------- host side


def block_rows(rows: int, cols: int, native_elements: int = 4096) -> int:
    """Rows per program for a [rows, cols] tile of about `native_elements` elements on a GPU (4K,
    32 per thread at 4 warps, measured best for these quantizers on the H200), or 16K under the
    interpreter, where every program costs Python overhead (larger tiles push torch's casts onto
    its slow multi-threaded path). The math of a group never depends on it."""
    target = 16384 if interpreter_mode() else native_elements
    return max(1, min(triton.next_power_of_2(max(rows, 1)), target // cols))


def _check_activations(fn: str, x: object, group: int, allowed: tuple[int, ...]) -> torch.Tensor:
    check_tensor(fn, "x", x, _FLOAT_INPUTS, 2)
    assert isinstance(x, torch.Tensor)
    check_group(fn, group, allowed)
    check_multiple(fn, "x.shape[1] (K)", x.shape[1], group)
    check_inner_contiguous(fn, "x", x)
    return x


def packed_ue8m0_empty(mn: int, num_groups: int, device: torch.device) -> torch.Tensor:
    """Uninitialised int32 [mn, ceil(num_groups/4)] with DeepGEMM's MN-major TMA-aligned strides
    (1, round_up(mn, 4)); the storage covers the pad rows too, as vLLM allocates it."""
    packs = ceil_div(num_groups, 4)
    lead = round_up(mn, 4)
    storage = torch.empty(packs, lead, dtype=torch.int32, device=device)
    return storage.as_strided((mn, packs), (1, lead))


def quantize_fp8_groups(
    x: torch.Tensor,
    group: int = 128,
    scale_fmt: ScaleFmt = ScaleFmt.FLOAT32,
    column_major: bool = False,
    tma_aligned: bool = False,
    eps: float = 1e-10,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (q fp8 e4m3 [M, K], scale fp32 [M, K/group]).

    Per group of `group` columns: amax = max(eps, max|x|), s = amax / 448 (a true division); for the
    UE8M0 formats s = 2^ceil(log2(max(s, 1e-10))); q = fp8_rne(clamp(x / s, +-448)). Scale strides:
    row-major (K/group, 1); column_major (1, M); column_major + tma_aligned (1, round_up(M, 4)).
    """
    fn = "quantize_fp8_groups"
    _check_activations(fn, x, group, _GROUPS)
    scale_fmt = check_scale_fmt(fn, scale_fmt)
    check_flag(fn, "column_major", column_major)
    check_flag(fn, "tma_aligned", tma_aligned)
    eps = check_eps(fn, eps)
    if tma_aligned and not column_major:
        fail(fn, "tma_aligned=True needs column_major=True (the TMA layout is MN-major)")
    m, k = x.shape
    num_groups = k // group
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if not column_major:
        scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    else:
        lead = round_up(m, 4) if tma_aligned else m
        storage = torch.empty(num_groups, lead, dtype=torch.float32, device=x.device)
        scale = storage.as_strided((m, num_groups), (1, lead))
    if m == 0 or num_groups == 0:
        return q, scale
    per_program = max(1, 128 // group)
    bm = block_rows(m, group * per_program)
    grid = (triton.cdiv(m, bm), triton.cdiv(num_groups, per_program))
    _quantize_fp8_groups_kernel[grid](
        x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), eps,
        GROUP=group, GROUPS_PER_PROGRAM=per_program, BLOCK_M=bm, UE8M0=scale_fmt.is_ue8m0,
        PACKED=False, num_warps=4,
    )  # fmt: skip
    return q, scale


def quantize_fp8_groups_packed(
    x: torch.Tensor, group: int = 128, eps: float = 1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [M, K], packed UE8M0 int32 [M, ceil(K/group/4)]).

    The int32 scales have DeepGEMM's MN-major TMA-aligned strides (1, round_up(M, 4)).
    s = max(max(eps, amax) / 448, 1e-10) rounded up to a power of two, byte = its exponent
    field, q = fp8_rne(clamp(x * 2^(127-byte), +-448)). Byte slots past the last group are 0.
    """
    fn = "quantize_fp8_groups_packed"
    _check_activations(fn, x, group, (32, 128))
    eps = check_eps(fn, eps)
    m, k = x.shape
    num_groups = k // group
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    packed = packed_ue8m0_empty(m, num_groups, x.device)
    if m == 0 or num_groups == 0:
        return q, packed
    bm = block_rows(m, group * 4)
    grid = (triton.cdiv(m, bm), packed.shape[1])
    _quantize_fp8_groups_kernel[grid](
        x, q, packed, m, k, x.stride(0), q.stride(0), packed.stride(0), packed.stride(1), eps,
        GROUP=group, GROUPS_PER_PROGRAM=4, BLOCK_M=bm, UE8M0=True, PACKED=True, num_warps=4,
    )  # fmt: skip
    return q, packed


def quantize_mxfp8(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 e4m3 [M, K], E8M0 bytes uint8 [M, K/32] row-major).

    FlashInfer's mxfp8_quantize: SF = amax * fp32(1/448); byte = E8M0 of SF rounded toward
    +inf, saturated to [0, 254]; q = fp8_rne_satfinite(x * 2^(127-byte)); amax == 0 gives byte 0
    and q = x * 0.
    """
    fn = "quantize_mxfp8"
    _check_activations(fn, x, group, (32,))
    m, k = x.shape
    num_groups = k // group
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    e8m0 = torch.empty(m, num_groups, dtype=torch.uint8, device=x.device)
    if m == 0 or num_groups == 0:
        return q, e8m0
    bm = block_rows(m, group * 4)
    grid = (triton.cdiv(m, bm), triton.cdiv(num_groups, 4))
    _quantize_mxfp8_kernel[grid](
        x, q, e8m0, m, k, x.stride(0), q.stride(0), e8m0.stride(0),
        GROUP=group, GROUPS_PER_PROGRAM=4, BLOCK_M=bm, num_warps=4,
    )  # fmt: skip
    return q, e8m0


def _pack(fn: str, src: torch.Tensor, from_fp32: bool) -> torch.Tensor:
    batched = src.dim() == 3
    src3 = src if batched else src.unsqueeze(0)
    b, mn, g = src3.shape
    if b > 65535:
        fail(fn, f"at most 65535 batches (grid axis z), got {b}")
    packs = ceil_div(g, 4)
    lead = round_up(mn, 4)
    # [B, MN, P] with strides (P * lead, 1, lead): DeepGEMM's MN-major TMA-aligned packed layout.
    storage = torch.empty(b, packs, lead, dtype=torch.int32, device=src.device)
    out = storage.as_strided((b, mn, packs), (packs * lead, 1, lead))
    if b and mn and packs:
        bmn = min(triton.next_power_of_2(mn), 1024 if interpreter_mode() else 128)
        bp = min(triton.next_power_of_2(packs), 16)
        grid = (triton.cdiv(mn, bmn), triton.cdiv(packs, bp), b)
        _pack_ue8m0_kernel[grid](
            src3, out, mn, g, src3.stride(0), src3.stride(1), src3.stride(2),
            out.stride(0), out.stride(2), FROM_FP32=from_fp32, BLOCK_MN=bmn, BLOCK_P=bp,
            num_warps=4,
        )  # fmt: skip
    return out if batched else out[0]


def pack_ue8m0(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes [MN, G] (or [B, MN, G], any strides) -> int32 [MN, ceil(G/4)].

    Word p of row i holds groups 4p..4p+3, group 4p+j in byte j (little-endian); slots past G are
    0. Strides (1, round_up(MN, 4)) (batched: (ceil(G/4) * round_up(MN, 4), 1, round_up(MN, 4))).
    """
    fn = "pack_ue8m0"
    check_tensor(fn, "exponent_bytes", exponent_bytes, (torch.uint8,), (2, 3))
    return _pack(fn, exponent_bytes, from_fp32=False)


def pack_ue8m0_from_fp32(scale: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """fp32 power-of-two scales [MN, G] (or [B, MN, G], any strides) -> int32 as `pack_ue8m0`.

    The byte is the fp32 exponent field, so every scale must be +0 or a positive normal power of
    two; anything else is refused before launch, naming the first offending (row, group) and value
    (DeepGEMM 2.6 checks the same on the device and traps). `validate=False` skips that check.
    """
    fn = "pack_ue8m0_from_fp32"
    check_tensor(fn, "scale", scale, (torch.float32,), (2, 3))
    if check_flag(fn, "validate", validate):
        check_power_of_two_scales(fn, "scale", scale)
    return _pack(fn, scale, from_fp32=True)


@triton.jit
def _quotient_kernel(v_ptr, out_ptr, n, NUMERATOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=1.0)
    # A plain `/`, as other engines' kernels write it (LMDeploy's `fp8_max / a_max`): compiled
    # for an NVIDIA GPU it is div.full.f32, not the IEEE quotient `div_rn` gives.
    tl.store(out_ptr + offs, NUMERATOR / v, mask=ok)


def triton_quotient(numerator: float, v: torch.Tensor) -> torch.Tensor:
    """fp32 [n]: numerator / v for each fp32 v, as this machine's Triton compiles a plain fp32
    division (the hardware tables of moe_verify/hw_vectors.py record it for every bf16 v)."""
    fn = "triton_quotient"
    if v.dtype != torch.float32 or v.dim() != 1:
        fail(fn, f"v must be a 1-D fp32 tensor, got {v.dtype} {tuple(v.shape)}")
    out = torch.empty_like(v)
    if v.numel():
        _quotient_kernel[(triton.cdiv(v.numel(), 1024),)](
            v.contiguous(), out, v.numel(), NUMERATOR=float(numerator), BLOCK=1024
        )
    return out
