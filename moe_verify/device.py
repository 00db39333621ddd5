"""Where things run: the default device, the GPU arch, and whether Triton runs interpreted."""

from __future__ import annotations

import functools
import os

import torch


def interpreter_mode() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def prepare_triton() -> None:
    """Without a GPU, run Triton kernels under its interpreter, with the correct float casts.

    TRITON_INTERPRET is read when triton is imported, so this must run before the first import
    of triton (the CLI and `verify` call it first). If triton was already imported in compiled
    mode on a machine without a GPU, kernel wrappers refuse CPU tensors and say why.
    """
    import sys

    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if interpreter_mode():
        from optimized.triton_compat import install_interpreter_fp8_fix

        install_interpreter_fp8_fix()
