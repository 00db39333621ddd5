"""The invariants DeepGEMM's m-grouped GEMMs assume, checked on the host before a call: the
contiguous GEMM's (m_indices or psum expert_ends) and the masked GEMM's (masked_m).

A violation faults or silently misroutes inside the kernel; here it raises InvalidKernelInput
naming the broken rule instead.
"""

from __future__ import annotations

import torch

from moe_verify.spec import LL_BLOCK_ROWS, QuantizedWeight, round_up
from optimized.deepgemm import sm100_ue8m0 as sm100
from optimized.kernels._validate import any_true, check_flag, check_range, fail, unexplained


def validate_contiguous_call(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    grouped_layout: torch.Tensor,
    alignment: int,
    use_ue8m0: bool,
    use_psum_layout: bool = False,
) -> None:
    """The invariants DeepGEMM's m-grouped contiguous GEMM assumes, checked on the host first.

    Violations fault or silently misroute inside the kernel (vLLM PR #49784, DeepGEMM issue #178);
    here they raise InvalidKernelInput naming the broken rule instead. The fp32 scales the kernel
    reads must be finite and >= 0, and on SM100 (which packs them to UE8M0) powers of two: every
    row with m_indices, the live rows only with psum (the packer skips gap rows, gemm.hpp).
    """
    from optimized.kernels.grouped_gemm import explain_m_indices, m_indices_violations
    from optimized.kernels.psum import (
        expert_ends_violations,
        explain_expert_ends,
        psum_live_rows,
    )

    fn = "deepgemm.m_grouped_gemm"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    check_flag(fn, "use_psum_layout", use_psum_layout)
    m_sum, k = a.shape
    num_experts, n, _ = w.shape
    name = "expert_ends" if use_psum_layout else "m_indices"
    if a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1:
        fail(fn, f"a must be K-major float8_e4m3fn, got {a.dtype} with strides {a.stride()}")
    if k % 128 or n % 8:
        fail(fn, f"K={k} must be a multiple of 128 and N={n} of 8 (TMA and the SM90 epilogue)")
    if grouped_layout.dtype != torch.int32 or not grouped_layout.is_contiguous():
        fail(fn, f"{name} must be contiguous int32, got {grouped_layout.dtype}")
    if m_sum % alignment:
        fail(fn, f"M_sum={m_sum} must be a multiple of the alignment {alignment} (BLOCK_M)")
    if use_psum_layout:
        if grouped_layout.shape != (num_experts,):
            fail(
                fn,
                f"expert_ends has shape {tuple(grouped_layout.shape)}; the psum layout holds "
                f"one end per expert, [{num_experts}] (DeepGEMM asserts it)",
            )
        layout_rules = expert_ends_violations(grouped_layout, m_sum, alignment)
        live = psum_live_rows(grouped_layout, m_sum, alignment)
    else:
        if grouped_layout.numel() != m_sum:
            fail(fn, f"m_indices has {grouped_layout.numel()} rows for M_sum={m_sum}")
        layout_rules = m_indices_violations(grouped_layout, num_experts, alignment)
        live = None
    fp32 = a_scale.dtype == torch.float32
    scale_rules = []
    if fp32:
        bad = ~torch.isfinite(a_scale) | (a_scale < 0)
        scale_rules.append(bad if live is None else bad & live[:, None])
    # Every rule above in one host read; only a violation reads more, to name it.
    if any_true(*layout_rules, *scale_rules):
        if any_true(*layout_rules):
            if use_psum_layout:
                explain_expert_ends(fn, grouped_layout, m_sum, alignment)
            explain_m_indices(fn, grouped_layout, num_experts, alignment)
        scales = a_scale if live is None else a_scale[live]
        bad = ~torch.isfinite(scales) | (scales < 0)
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            what = f"a_scale[{r}, {g}]" if live is None else f"a_scale (live row {r}, group {g})"
            fail(fn, f"{what} = {float(scales[r, g])} is not a finite scale >= 0")
        unexplained(fn)
    if fp32 and use_ue8m0:  # SM100 packs the fp32 scales: the live rows' must be powers of two
        sm100.check_packable_scales(fn, "a_scale", a_scale if live is None else a_scale[live])


# The largest BLOCK_M DeepGEMM picks for the masked GEMM (SM90 heuristics: 64 or 128); the LL
# dispatch capacity (MoEProblem.ll_max_tokens) is sized in these blocks.
MASKED_BLOCK_M = LL_BLOCK_ROWS


def validate_masked_call(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    masked_m: torch.Tensor,
    expected_m: int,
    use_ue8m0: bool,
) -> None:
    """The invariants DeepGEMM's m-grouped masked GEMM assumes, checked on the host first.

    The kernel trusts masked_m: a count above M_max reads A and writes D past their batch. A batch
    count other than the weights' pairs batches with the wrong experts (a workspace shaped with
    the global expert count: vLLM PR #19515; vLLM's BatchedDeepGemmExperts under DeepEP
    low-latency dispatch).
    """
    fn = "deepgemm.m_grouped_gemm_masked"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    if a.dim() != 3 or a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1:
        fail(fn, f"a must be a K-major float8_e4m3fn [G, M_max, K], got {a.dtype} {a.shape}")
    groups, max_m, k = a.shape
    if groups != w.shape[0] or k != w.shape[2]:
        fail(fn, f"a is [G={groups}, M_max, K={k}] but the weights are {tuple(w.shape)}")
    if k % 128 or w.shape[1] % 8:
        fail(fn, f"K={k} must be a multiple of 128 and N={w.shape[1]} of 8")
    if a_scale.dim() != 3 or a_scale.shape[:2] != (groups, max_m):
        fail(fn, f"a_scale must be [G={groups}, M_max={max_m}, K/128], got {a_scale.shape}")
    if masked_m.dtype != torch.int32 or masked_m.shape != (groups,):
        fail(fn, f"masked_m must be int32 [G={groups}], got {masked_m.dtype} {masked_m.shape}")
    if not masked_m.is_contiguous():
        fail(fn, "masked_m must be contiguous")
    if expected_m <= 0:
        fail(fn, f"expected_m must be > 0 (DeepGEMM asserts it), got {expected_m}")
    check_range(
        fn, "masked_m", masked_m, 0, max_m + 1,
        f"a batch's row count must be in [0, M_max={max_m}]; another value makes the kernel "
        "read A and write D outside the batch",
    )  # fmt: skip
    # DeepGEMM tiles a batch in BLOCK_M-row blocks (64 or 128 on SM90; the mk alignment, 128 by
    # default, on SM100) and its TMA descriptors view A and D as one [G * M_max] matrix: a block
    # running past M_max reads the next batch's A rows and stores over its D rows. Measured on the
    # H200 with DeepGEMM 2.6.1: M_max = 20 gave 47% wrong elements (DeepGEMM issue 268).
    # Every batch's rows, rounded up to 128, must fit.
    need = round_up(masked_m.to(torch.int64), MASKED_BLOCK_M)
    over = need > max_m
    if bool(over.any()):
        g = int(over.nonzero()[0])
        fail(
            fn,
            f"masked_m[{g}] = {int(masked_m[g])} fills {int(need[g])} rows in DeepGEMM's "
            f"{MASKED_BLOCK_M}-row blocks but M_max = {max_m}: its last block would read the "
            "next batch's rows of A and overwrite its rows of D (past the end of both for the "
            f"last batch). Size the batches (DeepEP's dispatch capacity) to a multiple of "
            f"{MASKED_BLOCK_M} rows",
        )
    if use_ue8m0 and a_scale.dtype == torch.float32:
        sm100.check_packable_scales(fn, "a_scale", a_scale)
