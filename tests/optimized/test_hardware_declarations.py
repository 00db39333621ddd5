"""What the optimized path declares about its own arithmetic, and only where it was measured: the
Triton engine's fp8-block GEMM as the tensor-core recipe (128-row tiles compiled for SM90), the
act_quant gate's source (compiled Triton on a CUDA GPU). The CPU has neither, so the GPU facts
are stood in for: a CUDA-looking output and the device capability."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import optimized.backend as backend
from moe_verify.spec import Engine, MoEProblem

pytestmark = pytest.mark.cpu

FP8 = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4)
CUDA_OUT = SimpleNamespace(is_cuda=True, device="cuda:0")


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled Triton on an SM90 GPU."""
    monkeypatch.setattr(backend, "interpreter_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize(
    ("problem", "engine", "alignment", "declared"),
    [
        (FP8, Engine.TRITON, 128, True),  # the tile measured on the H200
        (FP8, Engine.TRITON, 256, True),  # still 128-row blocks
        (FP8, Engine.TRITON, 64, False),  # 64-row blocks: another MMA may run, not measured
        (FP8, Engine.TRITON, 32, False),
        (FP8.replace(scale_fmt="float32_ceil_ue8m0"), Engine.TRITON, 128, True),
        (FP8.replace(scale_fmt="ue8m0_packed"), Engine.TRITON, 128, False),  # SM100's format
        (FP8.replace(recipe="mxfp8", scale_fmt="ue8m0_packed"), Engine.TRITON, 128, False),
        (FP8, Engine.DEEPGEMM, 128, False),  # DeepGEMM says so by its engine
    ],
    ids=["a128", "a256", "a64", "a32", "ceil", "packed", "mxfp8", "deepgemm"],
)
def test_the_triton_engine_declares_the_tensor_core_only_where_measured(
    problem: MoEProblem, engine: Engine, alignment: int, declared: bool, sm90: None
) -> None:
    out = backend.gemm_recipe(problem, engine, CUDA_OUT, alignment)
    assert out == ({"recipe": "tensor_core"} if declared else {})


def test_nothing_is_declared_off_sm90_or_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backend, "interpreter_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert backend.gemm_recipe(FP8, Engine.TRITON, CUDA_OUT, 128) == {}  # SM100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert backend.gemm_recipe(FP8, Engine.TRITON, torch.zeros(1), 128) == {}  # a CPU tensor
    monkeypatch.setattr(backend, "interpreter_mode", lambda: True)
    assert backend.gemm_recipe(FP8, Engine.TRITON, CUDA_OUT, 128) == {}


def test_the_gate_source_is_reported_for_compiled_cuda_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import optimized.kernels.act_quant as act_quant

    assert act_quant.gate_source(torch.device("cpu")) == {}
    monkeypatch.setattr(act_quant, "interpreter_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    facts = act_quant.gate_source(torch.device("cuda:0"))
    assert facts == {"gate_triton": act_quant.triton.__version__, "gate_capability": "9.0"}
    monkeypatch.setattr(act_quant, "interpreter_mode", lambda: True)
    assert act_quant.gate_source(torch.device("cuda:0")) == {}
