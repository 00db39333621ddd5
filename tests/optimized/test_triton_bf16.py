"""The Triton interpreter's bf16 arithmetic, as fixed by optimized.triton_compat.

The interpreter stores bf16 as uint16 bit patterns and applies numpy to them, so bf16 `x * y`
computes on integers. The fix decodes to fp32, runs the op and rounds back to nearest even once,
which for add/sub/mul/div is the correctly rounded bf16 result (checked below over whole rows of
the 2^32 pairs; every pair with --run-slow). Each op runs in a @triton.jit kernel over every bf16
pattern against fixed partners and over random pairs (subnormals, inf, NaN, signed zeros,
overflow), compared bit for bit with torch's bf16 op, which is itself checked to be one fp32 op
then RNE. fma and the int/fp64 -> bf16 casts are checked against exact rational arithmetic.
Every check is also run on the unpatched interpreter and must fail there
(test_triton_bf16_unpatched.py); reductions, scans, dot and a kernel shaped like vLLM's
colmajor act_quant are in test_triton_bf16_kernels.py, the shared inputs, kernels and oracles
in bf16_ops.py.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interp

from optimized import triton_compat
from tests.optimized.bf16_ops import (
    BF16,
    BUILDER_OPS,
    KERNEL_OPS,
    MARKS,
    PAIR_SETS,
    PARTNERS,
    ZERO_SIGN_FREE,
    all_bf16,
    bf16_bits_exact,
    bf16_from_bits,
    bits_of,
    cast_sources,
    describe,
    f32_rne_to_bf16_bits,
    fma_expected,
    fma_triples,
    mismatches,
    pairs,
    random_pairs,
    run_binary,
    run_builder_op,
    run_fma,
    run_unary,
)

pytestmark = MARKS


@pytest.fixture(autouse=True)
def _fixed_interpreter() -> None:
    # `import optimized` installs both fixes when kernels run interpreted; keep them explicit.
    triton_compat.install_interpreter_fp8_fix()
    triton_compat.install_interpreter_bf16_fix()


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


def test_fma_is_rounded_once_against_exact_arithmetic() -> None:
    x, y, z = fma_triples()
    got = run_fma(x, y, z)
    expected = fma_expected(x, y, z)
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), "bf16 fma: " + describe(wrong, got, expected, x, y, z)
    # Rounding x*y + z in fp32 first is what a non-fused path gives; the hard rows catch it.
    twice = torch.addcmul(z.float(), x.float(), y.float()).to(BF16)
    assert bool(mismatches(twice, expected).any()), "the triples no longer test single rounding"


@pytest.mark.parametrize("src", ["int32", "int64", "fp64", "uint8", "bool"])
def test_cast_to_bf16_is_rounded_once(src: str) -> None:
    x, exact = cast_sources()[src]
    got = run_unary("cast", x)
    expected = bf16_from_bits(bf16_bits_exact(exact))
    wrong = mismatches(got, expected)
    assert not bool(wrong.any()), f"{src} -> bf16: " + describe(wrong, got, expected, x.double())
