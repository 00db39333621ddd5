"""The golden's LMDeploy recipes against LMDeploy 0.18's own Triton kernels, bit for bit (the
-m lmdeploy tier: the kernels run under the Triton interpreter, docs/implementations.md).

LMDeploy's `_quant_fp8_kernel` quantizes by x * (448 / amax), not x / scale: the golden's
"amax_reciprocal" recipe must give its codes and scale bits, and vLLM's two recipes must not
(with fp32 scales). Its act_quant is `silu_and_mul` into bf16 and the same quantizer:
"colmajor_amax_reciprocal".
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.spec import Activation, ActQuantRecipe, InputQuantRecipe, ScaleFmt
from reference.activation import act_quant
from reference.formats import quantize_fp8_groups
from tests.reference.engine_data import bits, hidden_states

pytestmark = pytest.mark.lmdeploy

FP32_FORMATS = [ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0]


@pytest.fixture(scope="module")
def backend():  # noqa: ANN201 - the adapter, for LMDeploy's kernels and its CPU switch
    from moe_verify.adapters.lmdeploy import LmdeployBackend

    return LmdeployBackend()


@pytest.mark.parametrize("fmt", FP32_FORMATS, ids=str)
def test_lmdeploy_quantizer_is_the_amax_reciprocal_recipe(backend, fmt: ScaleFmt) -> None:
    x = hidden_states()
    with backend._device_props():
        q, s = backend.lmd.quant.per_token_group_quant_fp8(
            x, 128, scale_fmt="ue8m0" if fmt.is_ue8m0 else None
        )
    golden = quantize_fp8_groups(x, 128, fmt, recipe=InputQuantRecipe.AMAX_RECIPROCAL)
    assert torch.equal(bits(q), bits(golden[0])) and torch.equal(bits(s), bits(golden[1]))
    if fmt is ScaleFmt.FLOAT32:  # vLLM's two quantizers give other codes: the recipe is needed
        for other in (InputQuantRecipe.CUDA_DIVISION, InputQuantRecipe.TRITON_RECIPROCAL):
            assert not torch.equal(bits(q), bits(quantize_fp8_groups(x, 128, fmt, recipe=other)[0]))


def test_lmdeploy_act_quant_is_the_colmajor_amax_reciprocal_recipe(backend) -> None:
    mm1 = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    down = torch.empty((64, 512), dtype=torch.bfloat16)
    with backend._device_props():
        backend.lmd.activation.silu_and_mul(mm1, down)
        q, s = backend.lmd.quant.per_token_group_quant_fp8(down, 128)
    recipe = ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL
    golden = act_quant(mm1, Activation(), 128, ScaleFmt.FLOAT32, recipe)
    assert torch.equal(bits(q), bits(golden[0])) and torch.equal(bits(s), bits(golden[1]))
    vllm = act_quant(mm1, Activation(), 128, ScaleFmt.FLOAT32, ActQuantRecipe.COLMAJOR)
    assert not torch.equal(bits(q), bits(vllm[0]))  # vLLM's colmajor codes differ somewhere
