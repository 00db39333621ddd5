"""Poisoned allocations: every tensor a stage allocates uninitialised starts as a poison pattern.

`torch.empty` returns whatever the allocator hands out. On a CPU that is often fresh zeroed pages,
so a kernel that writes only the live rows of a buffer whose padding must be +0.0 passes by luck
(ref/anchors.md #6: vLLM allocated its permuted fp32 scales with `torch.empty`; DeepGEMM's SM100
packer then device-asserts on the garbage). Running the stage with the uninitialised allocators
filling their result with 0xFF bytes makes the padding checks deterministic: 0xFF..FF is NaN in
fp32, bf16 and e4m3, and the NaN byte in UE8M0, so an unwritten padding scale fails every time.

Poisoning only changes memory whose contents are undefined, so a correct stage gives the same
outputs with and without it.

It covers allocations made through torch's Python API (`torch.empty`, `torch.empty_strided`,
`torch.empty_like`, `Tensor.new_empty`), on any device: that is where vLLM, the suite's optimized
path and a Python backend allocate their outputs. Buffers a C++ extension allocates internally
are not covered.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

POISON_BYTE = 0xFF

_ALLOCATORS: tuple[tuple[Any, str], ...] = (
    (torch, "empty"),
    (torch, "empty_strided"),
    (torch, "empty_like"),
    (torch.Tensor, "new_empty"),
)


def _poisoning(alloc: Callable[..., torch.Tensor], byte: int) -> Callable[..., torch.Tensor]:
    @functools.wraps(alloc)
    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = alloc(*args, **kwargs)
        if out.numel() and out.device.type != "meta":
            # the whole storage: strided layouts (TMA-aligned packed scales) have gaps too
            out.untyped_storage().fill_(byte)
        return out

    return poisoned


@contextlib.contextmanager
def poisoned_allocations(byte: int = POISON_BYTE) -> Iterator[None]:
    """Within the block, uninitialised torch allocations are filled with `byte`."""
    if not 0 <= byte <= 0xFF:
        raise ValueError(f"poison byte must be in [0, 255], got {byte}")
    with contextlib.ExitStack() as stack:
        for owner, name in _ALLOCATORS:
            original = getattr(owner, name)
            stack.enter_context(mock.patch.object(owner, name, _poisoning(original, byte)))
        yield
