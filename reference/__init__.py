"""The golden: an independent pure-PyTorch MoE, staged like the kernels, readable like the math.

Never imports triton, deep_gemm or `optimized` (a golden that shares code with the kernel shares
its bugs). Runs on CPU or GPU.
"""

from __future__ import annotations

from reference.hardware.tensor_core import (
    tensor_core_gemm,
    tensor_core_grouped_gemm,
    tensor_core_masked_gemm,
)
from reference.moe import ReferenceBackend, run

__all__ = [
    "ReferenceBackend",
    "run",
    "tensor_core_gemm",
    "tensor_core_grouped_gemm",
    "tensor_core_masked_gemm",
]
