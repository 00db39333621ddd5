"""The Triton m-grouped contiguous GEMM against fp32 dequant-matmul of the same quantized operands.

Two kinds of checks:
- exact: operands built so that every output is a small multiple of a power of two, exactly
  representable in fp32 partial sums and in bf16, whatever the summation order. The kernel must
  then match bitwise, which catches a row computed with a neighbouring row, another expert, a
  wrong K group's scale or a wrong column, down to one element.
- random: realistic values, compared with an error bound derived below (no tuned literal).
Padding rows (m_indices == -1) carry NaN bytes in A: the kernel must still write exact zeros
there and keep the NaNs out of every live row.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moe_verify.spec import QuantizedWeight
from optimized.kernels.grouped_gemm import grouped_gemm
from reference import formats
from reference.gemm import dequantize_activations, dequantize_weight

pytestmark = pytest.mark.cpu

FP8 = torch.float8_e4m3fn
_NAN_E4M3 = 0x7F
_E8M0_ONE = 127  # byte of 2^0
# fp32 and bf16 unit roundoffs (round to nearest: half an ulp relative to the value).
_U32 = 2.0**-24
_U_BF16 = 2.0**-8


@dataclass(frozen=True)
class Case:
    """One grouped GEMM. `counts` are live rows per expert; segments are padded to `alignment`."""

    weights: str  # fp8_block | mxfp8 | mxfp4
    a_layout: str  # row | col | tma | strided | packed
    counts: tuple[int, ...]
    alignment: int
    n: int
    k: int
    block_m: int | None = None

    @property
    def a_group(self) -> int:
        return 32 if self.weights == "mxfp8" else 128

    @property
    def id(self) -> str:
        counts = "_".join(map(str, self.counts))
        text = f"{self.weights}-{self.a_layout}-A{self.alignment}-N{self.n}-K{self.k}-c{counts}"
        return text + (f"-BM{self.block_m}" if self.block_m else "")

    @property
    def seed(self) -> int:
        return sum(ord(c) * (i + 1) for i, c in enumerate(self.id)) % (2**31)


CASES = [
    Case("fp8_block", "row", (70, 0, 33), 128, 256, 256),  # SM90 recipe, empty middle expert
    Case("fp8_block", "col", (5, 64, 1), 64, 128, 256),  # column-major fp32 scales, A=64
    Case("fp8_block", "tma", (17, 9), 32, 144, 128),  # TMA-aligned scales; N=144: partial tile
    Case("fp8_block", "strided", (40, 40), 96, 96, 256),  # A=96 -> BLOCK_M 32; odd scale stride
    Case("fp8_block", "packed", (30, 0, 0, 12), 32, 64, 512),  # UE8M0 packed, 4 groups in a word
    Case("fp8_block", "row", (3, 11, 6), 8, 48, 128),  # A=8 < 16: per-row experts in a block
    Case("fp8_block", "row", (20, 45, 2), 32, 64, 128, block_m=64),  # block_m > alignment
    Case("mxfp8", "row", (25, 7), 32, 128, 256),  # MXFP8 with fp32 per-32 activation scales
    Case("mxfp8", "packed", (0, 50, 13), 64, 80, 160),  # MXFP8 recipe: packed, 5 groups -> 2 words
    Case("mxfp8", "packed", (40, 24), 32, 64, 256),  # packed per-32 scales folded, 128-K chunks
    Case("mxfp8", "tma", (9, 9, 9), 32, 32, 128),  # MXFP8, TMA-aligned fp32 scales
    Case("mxfp4", "row", (33, 21), 64, 128, 256),  # W4A8: E2M1 weights, fp32 act scales
    Case("mxfp4", "packed", (12, 0, 40), 32, 96, 256),  # W4A8 on SM100 formats
    Case("mxfp4", "col", (4, 19), 16, 64, 128, block_m=32),  # W4A8, per-row path
]


def _m_indices(case: Case) -> torch.Tensor:
    rows: list[int] = []
    for e, c in enumerate(case.counts):
        rows += [e] * c + [-1] * (-c % case.alignment)
    rows += [-1] * case.alignment  # a whole padding block past the last segment
    return torch.tensor(rows, dtype=torch.int32)


def _layout_a_scale(case: Case, fp32_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [M, G] -> the case's storage: same values, different strides, or packed UE8M0."""
    m, groups = fp32_scale.shape
    if case.a_layout == "row":
        return fp32_scale.contiguous()
    if case.a_layout == "col":
        return fp32_scale.t().contiguous().t()
    if case.a_layout in ("tma", "strided"):
        lead = -(-m // 4) * 4 if case.a_layout == "tma" else m + 5
        store = torch.full((groups * lead,), float("nan"))
        view = store.as_strided((m, groups), (1, lead))
        view.copy_(fp32_scale)
        return view
    return formats.pack_ue8m0(formats.ue8m0_bytes(fp32_scale))


def _weights(case: Case, e: int, g: torch.Generator, exact: bool) -> QuantizedWeight:
    n, k = case.n, case.k
    if case.weights == "mxfp4":
        if exact:
            # Magnitudes {0, 1, 2, 4} (codes 0, 2, 4, 6) with random signs.
            codes = torch.tensor([0, 2, 4, 6])[torch.randint(0, 4, (e, n, k), generator=g)]
            codes |= torch.randint(0, 2, (e, n, k), generator=g) << 3
            sbytes = torch.randint(_E8M0_ONE - 1, _E8M0_ONE + 1, (e, n, k // 32), generator=g)
        else:
            codes = torch.randint(0, 16, (e, n, k), generator=g)
            sbytes = torch.randint(_E8M0_ONE - 8, _E8M0_ONE + 3, (e, n, k // 32), generator=g)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return QuantizedWeight(packed, sbytes.to(torch.uint8), (1, 32))
    if exact:
        q = torch.randint(-4, 5, (e, n, k), generator=g).float().to(FP8)
    else:
        q = (torch.randn(e, n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    if case.weights == "mxfp8":
        lo, hi = (_E8M0_ONE - 1, _E8M0_ONE + 1) if exact else (_E8M0_ONE - 10, _E8M0_ONE + 2)
        sbytes = torch.randint(lo, hi, (e, n, k // 32), generator=g).to(torch.uint8)
        return QuantizedWeight(q, sbytes, (1, 32))
    shape = (e, -(-n // 128), k // 128)
    if exact:
        scale = 2.0 ** -torch.randint(0, 2, shape, generator=g).float()
    else:
        scale = torch.rand(shape, generator=g) * 1e-3 + 1e-5
    return QuantizedWeight(q, scale, (128, 128))


def _activations(
    case: Case, m_indices: torch.Tensor, g: torch.Generator, exact: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k, group = m_indices.numel(), case.k, case.a_group
    if exact:
        # Two nonzeros of +-1 per row at random columns: with |b| <= 4 (fp8) or 4 (E2M1) and
        # scales in {1/2, 1, 2}, each output is a sum of two terms, |d| <= 32 on a 1/4 grid:
        # at most 8 significant bits, exact in bf16 and in any fp32 summation order.
        a = torch.zeros(m, k)
        cols = torch.rand(m, k, generator=g).argsort(1)[:, :2]
        a.scatter_(1, cols, torch.randint(0, 2, (m, 2), generator=g).float() * 2 - 1)
        scale = 2.0 ** torch.randint(0, 2, (m, k // group), generator=g).float()
    else:
        a = (torch.randn(m, k, generator=g) * 32).clamp(-448, 448)
        # Packed UE8M0 needs powers of two; fp32 layouts take any positive scale.
        if case.a_layout == "packed":
            scale = 2.0 ** torch.randint(-12, -2, (m, k // group), generator=g).float()
        else:
            scale = torch.rand(m, k // group, generator=g) * 0.01 + 1e-4
    q = a.to(FP8)
    pad = m_indices < 0
    q.view(torch.uint8)[pad] = _NAN_E4M3  # garbage in padding rows must not leak
    return q, scale


def _reference(
    q: torch.Tensor, scale: torch.Tensor, case: Case, w: QuantizedWeight, m_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 dequant-matmul of live rows (no rounding), and sum_k |a_k b_k| for the error bound."""
    a = dequantize_activations(q, scale, case.a_group)
    out = torch.zeros(q.shape[0], case.n)
    mag = torch.zeros(q.shape[0], case.n)
    for e in range(w.q.shape[0]):
        rows = (m_indices == e).nonzero().flatten()
        b = dequantize_weight(w, e)
        out[rows] = a[rows].double().matmul(b.double().T).float()
        mag[rows] = a[rows].abs().double().matmul(b.abs().double().T).float()
    return out, mag


def _prepare(case: Case, exact: bool):
    g = torch.Generator().manual_seed(case.seed + exact)
    m_indices = _m_indices(case)
    w = _weights(case, len(case.counts), g, exact)
    q, fp32_scale = _activations(case, m_indices, g, exact)
    a_scale = _layout_a_scale(case, fp32_scale)
    d = grouped_gemm(
        q, a_scale, case.a_group, w.q, w.scale, w.block, m_indices, case.alignment,
        block_m=case.block_m,
    )  # fmt: skip
    ref, mag = _reference(q, fp32_scale, case, w, m_indices)
    return d, ref, mag, m_indices


def _describe(case: Case, bad: torch.Tensor, d: torch.Tensor, ref: torch.Tensor, m_idx) -> str:
    r, n = (int(v) for v in bad.nonzero()[0])
    return (
        f"{case.id}: {int(bad.sum())} elements wrong; first at row {r} (expert {int(m_idx[r])}), "
        f"column {n}: kernel {float(d[r, n])!r}, reference {float(ref[r, n])!r}"
    )


ids = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)


@ids
def test_exact_values_bitwise(case: Case) -> None:
    d, ref, _, m_indices = _prepare(case, exact=True)
    assert d.dtype == torch.bfloat16 and d.shape == (m_indices.numel(), case.n)
    # Every reference value is exact in bf16 by construction; check that it is, then compare bits.
    assert torch.equal(ref.to(torch.bfloat16).float(), ref)
    bad = d.float() != ref
    assert not bool(bad.any()), _describe(case, bad, d, ref, m_indices)


@ids
def test_random_values_within_bound(case: Case) -> None:
    d, ref, mag, m_indices = _prepare(case, exact=False)
    live = (m_indices >= 0).unsqueeze(1)
    # Error bound. Products of the (exact) dequantized operands are exact in fp32; the kernel
    # sums K of them in fp32 (interpreter: a plain fp32 matmul per K chunk), multiplies each chunk
    # by two scales and adds it to the accumulator: at most K + 3 * chunks + 1 roundings, each
    # <= U32 relative to sum_k |a_k b_k| (first-order bound for recursive summation). The final
    # bf16 rounding adds U_BF16 * |value|. (On a GPU the fp8 tensor core's in-chunk accumulation
    # is not IEEE fp32; that tier needs the policy table's measured bound, not this one.)
    chunks = case.k // 32  # at least 32 K per chunk
    delta = (case.k + 3 * chunks + 1) * _U32 * mag
    bound = _U_BF16 * (ref.abs() + delta) + delta
    err = (d.float() - ref).abs()
    bad = live & ~(err <= bound)  # NaN fails
    assert not bool(bad.any()), _describe(case, bad, d, ref, m_indices)
    assert bool(torch.isfinite(d.float()).all())
    # The bound is not vacuous: it is within a few bf16 ulps of the value.
    assert bool(
        (
            bound[live.expand_as(bound)] <= 4 * _U_BF16 * (ref.abs() + mag)[live.expand_as(bound)]
        ).all()
    )


@ids
def test_padding_rows_are_zero(case: Case) -> None:
    d, _, _, m_indices = _prepare(case, exact=False)
    pad = d[m_indices < 0].view(torch.int16)
    assert not bool(pad.any()), f"{case.id}: padding rows must be exact +0.0 (their A rows are NaN)"


def _expert_ends(case: Case) -> torch.Tensor:
    """The psum layout of `_m_indices(case)`: start_e + count_e, starts aligned."""
    ends, start = [], 0
    for c in case.counts:
        ends.append(start + c)
        start += -(-c // case.alignment) * case.alignment
    return torch.tensor(ends, dtype=torch.int32)


# A mix of weight formats, scale storages, empty experts and the per-row path.
PSUM_CASES = [CASES[i] for i in (0, 4, 5, 8, 12)]


@pytest.mark.parametrize("case", PSUM_CASES, ids=lambda c: c.id)
def test_psum_layout_matches_m_indices_on_live_rows_and_skips_the_rest(case: Case) -> None:
    """The psum layout (expert_ends) computes every live row bit for bit as the m_indices layout
    does, and leaves gap and tail rows as they were (DeepGEMM: unspecified); their A rows are
    NaN bytes, so reading one would show in a live row's neighbours only if rows mixed."""
    d, _, _, m_indices = _prepare(case, exact=False)
    g = torch.Generator().manual_seed(case.seed)  # the operands _prepare built
    w = _weights(case, len(case.counts), g, False)
    q, fp32_scale = _activations(case, m_indices, g, False)
    sentinel = torch.full(d.shape, 12345.0).to(torch.bfloat16)
    out = grouped_gemm(
        q, _layout_a_scale(case, fp32_scale), case.a_group, w.q, w.scale, w.block,
        _expert_ends(case), case.alignment, use_psum_layout=True, block_m=case.block_m,
        out=sentinel.clone(),
    )  # fmt: skip
    live = m_indices >= 0
    assert torch.equal(out[live].view(torch.int16), d[live].view(torch.int16)), case.id
    assert torch.equal(out[~live].view(torch.int16), sentinel[~live].view(torch.int16)), case.id


def test_empty_m_sum_returns_empty() -> None:
    w = torch.zeros(2, 32, 128).to(FP8)
    out = grouped_gemm(
        torch.zeros(0, 128).to(FP8), torch.zeros(0, 1), 128, w, torch.ones(2, 1, 1), (128, 128),
        torch.zeros(0, dtype=torch.int32), 128,
    )  # fmt: skip
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_e8m0_edge_bytes() -> None:
    """Byte 0 scales by 2^-127 (not 0) and byte 255 is NaN, as the tensor core reads E8M0."""
    m_indices = torch.zeros(32, dtype=torch.int32)
    a = torch.full((32, 32), 1.0).to(FP8)
    a_scale = torch.ones(32, 1)
    b = torch.full((1, 16, 32), 1.0).to(FP8)
    sb = torch.full((1, 16, 1), _E8M0_ONE, dtype=torch.uint8)
    sb[0, 0, 0] = 0
    sb[0, 1, 0] = 255
    # With the activation scaled by 2^100, column 0 is 32 * 2^-127 * 2^100 = 2^-22.
    d = grouped_gemm(a, a_scale * 2.0**100, 32, b, sb, (1, 32), m_indices, 32)
    assert float(d[0, 0]) == 2.0**-22
    assert bool(d[:, 1].float().isnan().all())
    assert float(d[0, 2]) == 32 * 2.0**100


def test_fp4_weights_as_int8_match_uint8() -> None:
    """vLLM hands DeepGEMM E2M1 weights as int8 (kPackedFP4): same bytes, same result."""
    case = next(c for c in CASES if c.weights == "mxfp4")
    g = torch.Generator().manual_seed(case.seed)
    m_indices = _m_indices(case)
    w = _weights(case, len(case.counts), g, exact=False)
    q, scale = _activations(case, m_indices, g, exact=False)
    a_scale = _layout_a_scale(case, scale)
    args = (q, a_scale, case.a_group)
    tail = (w.scale, w.block, m_indices, case.alignment)
    as_uint8 = grouped_gemm(*args, w.q, *tail)
    as_int8 = grouped_gemm(*args, w.q.view(torch.int8), *tail)
    assert torch.equal(as_uint8.view(torch.int16), as_int8.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Bad inputs: refused before launch, naming the argument.


def _good() -> dict:
    return dict(
        a=torch.zeros(64, 256).to(FP8),
        a_scale=torch.ones(64, 2),
        a_group=128,
        b=torch.zeros(2, 32, 256).to(FP8),
        b_scale=torch.ones(2, 1, 2),
        b_block=(128, 128),
        grouped_layout=torch.tensor([0] * 20 + [-1] * 12 + [1] * 32, dtype=torch.int32),
        alignment=32,
    )


def _psum(ends: list[int], dtype: torch.dtype = torch.int32) -> dict:
    """The same call in the psum layout (expert 0: rows 0..19, expert 1: rows 32..63)."""
    return dict(grouped_layout=torch.tensor(ends, dtype=dtype), use_psum_layout=True)


def _mixed_block() -> torch.Tensor:
    return torch.tensor([0] * 20 + [1] * 12 + [1] * 32, dtype=torch.int32)


def _late_row() -> torch.Tensor:
    return torch.tensor([0] * 20 + [-1] * 5 + [0] * 7 + [1] * 32, dtype=torch.int32)


BAD = [
    ("expert-out-of-range", dict(grouped_layout=torch.full((64,), 2, dtype=torch.int32)), "E=2"),
    ("minus-two", dict(grouped_layout=torch.full((64,), -2, dtype=torch.int32)), "m_indices"),
    ("two-experts-in-a-block", dict(grouped_layout=_mixed_block()), "aligned block"),
    ("live-row-after-padding", dict(grouped_layout=_late_row()), "aligned block"),
    ("m_indices-int64", dict(grouped_layout=torch.zeros(64, dtype=torch.int64)), "m_indices"),
    ("M_sum-not-aligned", dict(alignment=48), "alignment"),
    ("K-not-multiple-of-group", dict(a=torch.zeros(64, 160).to(FP8)), "K"),
    ("a_group-unsupported", dict(a_group=16, a_scale=torch.ones(64, 16)), "group"),
    ("a-bf16", dict(a=torch.zeros(64, 256, dtype=torch.bfloat16)), "a must be float8"),
    ("a_scale-wrong-groups", dict(a_scale=torch.ones(64, 3)), "a_scale"),
    ("a_scale-packed-wrong-words", dict(a_scale=torch.ones(64, 2, dtype=torch.int32)), "a_scale"),
    ("N-not-multiple-of-16", dict(b=torch.zeros(2, 40, 256).to(FP8)), "N=40"),
    ("b_scale-wrong-shape", dict(b_scale=torch.ones(2, 2, 2)), "b_scale"),
    ("fp4-with-128-blocks", dict(b=torch.zeros(2, 32, 128, dtype=torch.uint8)), "b_block"),
    ("b_block-unknown", dict(b_block=(1, 128)), "b_block"),
    ("psum-end-below-start", _psum([20, 31]), "below the start"),  # expert 1 starts at 32
    ("psum-end-past-M_sum", _psum([20, 65]), "past the buffer"),
    ("psum-per-row-shape", _psum([0] * 64), r"expert_ends must have shape \[E\]"),
    ("psum-int64", _psum([20, 64], torch.int64), "expert_ends"),
]


@pytest.mark.parametrize("name,change,arg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name: str, change: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        grouped_gemm(**{**_good(), **change})
