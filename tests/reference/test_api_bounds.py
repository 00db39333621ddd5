"""Public functions outside the kernels refuse what they cannot honour, by argument name, before
any work: a group the format does not have, a row count past int32, a block that would only pad."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from optimized.kernels import slot_counts
from optimized.kernels._validate import InvalidKernelInput
from reference import formats, layout

pytestmark = pytest.mark.cpu

HUGE = dict(num_tokens=2**40, topk=8, num_local_experts=32, alignment=128)


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda: formats.quantize_mxfp8(torch.ones(4, 56), group=7), ValueError, "group: the MX"),
        (
            lambda: formats.dequantize_mxfp8(
                torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
                torch.zeros(4, 4, dtype=torch.uint8),
                group=16,
            ),
            ValueError,
            "one E8M0 byte per 32 elements (OCP MX), got 16",
        ),
        (lambda: formats.quantize_mxfp4(torch.ones(4, 64), group=16), ValueError, "group: the MX"),
        (
            lambda: layout.aligned_m_sum_upper_bound(**HUGE),
            ValueError,
            "aligned_m_sum_upper_bound: 8796093026304 rows do not fit int32",
        ),
        (
            lambda: layout.aligned_m_sum_all_experts_bound(**HUGE),
            ValueError,
            "num_tokens=1099511627776",
        ),
        (lambda: layout.aligned_m_sum_tight_bound(**HUGE), ValueError, "do not fit int32"),
        (
            lambda: slot_counts.aligned_m_sum_upper_bound(**HUGE),
            InvalidKernelInput,
            "rows do not fit int32: num_tokens=1099511627776 x topk=8",
        ),
        (
            lambda: formats.quantize_fp8_blocks(torch.ones(256, 256), block=(2**20, 128)),
            ValueError,
            "block[0]=1048576 is larger than N=256",
        ),
        (
            lambda: formats.quantize_fp8_blocks(torch.ones(256, 256), block=(128, 2**20)),
            ValueError,
            "block[1]=1048576 is larger than K=256",
        ),
    ],
    ids=[
        "mxfp8-group",
        "mxfp8-dequant-group",
        "mxfp4-group",
        "upper-bound",
        "all-experts-bound",
        "tight-bound",
        "optimized-upper-bound",
        "fp8-block-rows",
        "fp8-block-cols",
    ],
)
def test_refused_by_name(call: Callable[[], object], error: type, says: str) -> None:
    with pytest.raises(error, match=re.escape(says)):
        call()


def test_the_edges_still_work() -> None:
    """The int32 limit itself and a block larger than a small tensor (up to DeepGEMM's 128)."""
    assert layout.aligned_m_sum_upper_bound(2**31 // 8 - 16, 8, 1, 1) <= layout.INT32_MAX
    q, s = formats.quantize_fp8_blocks(torch.ones(64, 96), block=(128, 128))
    assert q.shape == (64, 96) and s.shape == (1, 1)
