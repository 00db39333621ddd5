"""Integer arithmetic every layer sizes things with: ceil division and rounding up to a multiple.

Both take Python ints or integer tensors (elementwise), with a positive divisor. Trivial enough to
share across the independence line: a layout bug lives in where the rounding is applied, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

# "torch.Tensor" by name: the CLI sizes nothing, and checks its flags without importing torch.
_N = TypeVar("_N", int, "torch.Tensor")


def ceil_div(n: _N, d: int) -> _N:
    """ceil(n / d) for integer n and d > 0 (DeepGEMM's ceil_div)."""
    return -(-n // d)


def round_up(n: _N, multiple: int) -> _N:
    """The smallest multiple of `multiple` (> 0) that is >= n (DeepGEMM's align): the aligned
    segment rows round_up(count_e, A), the TMA-aligned scale rows round_up(MN, 4)."""
    return ceil_div(n, multiple) * multiple
