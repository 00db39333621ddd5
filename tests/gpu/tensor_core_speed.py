"""Measurement script (not a test): the tensor-core recipe's time on DeepSeek-V3 EP8-local and
Qwen3-like grouped GEMMs, eager and fused (reference/hardware/tensor_core.py), beside the fp32
golden GEMM on the same operands. docs/tensor-core.md#speed records its output on the H200.

    python tests/gpu/tensor_core_speed.py [NAME_FILTER ...]     # CUDA
    SKIP_EAGER=1 python tests/gpu/tensor_core_speed.py          # the fused form only

Operands are random e4m3 codes over the whole finite range with 1x128 / 128x128 scales; every
expert gets the same row count (rows are padded to 128 as the contiguous layout's are). Each
form runs once after a warm-up call (the fused form's first call compiles).
"""

from __future__ import annotations

import os
import sys

import torch

from moe_verify.common.timing import timed_once
from moe_verify.spec import QuantizedWeight
from reference.gemm import grouped_gemm
from reference.hardware import tensor_core as tc

# name: (experts, rows per expert, N, K)
CASES = {
    "dsv3 T=4096 gemm1": (32, 1024, 4096, 7168),
    "dsv3 T=4096 gemm2": (32, 1024, 7168, 2048),
    "dsv3 T=128 gemm1": (32, 128, 4096, 7168),
    "qwen3 T=1024 gemm1": (128, 128, 3072, 4096),
    "qwen3 T=1024 gemm2": (128, 128, 4096, 1536),
}


def _codes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32, device="cuda")
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # no NaN codes
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def measure(name: str, experts: int, rows: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = _codes((experts * rows, k), g)
    sa = torch.rand(experts * rows, k // 128, generator=g, device="cuda") + 0.5
    w = QuantizedWeight(
        _codes((experts, n, k), g),
        torch.rand(experts, -(-n // 128), k // 128, generator=g, device="cuda") + 0.5,
        (128, 128),
    )
    m_indices = torch.arange(experts, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    args = (a, sa, 128, w, m_indices)
    multiplies = experts * rows * n * k
    _, fp32_s = timed_once(lambda: grouped_gemm(*args))
    _, fp32_s = timed_once(lambda: grouped_gemm(*args))
    line = f"{name}: {multiplies:.2e} multiplies; fp32 golden {fp32_s * 1e3:.1f} ms"
    outs = {}
    forms = ("1",) if os.environ.get("SKIP_EAGER") else ("0", "1")
    for form in forms:
        os.environ[tc.FUSED_ENV] = form
        _, first_s = timed_once(lambda: tc.tensor_core_grouped_gemm(*args))
        outs[form], s = timed_once(lambda: tc.tensor_core_grouped_gemm(*args))
        label = "fused" if form == "1" else "eager"
        line += f"; {label} {s:.3f} s ({s / fp32_s:.0f}x, first call {first_s:.1f} s)"
    if len(outs) == 2:
        same = torch.equal(outs["0"].view(torch.int16), outs["1"].view(torch.int16))
        line += f"; fused == eager: {same}"
    print(line, flush=True)


if __name__ == "__main__":
    for name, shape in CASES.items():
        if len(sys.argv) < 2 or any(f in name for f in sys.argv[1:]):
            measure(name, *shape)
