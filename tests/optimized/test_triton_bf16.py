"""The Triton interpreter's bf16 arithmetic, as fixed by optimized.triton_compat.

The interpreter stores bf16 as uint16 bit patterns and applies numpy to them, so bf16 `x * y`
computes on integers. The fix decodes to fp32, runs the op and rounds back to nearest even once,
which for add/sub/mul/div is the correctly rounded bf16 result (checked below over whole rows of
the 2^32 pairs; every pair with --run-slow). Each op runs in a @triton.jit kernel over every bf16
pattern against fixed partners and over random pairs (subnormals, inf, NaN, signed zeros,
overflow), compared bit for bit with torch's bf16 op, which is itself checked to be one fp32 op
then RNE. fma and the int/fp64 -> bf16 casts are checked against exact rational arithmetic.
Every check is also run on the unpatched interpreter and must fail there.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interp

from moe_verify.spec import Activation, ScaleFmt
from optimized import triton_compat
from reference import activation as golden

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(
        not triton_compat.interpreter_mode(),
        reason="checks the Triton interpreter's arithmetic; on a GPU bf16 ops are the hardware's",
    ),
]

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
BLOCK = 1 << 16
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fixed_interpreter() -> None:
    # `import optimized` installs both fixes when kernels run interpreted; keep them explicit.
    triton_compat.install_interpreter_fp8_fix()
    triton_compat.install_interpreter_bf16_fix()


# ------------------------------------------------------------------------------------ inputs


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bf16 tensor with the given bit patterns (int64 0..65535)."""
    return bits.to(torch.int32).to(torch.int16).view(BF16)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of a bf16 tensor (0..65535)."""
    return x.view(torch.int16).to(torch.int64) & 0xFFFF


def all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern, in pattern order."""
    return bf16_from_bits(torch.arange(1 << 16))


# Partners for the all-patterns sweep, each row naming what it exercises.
PARTNERS = [
    0x3F80,  # 1.0: x*1, x+1 (absorption, carries into the exponent)
    0xBF80,  # -1.0: sign handling, cancellation at 1
    0x0000,  # +0: x+0 keeps -0 only for -0 + -0, x*0 and inf*0
    0x8000,  # -0
    0x4040,  # 3.0: odd significand, products need rounding
    0x3EAB,  # ~1/3: full significand
    0x3F81,  # 1 + 2^-7: products land on bf16 midpoints (ties to even)
    0x7F7F,  # largest finite: add/mul overflow to inf
    0x5F80,  # 2^64: mul overflow for |x| >= 2^64
    0x1F80,  # 2^-64: mul underflow into subnormals and to zero
    0x0001,  # smallest subnormal
    0x0080,  # smallest normal: subnormal boundary on add/sub
    0x7F80,  # +inf: inf - inf, inf * 0
    0xFF80,  # -inf
    0x7FC0,  # NaN
    0xC2F7,  # -123.5: a plain negative value
]


@functools.cache
def sweep_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every bf16 pattern against every partner, in both operand orders (~2.1M pairs)."""
    x = all_bf16().repeat(len(PARTNERS))
    y = bf16_from_bits(torch.tensor(PARTNERS).repeat_interleave(1 << 16))
    return torch.cat([x, y]), torch.cat([y, x])


def random_pairs(seed_name: str, n: int = 250_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pairs: uniform patterns (NaN/inf/subnormals included), pairs with close exponents
    (add/sub round, tie and cancel), and pairs whose product is subnormal or overflows."""
    g = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))

    def patterns(k: int) -> torch.Tensor:
        return torch.randint(0, 1 << 16, (k,), generator=g)

    def with_exponent(exp: torch.Tensor) -> torch.Tensor:
        sign_mantissa = patterns(exp.numel()) & 0x807F
        return sign_mantissa | (exp.clamp(0, 254) << 7)

    ux, uy = patterns(n), patterns(n)
    ex = torch.randint(0, 255, (n // 2,), generator=g)
    cx, cy = with_exponent(ex), with_exponent(ex + torch.randint(-9, 10, ex.shape, generator=g))
    # Product exponent ex + ey - 127: below 1 is subnormal, above 254 overflows.
    lo = torch.randint(0, 128, (n // 4,), generator=g)
    sx, sy = with_exponent(lo), with_exponent(torch.randint(100, 136, lo.shape, generator=g) - lo)
    hi = torch.randint(127, 255, (n // 4,), generator=g)
    ox, oy = with_exponent(hi), with_exponent(torch.randint(370, 392, hi.shape, generator=g) - hi)
    x = torch.cat([ux, cx, sx, ox])
    y = torch.cat([uy, cy, sy, oy])
    return bf16_from_bits(x), bf16_from_bits(y)


PAIR_SETS = {"all-patterns-x-partners": sweep_pairs, "random-pairs": random_pairs}


def pairs(name: str, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    return sweep_pairs() if name == "all-patterns-x-partners" else random_pairs(f"{op}-{name}")


# ------------------------------------------------------------------------------------ kernels


@triton.jit
def _binary_kernel(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    if OP == "add":
        out = x + y
    elif OP == "sub":
        out = x - y
    elif OP == "mul":
        out = x * y
    elif OP == "maximum":
        out = tl.maximum(x, y)
    elif OP == "maximum-nan":
        out = tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "minimum":
        out = tl.minimum(x, y)
    elif OP == "minimum-nan":
        out = tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "lt":
        out = x < y
    elif OP == "le":
        out = x <= y
    elif OP == "gt":
        out = x > y
    elif OP == "ge":
        out = x >= y
    elif OP == "eq":
        out = x == y
    elif OP == "ne":
        out = x != y
    elif OP == "clamp-nan":
        out = tl.clamp(x, y, y + 8.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        out = tl.clamp(x, y, y + 8.0)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _unary_kernel(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if OP == "neg":
        out = -x
    elif OP == "abs":
        out = tl.abs(x)
    else:
        out = x.to(tl.bfloat16)  # a cast from the pointer's type (int, bool, fp64)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _fma_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    z = tl.load(z_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.fma(x, y, z), mask=mask)


def run_binary(op: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    compare = op in COMPARES
    out = torch.empty(x.shape, dtype=torch.bool if compare else BF16)
    _binary_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, out, x.numel(), OP=op, BLOCK=BLOCK)
    return out


def run_unary(op: str, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=BF16)
    _unary_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), OP=op, BLOCK=BLOCK)
    return out


def run_fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=BF16)
    _fma_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, z, out, x.numel(), BLOCK=BLOCK)
    return out


def run_builder_op(method: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An interpreter builder op called on bf16 handles directly (for ops `/` and `%` never
    send as bf16: the frontend promotes them to fp32)."""
    handles = [
        interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        for t in (x, y)
    ]
    out = getattr(interp.interpreter_builder, method)(*handles).data
    return torch.from_numpy(out.astype(np.uint16).view(np.int16)).view(BF16)


# ----------------------------------------------------------------------------- expectations

COMPARES = {
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "eq": torch.eq,
    "ne": torch.ne,
}


def quieted(x: torch.Tensor) -> torch.Tensor:
    """x with signaling NaNs made quiet. torch's fmax/fmin return NaN for a signaling NaN
    (IEEE 754-2008 maxNum); PTX max/min and 754-2019 maximumNumber return the number, as numpy."""
    return torch.where(x.isnan(), bf16_from_bits(bits_of(x) | 0x40), x)


def nan_ignoring(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x, y: op(quieted(x), quieted(y))


# (op, torch's bf16 op) -- tl.maximum/minimum default to NaN-ignoring (fmax/fmin, maxnumf).
KERNEL_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "maximum": nan_ignoring(torch.fmax),
    "maximum-nan": torch.maximum,
    "minimum": nan_ignoring(torch.fmin),
    "minimum-nan": torch.minimum,
    "clamp": lambda x, y: torch.fmin(torch.fmax(quieted(x), quieted(y)), quieted(y + 8.0)),
    "clamp-nan": lambda x, y: torch.clamp(x, y, y + 8.0),
    **COMPARES,
}


def exact_fmod(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """bf16 fmod(x, y) from C's fmod on the fp64 values: exact, and so is its bf16 (the result
    lies on y's grid below |y|), like the libdevice fmodf a GPU runs. torch's vectorized fmod is
    a - trunc(a / b) * b, NaN once a / b overflows, so it is not the reference here."""
    with np.errstate(invalid="ignore"):  # fmod(inf, y) and fmod(x, 0) are NaN, as they should be
        out = np.fmod(x.double().numpy(), y.double().numpy())
    return torch.from_numpy(out).to(BF16)


BUILDER_OPS = {"create_fdiv": torch.div, "create_frem": exact_fmod}

# numpy and torch disagree on which zero max(+0, -0) returns (IEEE 754-2008 leaves it open, and
# Triton does not pin it down): these ops compare zeros by value, every other bit exactly.
ZERO_SIGN_FREE = {"maximum", "maximum-nan", "minimum", "minimum-nan", "clamp", "clamp-nan"}


def mismatches(
    got: torch.Tensor, expected: torch.Tensor, signed_zeros: bool = True
) -> torch.Tensor:
    """Where got and expected differ: floats bitwise (NaN matches any NaN), bools by value."""
    if got.dtype == torch.bool:
        return got != expected
    nan_got, nan_exp = got.isnan(), expected.isnan()
    raw = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.view(raw) == expected.view(raw)
    if not signed_zeros:
        same |= (got == 0) & (expected == 0)
    return torch.where(nan_got | nan_exp, nan_got != nan_exp, ~same)


def describe(
    wrong: torch.Tensor, got: torch.Tensor, expected: torch.Tensor, *operands: torch.Tensor
) -> str:
    """How many are wrong, and the first four: index, operands, result and expectation."""

    def show(t: torch.Tensor, i: int) -> str:
        bits = f" (0x{int(bits_of(t[i : i + 1])):04x})" if t.dtype == BF16 else ""
        return f"{t[i].item():.9g}{bits}"

    rows = [
        f"  [{i}] {', '.join(show(o, i) for o in operands)} -> {show(got, i)}, "
        f"expected {show(expected, i)}"
        for i in wrong.nonzero().flatten()[:4].tolist()
    ]
    return f"{int(wrong.sum())} of {wrong.numel()} wrong; first:\n" + "\n".join(rows)


# ---------------------------------------------------------------------------- exact oracles


def bf16_bits_exact(values: list[Fraction]) -> torch.Tensor:
    """int64 bf16 patterns of exact rationals, rounded to nearest even (overflow to inf)."""
    out = []
    for q in values:
        magnitude = abs(q)
        exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
        if magnitude and Fraction(2) ** exponent > magnitude:
            exponent -= 1
        ulp = Fraction(2) ** (max(exponent, -126) - 7)  # bf16 subnormals: a fixed 2^-133 grid
        n, rest = divmod(magnitude, ulp)
        if rest > ulp / 2 or (rest == ulp / 2 and n % 2):
            n += 1
        rounded = n * ulp
        out.append(float("inf") if rounded >= 2**128 else float(rounded))
    value = torch.tensor(out, dtype=torch.float64).float()  # exact: at most 8 significant bits
    sign = torch.tensor([q < 0 for q in values])
    return bits_of(value.to(BF16)) | (sign.to(torch.int64) << 15)


def f32_rne_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 bf16 patterns of fp32 x by integer RNE on its bits (finite and inf; not NaN)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


# ----------------------------------------------------------------- binary ops in a kernel


@pytest.mark.parametrize("pair_set", list(PAIR_SETS))
@pytest.mark.parametrize("op", list(KERNEL_OPS))
def test_binary_op_in_a_kernel_matches_torch(op: str, pair_set: str) -> None:
    x, y = pairs(pair_set, op)
    got = run_binary(op, x, y)
    expected = KERNEL_OPS[op](x, y)
    wrong = mismatches(got, expected, signed_zeros=op not in ZERO_SIGN_FREE)
    assert not bool(wrong.any()), f"bf16 {op}: " + describe(wrong, got, expected, x, y)


@pytest.mark.parametrize("pair_set", list(PAIR_SETS))
@pytest.mark.parametrize("method", list(BUILDER_OPS))
def test_div_and_fmod_on_bf16_handles_match_torch(method: str, pair_set: str) -> None:
    x, y = pairs(pair_set, method)
    got = run_builder_op(method, x, y)
    expected = BUILDER_OPS[method](x, y)
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), f"bf16 {method}: " + describe(wrong, got, expected, x, y)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_torch_bf16_op_is_one_fp32_op_then_rne(op: str) -> None:
    # What makes torch the reference above: its CPU bf16 ops compute in fp32 and round once.
    x, y = random_pairs(f"torch-{op}")
    fp32 = getattr(torch, op)(x.float(), y.float())
    got = getattr(torch, op)(x, y)
    nan = fp32.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits_of(got)[~nan], f32_rne_to_bf16_bits(fp32)[~nan])


# ------------------------------------------------- one fp32 op then RNE is correctly rounded

ALL_AS_F32 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
FINITE = ALL_AS_F32[np.isfinite(ALL_AS_F32)]
NP_OPS = {"add": np.add, "mul": np.multiply, "div": np.divide}


def double_rounding_errors(op: str, rows: np.ndarray, spare_bits: int = 16) -> int:
    """Pairs (row, every finite bf16) where RNE(RNE_p(a op b)) != RNE(a op b), for an
    intermediate of 8 + spare_bits significant bits (16: fp32 itself).

    Rounding to nearest is monotone and bf16 numbers and midpoints are intermediate numbers, so
    the double rounding can differ only where the intermediate lands exactly on a bf16 midpoint
    (low 16 fp32 bits 0x8000) that the exact result is not; fp64 decides exactness exactly (sums
    landing on a midpoint have exponents within 25 of each other; products are 16 or 32 bits)."""
    errors = 0
    b = FINITE[None, :]
    for start in range(0, rows.size, 64):
        a = rows[start : start + 64, None]
        with np.errstate(all="ignore"):
            r = NP_OPS[op](a, b)
        bits = r.view(np.uint32)
        if spare_bits < 16:
            cut = np.uint32(16 - spare_bits)
            half = (np.uint32(1) << (cut - np.uint32(1))) - np.uint32(1)
            bits = ((bits + half + ((bits >> cut) & np.uint32(1))) >> cut) << cut
            r = bits.view(np.float32)
        mid = ((bits & 0xFFFF) == 0x8000) & np.isfinite(r)
        ai, bi = np.nonzero(mid)
        a64, b64, r64 = a[ai, 0].astype(np.float64), FINITE[bi].astype(np.float64), r[ai, bi]
        r64 = r64.astype(np.float64)
        exact = {"add": r64 == a64 + b64, "mul": r64 == a64 * b64, "div": r64 * b64 == a64}[op]
        errors += int((~exact).sum())
    return errors


def sampled_rows(seed_name: str) -> np.ndarray:
    g = np.random.default_rng(zlib.crc32(seed_name.encode()))
    specials = (np.array(PARTNERS, dtype=np.uint32) << 16).view(np.float32)
    return np.concatenate([g.choice(FINITE, 112, replace=False), specials[np.isfinite(specials)]])


@pytest.mark.parametrize("op", list(NP_OPS))
def test_fp32_then_rne_is_correctly_rounded_on_sampled_rows(op: str) -> None:
    # 125 rows x every finite bf16 (~8M pairs); the slow test below sweeps every pair.
    assert double_rounding_errors(op, sampled_rows(op)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("op", list(NP_OPS))
def test_fp32_then_rne_is_correctly_rounded_on_every_pair(op: str) -> None:
    # Measured (numpy 2.4): 0 errors for each op; 29.0M / 55.5M / 0.23M midpoint candidates.
    assert double_rounding_errors(op, FINITE) == 0


@pytest.mark.parametrize("op", ["add", "mul"])
def test_the_double_rounding_check_can_fail(op: str) -> None:
    # With 1 spare bit instead of 16 (below the 8 + 2 a double rounding needs to be safe), the
    # same check must find pairs that round the wrong way.
    assert double_rounding_errors(op, sampled_rows(op), spare_bits=1) > 0


# ---------------------------------------------------------------- unary ops, fma, casts


def test_neg_and_abs_flip_and_clear_the_sign_bit_of_every_pattern() -> None:
    # neg.bf16 / abs.bf16 on a GPU touch the sign bit only, NaN payloads included.
    x = all_bf16()
    assert torch.equal(bits_of(run_unary("neg", x)), bits_of(x) ^ 0x8000)
    assert torch.equal(bits_of(run_unary("abs", x)), bits_of(x) & 0x7FFF)


@triton.jit
def _exp_kernel(x_ptr, out_ptr, SIGMOID: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, 4))
    tl.store(out_ptr + tl.arange(0, 4), tl.sigmoid(x) if SIGMOID else tl.exp(x))


@pytest.mark.parametrize("sigmoid", [False, True], ids=["exp", "sigmoid"])
def test_exp_and_sigmoid_reject_bf16_in_the_frontend(sigmoid: bool) -> None:
    # Why no kernel reaches unary math on bf16: Triton's frontend refuses it (libdevice's dtype
    # convention, the same on a GPU), so kernels upcast first, as vLLM's do.
    x = torch.ones(4, dtype=BF16)
    with pytest.raises(Exception, match="Expected dtype"):
        _exp_kernel[(1,)](x, torch.empty_like(x), SIGMOID=sigmoid)


def run_builder_unary(op: str, x: torch.Tensor) -> torch.Tensor:
    handle = interp.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    out = getattr(interp.interpreter_builder, f"create_{op}")(handle).data
    return torch.from_numpy(out.astype(np.uint16).view(np.int16)).view(BF16)


def builder_unary_expected(op: str, x: torch.Tensor) -> torch.Tensor:
    """The interpreter's fp32 math (numpy) on the bf16 values, rounded once to bf16."""
    with np.errstate(all="ignore"):
        return torch.from_numpy(getattr(np, op)(x.float().numpy())).to(BF16)


@pytest.mark.parametrize("op", ["exp", "sqrt", "log"])
def test_unary_math_on_bf16_handles_is_the_fp32_math_rounded_once(op: str) -> None:
    # Past the frontend (a direct builder call), unary math on bf16 is consistent with fp32.
    x = all_bf16()
    got, expected = run_builder_unary(op, x), builder_unary_expected(op, x)
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), f"bf16 {op}: " + describe(wrong, got, expected, x)
    # Unpatched, numpy's math on the bit patterns gives floats the handle refuses to carry.
    with triton_compat.unpatched_bf16_arithmetic(), np.errstate(all="ignore"):
        with pytest.raises(ValueError, match="exceeds dtype primitive_bitwidth"):
            run_builder_unary(op, x)


def fma_triples() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """~18K (x, y, z): random finite triples; x*y on a bf16 midpoint with a tiny z of either
    sign or zero (fp32 then bf16 would break the tie wrongly); z ~ -x*y (cancellation);
    subnormal and overflowing results; and every inf/NaN/zero combination of the partners."""
    g = torch.Generator().manual_seed(zlib.crc32(b"fma"))

    def bf16_exp(exp: torch.Tensor) -> torch.Tensor:
        return bf16_from_bits(
            (torch.randint(0, 1 << 16, exp.shape, generator=g) & 0x807F) | (exp.clamp(0, 254) << 7)
        )

    n = 4_000
    e = torch.randint(1, 254, (n,), generator=g)
    rx, ry = bf16_exp(e), bf16_exp(254 - e + torch.randint(-3, 4, (n,), generator=g))
    rz = bf16_exp(torch.randint(0, 255, (n,), generator=g))
    # 1.5 * 2^k times an odd-significand y: the exact product has 9 significant bits, a tie.
    k = torch.randint(100, 150, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) << 15
    mx = bf16_from_bits((0x3FC0 + ((k - 127) << 7)) | sign)
    my = bf16_from_bits(0x3F80 | (torch.randint(0, 64, (n,), generator=g) * 2 + 1))
    tiny = bf16_exp(k - 40) * torch.tensor([1.0, -1.0, 0.0]).repeat(n // 3 + 1)[:n].to(BF16)
    cz = -(rx.float() * ry.float()).to(BF16)  # rounded product: the exact residue remains
    sub_e = torch.randint(0, 127, (n,), generator=g)
    sx, sy = bf16_exp(sub_e), bf16_exp(torch.randint(0, 8, (n,), generator=g) + 120 - sub_e)
    specials = bf16_from_bits(torch.tensor(PARTNERS))
    grid = torch.cartesian_prod(*(torch.arange(len(PARTNERS), dtype=torch.int64),) * 3)[::2]
    x = torch.cat([rx, mx, rx, sx, specials[grid[:, 0]]])
    y = torch.cat([ry, my, ry, sy, specials[grid[:, 1]]])
    z = torch.cat([rz, tiny, cz, rz.abs().clamp(max=1e-38).to(BF16), specials[grid[:, 2]]])
    return x, y, z


def fma_expected(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """bf16 of the exact x*y + z: rational arithmetic where finite, IEEE fp64 for inf/NaN and
    for exact zeros (their sign), where fp64 is exact too (x*y has 16 bits)."""
    xd, yd, zd = x.double(), y.double(), z.double()
    ieee = xd * yd + zd
    finite = (xd.isfinite() & yd.isfinite() & zd.isfinite()).tolist()
    exact = [
        Fraction(a) * Fraction(b) + Fraction(c) if ok else Fraction(0)
        for a, b, c, ok in zip(xd.tolist(), yd.tolist(), zd.tolist(), finite, strict=True)
    ]
    rounded = bf16_from_bits(bf16_bits_exact(exact))
    use_ieee = ~torch.tensor(finite) | torch.tensor([q == 0 for q in exact])
    return torch.where(use_ieee, ieee.to(BF16), rounded)


def test_fma_is_rounded_once_against_exact_arithmetic() -> None:
    x, y, z = fma_triples()
    got = run_fma(x, y, z)
    expected = fma_expected(x, y, z)
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), "bf16 fma: " + describe(wrong, got, expected, x, y, z)
    # Rounding x*y + z in fp32 first is what a non-fused path gives; the hard rows catch it.
    twice = torch.addcmul(z.float(), x.float(), y.float()).to(BF16)
    assert bool(mismatches(twice, expected).any()), "the triples no longer test single rounding"


def cast_sources() -> dict[str, tuple[torch.Tensor, list[Fraction]]]:
    """(source tensor, its exact values) per source type of a cast to bf16."""
    g = torch.Generator().manual_seed(zlib.crc32(b"casts"))
    i32 = torch.randint(-(2**31), 2**31, (6_000,), generator=g, dtype=torch.int64)
    # Ties: 8 significant bits plus exactly half an ulp, and one below / above it.
    shift = torch.randint(1, 23, (2_000,), generator=g)
    tie = (torch.randint(128, 256, (2_000,), generator=g) * 2 + 1) << shift
    i32 = torch.cat([i32, tie, tie - 1, tie + 1, -tie, torch.arange(-300, 300)])
    i32 = torch.cat([i32, torch.tensor([-(2**31), 2**31 - 1, 2**31 - 2**23, 2**24 + 1])])
    i64 = torch.randint(-(2**63), 2**63 - 1, (3_000,), generator=g, dtype=torch.int64)
    # Ties above 2^53, where fp64 cannot hold tie + 1: the residual decides the rounding.
    shift64 = torch.randint(30, 55, (1_000,), generator=g)
    tie64 = (torch.randint(128, 256, (1_000,), generator=g) * 2 + 1) << shift64
    extremes = [-(2**63), 2**63 - 1, 2**63 - 2**55, 2**63 - 2**55 - 1, 2**62 + 2**54 + 1]
    i64 = torch.cat([i64, tie64, tie64 + 1, tie64 - 1, -tie64 - 1, torch.tensor(extremes)])
    f64 = torch.randint(-(2**63), 2**63 - 1, (3_000,), generator=g, dtype=torch.int64)
    f64 = f64.view(torch.float64)
    f64 = f64[f64.abs() < 1e39]
    in_range = torch.randn(3_000, generator=g, dtype=torch.float64)
    in_range = in_range * torch.exp2(torch.randint(-140, 128, (3_000,), generator=g).double())
    # A bf16 midpoint plus a sliver below fp32's resolution: fp32 first would tie to even.
    mids = torch.randint(0, 0x7F7F, (2_000,), generator=g).to(torch.int32) << 16 | 0x8000
    mids = mids.view(torch.float32).double()
    sliver = mids * 2.0**-30
    f64 = torch.cat(
        [
            f64,
            in_range,
            mids + sliver,
            mids - sliver,
            mids,
            torch.tensor([1e300, -1e-300, 0.0], dtype=torch.float64),
        ]
    )
    u8 = torch.arange(256).to(torch.uint8)
    flags = torch.tensor([True, False])
    return {
        "int32": (i32.to(torch.int32), [Fraction(int(v)) for v in i32.tolist()]),
        "int64": (i64, [Fraction(int(v)) for v in i64.tolist()]),
        "fp64": (f64, [Fraction(v) for v in f64.tolist()]),
        "uint8": (u8, [Fraction(v) for v in range(256)]),
        "bool": (flags, [Fraction(1), Fraction(0)]),
    }


@pytest.mark.parametrize("src", ["int32", "int64", "fp64", "uint8", "bool"])
def test_cast_to_bf16_is_rounded_once(src: str) -> None:
    x, exact = cast_sources()[src]
    got = run_unary("cast", x)
    expected = bf16_from_bits(bf16_bits_exact(exact))
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), f"{src} -> bf16: " + describe(wrong, got, expected, x.double())


# ------------------------------------------------------------- reductions, scans and dot


@triton.jit
def _reduce_kernel(x_ptr, out_ptr, idx_ptr, C: tl.constexpr, OP: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * C + tl.arange(0, C))
    if OP == "max":
        out, idx = tl.max(x, axis=0, return_indices=True)
        tl.store(idx_ptr + row, idx)
    elif OP == "min":
        out, idx = tl.min(x, axis=0, return_indices=True)
        tl.store(idx_ptr + row, idx)
    else:
        out = tl.sum(x, axis=0)
    tl.store(out_ptr + row, out)


@triton.jit
def _scan_kernel(x_ptr, out_ptr, C: tl.constexpr, OP: tl.constexpr):
    offs = tl.program_id(0) * C + tl.arange(0, C)
    x = tl.load(x_ptr + offs)
    out = tl.cumsum(x, axis=0) if OP == "cumsum" else tl.cumprod(x, axis=0)
    tl.store(out_ptr + offs, out)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    acc = tl.dot(tl.load(a_ptr + rows), tl.load(b_ptr + rows))
    tl.store(out_ptr + rows, acc)


def reduce_input(name: str) -> torch.Tensor:
    """bf16 [64, 256] of small integers (-256..256, all negative in row 0): any summation order
    gives the exact sum in fp32, and the bf16 of that needs a rounding."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randint(-256, 257, (64, 256), generator=g).float()
    x[0] = -x[0].abs() - 1
    return x.to(BF16)


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_bf16_reduction(op: str) -> None:
    x = reduce_input(op)
    out, idx = torch.empty(64, dtype=BF16), torch.zeros(64, dtype=torch.int32)
    _reduce_kernel[(64,)](x, out, idx, C=256, OP=op)
    if op == "sum":
        expected = x.float().sum(dim=1).to(BF16)  # exact in fp32, then one RNE
    else:
        expected = getattr(x, f"a{op}")(dim=1)
        first = getattr(x.float(), f"arg{op}")(dim=1)  # torch returns the first extremum
        assert torch.equal(idx.long(), first), f"arg{op} differs"
    assert torch.equal(bits_of(out), bits_of(expected)), f"bf16 {op}: {out[:4]} vs {expected[:4]}"


def scan_input(op: str) -> torch.Tensor:
    """bf16 [8, 128]: sums of |x| ~ 8 (their bf16 rounds at every step), or products of factors
    near 1 (no overflow, a rounding at every step)."""
    g = torch.Generator().manual_seed(zlib.crc32(op.encode()))
    x = torch.randn(8, 128, generator=g)
    return (x * 8 if op == "cumsum" else 1 + x / 16).to(BF16)


def scan_expected(x: torch.Tensor, op: str) -> torch.Tensor:
    """Running bf16 sums/products along dim 1, each step one torch bf16 op (fp32, then RNE)."""
    expected = x.clone()
    for j in range(1, x.shape[1]):
        step = expected[:, j - 1] + x[:, j] if op == "cumsum" else expected[:, j - 1] * x[:, j]
        expected[:, j] = step
    return expected


def run_scan(x: torch.Tensor, op: str) -> torch.Tensor:
    out = torch.empty_like(x)
    _scan_kernel[(x.shape[0],)](x, out, C=x.shape[1], OP=op)
    return out


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_bf16_scan_rounds_every_step(op: str) -> None:
    x = scan_input(op)
    assert torch.equal(bits_of(run_scan(x, op)), bits_of(scan_expected(x, op)))


def test_bf16_dot_accumulates_in_fp32() -> None:
    g = torch.Generator().manual_seed(zlib.crc32(b"dot"))
    a = torch.randint(-64, 65, (32, 32), generator=g).to(BF16)
    b = torch.randint(-64, 65, (32, 32), generator=g).to(BF16)
    out = torch.empty(32, 32, dtype=torch.float32)
    _dot_kernel[(1,)](a, b, out, N=32)
    assert torch.equal(out, a.float() @ b.float())  # small integers: exact in any order


# ------------------------------------------------------- the unpatched interpreter is wrong


def probe_silu_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _silu_mul_probe[(1,)](x, y, out, BLOCK=x.numel())
    return out


@triton.jit
def _silu_mul_probe(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.float32)
    silu = (x / (1.0 + tl.exp(-x))).to(tl.bfloat16)
    tl.store(out_ptr + offs, silu * tl.load(y_ptr + offs))


def test_silu_times_y_probe_is_garbage_unpatched_and_right_patched() -> None:
    # A probe first run by hand on 2026-12-01: bf16 silu(x) * y, as vLLM's colmajor kernel.
    x = torch.tensor([2.45, -0.12, -3.13, 1.24], dtype=BF16)
    y = torch.tensor([1.0, 2.0, -0.5, 3.0], dtype=BF16)
    with triton_compat.torch_exp_in_interpreter():
        xf = x.float()
        expected = (xf / (1 + torch.exp(-xf))).to(BF16) * y
        got = probe_silu_mul(x, y)
        with triton_compat.unpatched_bf16_arithmetic():
            unpatched = probe_silu_mul(x, y)
    assert torch.equal(bits_of(got), bits_of(expected)), f"{got} vs {expected}"
    # Measured with triton 3.9: [1.5e-05, -2.0, 1.2e-04, -5.1e-21] for [2.27, -0.113, 0.0659, 2.89]
    # (that run's y is not recorded; this y is ours, so its garbage differs).
    assert bool(mismatches(unpatched, expected).all()), f"unpatched gave {unpatched}"


def small_pairs(seed_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """~16K random pairs plus every pair of partners (NaN == NaN and +0 == -0 are in there: on
    bit patterns only those make == and != wrong)."""
    x, y = random_pairs(seed_name, n=8_000)
    grid = torch.cartesian_prod(torch.tensor(PARTNERS), torch.tensor(PARTNERS))
    return torch.cat([x, bf16_from_bits(grid[:, 0])]), torch.cat([y, bf16_from_bits(grid[:, 1])])


def run_unpatched(op: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(interpreter's own result, expected) for one check of this file, on a small input."""
    # numpy warns about the values it makes of bit patterns; the results are what is checked.
    with triton_compat.unpatched_bf16_arithmetic(), np.errstate(all="ignore"):
        if kind == "kernel":
            x, y = small_pairs(f"unpatched-{op}")
            return run_binary(op, x, y), KERNEL_OPS[op](x, y)
        if kind == "unary":
            x = all_bf16()
            return run_unary(op, x), bf16_from_bits(bits_of(x) ^ 0x8000)
        if kind == "fma":
            x, y, z = (t[:4_000] for t in fma_triples())
            return run_fma(x, y, z), fma_expected(x, y, z)
        if kind == "cast":
            x, exact = cast_sources()[op]
            return run_unary("cast", x), bf16_from_bits(bf16_bits_exact(exact))
        if kind == "scan":
            x = scan_input(op)
            return run_scan(x, op), scan_expected(x, op)
        if kind == "dot":
            a = torch.randint(-64, 65, (32, 32), generator=torch.Generator().manual_seed(7))
            a = a.to(BF16)
            out = torch.empty(32, 32, dtype=torch.float32)
            _dot_kernel[(1,)](a, a, out, N=32)
            return out, a.float() @ a.float()
        x = reduce_input(op)
        got, idx = torch.empty(64, dtype=BF16), torch.zeros(64, dtype=torch.int32)
        _reduce_kernel[(64,)](x, got, idx, C=256, OP=op)
        return got, x.float().sum(dim=1).to(BF16) if op == "sum" else x.amax(dim=1)


# (op, kind) -- every check above, run on the interpreter's own bf16 code.
UNPATCHED_CASES = [
    *((op, "kernel") for op in KERNEL_OPS),
    ("neg", "unary"),
    ("fma", "fma"),
    *((src, "cast") for src in ["int32", "int64", "fp64", "uint8", "bool"]),
    ("sum", "reduce"),
    ("max", "reduce"),
    ("min", "reduce"),
    ("cumsum", "scan"),
    ("cumprod", "scan"),
    ("dot", "dot"),
]


@pytest.mark.parametrize(
    ("op", "kind"), UNPATCHED_CASES, ids=[f"{op}-{kind}" for op, kind in UNPATCHED_CASES]
)
def test_the_checks_fail_on_the_unpatched_interpreter(op: str, kind: str) -> None:
    got, expected = run_unpatched(op, kind)
    wrong = mismatches(got, expected, signed_zeros=False)
    assert bool(wrong.any()), f"the interpreter's own bf16 {op} is right now: is the fix needed?"


def test_unpatched_block_restores_the_fix_and_install_is_idempotent() -> None:
    builder = interp.InterpreterBuilder
    patched = builder.binary_op
    triton_compat.install_interpreter_bf16_fix()
    assert builder.binary_op is patched, "a second install must not wrap the fix again"
    with triton_compat.unpatched_bf16_arithmetic():
        assert builder.binary_op is not patched
    assert builder.binary_op is patched


# ------------------------------------------------- a kernel shaped like vLLM's colmajor one


@triton.jit
def _silu_mul_quant_colmajor_like(
    mm1_ptr,
    q_ptr,
    s_ptr,
    M,
    I,  # noqa: E741 (the intermediate size, as everywhere in this project)
    alpha,
    beta,
    limit,
    eps,
    inv_fp8_max,
    HAS_LIMIT: tl.constexpr,
    CEIL: tl.constexpr,
    GROUP: tl.constexpr,
):
    # vLLM's silu_mul_per_token_group_quant_fp8_colmajor: bf16 after the clamp, the activation, up +
    # beta and the product (`silu_out * up` is a bf16 multiply), then per-group amax * (1/448)
    # scales.
    row, group = tl.program_id(0), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    gate = tl.load(mm1_ptr + row * 2 * I + cols)
    up = tl.load(mm1_ptr + row * 2 * I + I + cols)
    if HAS_LIMIT:
        gate = tl.minimum(gate.to(tl.float32), limit).to(tl.bfloat16)
        up = tl.clamp(up.to(tl.float32), -limit, limit).to(tl.bfloat16)
    g = gate.to(tl.float32)
    silu_out = (g / (1.0 + tl.exp(-g * alpha))).to(tl.bfloat16)
    up = (up.to(tl.float32) + beta).to(tl.bfloat16)
    y = (silu_out * up).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(y), axis=0), eps) * inv_fp8_max
    if CEIL:
        bits = s.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exponent << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(y / s, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * I + cols, q)
    tl.store(s_ptr + group * M + row, s)


def run_colmajor_like(
    mm1: torch.Tensor, act: Activation, fmt: ScaleFmt
) -> tuple[torch.Tensor, torch.Tensor]:
    m, inter, group = mm1.shape[0], mm1.shape[1] // 2, 128
    q = torch.empty(m, inter, dtype=FP8)
    scales = torch.empty(inter // group, m, dtype=torch.float32)
    limit = act.limit if act.limit is not None else 0.0
    _silu_mul_quant_colmajor_like[(m, inter // group)](
        mm1,
        q,
        scales,
        m,
        inter,
        act.alpha,
        act.beta,
        limit,
        golden.AMAX_EPS,
        1.0 / 448.0,
        HAS_LIMIT=act.limit is not None,
        CEIL=fmt is ScaleFmt.FLOAT32_CEIL_UE8M0,
        GROUP=group,
    )
    return q, scales.T


# (activation, scale format) -- each row one recipe branch of the colmajor kernel.
COLMAJOR_CASES = [
    (Activation(), ScaleFmt.FLOAT32),  # plain silu
    (Activation(), ScaleFmt.FLOAT32_CEIL_UE8M0),  # power-of-two scales
    (Activation(limit=7.05), ScaleFmt.FLOAT32),  # clamp at a limit bf16 cannot represent
    (Activation("swigluoai", 1.702, 1.0, 7.0), ScaleFmt.FLOAT32_CEIL_UE8M0),  # alpha, beta
]


def colmajor_input(case: str) -> torch.Tensor:
    """bf16 [16, 512] (I = 256, two groups of 128), |x| up to ~16, with one all-zero group."""
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    x = torch.randn(16, 512, generator=g) * 4.0
    x[0, :128] = 0.0
    x[0, 256:384] = 0.0
    return x.to(BF16)


@pytest.mark.parametrize(
    ("act", "fmt"), COLMAJOR_CASES, ids=[f"{a.tag}-{f}" for a, f in COLMAJOR_CASES]
)
def test_colmajor_like_kernel_matches_the_golden_only_when_patched(
    act: Activation, fmt: ScaleFmt
) -> None:
    mm1 = colmajor_input(f"{act.tag}-{fmt}")
    q_gold, s_gold = golden.act_quant(mm1, act, 128, fmt)
    with triton_compat.torch_exp_in_interpreter():  # the golden's exp: the rest is bitwise
        q, s = run_colmajor_like(mm1, act, fmt)
        with triton_compat.unpatched_bf16_arithmetic(), np.errstate(all="ignore"):
            q_bad, s_bad = run_colmajor_like(mm1, act, fmt)
    codes_wrong = int((q.view(torch.uint8) != q_gold.view(torch.uint8)).sum())
    assert codes_wrong == 0, f"{codes_wrong} fp8 codes differ from the golden's"
    assert torch.equal(s.contiguous().view(torch.int32), s_gold.view(torch.int32)), (
        f"scales differ: {s[:2]} vs {s_gold[:2]}"
    )
    # Unpatched, the bf16 product is computed on bit patterns (scales ~4e35 in issue 11).
    assert not torch.equal(s_bad, s_gold) and not torch.equal(
        q_bad.view(torch.uint8), q_gold.view(torch.uint8)
    )


# ------------------------------------------------------------------ installed by the import


def test_import_optimized_installs_the_bf16_fix_in_a_fresh_python() -> None:
    script = textwrap.dedent(
        """
        import torch
        import optimized
        import triton
        import triton.language as tl

        @triton.jit
        def mul(x_ptr, y_ptr, out_ptr):
            tl.store(out_ptr, tl.load(x_ptr) * tl.load(y_ptr))

        x = torch.tensor([1.5], dtype=torch.bfloat16)
        y = torch.tensor([-2.25], dtype=torch.bfloat16)
        out = torch.empty_like(x)
        mul[(1,)](x, y, out)
        print(out.item())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["-3.375"], proc.stdout
