"""Numeric formats of the DeepGEMM MoE path, written as the math: e4m3, UE8M0/E8M0, E2M1, packing.

Everything here is the golden definition of a format or quantizer, in plain PyTorch on whatever
device the input lives on. Bit-level facts (exponent fields, ties, padding bytes) are computed with
integer arithmetic on fp32 bit patterns, never with log2/exp2, so results are exact on CPU and GPU;
the one exception, `ceil_pow2_via_log2`, models a kernel that rounds up through an fp32 log2.

Glossary: `group` = K elements sharing one scale; `G` = groups per row (K / group); `P` = int32
words per row of packed UE8M0 (ceil(G / 4)); `tma` = MN rounded up to 4 (DeepGEMM's TMA alignment).
Sources of the semantics: vLLM 0.32's quantization/utils/fp8_utils.py and csrc
per_token_group_quant.cu; DeepGEMM 2.6.1's deep_gemm/utils/math.py (the quantizers) and
csrc/jit_kernels/impls/smxx_layout.hpp (the scale layouts).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_verify.spec import (
    E2M1_MAX,
    FP8_MAX,
    InputQuantRecipe,
    ScaleFmt,
    ceil_div,
    check_enum,
    round_up,
)
from reference.hardware.quotient_table import FLOORS, table_value
from reference.validate import (
    first_index,
    require_bool,
    require_finite,
    require_multiple,
    require_no_e8m0_nan,
    require_positive_int,
    require_scale_fmt,
    require_scale_values,
    require_shape,
    require_tensor,
)

__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "ceil_pow2_via_log2",
    "ceil_ue8m0",
    "cast_to_fp8",
    "dequantize_fp8_blocks",
    "dequantize_fp8_groups",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "e8m0_to_fp32",
    "group_scales_by_division",
    "group_scales_by_reciprocal",
    "pack_ue8m0",
    "quantize_fp8_blocks",
    "quantize_fp8_groups",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "requantize_blocks_ue8m0",
    "ue8m0_bytes",
    "unpack_e2m1_codes",
    "unpack_ue8m0",
]

FP8 = torch.float8_e4m3fn
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # all exactly representable in fp32

# fp32 bit fields.
_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_EXPONENT_BIAS = 127
_MIN_NORMAL = 2.0**-126

# The floor vLLM's group quantizers put on the scale before rounding it up (eps = 1e-10).
SCALE_FLOOR = 1e-10
# DeepGEMM's per_block_cast_to_fp8 and per_token_cast_to_fp4 floor amax here
# (deep_gemm/utils/math.py).
BLOCK_AMAX_FLOOR = 1e-4

# E2M1 code -> value. Bit 3 is the sign; bits 0-2 index the magnitudes (code 8 is -0.0).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: Tensor = torch.tensor(
    _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES), dtype=torch.float32
)
# Midpoints between consecutive magnitudes; a value exactly on one rounds DOWN (DeepGEMM counts
# the thresholds strictly exceeded), which is not IEEE ties-to-even at 0.75, 1.75 and 3.5.
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _divide(a: Tensor, b: float) -> Tensor:
    """a / b as a true (correctly rounded) fp32 division, on every device.

    CUDA torch turns division by a Python scalar into a multiply by its fp32 reciprocal (1344 / 448
    gives 3.0000002 there and 3 on the CPU); dividing by a tensor keeps the IEEE division.
    """
    return a / torch.full_like(a, b)


# ---------------------------------------------------------------------------------------------
# fp32 bit arithmetic: powers of two and their exponents, exactly.
# ---------------------------------------------------------------------------------------------


def _f32_bits(x: Tensor) -> Tensor:
    """int32 bit pattern of an fp32 tensor (any strides)."""
    return x.view(torch.int32)


def _exp2_int(n: Tensor) -> Tensor:
    """Exactly 2^n as fp32 for integer n in [-149, 127], built from bits (no exp2 rounding)."""
    n = n.to(torch.int32)
    normal = (n + _EXPONENT_BIAS).clamp(min=1) << _MANTISSA_BITS
    # Below 2^-126 the value is a subnormal: a single mantissa bit, 2^-149 being bit 0.
    subnormal = torch.ones_like(n) << (n + 149).clamp(0, 22)
    return torch.where(n >= -126, normal, subnormal).view(torch.float32)


def _ceil_log2(x: Tensor) -> Tensor:
    """ceil(log2(x)) as int32 for positive finite fp32 x, exact for normals and subnormals."""
    # A subnormal has no implicit leading bit; lifting it by 2^64 (exact) makes it normal.
    tiny = x < _MIN_NORMAL
    bits = _f32_bits(torch.where(tiny, x * 2.0**64, x))
    exponent = ((bits >> _MANTISSA_BITS) & 0xFF) - _EXPONENT_BIAS
    rounds_up = ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return exponent + rounds_up - 64 * tiny.to(torch.int32)


def ceil_ue8m0(x: Tensor) -> Tensor:
    """Smallest power of two >= x, as DeepGEMM's ceil_to_ue8m0 and vLLM's register kernel do it.

    x: fp32, any shape, every value finite and >= 0. Returns fp32 of the same shape.
    Biased exponent + (mantissa != 0), then the mantissa cleared. Zero and subnormals (including
    the subnormal powers of two) map to 2^-126, the smallest normal power of two, because UE8M0
    producers clamp the exponent field to >= 1. Values above 2^127 raise: their ceiling (2^128)
    is not an fp32 number (quantizer scales never get there: amax/448 < 2^120).
    """
    require_tensor("x", x, (torch.float32,), 0)
    bad = ~torch.isfinite(x) | (x < 0)
    if bool(bad.any()):
        at = first_index(bad)
        raise ValueError(f"x must be finite and >= 0 for ceil_ue8m0, got {x[at].item()} at {at}")
    bits = _f32_bits(x) & 0x7FFFFFFF  # -0.0 is zero
    biased = (bits >> _MANTISSA_BITS) + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    biased = biased.clamp(min=1)
    if bool((biased > 254).any()):
        at = first_index(biased > 254)
        raise ValueError(
            f"x must be <= 2^127 for ceil_ue8m0 (larger values have no fp32 power-of-two "
            f"ceiling), got {x[at].item()} at {at}"
        )
    return (biased << _MANTISSA_BITS).view(torch.float32)


def ue8m0_bytes(scale: Tensor) -> Tensor:
    """fp32 power-of-two scales -> uint8 biased exponents (bits >> 23), the UE8M0 byte.

    scale: fp32, any shape. Returns uint8 of the same shape.
    Accepts exactly what DeepGEMM's pack kernels accept (their device assert
    `(bits & 0x807FFFFF) == 0`): +0.0 (byte 0), normal powers of two 2^-126..2^127 (bytes
    1..254) and +Inf (byte 255). Anything else (3.0, subnormals, negatives, -0.0, NaN) raises,
    where the kernel would trap.
    """
    require_tensor("scale", scale, (torch.float32,), 0)
    bits = _f32_bits(scale)
    bad = (bits < 0) | ((bits & _MANTISSA_MASK) != 0)  # sign bit or mantissa bits set
    if bool(bad.any()):
        at = first_index(bad)
        raise ValueError(
            f"scale must hold exact non-negative powers of two (DeepGEMM asserts "
            f"(bits & 0x807FFFFF) == 0 before packing UE8M0): {int(bad.sum())} values are not, "
            f"first {scale[at].item()!r} at {at}"
        )
    return (bits >> _MANTISSA_BITS).to(torch.uint8)


def e8m0_to_fp32(b: Tensor) -> Tensor:
    """E8M0 bytes -> fp32 as the tensor core reads them: 2^(b - 127).

    b: uint8 (or float8_e8m0fnu), any shape. Returns fp32 of the same shape.
    Byte 0x00 is 2^-127 (an fp32 subnormal, NOT 0.0 as vLLM's `_upcast_e8m0_to_fp32` gives) and
    0xFF is NaN (NOT +Inf): the kernel's view, so a dequantized reference matches the GEMM.
    """
    if isinstance(b, Tensor) and b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    require_tensor("b", b, (torch.uint8,), 0)
    value = _exp2_int(b.to(torch.int32) - _EXPONENT_BIAS)
    return torch.where(b == 0xFF, torch.full_like(value, math.nan), value)


# ---------------------------------------------------------------------------------------------
# e4m3 (float8_e4m3fn): max 448, no Inf, 0x7F/0xFF are NaN.
# ---------------------------------------------------------------------------------------------


def cast_to_fp8(x: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn: clamp to [-448, 448], then round to nearest, ties to even.

    x: fp32, any shape. Returns float8_e4m3fn of the same shape.
    The clamp is explicit (the kernels' satfinite): +-Inf and anything beyond +-448 become +-448,
    whatever the torch build does on overflow (torch 2.13 CPU saturates, torch 2.11 CUDA gives NaN
    from 480 up). NaN stays NaN (an e4m3 NaN code, 0x7F or 0xFF);
    the quantizers below reject non-finite data before it gets here.
    """
    require_tensor("x", x, (torch.float32,), 0)
    # In range, torch's conversion is IEEE round-to-nearest-even (checked code by code in tests).
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


# ---------------------------------------------------------------------------------------------
# FP8 with fp32 scales: 1 x group activation groups and bm x bk weight blocks.
# ---------------------------------------------------------------------------------------------


def _group_view(x: Tensor, group: int) -> Tensor:
    """[..., K] -> [..., K/group, group] (K a multiple of group)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def group_scales_by_division(amax: Tensor, scale_fmt: ScaleFmt) -> Tensor:
    """Group scales as vLLM's CUDA `per_token_group_quant_fp8` computes them (csrc
    per_token_group_quant.cu `ComputeGroupScale` and its register and packed variants).

    amax: fp32 [...], each group's max |x| already floored at eps. Returns fp32 [...]:
        s = amax / 448, a true division;
        ue8m0 formats: s = ceil_ue8m0(max(s, 1e-10)), the floor on the SCALE (so a zero group
        gets 2^-33, byte 94), rounded up on the bits (exponent + (mantissa != 0)).
    """
    scale_fmt = require_scale_fmt(scale_fmt)
    scale = _divide(amax, FP8_MAX)
    if scale_fmt.is_ue8m0:
        scale = ceil_ue8m0(scale.clamp(min=SCALE_FLOOR))
    return scale


def ceil_pow2_via_log2(s: Tensor) -> Tensor:
    """2^ceil(log2(s)) as a Triton kernel evaluates it, `exp2(ceil(log2(s)))` in fp32 arithmetic.

    s: fp32 [...], positive, finite, <= 2^127. Returns fp32 powers of two of the same shape.
    log2 is rounded to fp32 before the ceiling, so for s a few ulps above a power of two 2^k
    (|k| >= 2) it rounds down to k exactly and the result is 2^k < s, where `ceil_ue8m0` gives
    2^(k+1). Everywhere else the two agree. amax * fp32(1/448) never lands in that window when
    amax is a bf16 or fp16 number (it is a power of two exactly or >= 2^-11 away from one; the
    tests check every bf16 amax), so on bf16 data this is `ceil_ue8m0` bit for bit.
    log2 is taken in float64 and rounded once to fp32: that is the correctly rounded fp32 log2
    wherever the ceiling depends on it (log2(1 + j 2^-23) in float64 is far from the fp32 half-ulp
    thresholds). A faithful but not correctly rounded log2 (the GPU's lg2.approx) may differ in
    that window on fp32 data (docs/tolerance.md#quant_input-recipes).
    """
    require_tensor("s", s, (torch.float32,), 0)
    bad = ~torch.isfinite(s) | (s <= 0) | (s > 2.0**127)
    if bool(bad.any()):
        at = first_index(bad)
        raise ValueError(f"s must be positive, finite and <= 2^127, got {s[at].item()} at {at}")
    exponent = torch.log2(s.double()).float().ceil()
    return _exp2_int(exponent)


def group_scales_by_reciprocal(amax: Tensor, scale_fmt: ScaleFmt) -> Tensor:
    """Group scales as vLLM's Triton `_per_token_group_quant_fp8` computes them (fp8_utils.py,
    vLLM 0.32; the fallback for non-contiguous input, and what the CPU interpreter runs).

    amax: fp32 [...], each group's max |x| already floored at eps. Returns fp32 [...]:
        s = amax * fp32(1/448), a multiply by the rounded reciprocal (one fp32 ulp from the
        division in many groups);
        ue8m0 formats: s = ceil_pow2_via_log2(s), with NO floor on the scale (a zero group gets
        2^ceil(log2(1e-10 * (1/448))) = 2^-42, byte 85).
    """
    scale_fmt = require_scale_fmt(scale_fmt)
    scale = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=amax.device)
    if scale_fmt.is_ue8m0:
        scale = ceil_pow2_via_log2(scale)
    return scale


_GROUP_SCALES = {
    InputQuantRecipe.CUDA_DIVISION: group_scales_by_division,
    InputQuantRecipe.TRITON_RECIPROCAL: group_scales_by_reciprocal,
}

# LMDeploy's quantizer floors amax at 1e-6, in fp32 (Triton promotes the bf16 amax to the fp32
# constant in tl.maximum); SGLang's JIT CUDA quantizer at 1e-10f. The recorded quotient tables
# hold an entry for each.
AMAX_RECIPROCAL_FLOOR, FAST_RECIPROCAL_FLOOR = FLOORS

# The quantizers whose codes are x * (448 / amax): amax's floor, and where the quotient comes
# from (None: the IEEE quotient; else the table of reference/hardware/quotient_table.py).
_AMAX_RECIPROCALS: dict[InputQuantRecipe, tuple[float, str | None]] = {
    InputQuantRecipe.AMAX_RECIPROCAL: (AMAX_RECIPROCAL_FLOOR, None),
    InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON: (AMAX_RECIPROCAL_FLOOR, "quotient_448_triton"),
    InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA: (
        FAST_RECIPROCAL_FLOOR,
        "quotient_448_cuda_fast_math",
    ),
}


# The recipes that read a recorded quotient: it exists for bf16 amax values (and the floors) only.
TABLE_QUOTIENT_RECIPES = frozenset(r for r, (_, table) in _AMAX_RECIPROCALS.items() if table)


def quantize_groups_by_amax_reciprocal(
    groups: Tensor,
    scale_fmt: ScaleFmt,
    recipe: InputQuantRecipe = InputQuantRecipe.AMAX_RECIPROCAL,
) -> tuple[Tensor, Tensor]:
    """The quantizers that multiply by 448 / amax: LMDeploy 0.18's `_quant_fp8_kernel`
    (pytorch/kernels/cuda/blocked_gemm_fp8.py) and SGLang 0.5.23's JIT CUDA per_token_group_quant
    (jit/csrc/gemm/per_token_group_quant.cuh, fp32 scales).

    groups: fp32 [..., G, group] (the input's values, bf16 numbers for the sm90 recipes). Per
    group:
        amax = max(max|x|, floor), floor fp32(1e-6) (LMDeploy) or fp32(1e-10) (SGLang);
        float32: s = amax * fp32(1/448); q = cast_to_fp8(x * r), r the quotient 448 / amax: the
            correctly rounded one ("amax_reciprocal", what the Triton interpreter computes), or
            as an H200 computes it, read from the recorded tables
            (reference/hardware/quotient_table.py): Triton's div.full.f32
            ("amax_reciprocal_sm90_triton") or nvcc --use_fast_math's ("fast_reciprocal_sm90_cuda").
            A multiply by r, not a division by s: one e4m3 code apart where x / s is near a
            rounding boundary, and the approximate r one more;
        ue8m0 formats (LMDeploy's): s = ceil_ue8m0(amax * fp32(1/448)) (its exponent-bit
            ceiling), and q = cast_to_fp8(x * (1 / s)), exact since s is a power of two (the
            approximate division of a power of two is exact too).
    Returns (q fp8 [..., G, group], s fp32 [..., G]).
    """
    scale_fmt = require_scale_fmt(scale_fmt)
    recipe = check_enum("recipe", recipe, InputQuantRecipe)
    if recipe not in _AMAX_RECIPROCALS:
        raise ValueError(f"{recipe.value!r} is not a 448 / amax quantizer")
    if recipe is InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA and scale_fmt.is_ue8m0:
        raise ValueError(
            "'fast_reciprocal_sm90_cuda' writes fp32 scales: SGLang's UE8M0 flavour runs another "
            "kernel (per_token_group_quant_8bit_v2), not modelled"
        )
    floor, table = _AMAX_RECIPROCALS[recipe]
    floor32 = torch.tensor(floor, dtype=torch.float32).item()
    amax = groups.abs().amax(dim=-1).clamp(min=floor32)
    scale = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=amax.device)
    if scale_fmt.is_ue8m0:
        scale = ceil_ue8m0(scale)
        rscale = 1.0 / scale
    elif table is None:
        rscale = torch.full_like(amax, FP8_MAX) / amax
    else:
        rscale = table_value(table, amax)
    return cast_to_fp8(groups * rscale.unsqueeze(-1)), scale


def quantize_fp8_groups(
    x: Tensor,
    group: int = 128,
    scale_fmt: ScaleFmt = ScaleFmt.FLOAT32,
    eps: float = 1e-10,
    recipe: InputQuantRecipe = InputQuantRecipe.CUDA_DIVISION,
) -> tuple[Tensor, Tensor]:
    """Per-token-group FP8 quantization, by one of vLLM's two quantizers (fp8_utils.py) or
    LMDeploy's (`quantize_groups_by_amax_reciprocal`, which has its own amax floor: eps is
    vLLM's).

    x: bf16/fp16/fp32 [..., M, K], K a multiple of `group`, finite.
    Per group of `group` K elements, in fp32:
        amax = max(eps, max|x|); s = the recipe's scale of amax (`group_scales_by_division` for
        "cuda_division", `group_scales_by_reciprocal` for "triton_reciprocal");
        q = cast_to_fp8(x / s), a true division in both recipes.
    Returns (q fp8 [..., M, K], s fp32 [..., M, K/group] row-major). UE8M0_PACKED returns the
    same fp32 powers of two as FLOAT32_CEIL_UE8M0: packing is a layout step (`pack_ue8m0`).
    The recipes differ by one fp32 ulp in many float32 scales (and so by one e4m3 code where
    x / s is a tie), and on ue8m0 scales only in groups with amax <= 448 * 2^-34 (about 2.6e-8:
    the floor sits on the scale in one, on amax in the other); docs/tolerance.md has the details
    (#quant_input-recipes).
    """
    require_tensor("x", x, _FLOATS, 1)
    group = require_positive_int("group", group)
    scale_fmt = require_scale_fmt(scale_fmt)
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and 0 < eps < math.inf):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    recipe = check_enum("recipe", recipe, InputQuantRecipe)
    require_multiple("x", x, group)
    require_finite("x", x)
    xg = _group_view(x.float(), group)
    if recipe in _AMAX_RECIPROCALS:
        q, scale = quantize_groups_by_amax_reciprocal(xg, scale_fmt, recipe)
        return q.reshape(x.shape), scale
    amax = xg.abs().amax(dim=-1).clamp(min=eps)
    scale = _GROUP_SCALES[recipe](amax, scale_fmt)
    q = cast_to_fp8(xg / scale.unsqueeze(-1))
    return q.reshape(x.shape), scale


def dequantize_fp8_groups(q: Tensor, scale: Tensor, group: int = 128) -> Tensor:
    """fp32 values of per-group FP8: q * scale of its group.

    q: fp8 [..., M, K]; scale: fp32 [..., M, K/group] (any strides). Returns fp32 [..., M, K].
    """
    require_tensor("q", q, (FP8,), 1)
    require_tensor("scale", scale, (torch.float32,), 1)
    group = require_positive_int("group", group)
    require_multiple("q", q, group)
    require_shape("scale", scale, (*q.shape[:-1], q.shape[-1] // group), "one per group of q")
    require_scale_values("scale", scale)
    return (_group_view(q.float(), group) * scale.unsqueeze(-1)).reshape(q.shape)


# DeepGEMM's weight block edge: a smaller tensor is padded to one such block.
DEEPGEMM_BLOCK = 128


def _require_block(block: object, name: str, t: Tensor) -> tuple[int, int]:
    """A (rows, cols) pair of positive ints that fits `t` [..., N, K] (named `name`): a block may
    exceed the tensor only up to DEEPGEMM_BLOCK, the one edge block it pads to; a larger one
    would only pad (block=(2**20, 128) asked the allocator for 17 GB)."""
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"block must be a (rows, cols) pair, got {block!r}")
    sizes = (
        require_positive_int("block[0]", block[0]),
        require_positive_int("block[1]", block[1]),
    )
    n, k = t.shape[-2:]
    for i, size, dim, axis in ((0, sizes[0], n, "N"), (1, sizes[1], k, "K")):
        if size > max(dim, DEEPGEMM_BLOCK):
            raise ValueError(
                f"block[{i}]={size} is larger than {axis}={dim} ({name} {tuple(t.shape)}); a "
                f"block may exceed the tensor only up to {DEEPGEMM_BLOCK}, DeepGEMM's"
            )
    return sizes


def quantize_fp8_blocks(
    w: Tensor, block: tuple[int, int] = (128, 128), use_ue8m0: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-block FP8 weight quantization, DeepGEMM's `per_block_cast_to_fp8` semantics.

    w: bf16/fp16/fp32 [..., N, K] (leading dims: experts), finite. Partial edge blocks are
    zero-padded, so their amax covers the real elements only. Per bm x bk block, in fp32:
        amax = max(max|w|, 1e-4); sf = amax / 448; sf = ceil_ue8m0(sf) if use_ue8m0;
        q = cast_to_fp8(w / sf).
    (DeepGEMM multiplies by 1/sf; that is identical when sf is a power of two.)
    Returns (q fp8 [..., N, K], sf fp32 [..., ceil(N/bm), ceil(K/bk)]).
    """
    require_tensor("w", w, _FLOATS, 2)
    bm, bk = _require_block(block, "w", w)
    require_bool("use_ue8m0", use_ue8m0)
    require_finite("w", w)
    *lead, n, k = w.shape
    nb, kb = ceil_div(n, bm), ceil_div(k, bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bm - n))
    blocks = padded.reshape(*lead, nb, bm, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=BLOCK_AMAX_FLOOR)
    sf = _divide(amax, FP8_MAX)
    if use_ue8m0:
        sf = ceil_ue8m0(sf)
    scaled = (blocks / sf[..., :, None, :, None]).reshape(*lead, nb * bm, kb * bk)
    return cast_to_fp8(scaled[..., :n, :k]), sf


def _expand_block_scale(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """[..., nb, kb] -> [..., n, k]: every element gets its block's scale."""
    bm, bk = block
    return scale.repeat_interleave(bm, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequantize_fp8_blocks(q: Tensor, scale: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """fp32 values of block-scaled FP8: q * scale of its block.

    q: fp8 [..., N, K]; scale: fp32 [..., ceil(N/bm), ceil(K/bk)]. Returns fp32 [..., N, K].
    """
    require_tensor("q", q, (FP8,), 2)
    require_tensor("scale", scale, (torch.float32,), 2)
    bm, bk = _require_block(block, "q", q)
    *lead, n, k = q.shape
    require_shape(
        "scale", scale, (*lead, ceil_div(n, bm), ceil_div(k, bk)), f"one per {bm}x{bk} block"
    )
    require_scale_values("scale", scale)
    return q.float() * _expand_block_scale(scale, (bm, bk), n, k)


def requantize_blocks_ue8m0(
    q: Tensor, scale: Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[Tensor, Tensor]:
    """vLLM's `requant_weight_ue8m0_inplace` (fp8_utils.py), out of place: fp32 scales -> powers
    of two.

    q: fp8 [..., N, K]; scale: fp32 [..., ceil(N/bm), ceil(K/bk)].
    Dequantize to fp32, then quantize_fp8_blocks(use_ue8m0=True). This is a lossy double
    quantization whenever a scale was not a power of two; with power-of-two scales and blocks
    whose largest code magnitude is above 224 (any block a ceil-UE8M0 quantizer produced) it
    returns the input bitwise. Returns (q' fp8 [..., N, K], sf' fp32 powers of two).
    """
    require_tensor("q", q, (FP8,), 2)
    require_finite("q", q.float())  # NaN codes (0x7F, 0xFF) would otherwise surface as "w"
    return quantize_fp8_blocks(dequantize_fp8_blocks(q, scale, block), block, use_ue8m0=True)


# ---------------------------------------------------------------------------------------------
# MXFP8: e4m3 with one E8M0 byte per 32 elements.
# ---------------------------------------------------------------------------------------------


# The OCP MX formats scale one E8M0 byte per 32 elements: the group is the format's, not a knob.
MX_GROUP = 32


def _require_mx_group(group: object) -> int:
    group = require_positive_int("group", group)
    if group != MX_GROUP:
        raise ValueError(
            f"group: the MX formats scale one E8M0 byte per {MX_GROUP} elements (OCP MX), got "
            f"{group}"
        )
    return group


def quantize_mxfp8(x: Tensor, group: int = 32) -> tuple[Tensor, Tensor]:
    """MXFP8 quantization, the FlashInfer / TRT-LLM `cvt_warp_fp16_to_mxfp8` recipe.

    x: bf16/fp16/fp32 [..., M, K] (activations, or weights [E, N, K]), K a multiple of group.
    Per group, in fp32:
        SF = amax * fp32(1/448)  (a reciprocal multiply, as the kernel);
        byte = ceil(log2(SF)) + 127 saturated to [0, 254]  (E8M0 rounded toward +Inf; exact,
               also for subnormal SF); amax == 0 -> byte 0;
        q = cast_to_fp8(x * 2^(127 - byte)).
    Not vLLM's old torch fallback (floor(log2 amax), no e4m3 emax offset): a different quantizer.
    Returns (q fp8 [..., M, K], E8M0 bytes uint8 [..., M, K/group]).
    """
    require_tensor("x", x, _FLOATS, 1)
    group = _require_mx_group(group)
    require_multiple("x", x, group)
    require_finite("x", x)
    xg = _group_view(x.float(), group)
    amax = xg.abs().amax(dim=-1)
    sf = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=x.device)
    # ceil_log2 needs a positive argument; zero groups are overwritten with byte 0 below.
    exponent = _ceil_log2(torch.where(amax > 0, sf, torch.ones_like(sf)))
    byte = (exponent + _EXPONENT_BIAS).clamp(0, 254)
    byte = torch.where(amax > 0, byte, torch.zeros_like(byte))
    inv_scale = _exp2_int(_EXPONENT_BIAS - byte)
    q = cast_to_fp8(xg * inv_scale.unsqueeze(-1))
    return q.reshape(x.shape), byte.to(torch.uint8)


def dequantize_mxfp8(q: Tensor, scale_bytes: Tensor, group: int = 32) -> Tensor:
    """fp32 values of MXFP8: q * 2^(byte - 127).

    q: fp8 [..., M, K]; scale_bytes: uint8 [..., M, K/group], never 0xFF. Returns fp32.
    """
    require_tensor("q", q, (FP8,), 1)
    require_tensor("scale_bytes", scale_bytes, (torch.uint8,), 1)
    group = _require_mx_group(group)
    require_multiple("q", q, group)
    require_shape(
        "scale_bytes", scale_bytes, (*q.shape[:-1], q.shape[-1] // group), "one per group of q"
    )
    require_no_e8m0_nan("scale_bytes", scale_bytes)
    scale = e8m0_to_fp32(scale_bytes)
    return (_group_view(q.float(), group) * scale.unsqueeze(-1)).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# MXFP4 weights: E2M1 codes, two per byte, one E8M0 byte per 32 elements.
# ---------------------------------------------------------------------------------------------


def quantize_mxfp4(w: Tensor, group: int = 32) -> tuple[Tensor, Tensor]:
    """MXFP4 weight quantization, DeepGEMM's `per_token_cast_to_fp4` with UE8M0 scales.

    w: bf16/fp16/fp32 [..., N, K], K a multiple of group (and so even), finite.
    Per group: sf = ceil_ue8m0(max(amax, 1e-4) / 6) with its exponent byte clamped to [1, 254];
    v = w / sf (exact: sf is a power of two); magnitude index = how many of the thresholds
    {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0} |v| strictly exceeds (ties go to the smaller
    magnitude; beyond 6 saturates); sign bit 3 only when v < 0 and the index is nonzero (no -0).
    Codes 2i and 2i+1 of a row share byte i: element 2i in the LOW nibble.
    Returns (packed uint8 [..., N, K/2], E8M0 bytes uint8 [..., N, K/group]).
    """
    require_tensor("w", w, _FLOATS, 1)
    group = _require_mx_group(group)  # 32: even, two E2M1 codes per byte
    require_multiple("w", w, group)
    require_finite("w", w)
    wg = _group_view(w.float(), group)
    amax = wg.abs().amax(dim=-1).clamp(min=BLOCK_AMAX_FLOOR)
    # amax >= 1e-4 keeps sf >= 2^-16 and amax <= fp32 max keeps it <= 2^126: the [1, 254] clamp
    # of DeepGEMM's helper never binds here, so ceil_ue8m0 is that helper exactly.
    sf = ceil_ue8m0(_divide(amax, E2M1_MAX))
    v = wg / sf.unsqueeze(-1)
    thresholds = torch.tensor(_E2M1_THRESHOLDS, dtype=torch.float32, device=w.device)
    # bucketize(right=False) counts the thresholds strictly below |v|.
    magnitude = torch.bucketize(v.abs(), thresholds, right=False).to(torch.uint8)
    sign = ((v < 0) & (magnitude > 0)).to(torch.uint8) << 3
    codes = (sign | magnitude).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, ue8m0_bytes(sf)


def unpack_e2m1_codes(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]: low nibble is element 2i, high nibble 2i+1."""
    require_tensor("packed", packed, (torch.uint8,), 1)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(
        *packed.shape[:-1], 2 * packed.shape[-1]
    )


def dequantize_mxfp4(packed: Tensor, scale_bytes: Tensor, group: int = 32) -> Tensor:
    """fp32 values of MXFP4: E2M1_VALUES[code] * 2^(byte - 127).

    packed: uint8 [..., N, K/2]; scale_bytes: uint8 [..., N, K/group], never 0xFF.
    Returns fp32 [..., N, K]. Code 8 decodes to -0.0 (DeepGEMM's quantizer never emits it).
    """
    require_tensor("packed", packed, (torch.uint8,), 1)
    require_tensor("scale_bytes", scale_bytes, (torch.uint8,), 1)
    group = _require_mx_group(group)
    codes = unpack_e2m1_codes(packed)
    require_multiple("packed (unpacked to K codes)", codes, group)
    require_shape(
        "scale_bytes",
        scale_bytes,
        (*codes.shape[:-1], codes.shape[-1] // group),
        "one per group of the unpacked codes",
    )
    require_no_e8m0_nan("scale_bytes", scale_bytes)
    values = E2M1_VALUES.to(packed.device)[codes.long()]
    scale = e8m0_to_fp32(scale_bytes)
    return (_group_view(values, group) * scale.unsqueeze(-1)).reshape(codes.shape)


# ---------------------------------------------------------------------------------------------
# Packed UE8M0: DeepGEMM's SM100 scale layout (`get_mn_major_tma_aligned_packed_ue8m0_tensor`).
# ---------------------------------------------------------------------------------------------

# Byte j of a word is its j-th least significant byte (little-endian, K-group 4p + j).
_BYTE_WEIGHTS = (1, 1 << 8, 1 << 16, 1 << 24)


def pack_ue8m0(exponents: Tensor) -> Tensor:
    """UE8M0 bytes -> int32 words, four K-groups per word, MN-major and TMA-aligned.

    exponents: uint8 [..., MN, G], any strides. Returns int32 [..., MN, P], P = ceil(G/4), as a
    strided view: strides (..., P * tma, 1, tma) with tma = round_up(MN, 4), i.e. each word column
    is MN consecutive int32s padded to 16 bytes, batches dense after each other.
    Word p of row i = sum_j byte(i, 4p + j) << 8j. Bytes of groups >= G are 0; the TMA padding
    rows MN..tma-1 (in storage, outside the view) are 0. The kernels leave those pad rows
    unwritten and differ on the pad bytes (see `act_quant`), so compare views, not storage.
    """
    require_tensor("exponents", exponents, (torch.uint8,), 2)
    *lead, mn, g = exponents.shape
    if g < 1:
        raise ValueError(
            f"exponents must have at least one group (G >= 1), got shape {(*lead, mn, g)}"
        )
    p, tma = ceil_div(g, 4), round_up(mn, 4)
    batch = math.prod(lead)
    padded = torch.zeros((batch, tma, 4 * p), dtype=torch.int64, device=exponents.device)
    padded[:, :mn, :g] = exponents.reshape(batch, mn, g)
    weights = torch.tensor(_BYTE_WEIGHTS, dtype=torch.int64, device=exponents.device)
    words = (padded.reshape(batch, tma, p, 4) * weights).sum(dim=-1)
    # Words with a top byte >= 0x80 are negative int32s: two's complement, made explicit.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    storage = words.transpose(1, 2).contiguous()  # [batch, P, tma]: MN runs fastest
    lead_strides: list[int] = []
    stride = p * tma
    for size in reversed(lead):
        lead_strides.insert(0, stride)
        stride *= size
    return storage.as_strided((*lead, mn, p), (*lead_strides, 1, tma))


def unpack_ue8m0(packed: Tensor, num_groups: int) -> Tensor:
    """Inverse of `pack_ue8m0`: int32 [..., MN, P] (any strides) -> uint8 [..., MN, G].

    num_groups: G, with P == ceil(G/4). Pad bytes (groups >= G) are dropped unchecked, since
    implementations legitimately differ there (0 or 94).
    """
    require_tensor("packed", packed, (torch.int32,), 2)
    g = require_positive_int("num_groups", num_groups)
    p = packed.shape[-1]
    if p != ceil_div(g, 4):
        raise ValueError(
            f"packed has P={p} words per row, which holds ceil(G/4) words for G in "
            f"[{4 * p - 3}, {4 * p}]; num_groups={g} needs P={ceil_div(g, 4)}"
        )
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor((0, 8, 16, 24), dtype=torch.int64, device=packed.device)
    groups = (words.unsqueeze(-1) >> shifts) & 0xFF  # [..., MN, P, 4], byte j = group 4p + j
    return groups.reshape(*packed.shape[:-1], 4 * p)[..., :g].to(torch.uint8)
