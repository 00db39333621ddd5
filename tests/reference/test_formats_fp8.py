"""Golden e4m3 and FP8 quantizers: the cast, per-token groups (quant_input) and 128x128 weight
blocks with their UE8M0 requant.

Expected values are derived by hand from the format definitions (comments show the arithmetic);
the e4m3 oracle below decodes codes from their bit fields, independent of torch's float8 casts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from moe_verify.spec import ScaleFmt
from reference.formats import (
    FP8_MAX,
    cast_to_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
    requantize_blocks_ue8m0,
    ue8m0_bytes,
)
from tests.reference.format_literals import F32, FP8, HEX, f32

pytestmark = pytest.mark.cpu


def codes_of(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).flatten().tolist()


# ---------------------------------------------------------------------------------------------
# e4m3 oracle: value of every code from its bit fields (sign | 4-bit exponent, bias 7 | 3-bit
# mantissa; exponent 0 is subnormal; 0x7F and 0xFF are NaN).
# ---------------------------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_TABLE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)
POSITIVE_CODES = torch.arange(0, 0x7F)  # 0x00..0x7E: every finite non-negative value, increasing


def test_e4m3_oracle_matches_known_points() -> None:
    # Anchors of the oracle itself: max 448, min normal 2^-6, min subnormal 2^-9, NaN codes.
    assert E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[0xFE] == -448.0
    assert E4M3_TABLE[0x08] == 2.0**-6 and E4M3_TABLE[0x01] == 2.0**-9
    assert E4M3_TABLE[0x38] == 1.0
    assert math.isnan(E4M3_TABLE[0x7F]) and math.isnan(E4M3_TABLE[0xFF])
    assert bool((E4M3_TABLE[POSITIVE_CODES].diff() > 0).all())


def test_e4m3_all_256_codes_round_trip() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(FP8).float()
    finite = ~values.isnan()
    assert finite.sum() == 254
    assert torch.equal(values[finite].double(), E4M3_TABLE[finite])
    back = cast_to_fp8(values).view(torch.uint8)
    # Every finite code (including -0.0, 0x80) comes back bitwise; the two NaN codes stay NaN.
    assert torch.equal(back[finite], codes[finite])
    assert bool(cast_to_fp8(values[~finite]).float().isnan().all())


def test_cast_to_fp8_midpoints_tie_to_even_exhaustive() -> None:
    # Between every pair of adjacent finite codes (both signs): the exact midpoint goes to the
    # code with an even mantissa (LSB 0), one fp32 ulp below/above goes to the nearer neighbour.
    lo, hi = POSITIVE_CODES[:-1], POSITIVE_CODES[1:]
    mid = ((E4M3_TABLE[lo] + E4M3_TABLE[hi]) / 2).float()  # exact: <= 5 significant bits
    even = torch.where(lo % 2 == 0, lo, hi)
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, math.inf))
    x = torch.cat((mid, below, above, -mid, -below, -above))
    expected = torch.cat((even, lo, hi, even | 0x80, lo | 0x80, hi | 0x80)).to(torch.uint8)
    assert torch.equal(cast_to_fp8(x).view(torch.uint8), expected)


@pytest.mark.parametrize(
    ("x", "code"),
    [
        pytest.param(1.0, 0x38, id="one"),
        pytest.param(1.0625, 0x38, id="tie-1.0625-to-even-1.0"),
        pytest.param(1.1875, 0x3A, id="tie-1.1875-to-even-1.25"),
        pytest.param(272.0, 0x78, id="tie-272-to-even-256"),
        pytest.param(432.0, 0x7E, id="tie-432-to-even-448"),
        pytest.param(448.0, 0x7E, id="max-448"),
        pytest.param(-448.0, 0xFE, id="min-neg-448"),
        pytest.param(464.0, 0x7E, id="464-clamped-not-nan"),
        pytest.param(500.0, 0x7E, id="500-saturates"),
        pytest.param(-500.0, 0xFE, id="neg-500-saturates"),
        pytest.param(1e30, 0x7E, id="huge-saturates"),
        pytest.param(math.inf, 0x7E, id="inf-clamps-to-448"),
        pytest.param(-math.inf, 0xFE, id="neg-inf-clamps-to-neg-448"),
        pytest.param(0.0, 0x00, id="zero"),
        pytest.param(-0.0, 0x80, id="neg-zero-kept"),
        pytest.param(2.0**-6, 0x08, id="min-normal"),
        pytest.param(15 * 2.0**-10, 0x08, id="tie-max-subnormal-to-min-normal"),
        pytest.param(2.0**-9, 0x01, id="min-subnormal"),
        pytest.param(2.0**-10, 0x00, id="tie-half-min-subnormal-to-zero"),
        pytest.param(3 * 2.0**-10, 0x02, id="tie-1.5-min-subnormal-to-2"),
        pytest.param(-(2.0**-12), 0x80, id="neg-underflow-to-neg-zero"),
    ],
)
def test_cast_to_fp8_hand_cases(x: float, code: int) -> None:
    assert codes_of(cast_to_fp8(f32(x))) == [code]


def test_cast_to_fp8_nan_stays_nan() -> None:
    # Documented: NaN is not clamped (clamp keeps NaN); it becomes an e4m3 NaN code.
    assert bool(cast_to_fp8(f32(math.nan)).float().isnan().all())


def test_cast_to_fp8_rejects_non_fp32() -> None:
    with pytest.raises(ValueError, match=r"x must have dtype float32, got bfloat16"):
        cast_to_fp8(torch.ones(2, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# FP8 per-token groups (quant_input): vLLM's CUDA per_token_group_quant_fp8.
# ---------------------------------------------------------------------------------------------

FLOAT32, CEIL, PACKED = ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
EPS_OVER_448 = HEX("0x1.f6a246p-43")  # fp32(fp32(1e-10) / 448), a true division
CEIL_OF_EPS = 2.0**-33  # ceil_ue8m0(max(1e-10/448, 1e-10)) = ceil(1e-10): 2^-34 < 1e-10 < 2^-33

# (first values of a 128-group row, the rest zero) -> per format: (scale, first q values)
GROUP_CASES = {
    # amax 448: s = 1 in every format; the codes are the values.
    "amax-448": ([448.0, -224.0, 1.0], {FLOAT32: (1.0, [448.0, -224.0, 1.0])}),
    # amax 3*448: s = 1344/448 = 3 exactly (true division); ceil: 4. 1/3 -> 0.34375 (11 * 2^-5);
    # ceil: 1344/4 = 336 and 672/4 = 168 are e4m3 ties -> even mantissas 320 and 160.
    "amax-3x448": (
        [1344.0, 672.0, -1.0],
        {FLOAT32: (3.0, [448.0, 224.0, -0.34375]), CEIL: (4.0, [320.0, 160.0, -0.25])},
    ),
    # All zero: amax = eps = 1e-10; float32 s = 1e-10/448; ceil s = 2^-33; q = 0.
    "zero-group": ([0.0], {FLOAT32: (EPS_OVER_448, [0.0]), CEIL: (CEIL_OF_EPS, [0.0])}),
    # amax 1e-12 < eps: s as for zeros. float32: 1e-12 / (1e-10/448) = 4.48 -> 4.5;
    # ceil: 1e-12 * 2^33 = 0.00859 = 4.4 * 2^-9 (e4m3 subnormal) -> 4 * 2^-9.
    "amax-below-eps": (
        [1e-12],
        {FLOAT32: (EPS_OVER_448, [4.5]), CEIL: (CEIL_OF_EPS, [0.0078125])},
    ),
}


def _expected_group(case: str, fmt: ScaleFmt) -> tuple[float, list[float]]:
    table = GROUP_CASES[case][1]
    if fmt in table:
        return table[fmt]
    # amax 448 gives s = 1 everywhere; PACKED quantizes exactly like CEIL at this stage.
    return table[CEIL] if CEIL in table else table[FLOAT32]


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_quantize_fp8_groups_hand_cases(case: str, fmt: ScaleFmt) -> None:
    head = GROUP_CASES[case][0]
    x = torch.zeros(1, 128)
    x[0, : len(head)] = f32(*head)
    q, s = quantize_fp8_groups(x, 128, fmt)
    scale, q_head = _expected_group(case, fmt)
    assert q.dtype == FP8 and q.shape == (1, 128)
    assert s.dtype == F32 and s.shape == (1, 1)
    assert s.item() == scale
    assert q.float()[0, : len(q_head)].tolist() == q_head
    assert not bool(q.float()[0, len(q_head) :].any())


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
def test_quantize_fp8_groups_groups_are_independent(fmt: ScaleFmt) -> None:
    # bf16 input. Row 0: group amaxes 448 (s=1) and 896 (s=2); row 1: 224 (s=0.5) and 1.0
    # (s = fp32(1/448), or its ceiling 2^-8).
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[0, 5], x[0, 200], x[1, 7], x[1, 130] = 448.0, -896.0, 224.0, 1.0
    q, s = quantize_fp8_groups(x, 128, fmt)
    assert s.tolist() == [[1.0, 2.0], [0.5, HEX("0x1.24924ap-9") if fmt is FLOAT32 else 2.0**-8]]
    assert s.stride() == (2, 1)
    assert q.float()[0, [5, 200]].tolist() == [448.0, -448.0]
    assert q.float()[1, 7].item() == 448.0
    # 1.0 / fp32(1/448) = 447.99998 -> 448; ceil: 1.0 / 2^-8 = 256.
    assert q.float()[1, 130].item() == (448.0 if fmt is FLOAT32 else 256.0)


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Oracle: RNE of fp32 v onto e4m3 (saturating at 448) from the decoded code table."""
    table = E4M3_TABLE[POSITIVE_CODES]
    mag = v.double().abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(table, mag).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    return (code | torch.where(v < 0, 0x80, 0)).to(torch.uint8)  # signbit of 0.0 not exercised


@pytest.mark.parametrize("fmt", list(ScaleFmt), ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_fp8_groups_codes_are_nearest(fmt: ScaleFmt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 256, generator=gen) * torch.logspace(-3, 3, 8).unsqueeze(1)
    q, s = quantize_fp8_groups(x, 128, fmt)
    assert torch.equal(q.view(torch.uint8), nearest_e4m3(x / s.repeat_interleave(128, 1)))
    if fmt.is_ue8m0:
        ue8m0_bytes(s)  # raises unless every scale is a power of two


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"x": torch.ones(2, 130)}, r"K=130 must be a multiple of group=128", id="K"),
        pytest.param({"x": torch.ones(2, 128, dtype=torch.int32)}, r"x must have dtype", id="dt"),
        pytest.param({"x": torch.ones(2, 128), "eps": 0.0}, r"eps must be", id="eps-zero"),
        pytest.param({"x": torch.ones(2, 128), "group": 0}, r"group must be", id="group-zero"),
        pytest.param({"x": f32(*[1.0] * 127, math.nan)}, r"x must be finite", id="nan-x"),
        pytest.param(
            {"x": torch.ones(1, 128), "scale_fmt": "e8m0"},
            r"scale_fmt must be one of float32, float32_ceil_ue8m0, ue8m0_packed",
            id="fmt",
        ),
    ],
)
def test_quantize_fp8_groups_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_fp8_groups(**kwargs)


def test_dequantize_fp8_groups_hand_case() -> None:
    q = cast_to_fp8(f32(*[1.5] * 128, *[-2.0] * 128).reshape(1, 256))
    out = dequantize_fp8_groups(q, f32(4.0, 0.25).reshape(1, 2))
    assert out.dtype == F32 and out[0, 0].item() == 6.0 and out[0, 255].item() == -0.5


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        pytest.param(f32(1.0, math.nan).reshape(1, 2), r"scale must be finite.*NaN 1", id="nan"),
        pytest.param(f32(1.0, -1.0).reshape(1, 2), r"scale must be finite and >= 0", id="neg"),
        pytest.param(f32(1.0, 1.0, 1.0).reshape(1, 3), r"scale must have shape \(1, 2\)", id="sh"),
    ],
)
def test_dequantize_fp8_groups_rejects(scale: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dequantize_fp8_groups(torch.zeros(1, 256, dtype=FP8), scale)


# ---------------------------------------------------------------------------------------------
# FP8 128x128 weight blocks and the UE8M0 requant.
# ---------------------------------------------------------------------------------------------


def _block_weight() -> torch.Tensor:
    """[2 experts, 130, 130]: partial edge blocks on both axes (block grid 2 x 2)."""
    w = torch.zeros(2, 130, 130)
    w[0, 0, 0] = 1344.0  # block (0,0): amax 3*448
    w[0, 5, 129] = 896.0  # block (0,1), a 128x2 partial block: amax 2*448
    w[0, 129, 129] = -2.0  # block (1,1), a 2x2 partial block: amax 2
    w[1, 0, 0] = 448.0  # expert 1 block (0,0): amax 448; its other blocks are all zero
    return w


TINY = HEX("0x1.df595ap-23")  # fp32(fp32(1e-4) / 448): zero blocks (amax clamped to 1e-4)


@pytest.mark.parametrize(
    ("use_ue8m0", "scale", "codes"),
    [
        # 2/448 = 0.00446 is not exact: -2 / fp32(2/448) = -447.99997 -> -448.
        pytest.param(
            False,
            [[[3.0, 2.0], [TINY, 2 / 448]], [[1.0, TINY], [TINY, TINY]]],
            [448.0, 448.0, -448.0, 448.0],
            id="fp32-scales",
        ),
        # ceil: 3 -> 4 (1344/4 = 336, an e4m3 tie -> 320); 2.23e-7 -> 2^-22; 0.00446 -> 2^-7.
        pytest.param(
            True,
            [[[4.0, 2.0], [2.0**-22, 2.0**-7]], [[1.0, 2.0**-22], [2.0**-22, 2.0**-22]]],
            [320.0, 448.0, -256.0, 448.0],
            id="ue8m0-scales",
        ),
    ],
)
def test_quantize_fp8_blocks_hand_case(use_ue8m0: bool, scale: list, codes: list) -> None:
    q, s = quantize_fp8_blocks(_block_weight(), (128, 128), use_ue8m0)
    assert q.shape == (2, 130, 130) and q.dtype == FP8
    assert s.shape == (2, 2, 2) and s.dtype == F32
    assert s.tolist() == torch.tensor(scale, dtype=F32).tolist()
    picked = q.float()[[0, 0, 0, 1], [0, 5, 129, 0], [0, 129, 129, 0]]
    assert picked.tolist() == codes
    assert int(q.float().count_nonzero()) == 4


def test_quantize_fp8_blocks_2d_and_nonsquare_block() -> None:
    w = torch.zeros(3, 5)
    w[2, 4] = 7.0  # block (1, 2) of a (2, 2) blocking: amax 7 -> s = 7/448 = 1/64 exactly
    q, s = quantize_fp8_blocks(w, (2, 2))
    assert s.shape == (2, 3) and s[1, 2].item() == 1 / 64 and q.float()[2, 4].item() == 448.0


def test_dequantize_fp8_blocks_partial_blocks() -> None:
    q, s = quantize_fp8_blocks(_block_weight(), (128, 128))
    w = dequantize_fp8_blocks(q, s, (128, 128))
    assert w.shape == (2, 130, 130)
    assert w[0, 0, 0].item() == 1344.0  # 448 * 3
    assert w[0, 5, 129].item() == 896.0  # 448 * 2 (block (0,1) is 128 x 2)
    assert w[0, 129, 129].item() == -448.0 * (2 / 448)  # block (1,1) is 2 x 2


def test_requantize_changes_non_power_of_two_scales() -> None:
    q, s = quantize_fp8_blocks(_block_weight(), (128, 128), use_ue8m0=False)
    rq, rs = requantize_blocks_ue8m0(q, s, (128, 128))
    assert rs[0, 0, 0].item() == 4.0  # 3 -> 4
    assert q.float()[0, 0, 0].item() == 448.0 and rq.float()[0, 0, 0].item() == 320.0
    # Lossy double quantization: 1344 comes back as 320 * 4 = 1280.
    assert dequantize_fp8_blocks(rq, rs)[0, 0, 0].item() == 1280.0
    ue8m0_bytes(rs)  # every new scale is a power of two


@pytest.mark.parametrize("seed", [0, 1])
def test_requantize_is_a_noop_for_power_of_two_scales(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 200, 300, generator=gen) * 10.0 ** torch.randint(
        -3, 3, (2, 1, 1), generator=gen
    )
    q, s = quantize_fp8_blocks(w, (128, 128), use_ue8m0=True)
    rq, rs = requantize_blocks_ue8m0(q, s, (128, 128))
    assert torch.equal(rq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs, s)


def test_requantize_small_codes_moves_scale_keeps_values() -> None:
    # A power-of-two scale with codes far below 448: the scale shrinks, the values stay exact.
    q = cast_to_fp8(torch.ones(1, 128, 128))
    rq, rs = requantize_blocks_ue8m0(q, f32(1.0).reshape(1, 1, 1))
    assert rs.item() == 2.0**-8 and rq.float()[0, 0, 0].item() == 256.0  # ceil(1/448) = 2^-8
    assert torch.equal(dequantize_fp8_blocks(rq, rs), q.float())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: quantize_fp8_blocks(torch.ones(4, 4), (128,)), r"block must be", id="block"
        ),
        pytest.param(lambda: quantize_fp8_blocks(torch.ones(4)), r"at least 2 dims", id="1d"),
        pytest.param(
            lambda: quantize_fp8_blocks(f32(math.inf, 1.0).reshape(1, 2)),
            r"w must be finite",
            id="inf",
        ),
        pytest.param(
            lambda: dequantize_fp8_blocks(torch.zeros(130, 130, dtype=FP8), torch.ones(1, 2)),
            r"scale must have shape \(2, 2\)",
            id="scale-shape",
        ),
        pytest.param(
            lambda: dequantize_fp8_blocks(
                torch.zeros(2, 2, dtype=FP8), f32(math.nan).reshape(1, 1)
            ),
            r"NaN 1",
            id="scale-nan",
        ),
        pytest.param(
            lambda: requantize_blocks_ue8m0(
                torch.tensor([[0x7F]], dtype=torch.uint8).view(FP8), torch.ones(1, 1)
            ),
            r"q must be finite",
            id="requant-nan-code",
        ),
        pytest.param(
            lambda: requantize_blocks_ue8m0(torch.zeros(2, 2), torch.ones(1, 1)),
            r"q must have dtype float8_e4m3fn",
            id="requant-dtype",
        ),
    ],
)
def test_fp8_blocks_reject(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
