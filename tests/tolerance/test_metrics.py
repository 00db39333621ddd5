"""Metric functions: each returns the right number, the right coordinates, and can tell a
difference apart from none (every case below has an equal and a differing side)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_verify.production.host_reads import HostReads
from tolerance import metrics as m

pytestmark = pytest.mark.cpu


def _e4m3(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).to(torch.float8_e4m3fn)


# -- bitwise / integer equality -------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
    ids=["fp32", "bf16", "fp8"],
)
def test_bitwise_mismatch_counts_and_finds_first(dtype: torch.dtype) -> None:
    a = torch.zeros(3, 5).to(dtype)
    b = a.clone()
    assert m.bitwise_mismatch(a, b) == m.Mismatch(0, 15, None)
    b[1, 2] = 1.0
    b[2, 4] = 2.0
    assert m.bitwise_mismatch(a, b) == m.Mismatch(2, 15, (1, 2))


def test_a_summary_reads_the_host_once() -> None:
    """A mismatch's count, first coordinates and rows, and the worst element's coordinates, each
    come from one host read however many numbers they hold."""
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[2, 5] = mask[3, 0] = True
    x = torch.arange(24.0).reshape(4, 6)
    x[1, 1] = float("nan")
    with HostReads().counting() as reads:
        assert m.mismatch_of(mask) == m.Mismatch(2, 24, (2, 5), 2)
        assert m.mismatch_of(torch.zeros(3, 2, dtype=torch.bool)) == m.Mismatch(0, 6, None, 0)
        assert m.argmax_coords(x) == (1, 1)
        assert m.argmax_coords(torch.arange(24.0).reshape(4, 6)) == (3, 5)
        assert m.first_true(mask) == (2, 5) and m.first_true(~mask.any(1, keepdim=True)) == (0, 0)
    assert reads.reads == ["tolist"] * 6, reads.reads


def test_bitwise_mismatch_tells_signed_zeros_apart() -> None:
    assert m.bitwise_mismatch(torch.tensor([0.0]), torch.tensor([-0.0])).count == 1


def test_bitwise_mismatch_treats_identical_nan_as_equal() -> None:
    nan = torch.tensor([float("nan")])
    assert m.bitwise_mismatch(nan, nan.clone()).equal


def test_bitwise_mismatch_refuses_shape_and_dtype_differences() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        m.bitwise_mismatch(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="dtypes differ"):
        m.bitwise_mismatch(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_bitwise_mismatch_reads_non_contiguous_views_logically() -> None:
    a = torch.arange(12.0).view(3, 4).t()
    b = a.contiguous()
    assert m.bitwise_mismatch(a, b).equal
    b[3, 1] = -1.0
    assert m.bitwise_mismatch(a, b).first == (3, 1)


def test_int_mismatch_widens_int32_against_int64() -> None:
    a = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    b = a.to(torch.int64)
    assert m.int_mismatch(a, b).equal
    b[1, 1] = 3
    assert m.int_mismatch(a, b) == m.Mismatch(1, 4, (1, 1))


# -- fp8 codes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, distance",
    [
        (1.0, 1.0, 0),
        (1.0, 1.125, 1),  # adjacent normals
        (1.0, 0.9375, 1),  # across a binade boundary
        (1.0, 1.5, 4),
        (0.0, -0.0, 0),  # both zeros are the same value
        (2.0**-9, -(2.0**-9), 2),  # smallest subnormals of each sign
        (448.0, -448.0, 252),
    ],
    ids=["same", "adjacent", "binade", "four", "signed-zero", "subnormal-sign", "full-range"],
)
def test_fp8_code_distance(a: float, b: float, distance: int) -> None:
    assert int(m.fp8_code_distance(_e4m3([a]), _e4m3([b]))[0]) == distance


def test_fp8_code_distance_marks_nan() -> None:
    nan = torch.tensor([0x7F], dtype=torch.uint8)
    one = _e4m3([1.0]).view(torch.uint8)
    assert int(m.fp8_code_distance(nan, one)[0]) == m.FP8_NAN_DISTANCE
    assert int(m.fp8_code_distance(nan, nan)[0]) == 0


def test_fp8_value_distance_one_exponent_flip_is_within_one_coarse_ulp() -> None:
    # The same y quantized at scale 1 and at scale 2 (a UE8M0 flip): 1.125 vs 0.5625*2 agree;
    # 1.25 vs 0.5625*2 = 1.125 is one step of the coarser grid (0.0625*2) apart.
    qa = _e4m3([1.125, 1.25, 0.875])
    qb = _e4m3([0.5625, 0.5625, 0.4375])
    sa, sb = torch.ones(3), torch.full((3,), 2.0)
    dist = m.fp8_value_distance(qa, sa, qb, sb)
    assert dist.tolist() == [0.0, 1.0, 0.0]


# -- ulp distances --------------------------------------------------------------------------------


def test_e4m3_ulp_is_the_gap_to_the_next_code_everywhere() -> None:
    codes = torch.arange(0, 0x7E, dtype=torch.uint8)  # +0 up to 416, each with a finite successor
    values = m.e4m3_value(codes).double()
    gap = m.e4m3_value(codes + 1).double() - values
    assert torch.equal(m.e4m3_ulp(values), gap)
    assert torch.equal(m.e4m3_ulp(-values), gap)  # magnitude only
    below_a_binade = values[1:] - gap[:-1] / 4  # just under each code: the lower binade's gap
    assert torch.equal(m.e4m3_ulp(below_a_binade), gap[:-1])
    inf_nan = m.e4m3_ulp(torch.tensor([math.inf, math.nan], dtype=torch.float64))
    assert math.isinf(inf_nan[0]) and math.isnan(inf_nan[1])


def test_bf16_ulp_distance_counts_representable_steps() -> None:
    a = torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0], dtype=torch.bfloat16)
    up = torch.nextafter(a.float(), torch.tensor(float("inf"))).to(torch.bfloat16)
    assert m.bf16_ulp_distance(a, a).tolist() == [0] * 5
    b = torch.tensor([1.0078125, 1.015625, -1.0078125, -0.0, 0.0], dtype=torch.bfloat16)
    assert m.bf16_ulp_distance(a, b).tolist() == [1, 2, 1, 0, 0]
    assert bool((m.bf16_ulp_distance(a, up) <= 1).all())


def test_bf16_ulp_distance_across_zero() -> None:
    tiny = torch.tensor([9.18e-41], dtype=torch.bfloat16)  # the smallest bf16 subnormal
    assert int(m.bf16_ulp_distance(tiny, -tiny)[0]) == 2


def test_bf16_ulp_distance_marks_nan_on_one_side() -> None:
    a = torch.tensor([float("nan"), float("nan")])
    b = torch.tensor([1.0, float("nan")])
    assert m.bf16_ulp_distance(a, b).tolist() == [m.BF16_NAN_DISTANCE, 0]


def test_fp32_ulp_distance() -> None:
    a = torch.tensor([0.25, 0.25])
    b = torch.nextafter(a, torch.tensor([1.0, 0.0]))
    assert m.fp32_ulp_distance(a, b).tolist() == [1, 1]
    assert m.fp32_ulp_distance(a, a).tolist() == [0, 0]


# -- calc_diff ------------------------------------------------------------------------------------


def test_calc_diff_identical_is_zero() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    assert m.calc_diff(x, x.clone()) == 0.0


def test_calc_diff_both_zero_is_zero() -> None:
    assert m.calc_diff(torch.zeros(4), torch.zeros(4)) == 0.0


def test_calc_diff_opposite_is_two() -> None:
    x = torch.randn(32, generator=torch.Generator().manual_seed(2))
    assert m.calc_diff(x, -x) == pytest.approx(2.0)


def test_calc_diff_matches_the_formula_in_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    xd, yd = x.double(), y.double()
    expected = 1.0 - 2.0 * float((xd * yd).sum()) / float((xd * xd + yd * yd).sum())
    assert m.calc_diff(x, y) == pytest.approx(expected)


def test_calc_diff_propagates_nan() -> None:
    assert math.isnan(m.calc_diff(torch.tensor([float("nan"), 1.0]), torch.ones(2)))


# -- abs / rel / per row --------------------------------------------------------------------------


def test_max_errors_coordinates() -> None:
    b = torch.tensor([[1.0, 2.0, 4.0], [8.0, 0.5, 1.0]])
    a = b.clone()
    a[1, 0] += 1.0  # largest absolute error
    a[1, 1] += 0.25  # largest relative error (0.5)
    stats = m.max_errors(a, b)
    assert (stats.max_abs, stats.abs_at) == (1.0, (1, 0))
    assert (stats.max_rel, stats.rel_at) == (0.5, (1, 1))


def test_max_errors_nan_is_worst() -> None:
    a = torch.tensor([1.0, float("nan"), 100.0])
    stats = m.max_errors(a, torch.ones(3))
    assert stats.abs_at == (1,)


def test_rel_error_zero_golden() -> None:
    a, b = torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0])
    assert m.rel_error(a, b).tolist() == [0.0, math.inf]


def test_row_rel_error_per_row_worst_and_column() -> None:
    b = torch.tensor([[4.0, 2.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    a = b.clone()
    a[0, 2] += 0.5  # 0.5 / rowmax 4
    a[2, 1] = 1.0  # golden row all zero: infinite
    values, cols = m.row_rel_error(a, b)
    assert values.tolist() == [0.125, 0.0, math.inf]
    assert cols.tolist()[0] == 2 and cols.tolist()[2] == 1


def test_row_worst_prefers_nan() -> None:
    values, cols = m.row_worst(torch.tensor([[1.0, float("nan"), 5.0]]))
    assert math.isnan(float(values[0])) and int(cols[0]) == 1


@pytest.mark.parametrize(
    "atol, rtol, expected",
    [(0.0, 0.0, 0.5), (0.1, 0.0, 0.25), (0.0, 0.5, 0.25), (1.0, 0.0, 0.0)],
    ids=["exact", "atol", "rtol", "loose"],
)
def test_mismatch_fraction(atol: float, rtol: float, expected: float) -> None:
    b = torch.tensor([1.0, 1.0, 1.0, 1.0])
    a = torch.tensor([1.0, 1.05, 1.0, 1.6])
    assert m.mismatch_fraction(a, b, atol, rtol) == expected


def test_beyond_tolerance_counts_nan_and_scales_atol_per_row() -> None:
    b = torch.tensor([[10.0, 0.0], [1.0, 0.0]])
    a = torch.tensor([[10.0, 0.5], [1.0, float("nan")]])
    beyond = m.beyond_tolerance(a, b, atol=0.1, rtol=0.0, scale=m.row_max(b))
    assert beyond.tolist() == [[False, False], [False, True]]


def test_excess_ratio() -> None:
    b = torch.tensor([2.0, 0.0, 1.0])
    a = torch.tensor([2.5, 0.0, 1.0])
    assert m.excess_ratio(a, b, atol=0.0, rtol=0.5).tolist() == [0.5, 0.0, 0.0]
    assert m.excess_ratio(torch.tensor([1.0]), torch.tensor([0.0]), 0.0, 0.5).tolist() == [math.inf]


# -- NaN / Inf ------------------------------------------------------------------------------------


def test_nan_inf_counts_float() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")], dtype=torch.bfloat16)
    assert m.nan_inf_counts(x) == (1, 2)
    assert m.nan_inf_counts(torch.ones(3)) == (0, 0)


def test_nan_inf_counts_fp8_codes() -> None:
    codes = torch.tensor([0x7F, 0xFF, 0x38, 0x00], dtype=torch.uint8)
    assert m.nan_inf_counts(codes) == (2, 0)
    assert m.nan_inf_counts(codes.view(torch.float8_e4m3fn)) == (2, 0)


def test_first_true_and_unravel() -> None:
    mask = torch.zeros(2, 3, 4, dtype=torch.bool)
    assert m.first_true(mask) is None
    mask[1, 2, 3] = True
    mask[1, 0, 0] = True
    assert m.first_true(mask) == (1, 0, 0)
    assert m.unravel(23, (2, 3, 4)) == (1, 2, 3)
