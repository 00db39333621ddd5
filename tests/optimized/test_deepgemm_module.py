"""optimized/deepgemm.py on a machine without a usable DeepGEMM: clear reasons, host validation.

The GEMM calls themselves run in the GPU tier (tests/gpu); here the capability probe, the engine
choice and the invariant checks that run before DeepGEMM is ever launched.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.spec import Engine, MoEProblem, QuantizedWeight, Recipe, ScaleFmt, StageSkipped
from optimized import deepgemm
from optimized.kernels._validate import InvalidKernelInput

pytestmark = pytest.mark.cpu


def test_probe_says_why_it_cannot_run() -> None:
    status = deepgemm.probe()
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the probe's no-GPU reason does not apply")
    assert not status.usable and "no CUDA GPU" in status.reason
    with pytest.raises(deepgemm.DeepGemmUnavailable, match="no CUDA GPU"):
        deepgemm.module()


def test_demanding_deepgemm_without_it_skips_with_the_reason() -> None:
    if deepgemm.probe().usable:
        pytest.skip("DeepGEMM is usable here")
    with pytest.raises(StageSkipped, match="DeepGEMM demanded but cannot run here"):
        deepgemm.choose_engine(MoEProblem(), 64, Engine.DEEPGEMM)
    auto = deepgemm.choose_engine(MoEProblem(), 64, "auto")
    assert auto.engine is Engine.TRITON and "fallback" in auto.reason


def test_engine_takes_its_names_and_refuses_others() -> None:
    assert deepgemm.as_engine("triton") is Engine.TRITON
    assert deepgemm.as_engine(Engine.DEEPGEMM) is Engine.DEEPGEMM
    choice = deepgemm.choose_engine(MoEProblem(), 64, "triton")
    assert choice.engine is Engine.TRITON and choice.reason == "engine forced to triton"
    with pytest.raises(
        ValueError, match=r"engine: expected one of \('auto', 'deepgemm', 'triton'\)"
    ):
        deepgemm.as_engine("cutlass")


def test_version_parsing_rejects_the_old_pypi_package() -> None:
    assert deepgemm._parse_version("2.6.1") >= deepgemm.MIN_VERSION
    assert deepgemm._parse_version("1.0.0") < deepgemm.MIN_VERSION
    assert deepgemm._parse_version("2.6.1+local") == (2, 6, 1)


def _call(m_indices: list[int], alignment: int = 4, scale: float = 1.0):
    m_sum = len(m_indices)
    a = torch.zeros(m_sum, 128).to(torch.float8_e4m3fn)
    sa = torch.full((m_sum, 1), scale)
    w = QuantizedWeight(
        torch.zeros(2, 128, 128).to(torch.float8_e4m3fn), torch.ones(2, 1, 1), (128, 128)
    )
    idx = torch.tensor(m_indices, dtype=torch.int32)
    deepgemm.validate_contiguous_call(a, sa, w, idx, alignment, use_ue8m0=False)


def test_valid_layout_passes_validation() -> None:
    _call([0, 0, -1, -1, 1, -1, -1, -1])


@pytest.mark.parametrize(
    ("m_indices", "alignment", "scale", "message"),
    [
        ([0, 1, -1, -1], 4, 1.0, "must hold one expert"),  # two experts in one block
        ([0, -1, 0, -1], 4, 1.0, "must hold one expert"),  # a hole inside a segment
        ([0, 2, -1, -1], 4, 1.0, "m_indices"),  # expert id out of range
        ([0, 0, -1], 4, 1.0, "multiple of the alignment"),  # M_sum not aligned
        ([0, -1, -1, -1], 4, float("nan"), "not a finite scale"),  # NaN activation scale
    ],
    ids=["two-experts-one-block", "hole", "id-out-of-range", "unaligned-m-sum", "nan-scale"],
)
def test_broken_invariants_are_reported_before_launch(m_indices, alignment, scale, message) -> None:
    with pytest.raises(InvalidKernelInput, match=message):
        _call(m_indices, alignment, scale)


def _masked_call(masked_m: list[int], groups: int = 2, max_m: int = 256, expected_m: int = 2):
    a = torch.zeros(groups, max_m, 128).to(torch.float8_e4m3fn)
    sa = torch.ones(groups, max_m, 1)
    w = QuantizedWeight(
        torch.zeros(2, 128, 128).to(torch.float8_e4m3fn), torch.ones(2, 1, 1), (128, 128)
    )
    counts = torch.tensor(masked_m, dtype=torch.int32)
    deepgemm.validate_masked_call(a, sa, w, counts, expected_m, use_ue8m0=False)


def test_valid_masked_layout_passes_validation() -> None:
    _masked_call([0, 256])
    _masked_call([128, 100], max_m=200)  # M_max need not be aligned while the blocks fit


@pytest.mark.parametrize(
    ("masked_m", "groups", "max_m", "expected_m", "message"),
    [
        ([1, 257], 2, 256, 2, r"masked_m\[1\] = 257 is outside \[0, 257\)"),  # above M_max
        ([150, 1], 2, 200, 2, r"masked_m\[0\] = 150 fills 256 rows .* M_max = 200"),
        ([20, 20], 2, 20, 2, r"masked_m\[0\] = 20 fills 128 rows"),  # DeepGEMM issue 268
        ([-1, 2], 2, 256, 2, "outside"),  # negative count
        ([1, 1, 1], 3, 256, 2, "but the weights are"),  # batches of the global experts (#21)
        ([1], 2, 256, 2, "masked_m must be int32"),  # one count for two batches
        ([1, 1], 2, 256, 0, "expected_m must be > 0"),
    ],
    ids=[
        "above-max-m",
        "last-block-crosses-batch",
        "max-m-below-one-block",
        "negative",
        "global-expert-batches",
        "count-length",
        "expected-m-zero",
    ],
)
def test_broken_masked_invariants_are_reported_before_launch(
    masked_m, groups, max_m, expected_m, message
) -> None:
    with pytest.raises(InvalidKernelInput, match=message):
        _masked_call(masked_m, groups=groups, max_m=max_m, expected_m=expected_m)


def test_support_table_names_the_arch_limits() -> None:
    if deepgemm.probe().usable:
        pytest.skip("support() on a real GPU is covered by the GPU tier")
    ok, why = deepgemm.support(MoEProblem(recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED))
    assert not ok and why
