"""The tensor-core recipe's fused form (torch.compile of `chunk_steps` and of the promotion's FMA;
forced here through MOE_VERIFY_FUSED_TENSOR_CORE=1, the CPU default being eager) gives the eager
form's bits: on the H200's recorded vectors, and on
random operands whose exponents spread over the whole e4m3 range. One compile (dynamic shapes)
serves every case here; a C++ compiler is needed on the CPU, as torch.compile needs."""

from __future__ import annotations

import shutil

import pytest
import torch

from moe_verify.spec import QuantizedWeight
from reference.hardware import tensor_core as tc
from tests.reference.hardware import test_tensor_core_vectors as recorded

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None,
        reason="torch.compile on the CPU needs a C++ compiler (g++ / c++ on PATH): none here",
    ),
]


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tc.FUSED_ENV, "1")


def _spread_e4m3(shape: tuple[int, int], g: torch.Generator, top: int) -> torch.Tensor:
    """e4m3 codes with exponents spread over [-12, top), 5% zeros."""
    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-12, top, shape, generator=g).float()
    x[torch.rand(shape, generator=g) < 0.05] = 0.0  # zeros never set a block exponent
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "m, n, k, top",
    [(48, 160, 512, 6), (7, 64, 256, 6), (40, 72, 384, -2)],
    # "small": every product and accumulator below 1, so block exponents are negative (an int8
    # max reduction that starts from 0 got them wrong in torch.compile's CPU code)
    ids=["48x160x512", "7x64x256", "small-40x72x384"],
)
def test_fused_steps_give_the_eager_bits(
    m: int, n: int, k: int, top: int, monkeypatch, fused
) -> None:
    g = torch.Generator().manual_seed(m)
    a, b = _spread_e4m3((m, k), g, top), _spread_e4m3((n, k), g, top)
    sa = torch.rand(m, k // 128, generator=g) + 0.5
    sb = torch.rand(-(-n // 128), k // 128, generator=g) + 0.5
    out = tc.tensor_core_gemm(a, sa, b, sb)
    assert tc.fused_steps(a.device, m * n * k)
    monkeypatch.setenv(tc.FUSED_ENV, "0")
    eager = tc.tensor_core_gemm(a, sa, b, sb)
    differ = out.view(torch.int16) != eager.view(torch.int16)
    assert not bool(differ.any()), f"{int(differ.sum())} of {differ.numel()} outputs differ"


@pytest.mark.parametrize("key", recorded.KEYS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_fused_steps_reproduce_the_h200(key: tuple, fused) -> None:
    layout, _ = key
    v = recorded.VECTORS[key]
    live = recorded._live(layout, v)
    w = QuantizedWeight(v["b"], v["b_scale"], (128, 128))
    if layout == "contiguous":
        out = tc.tensor_core_grouped_gemm(v["a"], v["a_scale"], 128, w, v["m_indices"])
    else:
        out = tc.tensor_core_masked_gemm(v["a"], v["a_scale"], w, v["masked_m"])
    differ = (out.view(torch.int16) != v["out"].view(torch.int16))[live]
    assert not bool(differ.any()), f"{int(differ.sum())} of {differ.numel()} live outputs differ"


def test_coinciding_sizes_compile_no_new_graphs(fused) -> None:
    """Sizes that merely coincide (rows == chunks here: 4 rows, K = 512) must not specialize a
    graph, or a nightly's many shapes pass torch's recompile limit and the case errors
    (FailOnRecompileLimitHit, fullgraph=True). One graph each for the steps and the promotion's
    FMA serves all four GEMMs (torch's default duck shaping compiled five)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(4)
    for m, n, k in [(4, 64, 512), (5, 64, 512), (64, 64, 512), (3, 96, 384)]:
        a, b = _spread_e4m3((m, k), g, 6), _spread_e4m3((n, k), g, 6)
        tc.tensor_core_gemm(a, torch.ones(m, k // 128), b, torch.ones(-(-n // 128), k // 128))
    assert counters["stats"]["unique_graphs"] - before == 2
