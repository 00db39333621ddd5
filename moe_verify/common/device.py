"""Where things run: the default device (the GPU arch is moe_verify/spec/arch.py's)."""

from __future__ import annotations

import torch

from optimized.triton_compat import interpreter_mode


def default_device() -> torch.device:
    """The GPU when there is one and the interpreter is off, else the CPU."""
    if torch.cuda.is_available() and not interpreter_mode():
        return torch.device("cuda")
    return torch.device("cpu")
