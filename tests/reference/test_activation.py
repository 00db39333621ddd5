"""Golden act_quant stage: SwiGLU + clamp with each kernel's rounding, then FP8 requant.

Expected values are hand-derived (the comments show the arithmetic): silu(g) = g * sigmoid(g),
bf16 has 8 significant bits, so its step is 2^-5 in [4, 8), 2^-8 in [0.5, 1), and so on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from moe_verify.spec import Activation, ScaleFmt
from reference.activation import ZERO_GROUP_PAD_BYTE, act_quant, swiglu
from reference.formats import dequantize_fp8_groups, e8m0_to_fp32, ue8m0_bytes, unpack_ue8m0

pytestmark = pytest.mark.cpu

HEX = float.fromhex
SILU = Activation()
SILU_L705 = Activation(limit=7.05)  # 7.05 is not a bf16 number: bf16(7.05) = 7.0625 > L
OAI = Activation("swigluoai", alpha=1.702, beta=1.0, limit=7.0)
FLOAT32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED


def mm1_row(gate: list[float], up: list[float]) -> torch.Tensor:
    """bf16 [1, 2I]: gate columns first, then up."""
    return torch.tensor([gate + up], dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("g", "u", "act", "packed", "colmajor"),
    [
        # silu(2) = 1.7615942. packed: 3 * 1.7615942 = 5.2847826 = 169.11 * 2^-5 -> 5.28125.
        # colmajor: bf16(1.7615942) = 1.7578125; * 3 = 5.2734375 = 168.75 * 2^-5 -> 5.28125.
        pytest.param(2.0, 3.0, SILU, 5.28125, 5.28125, id="silu-2-3"),
        # silu(0.5) = 0.3112297. packed: * 3 = 0.933689 = 239.02 * 2^-8 -> 0.93359375.
        # colmajor: bf16 -> 0.310546875; * 3 = 0.931640625 = 238.5 * 2^-8, a tie -> 238: 0.9296875.
        pytest.param(0.5, 3.0, SILU, 0.93359375, 0.9296875, id="silu-rounding-differs"),
        # Gate above L: packed clamps to fp32 7.05, silu = 7.04389 -> 7.03125; colmajor re-rounds
        # the clamped gate to bf16 7.0625, silu = 7.05646 -> 7.0625.
        pytest.param(8.0, 1.0, SILU_L705, 7.03125, 7.0625, id="gate-clamp-L7.05"),
        # Up clamped too: packed 7.04389 * 7.05 = 49.66 -> 49.75 (step 0.25);
        # colmajor 7.0625 * 7.0625 = 49.879 -> 50.0.
        pytest.param(8.0, 8.0, SILU_L705, 49.75, 50.0, id="up-clamp-L7.05-above"),
        pytest.param(8.0, -8.0, SILU_L705, -49.75, -50.0, id="up-clamp-L7.05-below"),
        # The gate is clamped from above only: silu(-8) = -0.00268284 -> -176 * 2^-16 (clamping
        # to -7.05 would give silu(-7.05) = -0.0061).
        pytest.param(
            -8.0, 1.0, SILU_L705, -0.002685546875, -0.002685546875, id="gate-not-clamped-below"
        ),
        # Gate/up order with |x| >= 1: silu(3) * -2 = -5.71544 -> -5.71875 ...
        pytest.param(3.0, -2.0, SILU, -5.71875, -5.71875, id="order-gate3-up-neg2"),
        # ... but silu(-2) * 3 = -0.715218 -> -0.71484375: swapping halves changes the answer.
        pytest.param(-2.0, 3.0, SILU, -0.71484375, -0.71484375, id="order-gate-neg2-up3"),
        # swigluoai: glu = 1 * sigmoid(1.702) = 0.845800; packed: (2 + 1) * 0.8458 = 2.5374
        # -> 2.53125; colmajor: bf16(0.8458) = 0.84765625, * 3 = 2.54296875 -> 2.546875.
        pytest.param(1.0, 2.0, OAI, 2.53125, 2.546875, id="swigluoai-1-2"),
        # swigluoai clamp at L = 7: gate 7, up -7; glu = 7 * sigmoid(11.914) = 6.99995;
        # (-7 + 1) * 6.99995 = -41.9997 -> -42 both ways.
        pytest.param(10.0, -10.0, OAI, -42.0, -42.0, id="swigluoai-clamp-L7"),
    ],
)
def test_swiglu_hand_values(
    g: float, u: float, act: Activation, packed: float, colmajor: float
) -> None:
    mm1 = mm1_row([g], [u])
    y_packed, y_colmajor = swiglu(mm1, act, "packed"), swiglu(mm1, act, "colmajor")
    assert y_packed.dtype == torch.float32 and y_packed.shape == (1, 1)
    assert (y_packed.item(), y_colmajor.item()) == (packed, colmajor)


@pytest.mark.parametrize("rounding", ["packed", "colmajor"])
def test_swiglu_outputs_are_bf16_numbers(rounding: str) -> None:
    gen = torch.Generator().manual_seed(len(rounding))
    mm1 = (torch.randn(16, 512, generator=gen) * 4).to(torch.bfloat16)
    y = swiglu(mm1, SILU_L705, rounding)
    assert y.shape == (16, 256)
    assert torch.equal(y.to(torch.bfloat16).float(), y)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: swiglu(torch.ones(2, 4), SILU, "packed"),
            r"mm1 must have dtype bfloat16",
            id="dt",
        ),
        pytest.param(
            lambda: swiglu(torch.ones(2, 5, dtype=torch.bfloat16), SILU, "packed"),
            r"2I must be even, got 5",
            id="odd",
        ),
        pytest.param(
            lambda: swiglu(torch.ones(2, 4, dtype=torch.bfloat16), SILU, "rowmajor"),
            r"rounding must be one of",
            id="rounding",
        ),
        pytest.param(
            lambda: swiglu(torch.ones(2, 4, dtype=torch.bfloat16), "silu", "packed"),
            r"activation must be a moe_verify.spec.Activation, got str",
            id="activation",
        ),
        pytest.param(
            lambda: swiglu(mm1_row([math.inf], [1.0]), SILU, "packed"),
            r"mm1 must be finite",
            id="inf",
        ),
    ],
)
def test_swiglu_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# A row of I = 3 groups of 128: group 0 y = 64 * 21 = 1344, group 1 zero, group 2 y = -224.
# silu(64) is exactly 64 in fp32 (exp(-64) vanishes next to 1), so y is exact in both roundings.
def _three_group_row() -> torch.Tensor:
    gate, up = [0.0] * 384, [0.0] * 384
    gate[0], up[0] = 64.0, 21.0
    gate[256], up[256] = 64.0, -3.5
    return mm1_row(gate, up)


@pytest.mark.parametrize(
    ("fmt", "scales", "codes"),
    [
        # colmajor, s = amax * fp32(1/448): 1344 * fp32(1/448) = 3.0000002 (not 3: quant_input's
        # true division gives 3); zero group 1e-10 * fp32(1/448); 224 * fp32(1/448) = 0.5.
        pytest.param(
            FLOAT32,
            [HEX("0x1.800002p+1"), HEX("0x1.f6a248p-43"), 0.5],
            [448.0, 0.0, -448.0],
            id="float32",
        ),
        # ceil: 3.0000002 -> 4 (1344/4 = 336, an e4m3 tie -> 320); zero group 2^-42 (byte 85).
        pytest.param(CEIL, [4.0, 2.0**-42, 0.5], [320.0, 0.0, -448.0], id="ceil"),
    ],
)
def test_act_quant_colmajor_hand_case(
    fmt: ScaleFmt, scales: list[float], codes: list[float]
) -> None:
    q, s = act_quant(_three_group_row(), SILU, 128, fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 384)
    assert s.dtype == torch.float32 and s.shape == (1, 3)
    assert s.flatten().tolist() == scales
    assert q.float()[0, [0, 128, 256]].tolist() == codes
    assert int(q.float().count_nonzero()) == 2


def test_act_quant_packed_hand_case() -> None:
    # s_raw = 1344/448 = 3 -> 2^2 (byte 129), q = 336 -> 320; zero group: max(0, 1e-10) -> 2^-33
    # (byte 94); 224/448 = 0.5 (byte 126), q = -448; the fourth slot is pad, byte 94.
    q, packed = act_quant(_three_group_row(), SILU, 128, PACKED)
    assert q.float()[0, [0, 128, 256]].tolist() == [320.0, 0.0, -448.0]
    assert packed.dtype == torch.int32 and packed.shape == (1, 1) and packed.stride() == (1, 4)
    assert packed.item() == 129 | 94 << 8 | 126 << 16 | 94 << 24  # 0x5E7E5E81
    assert not bool(packed.as_strided((4,), (1,))[1:].any())  # TMA pad rows in storage


@pytest.mark.parametrize("fmt", [PACKED, CEIL], ids=str)
def test_act_quant_zero_groups(fmt: ScaleFmt) -> None:
    # Packed: every zero group and every pad slot is byte 94 (2^-33), as the packed kernel
    # writes; the colmajor ceil path gives 2^ceil(log2(1e-10/448)) = 2^-42 (byte 85).
    q, s = act_quant(torch.zeros(5, 2 * 640, dtype=torch.bfloat16), SILU, 128, fmt)
    assert not bool(q.float().any())
    if fmt is PACKED:
        assert ZERO_GROUP_PAD_BYTE == 94
        assert s.shape == (5, 2) and s.stride() == (1, 8)
        assert bool((unpack_ue8m0(s, 8) == 94).all())  # 5 groups + 3 pad slots
    else:
        assert bool((ue8m0_bytes(s) == 85).all())


# Round-to-nearest onto e4m3 (3 mantissa bits) moves a normal value by at most 2^-4 of itself,
# a subnormal one (step 2^-9) by at most 2^-10: format facts, not tolerances.
E4M3_HALF_ULP_RELATIVE = 2.0**-4
E4M3_HALF_SUBNORMAL_STEP = 2.0**-10


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
@pytest.mark.parametrize("group", [32, 128])
def test_act_quant_scales_bound_the_codes(fmt: ScaleFmt, group: int) -> None:
    # The returned scales are the ones the codes were made with: dequantized values are y rounded
    # onto e4m3, and each group's largest code is 448 (float32) or in [224, 448] (power of two).
    gen = torch.Generator().manual_seed(group)
    mm1 = (torch.randn(6, 2 * 256, generator=gen) * 3).to(torch.bfloat16)
    q, s = act_quant(mm1, SILU_L705, group, fmt)
    if fmt is PACKED:
        s = e8m0_to_fp32(unpack_ue8m0(s, 256 // group))
    y = swiglu(mm1, SILU_L705, "packed" if fmt is PACKED else "colmajor")
    error = (dequantize_fp8_groups(q, s, group) - y).abs()
    bound = (
        y.abs() * E4M3_HALF_ULP_RELATIVE + s.repeat_interleave(group, 1) * E4M3_HALF_SUBNORMAL_STEP
    )
    assert bool((error <= bound).all())
    amax_q = q.float().abs().reshape(6, -1, group).amax(-1)
    if fmt.is_ue8m0:
        assert bool(((amax_q >= 224) & (amax_q <= 448)).all())
    else:
        assert bool((amax_q == 448).all())


def test_act_quant_batched_leading_dims() -> None:
    # [E_l=2, max_tokens=3, 2I] (the batched layout) packs per expert: strides (P * 4, 1, 4).
    mm1 = torch.ones(2, 3, 2 * 256, dtype=torch.bfloat16)
    q, s = act_quant(mm1, SILU, 128, PACKED)
    assert q.shape == (2, 3, 256) and s.shape == (2, 3, 1) and s.stride() == (4, 1, 4)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: act_quant(torch.ones(2, 200, dtype=torch.bfloat16), SILU, 128, FLOAT32),
            r"I = 200/2 = 100 columns per half must be a multiple of group=128",
            id="I-not-multiple",
        ),
        pytest.param(
            lambda: act_quant(torch.ones(2, 256, dtype=torch.bfloat16), SILU, 128, "fp16"),
            r"scale_fmt must be one of",
            id="fmt",
        ),
        pytest.param(
            lambda: act_quant(torch.ones(2, 256, dtype=torch.bfloat16), SILU, 0, PACKED),
            r"group must be a positive int, got 0",
            id="group",
        ),
        pytest.param(
            lambda: act_quant(torch.ones(256, dtype=torch.bfloat16), SILU, 128, PACKED),
            r"mm1 must have at least 2 dims",
            id="1d",
        ),
    ],
)
def test_act_quant_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
