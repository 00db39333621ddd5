"""Input validation shared by the golden's public functions: one clear ValueError per violation."""

from __future__ import annotations

import torch


def require(cond: bool, arg: str, expected: str, actual: str) -> None:
    """Raise ValueError('<arg>: expected <expected>, got <actual>') unless cond holds."""
    if not cond:
        raise ValueError(f"{arg}: expected {expected}, got {actual}")


def require_dtype(t: torch.Tensor, arg: str, *dtypes: torch.dtype) -> None:
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(t.dtype in dtypes, arg, f"dtype {names}", f"{str(t.dtype).removeprefix('torch.')}")


def require_shape(t: torch.Tensor, arg: str, shape: tuple[int, ...]) -> None:
    require(tuple(t.shape) == tuple(shape), arg, f"shape {tuple(shape)}", f"{tuple(t.shape)}")


def require_finite(t: torch.Tensor, arg: str) -> None:
    bad = ~torch.isfinite(t.float())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{arg}: expected finite values, got {t[idx].item()} at {idx}")
