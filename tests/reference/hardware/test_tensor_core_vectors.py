"""The tensor-core recipe against bits recorded from the H200 (moe_verify/hw_vectors.py).

tests/reference/data/sm90_deepgemm_gemm.safetensors holds DeepGEMM 2.6.1's outputs on an H200
(its metadata names the GPU and versions) for small grouped GEMMs, contiguous and masked, in both
SM90 scale formats, on operands that reach the model's edges (subnormal codes, zeros, a dominant
term, cancelling halves, a row of zeros). The CPU tier replays the golden's tensor-core recipe on
the same operands: every live output must match bit for bit. The fp32-dequant recipe must not
(it is exact math, not the hardware's), so this check cannot pass on the wrong recipe.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_verify import hw_vectors
from moe_verify.spec import QuantizedWeight, ScaleFmt
from reference.gemm import grouped_gemm
from reference.hardware.tensor_core import tensor_core_grouped_gemm, tensor_core_masked_gemm

pytestmark = pytest.mark.cpu

DATA = Path(__file__).parents[1] / "data" / hw_vectors.GEMM_FILE
VECTORS = hw_vectors.load_gemm_vectors(DATA)
KEYS = sorted(VECTORS, key=str)


def _live(layout: str, v: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool mask of the outputs DeepGEMM defines: rows of an expert (m_indices >= 0), or the
    first masked_m rows of each batch."""
    if layout == "contiguous":
        return v["m_indices"] >= 0
    rows = torch.arange(v["out"].shape[1])[None, :]
    return rows < v["masked_m"][:, None]


def _model(layout: str, v: dict[str, torch.Tensor]) -> torch.Tensor:
    w = QuantizedWeight(v["b"], v["b_scale"], (128, 128))
    if layout == "contiguous":
        return tensor_core_grouped_gemm(v["a"], v["a_scale"], 128, w, v["m_indices"])
    return tensor_core_masked_gemm(v["a"], v["a_scale"], w, v["masked_m"])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int16) == b.view(torch.int16)


def test_the_vectors_are_the_h200s() -> None:
    from safetensors import safe_open

    with safe_open(str(DATA), "pt") as f:
        meta = f.metadata()
    assert meta["capability"] == "9.0" and "H200" in meta["gpu"], meta
    assert meta["deep_gemm"].startswith("2.6"), meta
    assert set(KEYS) == {(s.layout, f) for s in hw_vectors.SHAPES for f in hw_vectors.FORMATS}, (
        "every recorded shape in both SM90 scale formats"
    )


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_operands_are_the_recorders(key: tuple[str, ScaleFmt]) -> None:
    """The stored operands are what `gemm_operands` generates: the recorder and the file agree,
    so a regenerated file is comparable with this one."""
    layout, fmt = key
    shape = next(s for s in hw_vectors.SHAPES if s.layout == layout)
    fresh = hw_vectors.gemm_operands(shape, fmt)
    for name, x in fresh.items():
        stored = VECTORS[key][name]
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           stored.view(torch.uint8) if stored.dtype == torch.float8_e4m3fn
                           else stored), name  # fmt: skip


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_tensor_core_recipe_reproduces_deepgemm_bit_for_bit(key: tuple[str, ScaleFmt]) -> None:
    layout, _ = key
    v = VECTORS[key]
    live = _live(layout, v)
    same = _same_bits(_model(layout, v)[live], v["out"][live])
    bad = (~same).nonzero()
    assert bool(same.all()), (
        f"{layout} {key[1]}: {int((~same).sum())} of {same.numel()} live outputs differ from the "
        f"H200's; first at flat index {bad[0].tolist()}"
    )


@pytest.mark.parametrize("fmt", hw_vectors.FORMATS, ids=str)
def test_exact_fp32_math_is_not_the_hardware(fmt: ScaleFmt) -> None:
    """The fp32-dequant recipe misses some of the recorded bits (94% equal here): a check that
    held the hardware to it bit for bit would false-fail, and one that held it to the recorded
    bits through the wrong recipe would be caught here."""
    v = VECTORS[("contiguous", fmt)]
    w = QuantizedWeight(v["b"], v["b_scale"], (128, 128))
    exact = grouped_gemm(v["a"], v["a_scale"], 128, w, v["m_indices"])
    live = _live("contiguous", v)
    assert not bool(_same_bits(exact[live], v["out"][live]).all())
