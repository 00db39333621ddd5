"""What the golden-vs-engine recipe tests share: raw bits to compare, and the hidden states the
quantizers are fed (a zero group, a tiny one and a large row among N(0, 1) values)."""

from __future__ import annotations

import torch


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes (one-byte dtypes) or 32-bit words of `x`, for bitwise comparison."""
    x = x.contiguous()
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32)


def hidden_states() -> torch.Tensor:
    """N(0, 1) bf16 [64, 1024] with a zero group, a tiny one (amax 1e-9) and a large row."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    x[0, :128] = 0.0
    x[1, 128:256] *= 1e-9
    x[2] *= 1e3
    return x.to(torch.bfloat16)
