"""The path under test: Triton kernels + DeepGEMM grouped GEMMs, staged like the golden.

Never imports `reference`. `deep_gemm` is imported only by optimized/deepgemm.py, lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OptimizedBackend"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not import triton (the CLI sets TRITON_INTERPRET first).
    if name == "OptimizedBackend":
        from optimized.backend import OptimizedBackend

        return OptimizedBackend
    raise AttributeError(f"module 'optimized' has no attribute {name!r}")
