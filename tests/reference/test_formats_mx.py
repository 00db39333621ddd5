"""Golden MX formats: MXFP8 (e4m3 with one E8M0 byte per 32 elements, the FlashInfer/TRT-LLM
recipe) and MXFP4 (E2M1 weights, DeepGEMM's per_token_cast_to_fp4).

Expected values are derived by hand from the format definitions (comments show the arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from reference.formats import (
    E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp8,
    quantize_mxfp4,
    quantize_mxfp8,
)
from tests.reference.format_literals import F32, FP8, ULP1

pytestmark = pytest.mark.cpu


# ---------------------------------------------------------------------------------------------
# MXFP8: FlashInfer/TRT-LLM recipe.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amax", "byte", "q"),
    [
        # SF = 448 * fp32(1/448) = 1.0 exactly -> byte 127; q = x.
        pytest.param(448.0, 127, 448.0, id="amax-448-sf-1"),
        # SF = 449/448 > 1 -> rounded up to 2 (byte 128); 449/2 = 224.5 -> 224.
        pytest.param(449.0, 128, 224.0, id="amax-449-sf-up-to-2"),
        # SF = 1344 * fp32(1/448) = 3.0000002 -> 4 (byte 129); 1344/4 = 336 ties to 320.
        pytest.param(1344.0, 129, 320.0, id="amax-3x448"),
        # amax == 0 -> byte 0 and q = 0 (the recipe's special case).
        pytest.param(0.0, 0, 0.0, id="zero-group-byte-0"),
        # SF = 2^-118/448 = 2^-126.8: exact ceil -126 -> byte 1; q = 2^-118 * 2^126 = 256.
        pytest.param(2.0**-118, 1, 256.0, id="tiny-sf-byte-1"),
        # SF = 2^-120/448 = 2^-128.8 (subnormal): ceil -128 saturates to byte 0 (2^-127), q = 128.
        pytest.param(2.0**-120, 0, 128.0, id="subnormal-sf-saturates-byte-0"),
    ],
)
def test_quantize_mxfp8_hand_cases(amax: float, byte: int, q: float) -> None:
    x = torch.zeros(1, 64)
    x[0, 3] = amax
    x[0, 40] = 448.0  # the second group is an independent, plain one
    qx, b = quantize_mxfp8(x)
    assert b.dtype == torch.uint8 and b.tolist() == [[byte, 127]]
    assert qx.float()[0, 3].item() == q and qx.float()[0, 40].item() == 448.0


def test_quantize_mxfp8_weights_and_dequant() -> None:
    w = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    w[1, 2, 33] = -3.0  # SF = 3/448 -> 2^-7 (byte 120); q = -3 * 128 = -384
    q, b = quantize_mxfp8(w)
    assert q.shape == (2, 3, 64) and b.shape == (2, 3, 2)
    assert b[1, 2, 1].item() == 120 and q.float()[1, 2, 33].item() == -384.0
    assert b[0, 0, 0].item() == 0  # zero group
    back = dequantize_mxfp8(q, b)
    assert back[1, 2, 33].item() == -3.0 and back.dtype == F32


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: quantize_mxfp8(torch.ones(2, 48)), r"multiple of group=32", id="K"),
        pytest.param(
            lambda: dequantize_mxfp8(
                torch.zeros(1, 32, dtype=FP8), torch.full((1, 1), 255, dtype=torch.uint8)
            ),
            r"0xFF \(E8M0 NaN\)",
            id="byte-0xFF",
        ),
        pytest.param(
            lambda: dequantize_mxfp8(
                torch.zeros(1, 64, dtype=FP8), torch.zeros(1, 1, dtype=torch.uint8)
            ),
            r"scale_bytes must have shape \(1, 2\)",
            id="scale-shape",
        ),
    ],
)
def test_mxfp8_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# MXFP4 (E2M1 weights, DeepGEMM per_token_cast_to_fp4 semantics).
# ---------------------------------------------------------------------------------------------


def test_e2m1_values_table() -> None:
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0]
    assert E2M1_VALUES.dtype == F32 and E2M1_VALUES.tolist() == [*expected, -6.0]
    assert E2M1_VALUES.signbit().tolist() == [False] * 8 + [True] * 8  # code 8 is -0.0


def test_dequantize_mxfp4_all_16_codes() -> None:
    # Codes 0..15 in order: byte i = code 2i (low nibble) | code 2i+1 (high nibble) << 4.
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8])
    packed = packed.to(torch.uint8)
    one = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert torch.equal(one[0, :16], E2M1_VALUES) and not bool(one[0, 16:].any())
    half = dequantize_mxfp4(packed, torch.tensor([[126]], dtype=torch.uint8))
    assert torch.equal(half[0, :16], E2M1_VALUES / 2)


def _fp4_pair(first: float, second: float) -> int:
    """Byte 0 of the packed row whose group is [first, second, 6.0, 0, ...] (6.0 makes sf = 1)."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = first, second, 6.0
    packed, scale = quantize_mxfp4(w)
    assert scale.tolist() == [[127]]  # ceil_ue8m0(6/6) = 1
    return int(packed[0, 0])


@pytest.mark.parametrize(
    ("v", "code"),
    [
        pytest.param(0.25, 0, id="tie-0.25-down-to-0"),
        pytest.param(0.75, 1, id="tie-0.75-down-to-0.5"),
        pytest.param(1.25, 2, id="tie-1.25-down-to-1"),
        pytest.param(1.75, 3, id="tie-1.75-down-to-1.5"),
        pytest.param(2.5, 4, id="tie-2.5-down-to-2"),
        pytest.param(3.5, 5, id="tie-3.5-down-to-3"),
        pytest.param(5.0, 6, id="tie-5-down-to-4"),
        pytest.param(0.25 * (1 + ULP1), 1, id="above-0.25-up"),
        pytest.param(5.0 * (1 + ULP1), 7, id="above-5-up-to-6"),
        pytest.param(-0.75, 0x9, id="neg-tie-0.75"),
        pytest.param(-5.0, 0xE, id="neg-tie-5"),
        pytest.param(-0.25, 0, id="neg-tie-0.25-no-neg-zero"),
        pytest.param(-0.1, 0, id="small-negative-no-neg-zero"),
        pytest.param(-6.0, 0xF, id="neg-6"),
    ],
)
def test_quantize_mxfp4_rounding_at_sf_1(v: float, code: int) -> None:
    # Element 1 lands in the high nibble of byte 0; element 0 (0.5 -> code 1) in the low one.
    assert _fp4_pair(0.5, v) == 0x01 | code << 4


def test_quantize_mxfp4_nibble_order_hand_built() -> None:
    assert _fp4_pair(0.5, 6.0) == 0x71  # code(0.5) = 1 low, code(6) = 7 high


@pytest.mark.parametrize(
    ("amax", "byte", "code"),
    [
        # max(0, 1e-4)/6 = 1.67e-5 -> 2^-15 (2^-16 = 1.53e-5 is below): byte 112.
        pytest.param(0.0, 112, 0, id="zero-group"),
        # 7/6 -> sf 2 (byte 128); 7/2 = 3.5 is a tie -> down to 3 (code 5).
        pytest.param(7.0, 128, 5, id="amax-7-sf-2-tie"),
        # 3/6 = 0.5 exact -> byte 126; 3/0.5 = 6 (code 7).
        pytest.param(3.0, 126, 7, id="amax-3-sf-half"),
        # -1e-6: amax clamped to 1e-4 -> sf 2^-15; v = -0.033 -> code 0, never -0 (8).
        pytest.param(-1e-6, 112, 0, id="tiny-negative-no-neg-zero"),
    ],
)
def test_quantize_mxfp4_scale(amax: float, byte: int, code: int) -> None:
    w = torch.zeros(1, 64)
    w[0, 32] = amax
    packed, scale = quantize_mxfp4(w)
    assert scale.tolist() == [[112, byte]]
    assert int(packed[0, 16]) == code


def test_mxfp4_weights_round_trip_exact_values() -> None:
    # E2M1 values times a power of two quantize to themselves: [experts, rows, K] shapes kept.
    w = E2M1_VALUES.repeat(2, 3, 4) * 2.0**-3  # [2, 3, 64]; each group holds +-6 -> sf 2^-3
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (2, 3, 32) and scale.shape == (2, 3, 2)
    assert bool((scale == 124).all())
    back = dequantize_mxfp4(packed, scale)
    assert torch.equal(back, w)  # -0.0 == 0.0 here; the code is 0, not 8
    assert not bool((packed & 0x0F == 8).any() or (packed >> 4 == 8).any())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: quantize_mxfp4(torch.ones(2, 48)), r"multiple of group=32", id="K"),
        pytest.param(
            lambda: quantize_mxfp4(torch.ones(2, 30), 15),
            r"one E8M0 byte per 32 elements \(OCP MX\), got 15",
            id="group-15",
        ),
        pytest.param(
            lambda: dequantize_mxfp4(
                torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8)
            ),
            r"0xFF",
            id="byte-0xFF",
        ),
        pytest.param(
            lambda: dequantize_mxfp4(
                torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8)
            ),
            r"scale_bytes must have shape \(1, 1\)",
            id="scale-shape",
        ),
    ],
)
def test_mxfp4_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
