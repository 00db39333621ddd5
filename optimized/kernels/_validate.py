"""Host-side input checks shared by the Triton kernel wrappers.

A Triton kernel handed a wrong dtype, a strided row or an out-of-range index does not fail: it
reads the wrong bytes, or faults the GPU and poisons the CUDA context for the rest of the process.
Each wrapper runs these checks before it launches and raises `InvalidKernelInput` (a ValueError)
naming the function, the argument and the assumption it broke. Shape, dtype and stride checks are
free; value checks (index ranges, power-of-two scales) read the tensor and synchronize with the
device, so wrappers skip them when called with `validate=False` (CUDA-graph capture, benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from moe_verify.spec import ScaleFmt, check_bool
from optimized.triton_compat import interpreter_mode


class InvalidKernelInput(ValueError):
    """An argument would make a kernel read or write the wrong memory; raised before launch."""


def fail(fn: str, msg: str) -> NoReturn:
    raise InvalidKernelInput(f"{fn}: {msg}")


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    fn: str,
    name: str,
    t: object,
    dtypes: Sequence[torch.dtype] | None,
    ndim: int | Sequence[int],
) -> torch.Tensor:
    """`t` is a tensor of one of `dtypes` (None: any) with `ndim` dimensions, on a device Triton
    can run on."""
    if not isinstance(t, torch.Tensor):
        fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(fn, f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        fail(fn, f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.device.type != "cuda" and not interpreter_mode():
        fail(
            fn,
            f"{name} is on {t.device}: Triton kernels run on CUDA tensors, or on CPU tensors only "
            "under the interpreter (TRITON_INTERPRET=1 before triton is first imported; on a "
            "machine without a GPU, `import optimized` sets it when it comes before triton)",
        )
    return t


def check_flag(fn: str, name: str, value: object) -> bool:
    """A real bool: TypeError otherwise (a string such as 'no' is truthy and would silently mean
    True)."""
    return check_bool(f"{fn}: {name}", value)


def check_scale_fmt(fn: str, value: object) -> ScaleFmt:
    """A ScaleFmt, or exactly one of its values as a string."""
    if isinstance(value, ScaleFmt):
        return value
    allowed = ", ".join(repr(f.value) for f in ScaleFmt)
    if not isinstance(value, str):
        raise TypeError(
            f"{fn}: scale_fmt must be one of {allowed}, got {value!r} ({type(value).__name__})"
        )
    try:
        return ScaleFmt(value)
    except ValueError:
        fail(fn, f"scale_fmt must be one of {allowed}, got {value!r}")


def check_eps(fn: str, eps: object) -> float:
    """The amax floor: a finite float > 0. eps <= 0 lets an all-zero group get scale 0, and
    0 / 0 makes NaN codes."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{fn}: eps must be a finite float > 0, got {eps!r} ({type(eps).__name__})")
    if not (0 < eps < float("inf")):
        fail(fn, f"eps must be a finite float > 0 (the amax floor; 0 gives NaN codes), got {eps!r}")
    return float(eps)


def check_same_device(fn: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            fail(fn, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_shape(fn: str, name: str, t: torch.Tensor, shape: Sequence[int], meaning: str) -> None:
    """`t.shape == shape`; `meaning` spells out the expected shape in the caller's symbols."""
    if tuple(t.shape) != tuple(shape):
        fail(fn, f"{name} must have shape {meaning} = {tuple(shape)}, got {tuple(t.shape)}")


def check_inner_contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    """The kernel adds column offsets to the row pointer directly (it ignores stride(-1))."""
    if t.dim() >= 1 and t.size(-1) > 1 and t.stride(-1) != 1:
        fail(
            fn,
            f"{name} must have unit stride along its last dimension (the kernel adds column "
            f"offsets directly); got strides {tuple(t.stride())}. Pass {name}.contiguous()",
        )


def check_group(fn: str, group: int, allowed: Sequence[int]) -> None:
    if not isinstance(group, int) or group not in allowed:
        fail(fn, f"group must be one of {list(allowed)} elements along K, got {group!r}")


def check_multiple(fn: str, what: str, value: int, group: int) -> None:
    if value % group != 0:
        fail(
            fn,
            f"{what}={value} must be a multiple of group={group}: every scale covers a whole "
            "group, and a partial last group has no defined scale in DeepGEMM's layouts",
        )


def check_signed_ids(fn: str, name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        fail(fn, f"{name} must be int32 or int64 expert ids, got {t.dtype}")
    if not t.dtype.is_signed:
        fail(
            fn,
            f"{name} must be a signed integer dtype (int32 or int64), got {t.dtype}: -1 marks a "
            "slot with no expert, and an unsigned id cannot hold it (vLLM's permute asserts "
            "is_signed for the same reason)",
        )
    if t.dtype not in (torch.int32, torch.int64):
        fail(fn, f"{name} must be int32 or int64, got {t.dtype}")


def first_true(mask: torch.Tensor) -> tuple[int, ...]:
    """Coordinates of the first True element of `mask` in row-major order."""
    flat = int(torch.nonzero(mask.reshape(-1))[0, 0])
    coords = []
    for size in reversed(mask.shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def any_true(*masks: torch.Tensor) -> bool:
    """Whether any element of `masks` is True, in one host read for them all (a device sync).
    A call's value checks queue their violation masks on the device and read them together;
    only when one is set do the checks run again one by one to say which and where
    (`unexplained` after them, in case none does)."""
    flags = [m.any().reshape(1) for m in masks if m.numel()]
    if not flags:
        return False
    return bool(torch.cat(flags).any())


def unexplained(fn: str) -> NoReturn:
    """A violation the batched device read flagged that no check then named: the two disagree
    (a defect of the checks, never of the input alone), so say so rather than launch."""
    raise AssertionError(
        f"{fn}: the batched input check flagged a violation that no single check found again"
    )


def range_violations(
    t: torch.Tensor, low: int, high: int, where: torch.Tensor | None = None
) -> torch.Tensor:
    """bool like `t`: the elements outside [low, high) (only where `where` is True)."""
    bad = (t < low) | (t >= high)
    return bad if where is None else bad & where


def check_range(
    fn: str,
    name: str,
    t: torch.Tensor,
    low: int,
    high: int,
    why: str,
    where: torch.Tensor | None = None,
) -> None:
    """low <= t < high for every element (or every element where `where` is True)."""
    bad = range_violations(t, low, high, where)
    if bool(bad.any()):
        at = first_true(bad)
        count = int(bad.sum())
        fail(
            fn,
            f"{name}{list(at)} = {int(t[at])} is outside [{low}, {high}) ({count} entries out of "
            f"range): {why}",
        )


def check_power_of_two_scales(fn: str, name: str, scale: torch.Tensor) -> None:
    """Every fp32 value is +0 or a positive normal power of two: (bits & 0x807FFFFF) == 0.

    This is the predicate DeepGEMM's fp32 -> packed-UE8M0 kernel asserts on the device (a trap that
    poisons the CUDA context); infinity also passes it there but becomes byte 0xFF, which the GEMM
    reads as NaN, so it is refused too.
    """
    bits = scale.contiguous().view(torch.int32)
    bad = ((bits & 0x807FFFFF) != 0) | (bits == 0x7F800000)
    if bool(bad.any()):
        at = first_true(bad)
        count = int(bad.sum())
        value = float(scale[at])
        where = f"row={at[-2]}, group={at[-1]}" + (f", batch={at[0]}" if len(at) == 3 else "")
        fail(
            fn,
            f"{name}[{where}] = {value!r} (bits 0x{int(bits[at]) & 0xFFFFFFFF:08x}) is not a "
            f"non-negative power of two ({count} such scales): UE8M0 keeps only the "
            "exponent, so packing it would silently drop the mantissa (DeepGEMM 2.6 traps on a "
            "device assert instead). Round scales up with ceil-UE8M0 when quantizing",
        )


def output_buffer(
    fn: str,
    name: str,
    out: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`out` when given (a caller's reused workspace: right shape, dtype, device, contiguous),
    else a fresh uninitialised tensor. Kernels must write every element they promise, so a
    poisoned workspace shows any element they leave stale."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        fail(
            fn,
            f"{name} workspace must be {dtype} {tuple(shape)} on {device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}",
        )
    if not out.is_contiguous():
        fail(fn, f"{name} workspace must be contiguous, got strides {out.stride()}")
    return out
