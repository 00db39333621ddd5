"""Public functions outside the kernels refuse what they cannot honour, by argument name, before
any work: a group the format does not have, a row count past int32, a block that would only pad."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from moe_verify.spec import ScaleFmt
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


IDS = torch.tensor([[0, 1], [1, 2]])
FP8 = torch.float8_e4m3fn


# The same gaps in the neighbours of the functions above: an enum given as a string, a size that
# only the allocator refused (or nobody), a row count past int32, an argument of the wrong type.
@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (  # the allocator was asked for 1 TB: the block is checked against q as when quantizing
            lambda: formats.dequantize_fp8_blocks(
                torch.zeros(256, 256, dtype=FP8), torch.ones(1, 1), block=(2**30, 2**30)
            ),
            ValueError,
            "block[0]=1073741824 is larger than N=256",
        ),
        (  # AttributeError: 'str' object has no attribute 'is_ue8m0'
            lambda: formats.group_scales_by_division(torch.ones(3), "bogus"),
            ValueError,
            "scale_fmt must be one of float32, float32_ceil_ue8m0, ue8m0_packed, got 'bogus'",
        ),
        (
            lambda: formats.group_scales_by_reciprocal(torch.ones(3), "bogus"),
            ValueError,
            "scale_fmt must be one of",
        ),
        (
            lambda: formats.quantize_groups_by_amax_reciprocal(torch.ones(2, 4, 8), "bogus"),
            ValueError,
            "scale_fmt must be one of",
        ),
        (  # "'xx' is not a valid InputQuantRecipe": no argument named
            lambda: formats.quantize_groups_by_amax_reciprocal(
                torch.ones(2, 4, 8), "float32", recipe="xx"
            ),
            ValueError,
            "recipe must be one of",
        ),
        (  # 4 TB asked of the allocator
            lambda: layout.permute_plan(IDS, 3, 8, m_sum=2**40),
            ValueError,
            "m_sum: expected at most 2147483647 rows (int32",
        ),
        (  # torch's "full(): argument 'size' ... must be tuple of ints"
            lambda: layout.permute_plan(IDS, 3, 8, m_sum=32.0),
            TypeError,
            "m_sum: expected an int >= 0, got 32.0 (float)",
        ),
        (  # "'>=' not supported between instances of 'str' and 'int'"
            lambda: layout.permute_plan(IDS, 3, "8"),
            TypeError,
            "alignment: expected an int >= 1, got '8' (str)",
        ),
        (  # 8 TB asked of the allocator by bincount
            lambda: layout.permute_plan(IDS, 2**40, 8),
            ValueError,
            "num_local_experts: expected an int in [0, 4096], got 1099511627776",
        ),
        (
            lambda: layout.expert_counts(IDS, 2**40),
            ValueError,
            "num_local_experts: expected an int in [0, 4096]",
        ),
        (  # returned 1099511627776, past the int32 layout indices
            lambda: layout.aligned_m_sum_exact(torch.tensor([2**40]), 8),
            ValueError,
            "aligned_m_sum_exact: 1099511627776 rows do not fit int32",
        ),
        (
            lambda: layout.m_indices_from_expert_ends(torch.tensor([4]), 2**40, 8),
            ValueError,
            "m_sum: expected at most 2147483647 rows",
        ),
        (  # "'<=' not supported between instances of 'int' and 'str'"
            lambda: layout.batched_plan(IDS, 3, "4"),
            TypeError,
            "max_tokens: expected an int >= 0, got '4' (str)",
        ),
        (  # accepted, a float capacity
            lambda: layout.batched_plan(IDS, 3, 4.5),
            TypeError,
            "max_tokens: expected an int >= 0, got 4.5 (float)",
        ),
    ],
    ids=[
        "fp8-dequant-block",
        "division-scale-fmt",
        "reciprocal-scale-fmt",
        "amax-reciprocal-scale-fmt",
        "amax-reciprocal-recipe",
        "plan-m_sum-int32",
        "plan-m_sum-float",
        "plan-alignment-str",
        "plan-experts-huge",
        "counts-experts-huge",
        "exact-int32",
        "psum-m_sum-int32",
        "batched-max_tokens-str",
        "batched-max_tokens-float",
    ],
)
def test_the_neighbours_refuse_by_name(call: Callable[[], object], error: type, says: str) -> None:
    with pytest.raises(error, match=re.escape(says)):
        call()


def test_the_neighbours_take_enums_as_strings_and_their_edges() -> None:
    """A scale format or recipe spelled as its string gives the enum's result bit for bit; the
    largest row count int32 holds is still one."""
    amax = torch.tensor([1e-12, 0.3, 448.0])
    assert torch.equal(
        formats.group_scales_by_division(amax, "float32_ceil_ue8m0"),
        formats.group_scales_by_division(amax, ScaleFmt.FLOAT32_CEIL_UE8M0),
    )
    groups = torch.linspace(-3, 3, 64).reshape(2, 4, 8)
    q_str, s_str = formats.quantize_groups_by_amax_reciprocal(groups, "float32", "amax_reciprocal")
    q_enum, s_enum = formats.quantize_groups_by_amax_reciprocal(groups, ScaleFmt.FLOAT32)
    assert torch.equal(q_str.view(torch.uint8), q_enum.view(torch.uint8))
    assert torch.equal(s_str, s_enum)
    top = layout.INT32_MAX - 7  # a multiple of 8
    assert layout.aligned_m_sum_exact(torch.tensor([top]), 8) == top
