"""The H200 quotient tables (reference/hardware/quotient_table.py) and the recipes that read them.

The tables were recorded on an H200 (moe_verify/hw_vectors.py `record_quotient_tables`);
tests/gpu/test_sm90_hw_vectors.py records them again there. Here: what the recorded bits are
(not the IEEE quotient, within div.full.f32's documented 2 ulps), and that each recipe computes
with its own table, so a kernel is told apart from the others where the quotients differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.spec import (
    Activation,
    ActQuantRecipe,
    InputQuantRecipe,
    MoEProblem,
    ScaleFmt,
    Stage,
    Trace,
)
from reference.activation import act_quant, sglang_sm90_cuda_recipe
from reference.formats import TABLE_QUOTIENT_RECIPES, quantize_fp8_groups
from reference.hardware.gate_table import every_bf16
from reference.hardware.quotient_table import (
    FLOORS,
    TABLES,
    bf16_entries,
    quotient_table_provenance,
    table_value,
)
from reference.moe import ReferenceBackend

pytestmark = pytest.mark.cpu

TRITON, FAST = "quotient_448_triton", "quotient_448_cuda_fast_math"
ALL_BF16 = every_bf16()
# amax values a quantizer divides by: positive normal bf16 numbers with a finite quotient
NORMAL = (ALL_BF16 >= 2.0**-126) & (ALL_BF16 < 2.0**120) & torch.isfinite(ALL_BF16)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_provenance_names_the_h200_and_its_compilers() -> None:
    meta = quotient_table_provenance()
    assert meta["gpu"] == "NVIDIA H200" and meta["capability"] == "9.0"
    assert meta["triton"] and meta["nvcc"] and meta["file"].endswith("sm90_quotient.safetensors")


@pytest.mark.parametrize("name", [TRITON, FAST])
def test_recorded_quotients_are_approximate_within_two_ulps(name: str) -> None:
    """Not the IEEE quotient (else the recipe would be the plain one), and within the 2 ulps the
    PTX ISA documents for div.full.f32 / div.approx.f32 on normal operands."""
    v = ALL_BF16[NORMAL]
    table = table_value(name, v)
    ieee = torch.full_like(v, 448.0) / v
    apart = ulps(table, ieee)
    assert int((apart > 0).sum()) > 1000, f"{name}: the table is (nearly) the IEEE quotient"
    assert int(apart.max()) <= 2


def test_the_floors_have_entries_and_nothing_else_off_grid() -> None:
    floors = torch.tensor(FLOORS, dtype=torch.float32)
    assert torch.isfinite(table_value(TRITON, floors)).all()
    with pytest.raises(ValueError, match="not bf16 numbers, first 1.0000001"):
        table_value(TRITON, torch.tensor([1.0, 1.0000001]))
    with pytest.raises(ValueError, match="no recorded table 'quotient_448'"):
        table_value("quotient_448", floors)
    assert set(TABLES) == {TRITON, FAST, "silu_cuda_fast_math"}


def _boundary_group() -> tuple[torch.Tensor, float]:
    """One bf16 group [1, 128] whose codes differ between the IEEE and the Triton quotient: its
    amax is a value whose recorded quotient is not the IEEE one, and one element sits where the
    two products round to different e4m3 codes."""
    v = ALL_BF16[NORMAL & (ALL_BF16 > 0.5) & (ALL_BF16 < 8.0)]
    table, ieee = table_value(TRITON, v), torch.full_like(v, 448.0) / v
    for amax, qt, qi in zip(
        v[table != ieee], table[table != ieee], ieee[table != ieee], strict=True
    ):
        xs = ALL_BF16[(ALL_BF16 > 0) & (ALL_BF16 < amax)]
        split = (xs * qt).to(torch.float8_e4m3fn).float() != (xs * qi).to(
            torch.float8_e4m3fn
        ).float()
        if bool(split.any()):
            group = torch.zeros(1, 128)
            group[0, 0], group[0, 1] = amax, xs[split][0]
            return group.bfloat16(), float(amax)
    raise AssertionError("no amax in (0.5, 8) splits a code: the table is the IEEE quotient")


def test_each_quantizer_recipe_uses_its_own_quotient() -> None:
    x, amax = _boundary_group()
    q = {
        r: quantize_fp8_groups(x, 128, ScaleFmt.FLOAT32, recipe=r)
        for r in (InputQuantRecipe.AMAX_RECIPROCAL, InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON)
    }
    ieee, sm90 = (q[r][0].view(torch.uint8) for r in q)
    assert int((ieee != sm90).sum()) == 1  # the planted element, one e4m3 step
    expected = (x.float() * table_value(TRITON, torch.tensor([amax]))).to(torch.float8_e4m3fn)
    assert torch.equal(sm90, expected.view(torch.uint8))
    # the scales are the same multiply in both: amax * fp32(1/448)
    assert torch.equal(
        q[InputQuantRecipe.AMAX_RECIPROCAL][1], q[InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON][1]
    )


def test_sglang_quantizer_floors_amax_at_1e_10() -> None:
    """A group of tiny values: LMDeploy's floor (1e-6) sets its scale, SGLang's (1e-10) does not."""
    x = torch.full((1, 128), 2.0**-30).bfloat16()
    _, s_lmd = quantize_fp8_groups(x, 128, ScaleFmt.FLOAT32, recipe="amax_reciprocal_sm90_triton")
    q_sgl, s_sgl = quantize_fp8_groups(x, 128, ScaleFmt.FLOAT32, recipe="fast_reciprocal_sm90_cuda")
    assert float(s_lmd) == pytest.approx(1e-6 / 448, rel=1e-6)
    assert float(s_sgl) == pytest.approx(2.0**-30 / 448, rel=1e-6)
    assert float(q_sgl.float().max()) == 448.0
    with pytest.raises(ValueError, match="UE8M0 flavour"):
        quantize_fp8_groups(x, 128, ScaleFmt.FLOAT32_CEIL_UE8M0, recipe="fast_reciprocal_sm90_cuda")


def test_sglang_act_quant_rounds_the_product_once_with_its_silu() -> None:
    """packed_fast_reciprocal_sm90_cuda: bf16(silu_table(g) * u), not colmajor's bf16 silu first;
    the two differ on a pair where rounding silu first moves the product's bf16."""
    silu = Activation("silu")
    g = ALL_BF16[(ALL_BF16 > 0.5) & (ALL_BF16 < 4.0)]
    u = torch.full_like(g, 2.6875)
    table = bf16_entries("silu_cuda_fast_math")[g.bfloat16().view(torch.int16).long() & 0xFFFF]
    once = (table * u).bfloat16().float()
    twice = (table.bfloat16().float() * u).bfloat16().float()
    at = int((once != twice).nonzero()[0])
    mm1 = torch.zeros(1, 256)
    mm1[0, 0], mm1[0, 128] = g[at], u[at]
    recipe = sglang_sm90_cuda_recipe(silu, ScaleFmt.FLOAT32)
    assert recipe is ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA
    _, s = act_quant(mm1.bfloat16(), silu, 128, ScaleFmt.FLOAT32, recipe)
    _, s_col = act_quant(mm1.bfloat16(), silu, 128, ScaleFmt.FLOAT32, "colmajor_amax_reciprocal")
    assert float(s[0, 0]) * 448 == pytest.approx(float(once[at]), rel=1e-6)
    assert float(s[0, 0]) != float(s_col[0, 0])
    assert sglang_sm90_cuda_recipe(silu, ScaleFmt.FLOAT32_CEIL_UE8M0) is None
    assert sglang_sm90_cuda_recipe(Activation("silu", limit=7.3), ScaleFmt.FLOAT32) is None


def test_the_golden_offers_table_recipes_for_bf16_input_only() -> None:
    """fp16 hidden states have amax values no table holds: the golden computes the other recipes
    instead of refusing the problem."""
    p = MoEProblem(tokens=4, hidden=256, intermediate=256, num_experts=4, topk=2, alignment=32)
    inputs = make_inputs(p, "cpu")
    bf16 = run_one_stage(ReferenceBackend(), Stage.QUANT_INPUT, p, inputs, Trace("golden"), 0)
    fp16 = dataclasses.replace(inputs, hidden_states=inputs.hidden_states.half())
    half = run_one_stage(ReferenceBackend(), Stage.QUANT_INPUT, p, fp16, Trace("golden"), 0)
    tabled = {r.value for r in TABLE_QUOTIENT_RECIPES}
    assert tabled <= set(bf16["recipe_outputs"])
    assert not tabled & set(half["recipe_outputs"]) and "amax_reciprocal" in half["recipe_outputs"]
