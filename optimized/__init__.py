"""The path under test: Triton kernels + DeepGEMM grouped GEMMs, staged like the golden.

Never imports `reference`. `deep_gemm` is imported only by optimized/deepgemm/, lazily.

Importing the package prepares Triton: without a GPU, kernels run under the Triton interpreter
with its float casts fixed (optimized/triton_compat.py). Every module of the package, so every
kernel, is imported after this runs.
"""

from __future__ import annotations

from typing import Any

from optimized.triton_compat import prepare_interpreter

__all__ = ["OptimizedBackend"]

prepare_interpreter()


def __getattr__(name: str) -> Any:
    # Lazy: `import optimized` stays light (no kernel is compiled or decorated until used).
    if name == "OptimizedBackend":
        from optimized.backend import OptimizedBackend

        return OptimizedBackend
    raise AttributeError(f"module 'optimized' has no attribute {name!r}")
