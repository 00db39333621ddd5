"""Literals the format tests share: fp32 tensors from Python floats, and the dtypes and fp32 steps
they name expected values with."""

from __future__ import annotations

import torch

F32 = torch.float32
FP8 = torch.float8_e4m3fn
HEX = float.fromhex
ULP1 = 2.0**-23  # fp32 ulp of 1.0


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F32)
