"""SM100 (Blackwell): DeepGEMM's FP8 kernels with UE8M0 scales, MXFP8 (per-32) and FP4 weights.

SM100 GEMMs read their scales packed: four UE8M0 exponents per int32, per row, MN-major,
TMA-aligned. DeepGEMM packs the weights' at load time (`weight_scales`) and fp32 activation
scales itself, device-asserting powers of two; plain fp32 scales are SM90's (`sm90_fp8_1d2d`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from moe_verify.spec import MoEProblem, QuantizedWeight, ScaleFmt
from optimized.deepgemm.status import module, on_sm100
from optimized.kernels._validate import check_power_of_two_scales


def unsupported(problem: MoEProblem) -> str | None:
    """Why the SM100 kernels cannot run `problem`'s GEMMs, or None when they can."""
    if problem.scale_fmt is ScaleFmt.FLOAT32:
        return "SM100 FP8 GEMMs take UE8M0 scales; plain float32 scales need SM90"
    return None


def _weight_recipe(w: QuantizedWeight) -> tuple[int, int, int]:
    return (1, w.block[0], w.block[1])


def weight_scales(
    dg: ModuleType, scale: torch.Tensor, w: QuantizedWeight, use_ue8m0: bool
) -> torch.Tensor:
    """`w`'s fp32 scales (powers of two, or upcast E8M0 bytes) packed by DeepGEMM into int32
    UE8M0, per row, MN-major, TMA-aligned."""
    e, n, k = w.shape
    return dg.transform_sf_into_required_layout(
        scale.contiguous(),
        mn=n,
        k=k,
        recipe=_weight_recipe(w),
        num_groups=e,
        is_sfa=False,
        disable_ue8m0_cast=not use_ue8m0,
    )


def scale_group_recipes(a_group: int, w: QuantizedWeight) -> dict[str, object]:
    """The scale groups a per-32 (MXFP8) or FP4 GEMM must be told: K elements per activation
    scale and per weight scale; {} for 128x128 blocks, DeepGEMM's default."""
    if w.fp4 or w.block != (128, 128):
        return {"recipe_a": (1, a_group), "recipe_b": (1, w.block[1])}
    return {}


def check_packable_scales(fn: str, name: str, scales: torch.Tensor) -> None:
    """fp32 `scales` DeepGEMM packs to UE8M0: on SM100 they must be powers of two (DeepGEMM 2.6
    device-asserts it while packing); SM90 reads them as they are."""
    if on_sm100():
        check_power_of_two_scales(fn, name, scales)


def psum_activation_scales(a_scale: torch.Tensor) -> torch.Tensor:
    """The activation scales as the psum layout's SFA packer takes them. On SM100 it takes only a
    K-major contiguous fp32 SF (smxx_layout.hpp asserts it) and act_quant's fp32 scales are
    column-major: a layout copy, same values. Packed int32 scales, and any on SM90, as given."""
    if a_scale.dtype == torch.float32 and on_sm100():
        return a_scale.contiguous()
    return a_scale


def pack_ue8m0_reference(scale: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's own packer (get_mn_major_tma_aligned_packed_ue8m0_tensor): fp32 powers of two
    [MN, G] -> int32 [MN, ceil(G/4)] MN-major TMA-aligned. It runs on SM90 too, so it
    cross-checks our packing on a Hopper machine even though only SM100 GEMMs consume it."""
    return module().get_mn_major_tma_aligned_packed_ue8m0_tensor(scale.contiguous())
