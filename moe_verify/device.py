"""Where things run: the default device and the GPU arch."""

from __future__ import annotations

import functools

import torch

from optimized.triton_compat import interpreter_mode


@functools.cache
def cuda_arch_major() -> int | None:
    """Compute capability major of the current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def default_device() -> torch.device:
    """The GPU when there is one and the interpreter is off, else the CPU."""
    if torch.cuda.is_available() and not interpreter_mode():
        return torch.device("cuda")
    return torch.device("cpu")
