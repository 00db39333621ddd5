"""The optimized side's host-side sizing refuses, by argument name, what the layout's int32
indices cannot hold (the kernel wrappers' own checks are in the kernel test files)."""

from __future__ import annotations

import re

import pytest
import torch

from optimized.kernels import slot_counts
from optimized.kernels._validate import InvalidKernelInput

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    "counts",
    [torch.tensor([2**40]), [2**30, 2**30, 2**30]],  # one huge expert; several that add up
    ids=["tensor-one-expert", "list-three-experts"],
)
def test_an_exact_m_sum_past_int32_is_refused(counts: torch.Tensor | list[int]) -> None:
    """It used to return 1099511627776 (or 3221225472): rows the int32 m_indices cannot index."""
    with pytest.raises(InvalidKernelInput, match=re.escape("rows do not fit int32: counts sum")):
        slot_counts.aligned_m_sum_exact(counts, 8)


def test_the_largest_exact_m_sum_int32_holds_is_returned() -> None:
    top = slot_counts.INT32_MAX - 7  # a multiple of 8
    assert slot_counts.aligned_m_sum_exact([top], 8) == top
