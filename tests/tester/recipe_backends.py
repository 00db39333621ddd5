"""Backends that implement another legitimate recipe than the golden's own, and near misses.

Each is the optimized path with one stage replaced by a direct torch computation of a vLLM
kernel's arithmetic, independent of `reference/`: vLLM 0.32's fp8_utils.py
`_per_token_group_quant_fp8`, and vLLM's tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py
for the CUDA kernel `persistent_masked_m_silu_mul_quant`. The right ones must pass and be named;
the near misses (a declaration that does not hold, an arithmetic no kernel uses) must fail at
their stage.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    ActQuantRecipe,
    InputQuantRecipe,
    ScaleFmt,
    StageContext,
    TopologyKind,
)
from optimized.backend import OptimizedBackend

Outputs = dict[str, object]
BF16 = torch.bfloat16


def triton_group_quant(
    x: torch.Tensor, fmt: ScaleFmt, inverse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton kernel, op for op in fp32: amax = max(max|x|, 1e-10); s = amax * inverse;
    ue8m0: s = exp2(ceil(log2 s)); q = e4m3(clamp(x / s, +-448))."""
    xg = x.float().reshape(x.shape[0], -1, 128)
    amax = xg.abs().amax(-1).clamp(min=1e-10)
    s = amax * inverse
    if fmt.is_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xg / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s


class TritonReciprocalQuant(OptimizedBackend):
    """quant_input by vLLM's Triton recipe: amax x fp32(1/448), the floor on amax."""

    name = "triton_reciprocal_quant"
    declares: str | None = None
    inverse = torch.tensor(1.0 / 448.0, dtype=torch.float32)

    def quant_input(self, ctx: StageContext) -> Outputs:
        p, x, up = ctx.problem, ctx.inputs, ctx.upstream
        hidden = x.hidden_states
        if p.topology.kind is TopologyKind.EP_HT:
            hidden = hidden[up["route"]["token_index"]]
        q, s = triton_group_quant(hidden, p.scale_fmt, self.inverse.to(hidden.device))
        out: Outputs = {"a1q": q, "a1q_scale": s}
        if self.declares is not None:
            out["recipe"] = self.declares
        return out


class DeclaresCudaComputesTriton(TritonReciprocalQuant):
    """Declares vLLM's CUDA recipe but computes the Triton one: held to its declaration."""

    name = "declares_cuda_computes_triton"
    declares = InputQuantRecipe.CUDA_DIVISION.value


class Bf16InverseQuant(TritonReciprocalQuant):
    """A quantizer no kernel implements: amax x bf16(1/448) (0.2% small) with fp32 scales."""

    name = "bf16_inverse_quant"
    inverse = torch.tensor(1.0 / 448.0).to(BF16).float()


def bf16_steps(mm1: torch.Tensor, fmt: ScaleFmt, scale_in_bf16: bool = True) -> tuple:
    """The bf16_steps kernel in torch bf16 arithmetic (each op computes in fp32 and rounds to bf16):
    act = bf16(silu(g)), y = act * u, amax clamped at bf16(1e-10), s = amax * bf16(1/448), ceil via
    log2/ceil/exp2, inv = 1 / s, q = e4m3(clamp(y * inv, +-448)). Returns (q, fp32 scales)."""
    i = mm1.shape[-1] // 2
    g, u = mm1[..., :i].float(), mm1[..., i:]
    y = (g / (1 + torch.exp(-g))).to(BF16) * u
    yg = y.reshape(*y.shape[:-1], i // 128, 128)
    amax = torch.maximum(yg.abs().amax(-1), torch.tensor(1e-10).to(BF16))
    if scale_in_bf16:
        s = amax * (torch.tensor(1.0, dtype=BF16) / torch.tensor(448.0, dtype=BF16))
    else:  # the near miss: the scale in fp32, the rest in bf16
        s = amax.float() * (1.0 / 448.0)
    if fmt.is_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    inv = (1.0 / s).to(BF16)
    q = (yg * inv[..., None]).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q.reshape(y.shape), s.float()


class Bf16StepsActQuant(OptimizedBackend):
    """act_quant by vLLM's low-latency CUDA kernel: every step in bf16 (plain silu, fp32
    scales: the batched layout's formats)."""

    name = "bf16_steps_act_quant"
    declares: str | None = None
    scale_in_bf16 = True

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        if p.scale_fmt is ScaleFmt.UE8M0_PACKED:
            raise ValueError("this test backend writes fp32 scales only")
        q, s = bf16_steps(up["gemm1"]["mm1"], p.scale_fmt, self.scale_in_bf16)
        out: Outputs = {"a2q": q, "a2q_scale": s}
        if self.declares is not None:
            out["recipe"] = self.declares
        return out


class DeclaresColmajorComputesBf16Steps(Bf16StepsActQuant):
    """Declares the colmajor Triton kernel but computes the bf16 one."""

    name = "declares_colmajor_computes_bf16_steps"
    declares = ActQuantRecipe.COLMAJOR.value


class Fp32ScaleBf16Steps(Bf16StepsActQuant):
    """A mix no kernel computes: bf16 steps except the scale, taken in fp32."""

    name = "fp32_scale_bf16_steps"
    scale_in_bf16 = False
