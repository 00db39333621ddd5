"""optimized/deepgemm on a machine without a usable DeepGEMM: clear reasons, host validation.

The GEMM calls themselves run in the GPU tier (tests/gpu); here the capability probe, the engine
choice and the invariant checks that run before DeepGEMM is ever launched, and, with the probe
stood in for (`_usable`), what each arch's module (sm90_fp8_1d2d, sm100_ue8m0) decides.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
import torch

from moe_verify.spec import Engine, MoEProblem, QuantizedWeight, Recipe, ScaleFmt, StageSkipped
from optimized import deepgemm
from optimized.deepgemm import status as deepgemm_status
from optimized.deepgemm.status import _parse_version
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
    assert _parse_version("2.6.1") >= deepgemm.MIN_VERSION
    assert _parse_version("1.0.0") < deepgemm.MIN_VERSION
    assert _parse_version("2.6.1+local") == (2, 6, 1)


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


def _usable(
    monkeypatch: pytest.MonkeyPatch, major: int, dg: object = None
) -> deepgemm.DeepGemmStatus:
    """DeepGEMM usable on an SM`major` GPU as far as the package can tell (`dg` its module)."""
    status = deepgemm.DeepGemmStatus(True, f"stand-in on SM{major}x", "2.6.1", major, dg)
    monkeypatch.setattr(deepgemm, "probe", lambda: status)  # support() and the engine choice
    monkeypatch.setattr(deepgemm_status, "probe", lambda: status)  # module() and on_sm90/100
    return status


PACKED = ScaleFmt.UE8M0_PACKED


@pytest.mark.parametrize(
    ("major", "problem", "refusal"),
    [
        (9, MoEProblem(), None),  # SM90's own: 128x128 blocks, fp32 scales
        (9, MoEProblem(scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0), None),  # still fp32 on the wire
        (9, MoEProblem(recipe=Recipe.MXFP8, scale_fmt=PACKED), "are SM100-only"),
        (9, MoEProblem(scale_fmt=PACKED), "packed UE8M0 scales feed SM100 GEMMs only"),
        (9, MoEProblem(alignment=32), "alignment 32 is not a legal SM90 BLOCK_M"),
        (10, MoEProblem(scale_fmt=PACKED), None),
        (10, MoEProblem(recipe=Recipe.MXFP4_W4A8, scale_fmt=PACKED), None),  # FP4 weights
        (10, MoEProblem(scale_fmt=PACKED, alignment=32), None),  # SM90's BLOCK_M rule only
        (10, MoEProblem(), "plain float32 scales need SM90"),
    ],
    ids=[
        "sm90-fp8_block",
        "sm90-ceil",
        "sm90-mxfp8",
        "sm90-packed",
        "sm90-A32",
        "sm100-packed",
        "sm100-mxfp4",
        "sm100-packed-A32",
        "sm100-float32",
    ],
)
def test_support_follows_the_arch(
    monkeypatch: pytest.MonkeyPatch, major: int, problem: MoEProblem, refusal: str | None
) -> None:
    status = _usable(monkeypatch, major)
    ok, why = deepgemm.support(problem)
    if refusal is None:
        assert ok and why == status.reason
    else:
        assert not ok and refusal in why


def _recording_deepgemm(calls: list[tuple[torch.Tensor, dict[str, object]]]) -> ModuleType:
    def transform_sf_into_required_layout(sf: torch.Tensor, **kwargs: object) -> str:
        calls.append((sf, kwargs))
        return "packed by DeepGEMM"

    return SimpleNamespace(transform_sf_into_required_layout=transform_sf_into_required_layout)


def test_sm90_reads_the_weight_scales_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.Tensor, dict[str, object]]] = []
    _usable(monkeypatch, 9, _recording_deepgemm(calls))
    scale = torch.rand(2, 1, 2).transpose(1, 2)  # [E, N/128, K/128], not contiguous
    w = QuantizedWeight(torch.zeros(2, 256, 128).to(torch.float8_e4m3fn), scale, (128, 128))
    out = deepgemm.prepare_weight_scales(w, use_ue8m0=False)
    assert torch.equal(out, scale) and out.is_contiguous() and calls == []


def test_sm100_has_deepgemm_pack_the_weight_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """E8M0 bytes become fp32 powers of two (the byte in the exponent field), then DeepGEMM packs
    them for the per-32 recipe of the weights' block."""
    calls: list[tuple[torch.Tensor, dict[str, object]]] = []
    _usable(monkeypatch, 10, _recording_deepgemm(calls))
    scale = torch.tensor([126, 127, 128, 130], dtype=torch.uint8).reshape(1, 1, 4).repeat(2, 8, 1)
    w = QuantizedWeight(torch.zeros(2, 8, 128).to(torch.float8_e4m3fn), scale, (1, 32))
    assert deepgemm.prepare_weight_scales(w, use_ue8m0=True) == "packed by DeepGEMM"
    [(sf, kwargs)] = calls
    assert torch.equal(sf, torch.tensor([0.5, 1.0, 2.0, 8.0]).expand(2, 8, 4))
    assert kwargs == {
        "mn": 8, "k": 128, "recipe": (1, 1, 32), "num_groups": 2, "is_sfa": False,
        "disable_ue8m0_cast": False,
    }  # fmt: skip


@pytest.mark.parametrize("major", [9, 10], ids=["sm90", "sm100"])
def test_psum_activation_scales_are_made_k_major_on_sm100_only(
    monkeypatch: pytest.MonkeyPatch, major: int
) -> None:
    _usable(monkeypatch, major)
    column_major = torch.rand(4, 64).t()  # act_quant's fp32 [M, K/128] layout
    packed = torch.ones(4, 64, dtype=torch.int32).t()
    out = deepgemm.psum_activation_scales(column_major)
    assert torch.equal(out, column_major)
    assert out.is_contiguous() if major == 10 else out is column_major
    assert deepgemm.psum_activation_scales(packed) is packed


def _fp32_scales_of(gemm: str, scale: float) -> None:
    """The host checks of `gemm` ("contiguous", "masked") on one fp32 activation scale value, with
    UE8M0 in use."""
    w = QuantizedWeight(
        torch.zeros(2, 128, 128).to(torch.float8_e4m3fn), torch.ones(2, 1, 1), (128, 128)
    )
    if gemm == "contiguous":
        a = torch.zeros(4, 128).to(torch.float8_e4m3fn)
        idx = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
        deepgemm.validate_contiguous_call(a, torch.full((4, 1), scale), w, idx, 2, use_ue8m0=True)
    else:
        a = torch.zeros(2, 128, 128).to(torch.float8_e4m3fn)
        counts = torch.tensor([1, 1], dtype=torch.int32)
        sa = torch.full((2, 128, 1), scale)
        deepgemm.validate_masked_call(a, sa, w, counts, 1, use_ue8m0=True)


@pytest.mark.parametrize("gemm", ["contiguous", "masked"])
def test_sm100_refuses_fp32_scales_ue8m0_cannot_hold(
    monkeypatch: pytest.MonkeyPatch, gemm: str
) -> None:
    """SM100 packs fp32 activation scales to UE8M0, and DeepGEMM device-asserts powers of two."""
    _usable(monkeypatch, 10)
    _fp32_scales_of(gemm, 0.5)
    with pytest.raises(InvalidKernelInput, match="is not a non-negative power of two"):
        _fp32_scales_of(gemm, 0.3)


@pytest.mark.parametrize("gemm", ["contiguous", "masked"])
def test_sm90_reads_any_finite_fp32_scale(monkeypatch: pytest.MonkeyPatch, gemm: str) -> None:
    _usable(monkeypatch, 9)
    _fp32_scales_of(gemm, 0.3)
