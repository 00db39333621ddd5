"""bf16 in whole kernels under the Triton interpreter (optimized.triton_compat's fix): max, min
and sum reductions, cumsum and cumprod rounded at every step, a dot accumulating in fp32, and a
kernel shaped like vLLM's colmajor silu_mul_quant that matches the golden bit for bit only when
patched (the element-wise checks: test_triton_bf16.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_verify.spec import Activation, ScaleFmt
from optimized import triton_compat
from reference import activation as golden
from tests.optimized.bf16_ops import (
    BF16,
    FP8,
    MARKS,
    bits_of,
    dot_kernel,
    reduce_input,
    reduce_kernel,
    run_scan,
    scan_expected,
    scan_input,
)

pytestmark = MARKS


@pytest.fixture(autouse=True)
def _fixed_interpreter() -> None:
    # `import optimized` installs both fixes when kernels run interpreted; keep them explicit.
    triton_compat.install_interpreter_fp8_fix()
    triton_compat.install_interpreter_bf16_fix()


# ------------------------------------------------------------- reductions, scans and dot


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_bf16_reduction(op: str) -> None:
    x = reduce_input(op)
    out, idx = torch.empty(64, dtype=BF16), torch.zeros(64, dtype=torch.int32)
    reduce_kernel[(64,)](x, out, idx, C=256, OP=op)
    if op == "sum":
        expected = x.float().sum(dim=1).to(BF16)  # exact in fp32, then one RNE
    else:
        expected = getattr(x, f"a{op}")(dim=1)
        first = getattr(x.float(), f"arg{op}")(dim=1)  # torch returns the first extremum
        assert torch.equal(idx.long(), first), f"arg{op} differs"
    assert torch.equal(bits_of(out), bits_of(expected)), f"bf16 {op}: {out[:4]} vs {expected[:4]}"


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_bf16_scan_rounds_every_step(op: str) -> None:
    x = scan_input(op)
    assert torch.equal(bits_of(run_scan(x, op)), bits_of(scan_expected(x, op)))


def test_bf16_dot_accumulates_in_fp32() -> None:
    g = torch.Generator().manual_seed(zlib.crc32(b"dot"))
    a = torch.randint(-64, 65, (32, 32), generator=g).to(BF16)
    b = torch.randint(-64, 65, (32, 32), generator=g).to(BF16)
    out = torch.empty(32, 32, dtype=torch.float32)
    dot_kernel[(1,)](a, b, out, N=32)
    assert torch.equal(out, a.float() @ b.float())  # small integers: exact in any order


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
