"""An act_quant written as TensorRT-LLM's DeepGEMM MoE computes it, declared as its recipe.

NVIDIA/TensorRT-LLM's DeepGEMM MoE (at 03857e0888701052edd74d0209559b09e381f7f8,
tensorrt_llm/_torch/modules/fused_moe/ops/moe_op_deepgemm.py) quantizes the SwiGLU output with
tensorrt_llm/quantization/utils/fp8_utils.py `silu_and_mul_masked_post_quant_fwd(...,
scale_ue8m0=True)`, a Triton kernel that rounds as C++ silu_and_mul does, rounds the scale up to
a power of two and packs the UE8M0 bytes four per int32 for DeepGEMM on Blackwell. That is
neither of vLLM's packed recipes, and a legitimate one: the act_quant recipe
"colmajor_ceil_packed" (docs/tolerance.md#act_quant-recipes). The kernel reads each mm1 row as
[up | gate] (its w3_w1 weights); the arithmetic is the same on the suite's [gate | up] rows, and
a gemm1 that writes up-first says so (moe_verify/examples/columns.py).

- `CeilPackedActQuant` (correct): the optimized path with act_quant computed here in torch, op
  for op as the kernel does it, declaring "colmajor_ceil_packed"; passes act_quant on a
  ue8m0_packed problem.
- `FloorPackedActQuant` (wrong): the same with the scale rounded DOWN to a power of two (floor
  for ceil), so the top codes clip at 448; fails at act_quant, against the declared recipe.

Problems with packed UE8M0 scales (`scale_fmt="ue8m0_packed"`), plain silu, 128-column groups.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    ActQuantRecipe,
    Engine,
    Outputs,
    ScaleFmt,
    Stage,
    StageContext,
    StageDelegate,
    round_up,
)
from optimized import OptimizedBackend

BF16 = torch.bfloat16
GROUP = 128  # the kernel's word loop steps by 128 columns
FP8_MAX = 448.0


def silu_and_mul_ceil_packed(mm1: torch.Tensor, ceil: bool = True) -> tuple:
    """The kernel's arithmetic on mm1 bf16 [..., M, 2I] ([gate | up]; the masked layout's
    [E_l, M_max, 2I] batch by batch): per 128-column group
    gate_up = up * bf16(gate / (1 + exp(-gate))) in bf16, amax = max(max|gate_up|, 1e-10),
    s = exp2(ceil(log2(amax / 448))) (floor with ceil=False: the wrong variant),
    q = e4m3(clamp(gate_up / s, +-448)); each word packs four groups' exponent bytes
    (s's bits >> 23), byte j at bits 8j, groups past the row's end computed from zeros.
    Returns (q fp8 [..., M, I], int32 [..., M, ceil(I / 512)] with strides (..., 1,
    round_up(M, 4)) per batch)."""
    *lead, rows, cols = mm1.shape
    width = cols // 2
    words = -(-width // (4 * GROUP))
    gate, up = mm1[..., :width].float(), mm1[..., width:]
    gate_up = (gate / (1 + torch.exp(-gate))).to(BF16) * up
    padded = torch.zeros(*lead, rows, words * 4 * GROUP, dtype=BF16, device=mm1.device)
    padded[..., :width] = gate_up  # the masked loads of the last word: zeros
    groups = padded.view(*lead, rows, words * 4, GROUP)
    amax = torch.maximum(groups.abs().amax(-1), torch.tensor(1e-10, device=mm1.device).to(BF16))
    log2 = torch.log2(amax.float() / FP8_MAX)
    s = torch.exp2(torch.ceil(log2) if ceil else torch.floor(log2))
    q = (groups.float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    exponents = (s.view(torch.int32) >> 23).view(*lead, rows, words, 4).to(torch.int64)
    shifts = torch.tensor([0, 8, 16, 24], device=mm1.device)
    packed = (exponents << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    # MN-major, each word column padded to 16 bytes (TMA); a batch's columns after each other
    storage = torch.zeros(*lead, words, round_up(rows, 4), dtype=torch.int32, device=mm1.device)
    storage[..., :rows] = packed.transpose(-1, -2)
    codes = q.view(*lead, rows, -1)[..., :width].contiguous()
    return codes, storage.transpose(-1, -2)[..., :rows, :]


class CeilPackedActQuant(StageDelegate):
    """act_quant by TensorRT-LLM's kernel, declared as "colmajor_ceil_packed"."""

    name = "ceil-packed-act-quant"
    ceil = True

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, gemm1 = ctx.problem, ctx.upstream[Stage.GEMM1]
        if p.scale_fmt is not ScaleFmt.UE8M0_PACKED or p.recipe.act_group != GROUP:
            raise ValueError(
                f"{self.name} writes packed UE8M0 scales of 128-column groups, the kernel's "
                f"only form: got scale_fmt {p.scale_fmt} with {p.recipe.act_group}-column groups"
            )
        if p.activation.kind != "silu" or p.activation.limit is not None:
            raise ValueError(f"{self.name} computes plain silu only, got {p.activation.tag}")
        q, s = silu_and_mul_ceil_packed(gemm1["mm1"], self.ceil)
        out: Outputs = {
            "a2q": q,
            "a2q_scale": s,
            "recipe": ActQuantRecipe.COLMAJOR_CEIL_PACKED.value,
        }
        if "layout" in gemm1:  # every row is computed, so any grouped layout reads it
            out["layout"] = gemm1["layout"]
        return out


class FloorPackedActQuant(CeilPackedActQuant):
    """Wrong: the scale rounded down to a power of two, declared as the ceil recipe."""

    name = "floor-packed-act-quant"
    ceil = False
