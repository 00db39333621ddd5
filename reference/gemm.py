"""Grouped GEMM by dequantizing both operands to fp32 (the math DeepGEMM's kernels approximate).

d[r, n] = bf16_RNE( Σ_k A[r,k]·SA(r,k) · B[e,n,k]·SB(e,n,k) ),  e = m_indices[r] >= 0.
One expert is dequantized at a time, so a DeepSeek-V3-sized layer never holds every dequantized
weight at once. Rows with m_indices == -1 (padding) are zero here; kernels leave them unspecified.
"""

from __future__ import annotations

import torch

from moe_verify.spec import QuantizedWeight
from reference import formats
from reference.validate import require, require_multiple, require_positive_int, require_tensor


def dequantize_activations(a: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 [M, K] with fp32 [M, K/group] scales, or int32 packed UE8M0 scales -> fp32 [M, K]."""
    require_tensor("a", a, (torch.float8_e4m3fn,), 2)
    group = require_positive_int("group", group)
    require_multiple("a", a, group)
    num_groups = a.shape[1] // group
    if scale.dtype == torch.int32:
        scale = formats.e8m0_to_fp32(formats.unpack_ue8m0(scale, num_groups))
    require_tensor("a_scale", scale, (torch.float32, torch.int32), 2)
    require(
        tuple(scale.shape) == (a.shape[0], num_groups),
        "a_scale",
        f"shape {(a.shape[0], num_groups)}",
        f"{tuple(scale.shape)}",
    )
    return a.float() * scale.repeat_interleave(group, dim=1)


def dequantize_weight(w: QuantizedWeight, expert: int) -> torch.Tensor:
    """One expert's weight [N, K] in fp32, exactly as the kernel's scaled operand."""
    q, s = w.q[expert], w.scale[expert]
    if w.fp4:
        return formats.dequantize_mxfp4(q, s, w.block[1])
    if w.block == (128, 128):
        return formats.dequantize_fp8_blocks(q, s, w.block)
    return formats.dequantize_mxfp8(q, s, w.block[1])


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    w: QuantizedWeight,
    m_indices: torch.Tensor,
    *,
    precision: torch.dtype = torch.float32,
) -> torch.Tensor:
    """bf16 [M_sum, N]: each live row times its expert's weight, one bf16 rounding at the end.

    a          fp8 [M_sum, K]; a_scale fp32 [M_sum, K/a_group] or int32 packed UE8M0
    w          the experts' quantized weights [E, N, K]
    m_indices  int32 [M_sum]: expert of each row, -1 for padding rows (left zero)
    precision  accumulation dtype of the dequantized product (float64 for calibration)
    """
    a_group = require_positive_int("a_group", a_group)
    num_experts, n, k = w.shape
    require(a.shape[1] == k, "a", f"K = {k} columns (the weight's K)", f"{a.shape[1]}")
    out = torch.zeros(a.shape[0], n, dtype=torch.bfloat16, device=a.device)
    groups = expert_rows(m_indices, num_experts, a.shape[0])
    if not groups:
        return out
    a_deq = dequantize_activations(a, a_scale, a_group)
    for e, rows in groups:
        b = dequantize_weight(w, e)
        out[rows] = (a_deq[rows].to(precision) @ b.to(precision).T).to(torch.bfloat16)
    return out


def expert_rows(
    m_indices: torch.Tensor, num_experts: int, m_sum: int
) -> list[tuple[int, torch.Tensor]]:
    """(expert, its row numbers) for every expert that owns rows of the grouped layout.

    m_indices int32 [M_sum]: the expert of each row, -1 for padding; checked against M_sum rows
    and the expert count, so every grouped GEMM recipe reads the layout the same way."""
    require(m_indices.numel() == m_sum, "m_indices", f"{m_sum} rows", f"{m_indices.numel()}")
    if m_sum == 0:
        return []
    require(
        int(m_indices.max()) < num_experts and int(m_indices.min()) >= -1,
        "m_indices",
        f"values in [-1, {num_experts})",
        f"range [{int(m_indices.min())}, {int(m_indices.max())}]",
    )
    return [
        (e, (m_indices == e).nonzero().squeeze(1))
        for e in torch.unique(m_indices[m_indices >= 0]).tolist()
    ]
