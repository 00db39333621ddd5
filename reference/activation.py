"""The act_quant stage: gated activation (SwiGLU + clamp) on GEMM1's output, then FP8 requant.

vLLM runs one of two fused Triton kernels here (vllm-deepgemm-path.md §5), and they round
differently, so the golden models both exactly:
- "packed" (§5.1, `silu_mul_quant_fp8_packed_triton`, UE8M0_PACKED): clamp and activation in fp32,
  ONE bf16 rounding of the product; scale exponent from amax / 448 floored at 1e-10; int32 packed.
- "colmajor" (§5.2, `silu_mul_per_token_group_quant_fp8_colmajor`, FLOAT32 and
  FLOAT32_CEIL_UE8M0): mimics C++ silu_and_mul: bf16 after the clamp, after the activation,
  after up + beta and after the product; scale = max(amax, 1e-10) * (1/448), optionally ceiled.
Both kernels use Triton's approximate `tl.exp`; the golden uses torch.exp (a documented 1-ulp
source of difference before the final bf16 rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_verify.spec import FP8_MAX, Activation, ScaleFmt
from reference.formats import (
    SCALE_FLOOR,
    _divide,
    cast_to_fp8,
    ceil_ue8m0,
    pack_ue8m0,
    ue8m0_bytes,
)
from reference.validate import (
    require_finite,
    require_positive_int,
    require_scale_fmt,
    require_tensor,
)

__all__ = ["ROUNDINGS", "ZERO_GROUP_PAD_BYTE", "act_quant", "swiglu"]

ROUNDINGS = ("packed", "colmajor")

# The packed kernel computes the slots past the last group of a row's final int32 word from zeros,
# so they get the zero-group exponent ceil(log2(1e-10)) = -33, byte 94 (§5.1). The golden writes
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


def swiglu(mm1: Tensor, activation: Activation, rounding: str) -> Tensor:
    """Gated activation y = (up + beta) * gate * sigmoid(alpha * gate), with the kernel's rounding.

    mm1: bf16 [..., M, 2I], gate = columns [0, I), up = columns [I, 2I) (contiguous halves).
    With activation.limit L: gate = min(gate, L) (from above only), up = clamp(up, -L, L).
    rounding "packed" (§5.1): clamp in fp32, no re-round; glu = g / (1 + exp(-g * alpha));
        y = (u + beta) * glu in fp32; one bf16 rounding.
    rounding "colmajor" (§5.2): g, u re-rounded to bf16 after the clamp (matters when L is not
        bf16-representable); glu = bf16(g / (1 + exp(-g * alpha))); up = bf16(u + beta);
        y = bf16(glu * up).
    silu is alpha = 1, beta = 0. Returns fp32 [..., M, I] whose values are all bf16 numbers.
    """
    _check_mm1(mm1, activation)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    gate, up = mm1.float().chunk(2, dim=-1)
    alpha, beta = _f32(activation.alpha, mm1), _f32(activation.beta, mm1)
    if activation.limit is not None:
        limit = _f32(activation.limit, mm1)
        gate = torch.minimum(gate, limit)
        up = up.clamp(-limit, limit)
    if rounding == "packed":
        glu = gate / (1 + torch.exp(-gate * alpha))
        return _bf16((up + beta) * glu)
    gate, up = _bf16(gate), _bf16(up)
    glu = _bf16(gate / (1 + torch.exp(-gate * alpha)))
    # A product of two bf16 numbers is exact in fp32, so this is the one rounding of the product.
    return _bf16(glu * _bf16(up + beta))


def act_quant(
    mm1: Tensor, activation: Activation, group: int, scale_fmt: ScaleFmt
) -> tuple[Tensor, Tensor]:
    """The act_quant stage: swiglu, then per-group FP8 quantization, as the kernel for scale_fmt.

    mm1: bf16 [M, 2I] (leading batch dims allowed), I a multiple of group.
    UE8M0_PACKED, the packed kernel (§5.1): y = swiglu(rounding="packed"); per group
        s_raw = max(amax / 448, 1e-10); e = ceil(log2(s_raw)) (bit arithmetic);
        q = cast_to_fp8(y / 2^e); byte = e + 127.
        Returns (a2q fp8 [M, I], int32 [M, P] from `pack_ue8m0`, P = ceil(I/group/4), strides
        (1, round_up(M, 4))). Pad slots of the last word hold byte 94 (ZERO_GROUP_PAD_BYTE) as
        that kernel writes; the TMA pad rows in storage are 0 (the kernel leaves them unwritten).
    FLOAT32 / FLOAT32_CEIL_UE8M0, the colmajor kernel (§5.2): y = swiglu(rounding="colmajor");
        amax = max(max|y|, 1e-10); s = amax * fp32(1/448) (a reciprocal multiply, unlike
        quant_input's true division); s = ceil_ue8m0(s) for the ceil format; q = cast_to_fp8(y/s).
        Returns (a2q fp8 [M, I], fp32 [M, I/group] row-major; the kernel's column-major storage
        holds the same logical values).
    Zero groups: byte 94 (2^-33) packed; 1e-10/448 float32; 2^-42 (byte 85) ceil.
    """
    _check_mm1(mm1, activation)
    group = require_positive_int("group", group)
    scale_fmt = require_scale_fmt(scale_fmt)
    cols = mm1.shape[-1]
    if (cols // 2) % group:
        raise ValueError(
            f"mm1: I = {cols}/2 = {cols // 2} columns per half must be a multiple of "
            f"group={group} (shape {tuple(mm1.shape)})"
        )
    packed = scale_fmt is ScaleFmt.UE8M0_PACKED
    y = swiglu(mm1, activation, "packed" if packed else "colmajor")
    groups = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
    amax = groups.abs().amax(dim=-1)
    if packed:
        scale = ceil_ue8m0(_divide(amax, FP8_MAX).clamp(min=SCALE_FLOOR))
    else:
        scale = amax.clamp(min=AMAX_EPS) * _f32(1.0 / FP8_MAX, mm1)
        if scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0:
            scale = ceil_ue8m0(scale)
    q = cast_to_fp8(groups / scale.unsqueeze(-1)).reshape(y.shape)
    if not packed:
        return q, scale
    exponents = ue8m0_bytes(scale)
    num_groups = exponents.shape[-1]
    pad = exponents.new_full((*exponents.shape[:-1], -num_groups % 4), ZERO_GROUP_PAD_BYTE)
    return q, pack_ue8m0(torch.cat((exponents, pad), dim=-1))
