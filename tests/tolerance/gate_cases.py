"""Cases that reach the entries where the H200's gate table differs from torch's gate.

The table differs from torch's fp32 g / (1 + exp(-alpha * g)) in ~3.6% of bf16 inputs, by a few
fp32 ulps: most such differences vanish in the bf16 rounding of y, or in the e4m3 rounding of the
quantization. `differing_pairs` searches (gate, up) bf16 pairs whose one element, alone in its
quantization group, gives other fp8 codes or scales under the table recipe than under the plain
one; `planted` writes them into the live rows of an mm1, each alone in a group of zeros (a zero
gate and up give y = 0 exactly, so the group's amax and the other codes are the pair's own).
"""

from __future__ import annotations

import functools

import torch

from moe_verify.spec import Activation, ActQuantRecipe, ScaleFmt
from reference.activation import act_quant, sm90_triton_recipe
from reference.hardware.gate_table import every_bf16, gate_table

BF16 = torch.bfloat16
# Candidate up values: every bf16 in [1, 2), and 0 (y = (0 + beta) * glu).
_UPS = torch.cat((torch.zeros(1), 1 + torch.arange(128) / 128))


def all_bf16() -> torch.Tensor:
    """fp32 [65536]: the bf16 value of every bit pattern (entry i has bits i)."""
    return every_bf16()


def torch_gate(alpha: float) -> torch.Tensor:
    """fp32 [65536]: torch's gate of every bf16 input, the plain recipes' arithmetic."""
    g = all_bf16()
    return g / (1 + torch.exp(-g * torch.tensor(alpha, dtype=torch.float32)))


def differing_entries(alpha: float) -> torch.Tensor:
    """bool [65536]: finite bf16 inputs whose table entry differs from torch's gate in its bits."""
    table = gate_table(alpha)
    assert table is not None, f"no gate table for alpha={alpha}"
    same = table.view(torch.int32) == torch_gate(alpha).view(torch.int32)
    return ~same & torch.isfinite(all_bf16())


@functools.cache
def differing_pairs(
    activation: Activation, fmt: ScaleFmt, count: int = 4
) -> tuple[tuple[float, float], ...]:
    """Up to `count` (gate, up) bf16 pairs for which act_quant's table recipe and the plain one
    give different codes or scales, each pair alone in a one-element group."""
    fused = ActQuantRecipe.PACKED if fmt is ScaleFmt.UE8M0_PACKED else ActQuantRecipe.COLMAJOR
    twin = sm90_triton_recipe(fused, activation)
    assert twin is not None, f"no table recipe for {activation.tag}"
    gates = all_bf16()[differing_entries(activation.alpha)]
    if activation.limit is not None:  # a clamped gate reads the entry of the limit instead
        gates = gates[gates <= activation.limit]
    g = gates.repeat_interleave(_UPS.numel())
    u = _UPS.repeat(gates.numel())
    mm1 = torch.stack((g, u), dim=1).to(BF16)
    plain = act_quant(mm1, activation, 1, fmt, fused)
    table = act_quant(mm1, activation, 1, fmt, twin)
    differs = (plain[0].view(torch.uint8) != table[0].view(torch.uint8)).any(1)
    if fmt is not ScaleFmt.UE8M0_PACKED:  # packed scales are words of four rows' bytes
        differs |= (plain[1].view(torch.int32) != table[1].view(torch.int32)).any(1)
    else:
        differs |= _packed_bytes(plain[1]) != _packed_bytes(table[1])
    rows = differs.nonzero().squeeze(1)[:count].tolist()
    return tuple((float(g[r]), float(u[r])) for r in rows)


def _packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [M]: the first group's exponent byte of each row of an int32 [M, P] packing."""
    return (packed[:, 0] & 0xFF).to(torch.uint8)


def planted(mm1: torch.Tensor, rows: list[int], pairs: tuple[tuple[float, float], ...], group: int):
    """A copy of bf16 mm1 [R, 2I] whose first group of each of `rows` holds one pair (gate at
    column 0, up at column I) among zeros."""
    out = mm1.clone()
    half = out.shape[-1] // 2
    for row, (g, u) in zip(rows, pairs, strict=False):
        out[row, :group] = 0
        out[row, half : half + group] = 0
        out[row, 0], out[row, half] = g, u
    return out
