"""Tested GEMMs for the zero-tolerance SM90 check: each reports engine "deepgemm" (the verdict is
then bitwise where the harness sees SM90, which a CPU test forces), and computes its GEMMs as:

- TensorCoreGemm (moe_verify/examples/tensor_core.py, where the README's demo builds on it): the
  tensor core's block accumulation (the golden's tensor-core recipe), what DeepGEMM's SM90
  kernel computes: passes bit for bit;
- Fp32DequantGemm: exact fp32 math on the dequantized operands (the golden's bounded recipe):
  within the old bound, but not the hardware's bits;
- OneUlpGemm: the tensor core's bits with one live element one bf16 ulp up, at ROW / COLUMN of
  each GEMM's output (flattened for the batched layout): must fail there, and only there.
"""

from __future__ import annotations

import torch

from moe_verify.examples.tensor_core import TensorCoreGemm
from moe_verify.spec import GEMM_OUTPUT, Stage, StageContext

Outputs = dict[str, object]


class Fp32DequantGemm(TensorCoreGemm):
    """Exact fp32 math, reporting DeepGEMM: what the fp32 bound admits, not the hardware."""

    name = "fp32_dequant_gemm"
    recipe = "fp32_dequant"


class OneUlpGemm(TensorCoreGemm):
    """The tensor core's bits, one element of each GEMM one bf16 ulp up (a live row of expert
    0 in every layout the tests use: the first row of the buffer)."""

    name = "one_ulp_gemm"
    ROW, COLUMN = 0, 5

    def _gemm(self, ctx: StageContext, stage: Stage) -> Outputs:
        outs = super()._gemm(ctx, stage)
        mm = outs[GEMM_OUTPUT[stage]].clone()
        flat = mm.view(-1, mm.shape[-1])
        bits = flat.view(torch.int16)
        bits[self.ROW, self.COLUMN] += 1
        return {**outs, GEMM_OUTPUT[stage]: mm}
