"""Fused gated activation + FP8 group quantization of GEMM1's output (stage `act_quant`).

Mirrors reference/activation.py `act_quant`. mm1 is [M, 2I] bf16, gate = columns [0, I), up =
columns [I, 2I). With a clamp limit L the gate is clamped from above only and up on both sides.
Two rounding recipes, chosen by the scale format exactly as vLLM 0.32's
`DeepGemmExperts._act_mul_quant` does (both kernels in quantization/utils/fp8_utils.py):

- UE8M0_PACKED, `silu_mul_quant_fp8_packed_triton`: everything in fp32, y rounded to bf16
  once; s = 2^ceil(log2(max(amax/448, 1e-10))); scales packed 4 bytes per int32, MN-major,
  strides (1, round_up(M, 4)); byte slots past the last group are computed from zeros (byte 94).
- FLOAT32 / FLOAT32_CEIL_UE8M0, `silu_mul_per_token_group_quant_fp8_colmajor`: the clamp,
  the activation, up + beta and the product are each rounded to bf16 (three roundings, five with
  a clamp); amax floored at 1e-10, s = amax * fp32(1/448), rounded up to a power of two for the
  ceil format; fp32 scales column-major, strides (1, M). Unlike vLLM, M need not be a multiple of
  128.

With the psum grouped layout (`expert_ends`), rows no expert owns (each segment's gap rows and
the tail) are neither read nor written, as vLLM 0.32's `_act_mul_quant(expert_ends=...)` skips
them: their codes and scales are unspecified.

Exact arithmetic everywhere except the activation itself: `tl.exp` and the gate division g / (1 +
exp) are the GPU's approximate instructions natively (div.full.f32, as in vLLM's kernels; an IEEE
division there made the kernel 1.6x slower on the H200), correctly rounded under the interpreter.
The policy bounds their effect (docs/tolerance.md#act_quant-codes-and-scales). Scale divisions
and y / s are IEEE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_verify.spec import Activation, ScaleFmt, compute_capability
from optimized.kernels._validate import (
    check_flag,
    check_group,
    check_inner_contiguous,
    check_multiple,
    check_same_device,
    check_scale_fmt,
    check_tensor,
    fail,
    output_buffer,
)
from optimized.kernels.e8m0 import pack_word, pow2_from_byte, ue8m0_ceil_byte
from optimized.kernels.psum import block_experts, check_expert_ends, psum_row_experts
from optimized.kernels.quant import (
    block_rows,
    div_rn,
    divide_by_scale,
    group_tile,
    packed_ue8m0_empty,
    to_fp8_satfinite,
)
from optimized.triton_compat import interpreter_mode


@triton.jit
def _bf16(x):
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _gate(g, alpha):
    """g * sigmoid(alpha * g) in fp32: the one non-IEEE step (tl.exp, the approximate division).

    Both roundings below call it, and so does `gate_table`'s kernel, so the table recorded from
    the hardware is the value the act_quant kernel computes for that bf16 gate."""
    return g / (1.0 + tl.exp(-g * alpha))


@triton.jit
def _glu_fp32(g, u, alpha, beta, limit, HAS_LIMIT: tl.constexpr):
    """The packed recipe: clamp, activation and product in fp32, then one bf16 rounding of y."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    glu = _gate(g, alpha)
    return _bf16((u + beta) * glu)


@triton.jit
def _glu_bf16_steps(g, u, alpha, beta, limit, HAS_LIMIT: tl.constexpr):
    """The colmajor recipe (C++ silu_and_mul rounding): every intermediate narrowed to bf16."""
    if HAS_LIMIT:
        g = _bf16(tl.minimum(g, limit))
        u = _bf16(tl.minimum(tl.maximum(u, -limit), limit))
    glu = _bf16(_gate(g, alpha))
    up = _bf16(u + beta)
    return _bf16(glu * up)


@triton.jit
def _silu_mul_quant_kernel(
    mm1_ptr,
    q_ptr,
    s_ptr,
    M,
    INTER,
    stride_mm,
    stride_qm,
    stride_sm,
    stride_sg,
    alpha,
    beta,
    limit,
    ends_ptr,
    num_experts,
    alignment,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    PACKED: tl.constexpr,
    CEIL_UE8M0: tl.constexpr,
    PSUM: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: BLOCK_M rows x GROUPS_PER_PROGRAM groups (one int32 word of 4 when PACKED)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, group_ok, mask = group_tile(rows, M, INTER, GROUP, GROUPS_PER_PROGRAM)
    row_ok = rows < M
    if PSUM:  # gap and tail rows: nothing loaded, nothing stored
        row_ok = psum_row_experts(ends_ptr, rows, row_ok, num_experts, alignment, BLOCK_E) >= 0
        if tl.max(row_ok.to(tl.int32), 0) == 0:
            return  # a block of gap rows only (most of them at decode sizes): no work at all
        group_ok = group_ok & row_ok[:, None]
        mask = mask & row_ok[:, None, None]
    rows = rows.to(tl.int64)
    gate_ptrs = mm1_ptr + rows[:, None, None] * stride_mm + cols[None, :, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + INTER, mask=mask, other=0.0).to(tl.float32)
    if PACKED:
        y = _glu_fp32(gate, up, alpha, beta, limit, HAS_LIMIT)
        s_raw = tl.maximum(div_rn(tl.max(tl.abs(y), axis=2), 448.0), 1e-10)
        # Slots past the last group saw only zeros: byte 94 (2^-33), as vLLM's packed kernel.
        byte = tl.minimum(ue8m0_ceil_byte(s_raw), 255)
        s = pow2_from_byte(byte)
        s_ptrs = s_ptr + rows * stride_sm + tl.program_id(1).to(tl.int64) * stride_sg
        tl.store(s_ptrs, pack_word(byte, GROUPS_PER_PROGRAM), mask=row_ok)
    else:
        y = _glu_bf16_steps(gate, up, alpha, beta, limit, HAS_LIMIT)
        s = tl.maximum(tl.max(tl.abs(y), axis=2), 1e-10) * (1.0 / 448.0)
        if CEIL_UE8M0:
            s = pow2_from_byte(ue8m0_ceil_byte(s))
        s_ptrs = s_ptr + rows[:, None] * stride_sm + groups.to(tl.int64)[None, :] * stride_sg
        tl.store(s_ptrs, s, mask=group_ok)
    q = to_fp8_satfinite(divide_by_scale(y, s, PACKED or CEIL_UE8M0))
    tl.store(q_ptr + rows[:, None, None] * stride_qm + cols[None, :, :], q, mask=mask)


def silu_mul_quant(
    mm1: torch.Tensor,
    activation: Activation,
    group: int,
    scale_fmt: ScaleFmt,
    out_q: torch.Tensor | None = None,
    *,
    expert_ends: torch.Tensor | None = None,
    expert_alignment: int = 0,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mm1 bf16 [M, 2I] -> (a2q fp8 e4m3 [M, I], a2q_scale).

    a2q_scale: int32 [M, ceil(I/group/4)] strides (1, round_up(M, 4)) for UE8M0_PACKED; else fp32
    [M, I/group] strides (1, M) (powers of two for FLOAT32_CEIL_UE8M0). M may be 0.
    expert_ends, expert_alignment: the psum grouped layout (int32 [E], A), as vLLM 0.32 passes
    them: only rows some expert owns are computed; the others are left unwritten. validate: check
    the ends on the host (a device sync; False under CUDA-graph capture).
    """
    fn = "silu_mul_quant"
    check_tensor(fn, "mm1", mm1, (torch.bfloat16,), 2)
    if not isinstance(activation, Activation):
        got = type(activation).__name__
        fail(fn, f"activation must be a moe_verify.spec.Activation, got {got}")
    scale_fmt = check_scale_fmt(fn, scale_fmt)
    check_flag(fn, "validate", validate)
    check_group(fn, group, (32, 128))
    m, n = mm1.shape
    if n % 2:
        fail(fn, f"mm1.shape[1] = {n} must be even: [gate | up] halves of 2*I columns each")
    inter = n // 2
    check_multiple(fn, "I = mm1.shape[1] / 2", inter, group)
    check_inner_contiguous(fn, "mm1", mm1)
    num_groups = inter // group
    packed = scale_fmt is ScaleFmt.UE8M0_PACKED

    psum = expert_ends is not None
    if expert_ends is not None:
        check_tensor(fn, "expert_ends", expert_ends, (torch.int32,), 1)
        if not expert_ends.is_contiguous():
            fail(fn, "expert_ends must be contiguous")
        check_same_device(fn, "mm1", mm1, expert_ends=expert_ends)
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            fail(fn, f"expert_alignment must be an int >= 1 with expert_ends: {expert_alignment!r}")
        if validate:
            check_expert_ends(fn, expert_ends, m, expert_alignment)
    elif expert_alignment:
        fail(fn, f"expert_alignment={expert_alignment} without expert_ends (the psum layout)")
    q = output_buffer(fn, "out_q", out_q, (m, inter), torch.float8_e4m3fn, mm1.device)
    if packed:
        scale = packed_ue8m0_empty(m, num_groups, mm1.device)
    else:
        storage = torch.empty(num_groups, m, dtype=torch.float32, device=mm1.device)
        scale = storage.as_strided((m, num_groups), (1, m))
    if m == 0 or num_groups == 0:
        return q, scale

    per_program = 4 if packed else 1
    # 2K-element tiles (16 gate + 16 up values per thread): measured best on the H200, 7% over 4K.
    bm = block_rows(m, group * per_program, native_elements=2048)
    grid = (triton.cdiv(m, bm), scale.shape[1] if packed else triton.cdiv(num_groups, per_program))
    limit = activation.limit
    _silu_mul_quant_kernel[grid](
        mm1, q, scale, m, inter, mm1.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        activation.alpha, activation.beta, 0.0 if limit is None else limit,
        expert_ends if psum else mm1, 0 if expert_ends is None else expert_ends.numel(),
        max(expert_alignment, 1),
        GROUP=group, GROUPS_PER_PROGRAM=per_program, BLOCK_M=bm, HAS_LIMIT=limit is not None,
        PACKED=packed, CEIL_UE8M0=scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0, PSUM=psum,
        BLOCK_E=block_experts(0 if expert_ends is None else expert_ends.numel()), num_warps=4,
    )  # fmt: skip
    return q, scale


@triton.jit
def _gate_table_kernel(g_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _gate(g, alpha), mask=ok)


def gate_table(alpha: float, device: torch.device | str = "cuda") -> torch.Tensor:
    """fp32 [65536]: the kernels' gate g * sigmoid(alpha * g) for every bf16 bit pattern g (entry
    i is the gate of the bf16 whose bits are i, NaN patterns included), as this machine's
    compiled Triton computes it. The act_quant stage's only non-IEEE step is this function of one
    bf16 value, so the table lets the golden reproduce the kernel bit for bit (reference
    `gate_from_table`)."""
    fn = "gate_table"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        fail(fn, f"alpha must be a float, got {alpha!r}")
    g = torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    out = torch.empty(g.numel(), dtype=torch.float32, device=device)
    grid = (triton.cdiv(g.numel(), 1024),)
    _gate_table_kernel[grid](g, out, g.numel(), float(alpha), BLOCK=1024)
    return out


def gate_source(device: torch.device) -> dict[str, str]:
    """Where the kernels' gate values come from on `device`, as facts the harness can match to a
    recorded gate table (reference/hardware/gate_table.py): {"gate_triton": Triton's version,
    "gate_capability": "major.minor"} when compiled for a CUDA GPU; {} under the interpreter, whose
    gate is numpy's exp (the plain recipes)."""
    capability = compute_capability(device)
    if interpreter_mode() or capability is None:
        return {}
    major, minor = capability
    return {"gate_triton": triton.__version__, "gate_capability": f"{major}.{minor}"}
