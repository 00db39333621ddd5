"""The GEMM calls: DeepGEMM's process-global settings scoped to one call, the weight scales in
the layout this arch's kernel reads, and the m-grouped contiguous and masked FP8 (FP4) GEMMs.

What differs by arch lives in `sm90_fp8_1d2d` and `sm100_ue8m0`; this module calls one or the
other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moe_verify.spec import QuantizedWeight
from optimized.deepgemm import sm90_fp8_1d2d as sm90
from optimized.deepgemm import sm100_ue8m0 as sm100
from optimized.deepgemm.status import module, on_sm90
from optimized.deepgemm.validate import validate_contiguous_call, validate_masked_call
from optimized.kernels._validate import check_flag, output_buffer


@contextlib.contextmanager
def alignment_scope(value: int) -> Iterator[None]:
    """Set DeepGEMM's process-global contiguous-layout alignment (its BLOCK_M) for one call.

    The per-expert padding of the workspace must equal the kernel's BLOCK_M, or the scheduler reads
    the expert of a block from the wrong row (silent misrouting or an IMA; vLLM wraps its GEMMs in
    `mk_alignment_scope` for this). Always restores the previous value.
    """
    dg = module()
    previous = dg.get_mk_alignment_for_contiguous_layout()
    if isinstance(previous, (tuple, list)):
        previous = previous[0]
    dg.set_mk_alignment_for_contiguous_layout(value)
    try:
        yield
    finally:
        dg.set_mk_alignment_for_contiguous_layout(previous)


@contextlib.contextmanager
def sm_count_scope(num_sms: int | None) -> Iterator[None]:
    """Let DeepGEMM use `num_sms` SMs for the calls inside (deep_gemm.set_num_sms, a
    process-global); None leaves it as it is. Always restores the previous count."""
    if num_sms is None:
        yield
        return
    dg = module()
    previous = dg.get_num_sms()
    dg.set_num_sms(num_sms)
    try:
        yield
    finally:
        dg.set_num_sms(previous)


def current_alignment() -> int:
    value = module().get_mk_alignment_for_contiguous_layout()
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def prepared_scale_key(which: str, use_ue8m0: bool) -> str:
    """The key of `which`'s ("w13", "w2") scales in DeepGEMM's layout among a shard's prepared
    weights (`RankShard.prepared`): production mode fills it at load time, verification on
    first use."""
    return f"deepgemm_scale:{which}:{'ue8m0' if use_ue8m0 else 'fp32'}"


def prepare_weight_scales(w: QuantizedWeight, use_ue8m0: bool) -> torch.Tensor:
    """The weight scales in the layout this arch's kernel reads.

    SM90: fp32 [E, N/128, K/128] as-is. SM100: DeepGEMM packs fp32 powers of two (or upcast E8M0
    bytes) into int32 UE8M0, per row, MN-major, TMA-aligned.
    """
    check_flag("deepgemm.prepare_weight_scales", "use_ue8m0", use_ue8m0)
    dg = module()
    scale = w.scale
    if scale.dtype == torch.uint8:
        # E8M0 bytes -> fp32 powers of two by placing the byte in the exponent field.
        scale = (scale.to(torch.int32) << 23).view(torch.float32)
    if on_sm90():
        return sm90.weight_scales(scale)
    return sm100.weight_scales(dg, scale, w, use_ue8m0)


def m_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    w: QuantizedWeight,
    w_scale: torch.Tensor,
    grouped_layout: torch.Tensor,
    alignment: int,
    *,
    use_ue8m0: bool,
    use_psum_layout: bool = False,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d = A @ B[e(r)]^T in bf16 through m_grouped_fp8(_fp4)_gemm_nt_contiguous.

    The arguments in the order of every grouped GEMM of the suite (the golden's, the Triton
    engine's `grouped_gemm`): activations with their scales and group, weights, layout.
    a_group: K elements per activation scale; w_scale: `w`'s scales in this arch's layout
    (`prepare_weight_scales`); grouped_layout: m_indices [M_sum], or with `use_psum_layout`
    expert_ends [E] (DeepGEMM 2.6.1's `use_psum_layout=True`: the SM100 SFA packer then skips
    the gap rows; vLLM 0.32 passes neither `expected_m_for_psum_layout` nor
    `ensure_zero_padding`, and neither do we); `out`, when given, is a reused [M_sum, N] bf16
    workspace. DeepGEMM writes padding (-1) rows, and under psum gap rows, unspecified, and
    leaves tail rows past the last segment unwritten. validate: the host checks of
    `validate_contiguous_call` (device syncs; False in production mode and under capture)."""
    # The flags first: a string such as 'no' is truthy, and DeepGEMM would take it as True.
    check_flag("deepgemm.m_grouped_gemm", "use_ue8m0", use_ue8m0)
    check_flag("deepgemm.m_grouped_gemm", "use_psum_layout", use_psum_layout)
    check_flag("deepgemm.m_grouped_gemm", "validate", validate)
    dg = module()
    m_sum = a.shape[0]
    n = w.shape[1]
    d = output_buffer("deepgemm.m_grouped_gemm", "out", out, (m_sum, n), torch.bfloat16, a.device)
    if m_sum == 0:
        return d
    if validate:
        validate_contiguous_call(
            a, a_scale, w, grouped_layout, alignment, use_ue8m0, use_psum_layout
        )
    b = w.q.view(torch.int8) if w.fp4 else w.q
    kwargs: dict[str, object] = {
        "disable_ue8m0_cast": not use_ue8m0,
        **sm100.scale_group_recipes(a_group, w),
    }
    if use_psum_layout:
        kwargs["use_psum_layout"] = True
        a_scale = sm100.psum_activation_scales(a_scale)
    with alignment_scope(alignment):
        if w.fp4:
            dg.m_grouped_fp8_fp4_gemm_nt_contiguous(
                (a, a_scale), (b, w_scale), d, grouped_layout, **kwargs
            )
        else:
            dg.m_grouped_fp8_gemm_nt_contiguous(
                (a, a_scale), (b, w_scale), d, grouped_layout, **kwargs
            )
    return d


def m_grouped_gemm_masked(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    *,
    use_ue8m0: bool,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d[e, :masked_m[e]] = A[e] @ B[e]^T through m_grouped_fp8_gemm_nt_masked. validate: the
    host checks of `validate_masked_call` (device syncs; False in production mode); out: a
    reused bf16 [G, M_max, N] workspace."""
    fn = "deepgemm.m_grouped_gemm_masked"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    check_flag(fn, "validate", validate)
    dg = module()
    if validate:
        validate_masked_call(a, a_scale, w, masked_m, expected_m, use_ue8m0)
    e, max_m, _ = a.shape
    d = output_buffer(fn, "out", out, (e, max_m, w.shape[1]), torch.bfloat16, a.device)
    dg.m_grouped_fp8_gemm_nt_masked(
        (a, a_scale), (w.q, w_scale), d, masked_m, expected_m, disable_ue8m0_cast=not use_ue8m0
    )
    return d
