"""SM90 tier: the tensor-core recipe's fused form (reference/hardware/tensor_core.py `chunk_steps`
and the promotion's FMA under torch.compile, Triton code on the GPU; the default on CUDA for large
GEMMs) gives the eager form's bits and DeepGEMM's on a DeepSeek-V3 EP8-local gemm1, and how fast
both are beside the fp32 golden GEMM (printed; docs/tensor-core.md#speed records it)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.common.timing import timed_once
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_chained
from moe_verify.spec import MoEProblem
from optimized.backend import OptimizedBackend
from reference.gemm import grouped_gemm
from reference.hardware import tensor_core as tc
from reference.moe import ReferenceBackend

pytestmark = pytest.mark.sm90

DSV3 = MoEProblem(
    tokens=128,
    hidden=7168,
    intermediate=2048,
    num_experts=32,
    topk=8,
    routing="grouped",
    num_expert_group=8,
    topk_group=4,
)


def test_fused_steps_give_deepgemms_bits_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    x = make_inputs(DSV3, "cuda")
    t = run_chained(OptimizedBackend(engine="deepgemm"), DSV3, x, 0)
    w = ReferenceBackend().shard(DSV3, x, 0).w13
    perm = t["permute"]
    args = (perm["a_perm"], perm["a_scale_perm"], 128, w, perm["m_indices"])
    monkeypatch.setenv(tc.FUSED_ENV, "0")
    eager, eager_s = timed_once(lambda: tc.tensor_core_grouped_gemm(*args))
    monkeypatch.setenv(tc.FUSED_ENV, "1")
    _, compile_s = timed_once(lambda: tc.tensor_core_grouped_gemm(*args))
    fused, fused_s = timed_once(lambda: tc.tensor_core_grouped_gemm(*args))
    grouped_gemm(*args)  # warm, as the others are
    _, fp32_s = timed_once(lambda: grouped_gemm(*args))
    live = perm["m_indices"] >= 0
    assert torch.equal(fused.view(torch.int16), eager.view(torch.int16))
    differ = (fused.view(torch.int16) != t["gemm1"]["mm1"].view(torch.int16))[live]
    assert not bool(differ.any()), f"{int(differ.sum())} live outputs differ from DeepGEMM's"
    print(
        f"\ngemm1 DSV3 T=128: eager {eager_s:.3f} s, fused {fused_s:.3f} s (first call with the "
        f"compile {compile_s:.1f} s), fp32 golden {fp32_s:.4f} s"
    )
