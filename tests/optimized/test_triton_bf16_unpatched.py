"""The Triton interpreter's own bf16 arithmetic is wrong, and the fix is where it must be: a
silu * y probe gives garbage unpatched, every check of test_triton_bf16.py and
test_triton_bf16_kernels.py fails on the unpatched interpreter (each check can fail), the unpatched
block restores the fix, and `import optimized` installs it in a fresh Python."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interp

from optimized import triton_compat
from tests.optimized.bf16_ops import (
    BF16,
    KERNEL_OPS,
    MARKS,
    PARTNERS,
    all_bf16,
    bf16_bits_exact,
    bf16_from_bits,
    bits_of,
    cast_sources,
    dot_kernel,
    fma_expected,
    fma_triples,
    mismatches,
    random_pairs,
    reduce_input,
    reduce_kernel,
    run_binary,
    run_fma,
    run_scan,
    run_unary,
    scan_expected,
    scan_input,
)

pytestmark = MARKS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fixed_interpreter() -> None:
    # `import optimized` installs both fixes when kernels run interpreted; keep them explicit.
    triton_compat.install_interpreter_fp8_fix()
    triton_compat.install_interpreter_bf16_fix()


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
    """(interpreter's own result, expected) for one bf16 check, on a small input."""
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
            dot_kernel[(1,)](a, a, out, N=32)
            return out, a.float() @ a.float()
        x = reduce_input(op)
        got, idx = torch.empty(64, dtype=BF16), torch.zeros(64, dtype=torch.int32)
        reduce_kernel[(64,)](x, got, idx, C=256, OP=op)
        return got, x.float().sum(dim=1).to(BF16) if op == "sum" else x.amax(dim=1)


# (op, kind) -- every check of test_triton_bf16.py and test_triton_bf16_kernels.py, run on the
# interpreter's own bf16 code.
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
