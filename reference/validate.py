"""Input validation shared by the golden's public functions: one clear ValueError per violation.

The golden's twin of optimized/kernels/_validate.py (which the kernel wrappers run before launch);
the two share no code, so a wrong assumption in one is not copied into the other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_verify.spec import ScaleFmt, check_bool


def require(cond: bool, arg: str, expected: str, actual: str) -> None:
    """Raise ValueError('<arg>: expected <expected>, got <actual>') unless cond holds."""
    if not cond:
        raise ValueError(f"{arg}: expected {expected}, got {actual}")


def require_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], min_ndim: int) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name} must have dtype {want}, got {str(t.dtype).removeprefix('torch.')}"
        )
    if t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")


def require_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """An int in [low, high] (high None: no upper bound): TypeError for anything else (a bool, a
    float such as 64.5), ValueError out of range."""
    want = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected {want}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}: expected {want}, got {value}")
    return value


def require_bool(name: str, value: object) -> bool:
    """A real bool: a string such as 'no' is truthy and would silently mean True."""
    return check_bool(name, value)


def require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def require_expert_map(expert_map: object, num_local_experts: int | None = None) -> None:
    """None, or a 1-D integer tensor [E_global]: each global expert's local id on this rank, -1
    where another rank hosts it; values in [-1, num_local_experts) when that is given. A float
    or bool map would index as garbage, a list not at all."""
    if expert_map is None:
        return
    if not isinstance(expert_map, Tensor):
        raise TypeError(
            f"expert_map: expected None or a 1-D integer tensor [E_global], got "
            f"{expert_map!r:.60} ({type(expert_map).__name__})"
        )
    integer = not (expert_map.dtype.is_floating_point or expert_map.dtype.is_complex)
    require(
        expert_map.dim() == 1 and integer and expert_map.dtype != torch.bool,
        "expert_map",
        "a 1-D integer tensor [E_global] (global -> local expert id, -1: another rank's)",
        f"{expert_map.dtype} of shape {tuple(expert_map.shape)}",
    )
    if num_local_experts is not None and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        require(
            lo >= -1 and hi < num_local_experts,
            "expert_map",
            f"values in [-1, {num_local_experts})",
            f"range [{lo}, {hi}]",
        )


def require_multiple(name: str, t: Tensor, group: int) -> None:
    k = t.shape[-1]
    if k % group:
        raise ValueError(
            f"{name}: last dim K={k} must be a multiple of group={group} (shape {tuple(t.shape)})"
        )


def first_index(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def require_finite(name: str, t: Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        at = first_index(bad)
        raise ValueError(
            f"{name} must be finite: {int(bad.sum())} NaN/Inf values, first at {at} "
            f"({t[at].item()}); the golden models finite data only"
        )


def require_scale_values(name: str, scale: Tensor) -> None:
    """Scales are divisors/multipliers: NaN, Inf or negative values are a bug upstream."""
    bad = ~torch.isfinite(scale) | (scale < 0)
    if bool(bad.any()):
        at = first_index(bad)
        raise ValueError(
            f"{name} must be finite and >= 0: {int(bad.sum())} bad values "
            f"(NaN {int(scale.isnan().sum())}), first at {at} ({scale[at].item()})"
        )


def require_shape(name: str, t: Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({why}), got {tuple(t.shape)}")


def require_scale_fmt(value: object) -> ScaleFmt:
    try:
        return ScaleFmt(value)
    except ValueError:
        allowed = ", ".join(f.value for f in ScaleFmt)
        raise ValueError(f"scale_fmt must be one of {allowed}, got {value!r}") from None


def require_no_e8m0_nan(name: str, scale_bytes: Tensor) -> None:
    bad = scale_bytes == 0xFF
    if bool(bad.any()):
        raise ValueError(
            f"{name} holds byte 0xFF (E8M0 NaN) at {first_index(bad)} ({int(bad.sum())} in all); "
            "kernels read it as NaN (padded scales must not be 0xFF)"
        )
