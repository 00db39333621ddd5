"""Argument checks every vocabulary type runs on its fields, and the bounds of a problem.

A wrong type or an absurd size is refused where it enters (a CLI flag, a JSON file, a constructor
call), with the argument's name, what was expected and what came: never later, as a crash inside a
kernel or a silent truncation. Besides values: a type (`check_type`), a device (`check_device`),
and an output path that must be writable before any work (`check_output_file`,
`check_output_dir`).
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

# Bounds of a problem (documented maxima, deliberately above every model vLLM serves: DeepSeek-V3
# has H=7168, E=256; Llama-405B H=16384; Kimi-K2 E=384). They keep a typo (an extra zero, a size in
# bytes) from allocating or spawning without bound: `ep:100000` used to hang building 100000 ranks.
MAX_RANKS = 64
MAX_TOKENS = 1 << 20
MAX_HIDDEN = 1 << 16
MAX_INTERMEDIATE = 1 << 16
MAX_EXPERTS = 4096
MAX_SHARED_EXPERTS = 64
# Every row padding real stacks use (vLLM's Triton BLOCK_SIZE_M 16..256, DeepGEMM's mk alignment
# 32..256 by arch and M) is a multiple of 8; the suite also takes 8 itself (its tiny problems) and
# paddings that are not powers of two (96), which the golden and both engines handle.
ALIGNMENT_STEP = 8
MAX_ALIGNMENT = 1024
# torch.Generator.manual_seed takes [-2^63, 2^64); non-negative seeds keep ids readable, and the
# headroom keeps `seed + i` (calibration draws) legal.
MAX_SEED = (1 << 63) - 1

_E = TypeVar("_E", bound=enum.StrEnum)
_T = TypeVar("_T")


def _got(value: object) -> str:
    """`value` as an error message shows it: repr and type."""
    return f"{value!r} ({type(value).__name__})"


def check_int(arg: str, value: object, low: int, high: int) -> int:
    """`value` as an int in [low, high]: TypeError for a non-int (bools and floats included, so
    64.5 or True never become sizes), ValueError out of range."""
    want = f"an int in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg}: expected {want}, got {_got(value)}")
    if not low <= value <= high:
        raise ValueError(f"{arg}: expected {want}, got {value}")
    return int(value)


def check_bool(arg: str, value: object) -> bool:
    """A real bool: a string such as 'no' is truthy and would silently mean True."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected True or False, got {_got(value)}")
    return value


def check_float(arg: str, value: object, *, positive: bool = False) -> float:
    """A finite real number (int or float, not bool), > 0 when `positive`."""
    want = "a finite number" + (" > 0" if positive else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg}: expected {want}, got {_got(value)}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{arg}: expected {want}, got {value!r}")
    return float(value)


def check_enum(arg: str, value: object, typ: type[_E]) -> _E:
    """A member of `typ`, or exactly one of its values as a string (CLI, JSON round trips)."""
    if isinstance(value, typ):
        return value
    allowed = ", ".join(repr(v.value) for v in typ)
    if not isinstance(value, str):
        raise TypeError(f"{arg}: expected a {typ.__name__} or one of {allowed}, got {_got(value)}")
    try:
        return typ(value)
    except ValueError:
        raise ValueError(f"{arg} must be one of {allowed}; got {value!r}") from None


def exact_keys(arg: str, d: object, keys: Sequence[str]) -> Mapping[str, Any]:
    """`d` is a mapping with exactly `keys`: a typo'd key would otherwise be dropped silently, and
    a missing one would fall back to a default the dump never had."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{arg}: expected a mapping with keys {list(keys)}, got {_got(d)}")
    unknown = sorted(str(k) for k in d if k not in keys)
    if unknown:
        raise ValueError(f"{arg}: unknown keys {unknown} (expected {list(keys)})")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{arg}: missing keys {missing} (expected {list(keys)})")
    return d


def check_type(arg: str, value: object, typ: type[_T]) -> _T:
    """`value` is a `typ`: a TypeError naming the argument and what came otherwise (a dict for a
    MoEProblem would fail later as an AttributeError that names neither)."""
    if not isinstance(value, typ):
        raise TypeError(f"{arg}: expected a {typ.__name__}, got {_got(value)}")
    return value


def check_device(arg: str, value: object, *, present: bool = False) -> torch.device:
    """A device torch parses ('cpu', 'cuda:1', a torch.device) as a torch.device; with `present`,
    also one this machine has (a tensor can be made there), so a case is not run to the end only
    for every comparison on 'cuda:7' to fail."""
    import torch  # here, not above: the CLI checks its flags without importing torch

    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"{arg}: expected a device (a torch.device, or a string such as 'cpu' or 'cuda:0'), "
            f"got {_got(value)}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{arg}: expected a device such as 'cpu' or 'cuda:0', got {value!r}"
        ) from None
    if present and device.type != "meta":
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as exc:  # torch's "not compiled with CUDA" asserts
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{arg}: device {str(device)!r} is not usable here ({why})") from None
    return device


def check_output_file(arg: str, value: str | os.PathLike[str] | None) -> None:
    """Before any work: `value` can be written as a file (its directory exists and is writable,
    and it is not a directory); ValueError naming the argument (a flag such as --json, or a
    keyword) and the path otherwise."""
    if value is None:
        return
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{arg} {path}: is a directory; expected a file path")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{arg} {path}: directory {parent} does not exist")
    if not _can_create_in(parent) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{arg} {path}: not writable")


def check_output_dir(arg: str, value: str | os.PathLike[str] | None) -> None:
    """Before any work: `value` can be used as a directory (it is one, or it can be made under
    its nearest existing ancestor); ValueError naming the argument and the path otherwise."""
    if value is None:
        return
    path = Path(value)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"{existing} is a file"
        raise ValueError(f"{arg} {path}: {what}; expected a directory")
    if not _can_create_in(existing):
        raise ValueError(f"{arg} {path}: {existing} is not writable")


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created in `directory`, found by creating (and removing) one:
    os.access says yes to root for /proc and /sys, where nothing can be created."""
    try:
        fd, name = tempfile.mkstemp(prefix=".moe-verify-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True
