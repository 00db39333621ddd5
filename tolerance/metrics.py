"""Error metrics between a tested tensor `a` and its golden `b`: pure, vectorized functions.

Conventions: the tested side comes first and the golden second, as in `assert_close(actual,
expected)`; shapes must match exactly (no broadcasting hides a wrong layout); coordinates are
tuples of ints in the tensors' logical (row-major) order. Nothing here knows about stages or
thresholds: the policy table holds every tolerance, `compare` decides what to measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Format facts (not tolerances): e4m3fn has 3 mantissa bits, smallest normal 2^-6, subnormal
# step 2^-9, and codes 0x7F / 0xFF are NaN (no Inf).
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6
E4M3_SUBNORMAL_STEP = 2.0**-9
# Distance reported when exactly one side is NaN (larger than any real code or ulp distance).
FP8_NAN_DISTANCE = 256
BF16_NAN_DISTANCE = 1 << 16
FP32_NAN_DISTANCE = 1 << 32

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class Mismatch:
    """How many elements differ, out of how many, and where the first one is; `rows`: how many
    rows (first index) hold one, for a mask of two or more dimensions (None otherwise)."""

    count: int
    total: int
    first: tuple[int, ...] | None
    rows: int | None = field(default=None, compare=False)

    @property
    def equal(self) -> bool:
        return self.count == 0


@dataclass(frozen=True)
class ErrorStats:
    """Largest absolute and relative error, each with its coordinates (None when empty)."""

    max_abs: float
    abs_at: tuple[int, ...] | None
    max_rel: float
    rel_at: tuple[int, ...] | None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs golden {tuple(b.shape)}")


def unravel(flat_index: int, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Coordinates of a row-major flat index in `shape`."""
    coords = []
    for dim in reversed(tuple(shape)):
        coords.append(flat_index % dim)
        flat_index //= dim
    return tuple(reversed(coords))


def host_ints(*values: torch.Tensor) -> list[int]:
    """Integer-valued scalars of one device as Python ints, read with one host sync (a stage's
    comparison takes dozens of counts; under `sweep --jobs` every sync waits for the GPU's other
    processes)."""
    return [int(v) for v in torch.stack([v.to(torch.int64) for v in values]).tolist()]


def first_true(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Coordinates of the first True element of a bool tensor (row-major), or None."""
    flat = mask.reshape(-1)
    if flat.numel() == 0:
        return None
    found, at = host_ints(flat.any(), torch.argmax(flat.to(torch.uint8)))
    return unravel(at, mask.shape) if found else None


def first_rows(mask: torch.Tensor, n: int) -> list[int]:
    """The first `n` rows (first index, in order) of a bool tensor holding a True."""
    if mask.dim() == 0 or mask.numel() == 0:
        return []
    held = mask.flatten(1).any(dim=1) if mask.dim() > 1 else mask
    return torch.nonzero(held)[:n, 0].tolist()


def argmax_coords(x: torch.Tensor) -> tuple[int, ...] | None:
    """Coordinates of the largest element (a NaN counts as largest: the first NaN), or None when
    empty."""
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return None
    if not flat.is_floating_point():
        return unravel(host_ints(torch.argmax(flat))[0], x.shape)
    nan = torch.isnan(flat)
    has_nan, first_nan, largest = host_ints(
        nan.any(), torch.argmax(nan.to(torch.uint8)), torch.argmax(flat)
    )
    return unravel(first_nan if has_nan else largest, x.shape)


def mismatch_of(mask: torch.Tensor) -> Mismatch:
    """Summarize a bool 'differs' mask: count, total, first coordinates, rows holding one."""
    flat = mask.reshape(-1)
    if flat.numel() == 0:
        return Mismatch(0, 0, None, 0 if mask.dim() >= 2 else None)
    stats = [flat.sum(), torch.argmax(flat.to(torch.uint8))]
    if mask.dim() >= 2:
        stats.append(mask.flatten(1).any(dim=1).sum())
    count, at, *rows = host_ints(*stats)
    first = unravel(at, mask.shape) if count else None
    return Mismatch(count, flat.numel(), first, rows[0] if rows else None)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor as signed ints of the same width (same shape).

    fp8 -> uint8, bf16/fp16 -> int16, fp32 -> int32, fp64 -> int64; integer tensors unchanged.
    """
    if not (x.is_floating_point() or x.dtype in _FP8_DTYPES):
        return x
    return x.view(_INT_OF_SIZE[x.element_size()])


def bitwise_mismatch(a: torch.Tensor, b: torch.Tensor) -> Mismatch:
    """Bit-for-bit comparison of two same-shape, same-dtype tensors (-0.0 != +0.0; NaN == NaN
    when the payloads match)."""
    _same_shape(a, b)
    if a.dtype != b.dtype:
        raise ValueError(f"dtypes differ: {a.dtype} vs golden {b.dtype}")
    return mismatch_of(bits(a) != bits(b))


def int_mismatch(a: torch.Tensor, b: torch.Tensor) -> Mismatch:
    """Exact integer equality after widening both to int64 (int32 vs int64 ids compare)."""
    _same_shape(a, b)
    return mismatch_of(a.to(torch.int64) != b.to(torch.int64))


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of an fp8 tensor (or of a uint8 tensor holding codes), same shape."""
    if x.dtype == torch.uint8:
        return x
    if x.dtype in _FP8_DTYPES:
        return x.view(torch.uint8)
    raise ValueError(f"expected fp8 codes (float8 or uint8), got {x.dtype}")


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of e4m3fn codes [...] (NaN codes give NaN)."""
    return fp8_codes(codes).view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_is_nan(codes: torch.Tensor) -> torch.Tensor:
    """Bool [...]: the e4m3fn code is NaN (0x7F or 0xFF)."""
    return (fp8_codes(codes) & 0x7F) == 0x7F


def e4m3_ordered(codes: torch.Tensor) -> torch.Tensor:
    """int32 [...]: e4m3 codes mapped onto integers in value order (+0 and -0 both map to 0)."""
    c = fp8_codes(codes).to(torch.int32)
    magnitude = c & 0x7F
    return torch.where(c >= 0x80, -magnitude, magnitude)


def fp8_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 [...]: how many representable e4m3 values lie between a and b (0 = same value).

    Adjacent codes are 1 apart, the smallest positive and negative subnormals 2 apart. A NaN
    code against a different code gives FP8_NAN_DISTANCE.
    """
    _same_shape(a, b)
    ca, cb = fp8_codes(a), fp8_codes(b)
    dist = (e4m3_ordered(ca) - e4m3_ordered(cb)).abs()
    nan = (e4m3_is_nan(ca) | e4m3_is_nan(cb)) & (ca != cb)
    return torch.where(nan, torch.full_like(dist, FP8_NAN_DISTANCE), dist)


def e4m3_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """float64 [...]: spacing of e4m3 values at |value| `magnitude` (the subnormal step below
    the smallest normal).

    The binade comes from frexp, which is exact, not from log2, whose last-ulp rounding near a
    power of two may differ between the CPU and a GPU and so flip a verdict with the device.
    """
    m = magnitude.to(torch.float64).abs()
    _, exponent = torch.frexp(m.clamp_min(2.0**E4M3_MIN_NORMAL_EXP))  # m = f * 2^exponent, f < 1
    ulp = torch.where(
        m < 2.0**E4M3_MIN_NORMAL_EXP,
        torch.full_like(m, E4M3_SUBNORMAL_STEP),
        torch.ldexp(torch.ones_like(m), exponent - 1 - E4M3_MANTISSA_BITS),
    )
    return torch.where(torch.isfinite(m), ulp, m)  # Inf and NaN stay what they are


def fp8_value_distance(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor
) -> torch.Tensor:
    """float64 [...]: |qa*sa - qb*sb| in e4m3 ulps at the coarser of the two scales.

    qa, qb: e4m3 codes [...]; sa, sb: their dequantization scales, broadcast to the same shape.
    Where the scales are equal this is at most the code distance; where a UE8M0 exponent flipped
    (sa = 2*sb), two correct roundings of nearby values are at most 1 apart.
    """
    va = e4m3_value(qa).double() * sa.double()
    vb = e4m3_value(qb).double() * sb.double()
    coarse = torch.maximum(sa.double(), sb.double())
    ulp = e4m3_ulp(torch.maximum(va.abs(), vb.abs()) / coarse) * coarse
    dist = (va - vb).abs() / ulp
    return torch.where(va == vb, torch.zeros_like(dist), dist)


def _ordered_ints(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Sign-magnitude bit patterns (as unsigned, in int64) mapped onto integers in value order."""
    sign = 1 << (width - 1)
    magnitude = raw & (sign - 1)
    return torch.where((raw & sign) != 0, -magnitude, magnitude)


def _ulp_distance(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, width: int, nan_distance: int
) -> torch.Tensor:
    """int64 [...]: |a - b| in ulps of `dtype` (both cast to it first); 0 for +0 vs -0 and for
    NaN vs NaN, `nan_distance` for a NaN on one side only."""
    _same_shape(a, b)
    ca, cb = a.to(dtype), b.to(dtype)
    mask = (1 << width) - 1
    ra = bits(ca).to(torch.int64) & mask
    rb = bits(cb).to(torch.int64) & mask
    dist = (_ordered_ints(ra, width) - _ordered_ints(rb, width)).abs()
    na, nb = torch.isnan(ca), torch.isnan(cb)
    return torch.where(na ^ nb, torch.full_like(dist, nan_distance), dist.masked_fill(na & nb, 0))


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 [...]: distance between a and b in bf16 ulps (both rounded to bf16 first, RNE).

    +0 and -0 are 0 apart; the largest finite value and Inf are 1 apart; a NaN on either side
    (unless both are NaN) gives BF16_NAN_DISTANCE.
    """
    return _ulp_distance(a, b, torch.bfloat16, 16, BF16_NAN_DISTANCE)


def fp32_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 [...]: distance between a and b in fp32 ulps (both cast to fp32 first).

    NaN on exactly one side gives FP32_NAN_DISTANCE.
    """
    return _ulp_distance(a, b, torch.float32, 32, FP32_NAN_DISTANCE)


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - 2*sum(a*b) / sum(a^2 + b^2) over the whole tensor, in float64 (DeepGEMM's metric).

    0 for identical tensors and when both are all zero; 2 for a == -b; NaN when either has NaN.
    """
    _same_shape(a, b)
    x, y = a.to(torch.float64), b.to(torch.float64)
    denominator = (x * x + y * y).sum()
    if bool(denominator == 0):
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denominator)


def abs_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 [...]: |a - b| (NaN where either is NaN)."""
    _same_shape(a, b)
    return (a.to(torch.float64) - b.to(torch.float64)).abs()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 [...]: |a - b| / |b|; 0 where both are 0, Inf where only the golden b is 0."""
    err = abs_error(a, b)
    ref = b.to(torch.float64).abs()
    rel = err / ref
    return torch.where(err == 0, torch.zeros_like(rel), rel)


def max_errors(a: torch.Tensor, b: torch.Tensor) -> ErrorStats:
    """Largest |a-b| and |a-b|/|b| with their coordinates (a NaN counts as the worst)."""
    err, rel = abs_error(a, b), rel_error(a, b)
    abs_at, rel_at = argmax_coords(err), argmax_coords(rel)
    return ErrorStats(
        max_abs=float(err[abs_at]) if abs_at is not None else 0.0,
        abs_at=abs_at,
        max_rel=float(rel[rel_at]) if rel_at is not None else 0.0,
        rel_at=rel_at,
    )


def row_max(x: torch.Tensor) -> torch.Tensor:
    """float64 [R, 1]: max |x| of each row of a [R, N] tensor (NaN ignored; 0 for empty rows)."""
    mag = x.to(torch.float64).abs().nan_to_num(nan=0.0)
    if mag.shape[1] == 0:
        return mag.new_zeros(mag.shape[0], 1)
    return mag.amax(dim=1, keepdim=True)


def row_worst(err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row worst of an error matrix [R, N]: (values float64 [R], columns int64 [R]).

    A NaN in a row makes it that row's worst.
    """
    e = err.to(torch.float64)
    if e.shape[1] == 0:
        return e.new_zeros(e.shape[0]), e.new_zeros(e.shape[0], dtype=torch.long)
    ranked = e.nan_to_num(nan=float("inf"))
    cols = ranked.argmax(dim=1)
    return e.gather(1, cols[:, None])[:, 0], cols


def row_rel_error(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) worst error relative to the golden row's scale, for [R, N] inputs.

    value[r] = max_j |a[r,j] - b[r,j]| / max_j |b[r,j]|  (0 where the row matches exactly,
    Inf where the golden row is all zero and `a` is not). Returns (values float64 [R],
    worst columns int64 [R]).
    """
    err = abs_error(a, b)
    scaled = err / row_max(b)
    scaled = torch.where(err == 0, torch.zeros_like(scaled), scaled)
    return row_worst(scaled)


def allowed_error(
    b: torch.Tensor, atol: float, rtol: float, scale: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """float64 [...]: the bound atol*scale + rtol*|b| (scale, e.g. a row max, broadcasts)."""
    ref = b.to(torch.float64).abs()
    if isinstance(scale, torch.Tensor):
        scale = scale.to(ref.device, torch.float64)
    return atol * scale + rtol * ref


def beyond_tolerance(
    a: torch.Tensor,
    b: torch.Tensor,
    atol: float,
    rtol: float,
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Bool [...]: |a-b| > atol*scale + rtol*|b| (NaN on either side counts as beyond)."""
    err = abs_error(a, b)
    return ~(err <= allowed_error(b, atol, rtol, scale))


def excess_ratio(
    a: torch.Tensor,
    b: torch.Tensor,
    atol: float,
    rtol: float,
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """float64 [...]: |a-b| / (atol*scale + rtol*|b|); > 1 means beyond the bound.

    0 where a == b, Inf where the bound is 0 but a != b, NaN where either side is NaN.
    """
    err = abs_error(a, b)
    ratio = err / allowed_error(b, atol, rtol, scale)
    return torch.where(err == 0, torch.zeros_like(ratio), ratio)


def mismatch_fraction(
    a: torch.Tensor,
    b: torch.Tensor,
    atol: float,
    rtol: float,
    scale: torch.Tensor | float = 1.0,
) -> float:
    """Fraction of elements beyond atol*scale + rtol*|b| (0.0 for empty tensors)."""
    beyond = beyond_tolerance(a, b, atol, rtol, scale)
    return float(beyond.sum()) / beyond.numel() if beyond.numel() else 0.0


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Bool [...]: NaN or Inf (for fp8 codes: the NaN codes; e4m3fn has no Inf)."""
    if x.dtype == torch.uint8 or x.dtype in _FP8_DTYPES:
        return e4m3_is_nan(x)
    if not x.is_floating_point():
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    return ~torch.isfinite(x)


def nan_inf_counts(x: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a float tensor; fp8 NaN codes count as NaN; ints give (0, 0)."""
    if x.dtype == torch.uint8 or x.dtype in _FP8_DTYPES:
        return int(e4m3_is_nan(x).sum()), 0
    if not x.is_floating_point():
        return 0, 0
    nans, infs = host_ints(torch.isnan(x).sum(), torch.isinf(x).sum())
    return nans, infs
