"""The GPU arch, asked one way everywhere: SM90 (Hopper) is compute capability major 9, SM100
(Blackwell) major 10.

The harness, the optimized path and the test tiers each decide something by arch (which grouped
layout vLLM picks, whether a GEMM ran on Hopper's tensor cores, which tests run); one predicate
keeps them from disagreeing about what "an SM90 device" is.
"""

from __future__ import annotations

import torch

# What torch.cuda takes as a device: None is the current CUDA device, an int a CUDA index.
DeviceLike = torch.device | str | int | None

SM90_MAJOR = 9  # Hopper: H100, H200
SM100_MAJOR = 10  # Blackwell datacenter: B200, GB200 (SM120, a 12, is not one)


def is_sm90_major(major: int | None) -> bool:
    """A compute capability major that is SM90: 9 exactly (None, no GPU, is not)."""
    return major == SM90_MAJOR


def is_sm100_major(major: int | None) -> bool:
    """A compute capability major that is SM100: 10 exactly (None, no GPU, is not)."""
    return major == SM100_MAJOR


def compute_capability(device: DeviceLike = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None without CUDA or for a device that is not CUDA
    (a CPU tensor's device says "no GPU arch", not an error)."""
    if not torch.cuda.is_available():
        return None
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def cc_major(device: DeviceLike = None) -> int | None:
    """The compute capability major of a CUDA device, or None (see `compute_capability`)."""
    cap = compute_capability(device)
    return None if cap is None else cap[0]


def is_sm90(device: DeviceLike = None) -> bool:
    """A Hopper GPU (H100, H200: major 9); False without CUDA or off CUDA."""
    return is_sm90_major(cc_major(device))


def is_sm100(device: DeviceLike = None) -> bool:
    """A Blackwell datacenter GPU (B200, GB200: major 10); False without CUDA or off CUDA."""
    return is_sm100_major(cc_major(device))
