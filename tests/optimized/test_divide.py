"""`divide_by_scale`, the quantizers' x / s (act_quant and quant_input): the e4m3 codes of its
result are those of IEEE division for every finite bf16 x under scales across the range, on
rounding midpoints, under tiny scales and for special values. It is the IEEE division today; any
faster form (a reciprocal per group and Markstein's correction was tried, docs/perf.md) must keep
these codes: each test below failed for a form that got its case wrong."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from optimized.kernels.quant import divide_by_scale, to_fp8_satfinite

GROUP = 128


@triton.jit
def _divide_kernel(x_ptr, s_ptr, q_ptr, M, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < M
    offs = rows[:, None, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None, None], other=0.0)
    s = tl.load(s_ptr + rows[:, None], mask=ok[:, None], other=1.0)
    tl.store(q_ptr + offs, to_fp8_satfinite(divide_by_scale(x, s, False)), mask=ok[:, None, None])


def _codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _divide_kernel[(triton.cdiv(x.shape[0], 64),)](x, s, q, x.shape[0], GROUP=GROUP, BLOCK_M=64)
    return q.view(torch.uint8)


def _ieee_codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _bf16_groups() -> torch.Tensor:
    """Every finite bf16 value, sorted by magnitude into groups of 128 (a group's values alike
    in size, so its quotients spread over the whole e4m3 range rather than rounding to 0)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    x = x[x.abs().argsort()]
    x = torch.cat([x, x[: (-x.numel()) % GROUP]])
    return x.view(-1, GROUP)


@pytest.mark.parametrize("factor", [1.0, 1.0000001, 1.37, 3.0, 1000.0, 2.0**20])
def test_codes_match_ieee_division_over_every_bf16(factor: float) -> None:
    """s = amax / 448 * factor per group (the quantizers' scale: every |x / s| <= 448), and
    with a random mantissa per group: every code equals IEEE division's."""
    x = _bf16_groups()
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    g = torch.Generator().manual_seed(int(factor * 1000) % 2**31)
    jitter = 1 + torch.rand(amax.shape, generator=g)
    for s in (amax / 448 * factor, amax / 448 * factor * jitter):
        s = s.float()
        got, want = _codes(x, s), _ieee_codes(x, s)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (
            f"{bad.shape[0]} codes differ, first x={x[tuple(bad[0])].item()!r} "
            f"s={s[bad[0][0], 0].item()!r}: {got[tuple(bad[0])]} vs IEEE {want[tuple(bad[0])]}"
        )


def test_quotients_on_a_rounding_midpoint() -> None:
    """x = m * s exactly, m every midpoint between two e4m3 values, s of few significant bits
    (3, 5, 7, 0.75, 11 * 2^-10 ...): IEEE division lands on the midpoint and rounds to even,
    where x times a rounded reciprocal of s lands beside it (3.1875 * fl(1/3) = 1.0625 + 2^-24:
    code 1.125, IEEE 1.0). Markstein's correction gets these right."""
    codes = torch.arange(0, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2
    mids = torch.cat([mids, -mids])
    scales = torch.tensor([3.0, 5.0, 7.0, 0.75, 11 * 2.0**-10, 13 * 2.0**20, 1.5, 9 * 2.0**-40])
    x = (mids[None, :] * scales[:, None]).flatten()
    keep = (x.to(torch.bfloat16).float() == x) & torch.isfinite(x)  # x itself a bf16 value
    s = scales[:, None].expand(-1, mids.numel()).flatten()[keep]
    x = x[keep]
    rows_x, rows_s = [], []  # one scale per row (group)
    for value in s.unique():
        xs = x[s == value]
        xs = torch.cat([xs, xs.new_zeros((-xs.numel()) % GROUP)]).view(-1, GROUP)
        rows_x.append(xs)
        rows_s.append(torch.full((xs.shape[0], 1), float(value)))
    x, s = torch.cat(rows_x), torch.cat(rows_s)
    assert x.numel() > 500
    assert torch.equal(_codes(x, s), _ieee_codes(x, s))


def test_tiny_scales_divide_exactly() -> None:
    """Under a scale of 2^-90 the FMA residual can underflow: x = -1.444797e-37 over
    s = 4.772491e-36 corrected by Markstein's step alone gives code 144, IEEE 143 (found by a
    random search); such tiles take the IEEE division."""
    x = torch.full((1, GROUP), -1.444797e-37)
    x[0, 1:] = torch.linspace(-2e-33, 2e-33, GROUP - 1)
    s = torch.tensor([[4.772491e-36]])
    assert torch.equal(_codes(x, s), _ieee_codes(x, s))


def test_special_values() -> None:
    """Zeros keep their sign, an infinite scale gives 0 (x / inf), a NaN x a NaN code."""
    x = torch.zeros(3, GROUP)
    x[0, 0], x[0, 1], x[0, 2] = -0.0, 3.0, float("nan")
    x[1, :4] = torch.tensor([-0.0, 1.0, -2.0, 3e38])
    x[2, :2] = torch.tensor([-1e-39, 1e-39])  # bf16-range subnormals
    s = torch.tensor([[0.75], [float("inf")], [0.1]])
    got, want = _codes(x, s), _ieee_codes(x, s)
    assert torch.equal(got[:, :4], want[:, :4]), (got[:, :4], want[:, :4])
    assert got[0, 0] == 0x80 and got[1, 0] == 0x80  # -0 stays -0
