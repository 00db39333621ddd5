"""The DeepGEMM path: what the rest of the suite imports from it, and the two choices made
before a GEMM runs, the engine (DeepGEMM or Triton) and the grouped layout (m_indices or psum).

The only package that imports deep_gemm, lazily (`status.probe`, on first use). Split the way
DeepGEMM names its kernels, by arch:

- `loading`: where DeepGEMM comes from (a standalone `deep_gemm`, else the copy vLLM's wheel
  bundles as `vllm.third_party.deep_gemm`, loaded without running vLLM's own __init__);
- `status`: can it run here (`probe`: which one, its version and directory, the GPU arch; a
  reason in words where it cannot), the module itself, and a first call in a child process;
- `validate`: the host checks of the grouped GEMMs' invariants;
- `gemm`: the calls (alignment and SM-count scopes, weight scales, contiguous and masked GEMMs);
- `sm90_fp8_1d2d`: SM90's 1D2D FP8 kernels, fp32 scales;
- `sm100_ue8m0`: SM100's UE8M0-packed scales, MXFP8 and FP4 (everything UE8M0-packed, per-32
  or FP4 is SM100-only).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.spec import (
    Engine,
    GroupedLayout,
    MoEProblem,
    Recipe,
    ScaleFmt,
    StageSkipped,
    cc_major,
    is_sm90_major,
    is_sm100_major,
)
from optimized.deepgemm import sm90_fp8_1d2d as sm90
from optimized.deepgemm import sm100_ue8m0 as sm100
from optimized.deepgemm.gemm import (
    alignment_scope,
    current_alignment,
    m_grouped_gemm,
    m_grouped_gemm_masked,
    prepare_weight_scales,
    prepared_scale_key,
    sm_count_scope,
)
from optimized.deepgemm.loading import (
    BUNDLED_MODULE,
    SOURCES,
    STANDALONE,
    VLLM_BUNDLED,
    Found,
    find_deepgemm,
    import_found,
)
from optimized.deepgemm.sm90_fp8_1d2d import SM90_LEGAL_ALIGNMENTS
from optimized.deepgemm.sm100_ue8m0 import (
    pack_ue8m0_reference,
    psum_activation_scales,
    scale_group_recipes,
)
from optimized.deepgemm.status import (
    LIBSTDCXX,
    MIN_VERSION,
    REQUIRED_API,
    DeepGemmStatus,
    DeepGemmUnavailable,
    module,
    on_sm90,
    on_sm100,
    probe,
    probe_first_call,
)
from optimized.deepgemm.validate import (
    MASKED_BLOCK_M,
    validate_contiguous_call,
    validate_masked_call,
)
from optimized.triton_compat import interpreter_mode

__all__ = [
    "BUNDLED_MODULE",
    "LIBSTDCXX",
    "MASKED_BLOCK_M",
    "MIN_INTERMEDIATE",
    "MIN_VERSION",
    "REQUIRED_API",
    "SM90_LEGAL_ALIGNMENTS",
    "SOURCES",
    "STANDALONE",
    "VLLM_BUNDLED",
    "DeepGemmStatus",
    "DeepGemmUnavailable",
    "EngineChoice",
    "Found",
    "LayoutChoice",
    "alignment_scope",
    "as_engine",
    "choose_engine",
    "choose_grouped_layout",
    "current_alignment",
    "find_deepgemm",
    "import_found",
    "m_grouped_gemm",
    "m_grouped_gemm_masked",
    "module",
    "on_sm90",
    "on_sm100",
    "pack_ue8m0_reference",
    "prepare_weight_scales",
    "prepared_scale_key",
    "probe",
    "probe_first_call",
    "psum_activation_scales",
    "scale_group_recipes",
    "sm_count_scope",
    "support",
    "validate_contiguous_call",
    "validate_masked_call",
]

# vLLM _valid_deep_gemm: at or below this intermediate size (per rank) Triton is preferred for
# speed.
MIN_INTERMEDIATE = 512


def support(problem: MoEProblem) -> tuple[bool, str]:
    """Can DeepGEMM run this problem's GEMMs on this machine? (yes/no, and why)."""
    status = probe()
    if not status.usable:
        return False, status.reason
    arch = sm90 if is_sm90_major(status.arch_major) else sm100
    why = arch.unsupported(problem)
    return (False, why) if why else (True, status.reason)


def as_engine(value: Engine | str) -> Engine:
    """`value` as an Engine; a ValueError naming the allowed values for anything else."""
    try:
        return Engine(value)
    except ValueError:
        allowed = tuple(e.value for e in Engine)
        raise ValueError(f"engine: expected one of {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class EngineChoice:
    """The engine a GEMM stage runs on (DEEPGEMM or TRITON, never AUTO), and why."""

    engine: Engine
    reason: str


def choose_engine(
    problem: MoEProblem, num_tokens: int, override: Engine | str = Engine.AUTO
) -> EngineChoice:
    """TritonOrDeepGemm: DeepGEMM when E8M0 is in use or the shape is valid for it, else Triton.

    `override=Engine.DEEPGEMM` demands DeepGEMM (a stage it cannot run is skipped with the
    reason, never silently replaced); `Engine.TRITON` forces the Triton engine.
    """
    override = as_engine(override)
    if override is Engine.TRITON:
        return EngineChoice(Engine.TRITON, "engine forced to triton")
    ok, why = support(problem)
    if override is Engine.DEEPGEMM:
        if not ok:
            raise StageSkipped(f"DeepGEMM demanded but cannot run here: {why}")
        return EngineChoice(Engine.DEEPGEMM, f"engine forced to deepgemm ({why})")
    if not ok:
        return EngineChoice(Engine.TRITON, f"TritonOrDeepGemm fallback: {why}")
    if problem.scale_fmt.is_ue8m0:
        return EngineChoice(Engine.DEEPGEMM, "E8M0 scales in use: DeepGEMM regardless of shape")
    a, ip, h = problem.alignment, problem.intermediate_per_rank, problem.hidden
    if num_tokens >= a and ip % a == 0 and h % a == 0 and ip > MIN_INTERMEDIATE:
        return EngineChoice(Engine.DEEPGEMM, "shape valid for DeepGEMM (_valid_deep_gemm)")
    return EngineChoice(
        Engine.TRITON,
        f"_valid_deep_gemm fails (M={num_tokens} >= A={a}, I_p={ip} % A, H={h} % A, "
        f"I_p > {MIN_INTERMEDIATE}): Triton",
    )


@dataclass(frozen=True)
class LayoutChoice:
    """The grouped layout the contiguous GEMMs and act_quant read (M_INDICES or PSUM, never
    AUTO), and why."""

    layout: GroupedLayout
    reason: str


def _gpu_arch_major() -> int | None:
    """The GPU this path runs on, or None on the CPU (the Triton interpreter)."""
    return None if interpreter_mode() else cc_major()


def choose_grouped_layout(problem: MoEProblem) -> LayoutChoice:
    """vLLM 0.32's choice (DeepGemmExperts.apply, `use_psum_layout`) unless the problem forces one.

    psum for fp8_block (not MXFP8; the FP4 experts never use it) with silu or swigluoai, on SM90,
    and on SM100 with packed UE8M0 scales (vLLM's DeepGemmQuantScaleFMT.UE8M0, the only E8M0
    format it runs there). Without a GPU there is no arch to choose by: m_indices, the layout
    vLLM runs wherever it does not choose psum (both come from one permute plan, so either is
    exercised by forcing it).
    """
    if problem.grouped_layout is not GroupedLayout.AUTO:
        return LayoutChoice(problem.grouped_layout, "forced by the problem")
    major = _gpu_arch_major()
    if major is None:
        return LayoutChoice(GroupedLayout.M_INDICES, "auto without a GPU: m_indices")
    if problem.recipe is not Recipe.FP8_BLOCK:
        return LayoutChoice(
            GroupedLayout.M_INDICES, f"auto: vLLM runs {problem.recipe} on m_indices"
        )
    arch_ok = is_sm90_major(major) or (
        is_sm100_major(major) and problem.scale_fmt is ScaleFmt.UE8M0_PACKED
    )
    if arch_ok and problem.activation.kind in ("silu", "swigluoai"):
        return LayoutChoice(GroupedLayout.PSUM, f"auto: vLLM 0.32 runs psum on SM{major}x here")
    return LayoutChoice(
        GroupedLayout.M_INDICES,
        f"auto: vLLM 0.32 runs m_indices on SM{major}x with {problem.scale_fmt}",
    )
