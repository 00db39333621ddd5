"""The act_quant stage: gated activation (SwiGLU + clamp) on GEMM1's output, then FP8 requant.

vLLM runs one of three kernels here, and they round differently, so the golden models each
exactly (`ActQuantRecipe`; vLLM 0.32's fp8_utils.py, and csrc activation_kernels.cu), and
LMDeploy a fourth ("colmajor_amax_reciprocal", below), and TensorRT-LLM's DeepGEMM MoE a fifth
("colmajor_ceil_packed", below: the colmajor activation, ceil-UE8M0 scales packed four per int32):
- "packed" (`silu_mul_quant_fp8_packed_triton`, UE8M0_PACKED): clamp and activation in fp32,
  ONE bf16 rounding of the product; scale exponent from amax / 448 floored at 1e-10; int32 packed.
- "colmajor" (`silu_mul_per_token_group_quant_fp8_colmajor`, FLOAT32 and
  FLOAT32_CEIL_UE8M0): mimics C++ silu_and_mul: bf16 after the clamp, after the activation,
  after up + beta and after the product; scale = max(amax, 1e-10) * (1/448), optionally ceiled.
- "bf16_steps" (`persistent_masked_m_silu_mul_quant`, the CUDA kernel of the batched low-latency
  path, as vLLM's tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py pins it; plain silu,
  every format): the colmajor activation, then the scale, its log2 ceiling, its reciprocal and
  y * (1/s) each rounded to bf16.
The Triton kernels use the approximate `tl.exp`, the CUDA one `expf` and `__fdividef`; the golden
uses torch.exp and an IEEE division (a documented 1-ulp source of difference before the bf16
rounding of the activation). The Triton kernels' gate as the H200 computes it is recorded for
every bf16 input (reference/hardware/gate_table.py), so each Triton rounding has a twin recipe,
"packed_sm90_triton" / "colmajor_sm90_triton": the same IEEE steps around a gate read from that
table (`sm90_triton_recipe`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_verify.spec import FP8_MAX, Activation, ActQuantRecipe, InputQuantRecipe, ScaleFmt
from reference.formats import (
    SCALE_FLOOR,
    _divide,
    _exp2_int,
    cast_to_fp8,
    ceil_ue8m0,
    pack_ue8m0,
    quantize_groups_by_amax_reciprocal,
    ue8m0_bytes,
)
from reference.hardware.gate_table import gate_from_table, gate_table, tabulated_alphas
from reference.hardware.quotient_table import bf16_entries
from reference.validate import (
    require_finite,
    require_positive_int,
    require_scale_fmt,
    require_tensor,
)

__all__ = [
    "ROUNDINGS",
    "ZERO_GROUP_PAD_BYTE",
    "act_quant",
    "fused_act_quant_recipe",
    "quantize_groups_bf16_steps",
    "quantize_groups_colmajor",
    "quantize_groups_colmajor_packed",
    "quantize_groups_packed",
    "sglang_sm90_cuda_recipe",
    "sm90_triton_recipe",
    "swiglu",
]

ROUNDINGS = ("packed", "colmajor")

# The packed kernel computes the slots past the last group of a row's final int32 word from zeros,
# so they get the zero-group exponent ceil(log2(1e-10)) = -33, byte 94. The golden writes
# 94 there too. Other producers write 0 (vLLM's CUDA packer, DeepGEMM's packer): pad bytes are a
# documented difference between implementations and must be compared as such, never bitwise.
ZERO_GROUP_PAD_BYTE = 94
# The colmajor kernel's eps: a floor on amax (not on the scale, unlike the packed kernel).
AMAX_EPS = 1e-10


def _bf16(x: Tensor) -> Tensor:
    """Round fp32 to the nearest bf16 (ties to even), kept as fp32."""
    return x.to(torch.bfloat16).float()


def _f32(value: float, like: Tensor) -> Tensor:
    """A kernel's fp32 scalar argument (alpha, beta, the clamp limit)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _check_mm1(mm1: Tensor, activation: Activation) -> None:
    require_tensor("mm1", mm1, (torch.bfloat16,), 2)
    if not isinstance(activation, Activation):
        raise ValueError(
            f"activation must be a moe_verify.spec.Activation, got {type(activation).__name__}"
        )
    if mm1.shape[-1] % 2:
        raise ValueError(
            f"mm1 must hold [gate | up] halves: last dim 2I must be even, got {mm1.shape[-1]}"
        )
    require_finite("mm1", mm1)


def swiglu(
    mm1: Tensor, activation: Activation, rounding: str, table: Tensor | None = None
) -> Tensor:
    """Gated activation y = (up + beta) * gate * sigmoid(alpha * gate), with the kernel's rounding.

    mm1: bf16 [..., M, 2I], gate = columns [0, I), up = columns [I, 2I) (contiguous halves).
    With activation.limit L: gate = min(gate, L) (from above only), up = clamp(up, -L, L).
    rounding "packed": clamp in fp32, no re-round; glu = g / (1 + exp(-g * alpha));
        y = (u + beta) * glu in fp32; one bf16 rounding.
    rounding "colmajor": g, u re-rounded to bf16 after the clamp (matters when L is not
        bf16-representable); glu = bf16(g / (1 + exp(-g * alpha))); up = bf16(u + beta);
        y = bf16(glu * up).
    table: fp32 [65536], the gate of every bf16 input at this alpha
        (reference/hardware/gate_table.py); when given, glu is read from it instead of computed (the
        clamped gate must then be a bf16 value: always under "colmajor", under "packed" when L is
        one). Every other step is the same IEEE arithmetic.
    silu is alpha = 1, beta = 0. Returns fp32 [..., M, I] whose values are all bf16 numbers.
    """
    _check_mm1(mm1, activation)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    gate, up = mm1.float().chunk(2, dim=-1)
    alpha, beta = _f32(activation.alpha, mm1), _f32(activation.beta, mm1)

    def glu_of(g: Tensor) -> Tensor:
        return gate_from_table(g, table) if table is not None else g / (1 + torch.exp(-g * alpha))

    if activation.limit is not None:
        limit = _f32(activation.limit, mm1)
        gate = torch.minimum(gate, limit)
        up = up.clamp(-limit, limit)
    if rounding == "packed":
        return _bf16((up + beta) * glu_of(gate))
    gate, up = _bf16(gate), _bf16(up)
    glu = _bf16(glu_of(gate))
    # A product of two bf16 numbers is exact in fp32, so this is the one rounding of the product.
    return _bf16(glu * _bf16(up + beta))


def fused_act_quant_recipe(scale_fmt: ScaleFmt) -> ActQuantRecipe:
    """The fused Triton kernel vLLM's `DeepGemmExperts._act_mul_quant` runs for `scale_fmt`:
    "packed" for UE8M0_PACKED, "colmajor" for FLOAT32 and FLOAT32_CEIL_UE8M0."""
    packed = require_scale_fmt(scale_fmt) is ScaleFmt.UE8M0_PACKED
    return ActQuantRecipe.PACKED if packed else ActQuantRecipe.COLMAJOR


# Each Triton kernel's twin with the H200's gate, and the rounding path both share.
_SM90_TRITON = {
    ActQuantRecipe.PACKED: ActQuantRecipe.PACKED_SM90_TRITON,
    ActQuantRecipe.COLMAJOR: ActQuantRecipe.COLMAJOR_SM90_TRITON,
    ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL: ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON,
}
_ROUNDING = {
    ActQuantRecipe.PACKED: "packed",
    ActQuantRecipe.PACKED_SM90_TRITON: "packed",
    ActQuantRecipe.COLMAJOR: "colmajor",
    ActQuantRecipe.COLMAJOR_SM90_TRITON: "colmajor",
    ActQuantRecipe.BF16_STEPS: "colmajor",  # bf16(bf16(silu(g)) * u) for plain silu
    ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL: "colmajor",  # LMDeploy's silu_and_mul: the same
    ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON: "colmajor",
    ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA: "packed",  # SGLang's silu_and_mul
    ActQuantRecipe.COLMAJOR_CEIL_PACKED: "colmajor",  # TensorRT-LLM: bf16(bf16(silu(g)) * u)
}
# The recipes whose activation rounding is not their quantizer's: they quantize the bf16
# activations with an input quantizer (reference/formats.py `quantize_groups_by_amax_reciprocal`).
_AMAX_RECIPROCAL_QUANTIZER = {
    ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL: InputQuantRecipe.AMAX_RECIPROCAL,
    ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON: (
        InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON
    ),
    ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA: InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA,
}
# SGLang's silu as nvcc --use_fast_math compiles it on an H200
# (reference/hardware/quotient_table.py).
_SGLANG_SILU_TABLE = "silu_cuda_fast_math"


def sglang_sm90_cuda_recipe(activation: Activation, scale_fmt: ScaleFmt) -> ActQuantRecipe | None:
    """SGLang's act_quant on an H200 ("packed_fast_reciprocal_sm90_cuda") where the golden
    models it: fp32 scales, silu (alpha 1, beta 0; its DeepGEMM runner runs no other) with no
    clamp or a bf16 clamp limit (SGLang clamps at bf16(limit), the golden at the fp32 limit: the
    same where the limit is a bf16 value); else None."""
    if scale_fmt is not ScaleFmt.FLOAT32 or activation.kind != "silu":
        return None
    if (activation.alpha, activation.beta) != (1.0, 0.0):
        return None
    if activation.limit is not None and not _is_bf16(activation.limit):
        return None
    return ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA


def _is_bf16(value: float) -> bool:
    return float(torch.tensor(value, dtype=torch.float32).to(torch.bfloat16)) == value


def sm90_triton_recipe(fused: ActQuantRecipe, activation: Activation) -> ActQuantRecipe | None:
    """The twin of the Triton kernel `fused` (packed or colmajor) whose gate is read from the
    H200 table: "packed_sm90_triton" / "colmajor_sm90_triton". None, silently, where there is no
    such recipe: no table was recorded for activation.alpha (`tabulated_alphas`), or the packed
    kernel clamps the gate in fp32 at a limit that is not a bf16 value (the clamped gate then has
    no table entry), or `fused` is not a Triton kernel."""
    twin = _SM90_TRITON.get(ActQuantRecipe(fused))
    if twin is None or gate_table(activation.alpha) is None:
        return None
    if fused is ActQuantRecipe.PACKED and activation.limit is not None:
        return twin if _is_bf16(activation.limit) else None
    return twin


def _groups(y: Tensor, group: int) -> Tensor:
    return y.reshape(*y.shape[:-1], y.shape[-1] // group, group)


def quantize_groups_packed(y: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """The packed kernel's quantization: y fp32 [..., I] of bf16 values, per group
        s = ceil_ue8m0(max(amax / 448, 1e-10)) (a true division, the floor on the scale);
        q = cast_to_fp8(y / s); byte = exponent of s, packed four per int32 with pad bytes 94.
    Returns (q fp8 [..., I], int32 [..., P] from `pack_ue8m0`)."""
    groups = _groups(y, group)
    scale = ceil_ue8m0(_divide(groups.abs().amax(dim=-1), FP8_MAX).clamp(min=SCALE_FLOOR))
    q = cast_to_fp8(groups / scale.unsqueeze(-1)).reshape(y.shape)
    exponents = ue8m0_bytes(scale)
    pad = exponents.new_full((*exponents.shape[:-1], -exponents.shape[-1] % 4), ZERO_GROUP_PAD_BYTE)
    return q, pack_ue8m0(torch.cat((exponents, pad), dim=-1))


def quantize_groups_colmajor(y: Tensor, group: int, scale_fmt: ScaleFmt) -> tuple[Tensor, Tensor]:
    """The colmajor kernel's quantization: y fp32 [..., I] of bf16 values, per group
        s = max(amax, 1e-10) * fp32(1/448) (a reciprocal multiply, the floor on amax);
        FLOAT32_CEIL_UE8M0: s = 2^ceil(log2 s), `ceil_ue8m0` (the kernel's fp32 log2 gives the
        same bits for bf16 amax, see `ceil_pow2_via_log2`); q = cast_to_fp8(y / s).
    Returns (q fp8 [..., I], s fp32 [..., I/group])."""
    groups = _groups(y, group)
    scale = groups.abs().amax(dim=-1).clamp(min=AMAX_EPS) * _f32(1.0 / FP8_MAX, y)
    if scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0:
        scale = ceil_ue8m0(scale)
    return cast_to_fp8(groups / scale.unsqueeze(-1)).reshape(y.shape), scale


def quantize_groups_colmajor_packed(y: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """TensorRT-LLM's quantization (`_silu_and_mul_post_quant_kernel` with SCALE_UE8M0, docs/
    tolerance.md#act_quant-recipes): y fp32 [..., I] of bf16 values, per group
        s = 2^ceil(log2(max(amax, 1e-10) / 448)); q = cast_to_fp8(y / s);
        byte = exponent of s, four groups per int32 word (byte j of word w is group 4w + j).
    The kernel divides amax by 448 where the colmajor kernel multiplies by fp32(1/448); for every
    bf16 amax both quotients have the same power-of-two ceiling (tests), so the scales are
    `quantize_groups_colmajor`'s FLOAT32_CEIL_UE8M0 ones. The kernel computes all four groups of
    a word, loading zeros past the row's end, so a partial last word's pad slots hold a zero
    group's byte, 85 (2^-42): y is padded with zero groups here likewise.
    Returns (q fp8 [..., I], int32 [..., P] from `pack_ue8m0`, P = ceil(I/group/4)).
    """
    width = y.shape[-1]
    missing = -(width // group) % 4  # groups of zeros that complete the last word
    padded = torch.cat((y, y.new_zeros((*y.shape[:-1], missing * group))), dim=-1)
    q, scale = quantize_groups_colmajor(padded, group, ScaleFmt.FLOAT32_CEIL_UE8M0)
    return q[..., :width].contiguous(), pack_ue8m0(ue8m0_bytes(scale))


def _log2_bf16(s: Tensor) -> Tensor:
    """bf16(log2(s)) for positive bf16 s (hlog2: an fp32 log2 rounded to bf16), as fp32.

    Taken in float64 and rounded through fp32 to bf16; for every positive bf16 s the result is
    decided with margin (tests), so the GPU's approximate lg2 rounds to the same bf16."""
    return _bf16(torch.log2(s.double()).float())


def quantize_groups_bf16_steps(y: Tensor, group: int, scale_fmt: ScaleFmt) -> tuple[Tensor, Tensor]:
    """The low-latency CUDA kernel's quantization, every step in bf16 (vLLM's
    tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py and activation_kernels.cu
    `silu_mul_fp8_quant_deep_gemm_kernel`).

    y: fp32 [..., I] of bf16 values. Per group, each operation rounded to bf16 (RNE):
        amax = max(max|y|, bf16(1e-10)); s = bf16(amax * bf16(1/448));
        ceil formats: s = 2^ceil(bf16(log2 s)), so s may come out BELOW amax / 448 (log2 of
        s = 2^k (1 + j/128) rounds to k for small j) and the top codes clip at 448;
        inv = bf16(1 / s); q = cast_to_fp8(bf16(y * inv)) (clip at +-448, then RNE to e4m3:
        a second rounding after the bf16 one).
    Returns (q fp8 [..., I], s fp32 [..., I/group] (the bf16 values) or, for UE8M0_PACKED,
    int32 [..., P] from `pack_ue8m0` with pad bytes 0 (the kernel zero-fills its scales)).
    """
    groups = _groups(y, group)
    amax = torch.maximum(groups.abs().amax(dim=-1), _bf16(_f32(AMAX_EPS, y)))
    scale = _bf16(amax * _bf16(_f32(1.0 / FP8_MAX, y)))
    if scale_fmt.is_ue8m0:
        scale = _exp2_int(_log2_bf16(scale).ceil())
    inv = _bf16(torch.ones_like(scale) / scale)
    q = cast_to_fp8(_bf16(groups * inv.unsqueeze(-1))).reshape(y.shape)
    if scale_fmt is ScaleFmt.UE8M0_PACKED:
        return q, pack_ue8m0(ue8m0_bytes(scale))
    return q, scale


def _check_colmajor_ceil_packed(activation: Activation, group: int, fmt: ScaleFmt) -> None:
    what = (
        "act_quant recipe 'colmajor_ceil_packed' (TensorRT-LLM's _silu_and_mul_post_quant_kernel)"
    )
    if fmt is not ScaleFmt.UE8M0_PACKED:
        raise ValueError(
            f"{what} writes packed UE8M0 scales: scale_fmt must be ue8m0_packed, got {fmt}"
        )
    if activation.kind != "silu" or activation.limit is not None:
        raise ValueError(
            f"{what} computes plain silu only: activation must be silu with no clamp, got "
            f"{activation.tag}"
        )
    if group != 128:
        raise ValueError(f"{what} packs 128-column groups: group must be 128, got {group}")


def _check_recipe(
    recipe: ActQuantRecipe, activation: Activation, group: int, fmt: ScaleFmt
) -> None:
    packed = fmt is ScaleFmt.UE8M0_PACKED
    rounding = _ROUNDING[recipe]
    if recipe is ActQuantRecipe.COLMAJOR_CEIL_PACKED:
        _check_colmajor_ceil_packed(activation, group, fmt)
        return
    if recipe is ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA:
        if sglang_sm90_cuda_recipe(activation, fmt) is None:
            raise ValueError(
                f"act_quant recipe {recipe.value!r} (SGLang's on an H200) is modelled for float32 "
                f"scales and silu with no clamp or a bf16 limit, got {fmt} and {activation.tag}"
            )
        return
    if recipe is not ActQuantRecipe.BF16_STEPS and rounding == "packed" and not packed:
        raise ValueError(f"act_quant recipe {recipe.value!r} writes packed UE8M0 scales, not {fmt}")
    if recipe is not ActQuantRecipe.BF16_STEPS and rounding == "colmajor" and packed:
        raise ValueError(f"act_quant recipe {recipe.value!r} writes fp32 scales, not ue8m0_packed")
    if recipe in _SM90_TRITON.values() and gate_table(activation.alpha) is None:
        raise ValueError(
            f"act_quant recipe {recipe.value!r} reads the H200 gate table, which has no table for "
            f"alpha={activation.alpha} (tables: alpha in {list(tabulated_alphas())})"
        )
    if recipe is ActQuantRecipe.PACKED_SM90_TRITON and activation.limit is not None:
        if not _is_bf16(activation.limit):
            raise ValueError(
                f"act_quant recipe 'packed_sm90_triton': the packed kernel clamps the gate in fp32 "
                f"at limit={activation.limit}, which is not a bf16 value, so the clamped gate has "
                "no entry in the bf16 gate table"
            )
    if recipe is ActQuantRecipe.BF16_STEPS and (activation.kind != "silu" or activation.limit):
        raise ValueError(
            f"act_quant recipe 'bf16_steps' (persistent_masked_m_silu_mul_quant) computes plain "
            f"silu only, got activation {activation.tag}"
        )
    if recipe is ActQuantRecipe.BF16_STEPS and group != 128:
        raise ValueError(f"act_quant recipe 'bf16_steps' has 128-column groups, got {group}")


def act_quant(
    mm1: Tensor,
    activation: Activation,
    group: int,
    scale_fmt: ScaleFmt,
    recipe: ActQuantRecipe | None = None,
) -> tuple[Tensor, Tensor]:
    """The act_quant stage: swiglu, then per-group FP8 quantization, as `recipe` computes them.

    mm1: bf16 [M, 2I] (leading batch dims allowed), I a multiple of group. recipe: one of
    ActQuantRecipe, by default the fused kernel for scale_fmt (`fused_act_quant_recipe`):
    "packed" (UE8M0_PACKED only): y = swiglu(rounding="packed"), `quantize_groups_packed`.
        Returns (a2q fp8 [M, I], int32 [M, P] from `pack_ue8m0`, P = ceil(I/group/4), strides
        (1, round_up(M, 4))). Pad slots of the last word hold byte 94 (ZERO_GROUP_PAD_BYTE) as
        that kernel writes; the TMA pad rows in storage are 0 (the kernel leaves them unwritten).
    "colmajor" (FLOAT32 / FLOAT32_CEIL_UE8M0): y = swiglu(rounding="colmajor"),
        `quantize_groups_colmajor`. Returns (a2q fp8 [M, I], fp32 [M, I/group] row-major; the
        kernel's column-major storage holds the same logical values).
    "colmajor_amax_reciprocal" (FLOAT32 / FLOAT32_CEIL_UE8M0; LMDeploy's silu_and_mul then its
        `_quant_fp8_kernel` on the bf16 result): y as colmajor's, then
        `quantize_groups_by_amax_reciprocal`. Scales as colmajor's, amax floored at 1e-6.
        "colmajor_amax_reciprocal_sm90_triton": the same compiled for an H200, the gate from
        the Triton gate table, 448 / amax from the recorded quotient
        ("amax_reciprocal_sm90_triton").
    "bf16_steps" (any format; plain silu, group 128): y = bf16(bf16(silu(g))
        * u), which is swiglu(rounding="colmajor") for plain silu, then
        `quantize_groups_bf16_steps`. Scales as colmajor's, or packed with pad bytes 0.
    "packed_fast_reciprocal_sm90_cuda" (FLOAT32; SGLang's silu_and_mul then its JIT CUDA
        quantizer, as an H200 computes them): y = swiglu(rounding="packed") with silu read from
        the recorded fast-math table (reference/hardware/quotient_table.py), then
        `quantize_groups_by_amax_reciprocal` ("fast_reciprocal_sm90_cuda": amax floored at 1e-10,
        scale amax * (1/448), codes y times the table's 448 / amax).
    "packed_sm90_triton" / "colmajor_sm90_triton": "packed" / "colmajor" with the gate read from
        the H200 Triton table of activation.alpha (`swiglu`'s table;
        reference/hardware/gate_table.py, `gate_table_provenance` names the GPU and versions); a
        ValueError where no table applies (`sm90_triton_recipe` says when one does).
    "colmajor_ceil_packed" (UE8M0_PACKED only; plain silu, group 128; TensorRT-LLM's
        silu_and_mul_masked_post_quant_fwd with scale_ue8m0=True): y = swiglu(rounding=
        "colmajor"), `quantize_groups_colmajor_packed`. Scales as packed's (strides included);
        the pad slots of the last word hold byte 85, a zero group's (the kernel's).
    Zero groups: byte 94 (2^-33) packed, byte 85 (2^-42) colmajor_ceil_packed; 1e-10/448
    float32 and 2^-42 (byte 85) ceil (colmajor); bf16_steps: bf16(bf16(1e-10) * bf16(1/448)),
    or 2^-42 for the ue8m0 formats.
    """
    _check_mm1(mm1, activation)
    group = require_positive_int("group", group)
    scale_fmt = require_scale_fmt(scale_fmt)
    recipe = fused_act_quant_recipe(scale_fmt) if recipe is None else ActQuantRecipe(recipe)
    _check_recipe(recipe, activation, group, scale_fmt)
    cols = mm1.shape[-1]
    if (cols // 2) % group:
        raise ValueError(
            f"mm1: I = {cols}/2 = {cols // 2} columns per half must be a multiple of "
            f"group={group} (shape {tuple(mm1.shape)})"
        )
    rounding = _ROUNDING[recipe]
    table = gate_table(activation.alpha) if recipe in _SM90_TRITON.values() else None
    if recipe is ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA:
        table = bf16_entries(_SGLANG_SILU_TABLE)
    y = swiglu(mm1, activation, rounding, table)
    if recipe is ActQuantRecipe.BF16_STEPS:
        return quantize_groups_bf16_steps(y, group, scale_fmt)
    if recipe is ActQuantRecipe.COLMAJOR_CEIL_PACKED:
        return quantize_groups_colmajor_packed(y, group)
    if recipe in _AMAX_RECIPROCAL_QUANTIZER:
        quantizer = _AMAX_RECIPROCAL_QUANTIZER[recipe]
        q, scale = quantize_groups_by_amax_reciprocal(_groups(y, group), scale_fmt, quantizer)
        return q.reshape(y.shape), scale
    if rounding == "packed":
        return quantize_groups_packed(y, group)
    return quantize_groups_colmajor(y, group, scale_fmt)
