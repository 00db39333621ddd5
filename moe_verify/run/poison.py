"""Poisons: every tensor a stage allocates uninitialised starts as a poison pattern, and the
golden's padding rows can hold stale worst-case values (`poison_padding`).

`torch.empty` returns whatever the allocator hands out. On a CPU that is often fresh zeroed pages,
so a kernel that writes only the live rows of a buffer whose padding must be +0.0 passes by luck
(vLLM PR #49784: vLLM allocated its permuted fp32 scales with `torch.empty`; DeepGEMM's SM100
packer then device-asserts on the garbage). Running the stage with the uninitialised allocators
filling their result with 0xFF bytes makes the padding checks deterministic: 0xFF..FF is NaN in
fp32, bf16 and e4m3, and the NaN byte in UE8M0, so an unwritten padding scale fails every time.

Poisoning only changes memory whose contents are undefined, so a correct stage gives the same
outputs with and without it.

It covers allocations made through torch's Python API (`torch.empty`, `torch.empty_strided`,
`torch.empty_like`, `Tensor.new_empty`), on any device: that is where vLLM, the suite's optimized
path and a Python backend allocate their outputs. Buffers a C++ extension allocates internally
are not covered.

The padding poison is the other half: what a GEMM must never read. A fresh scatter's padding rows
are zero, so a GEMM that computes them (and lets them reach live rows) passes on synthetic inputs;
in a served model they hold whatever an earlier batch left (FlashInfer #3650:
padding accumulators overflowed to Inf over stale FP8 input and NaN bled into live rows).
`poison_padding` gives the golden's permute (or dispatch) padding the largest e4m3 code, and the
largest scale wherever the layout leaves padding scales unspecified, so a padding accumulator
overflows; `verify(..., padding_poison=True)` feeds that upstream to the tested stages.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from moe_verify.spec import GroupedLayout, MoEProblem, Stage, Trace

POISON_BYTE = 0xFF
FP8_MAX_CODE = 0x7E  # e4m3 448, the largest finite code (0x7F is NaN)
FP32_MAX = torch.finfo(torch.float32).max
# Packed UE8M0: byte 254 (2^127, the largest finite E8M0 scale) in all four slots of a word,
# 0xFEFEFEFE as an int32.
PACKED_MAX_WORD = -0x01010102

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


def poison_padding(golden: Trace, problem: MoEProblem) -> Trace:
    """A copy of the golden's trace whose padding rows hold stale worst-case values; the live rows
    and every other stage are the golden's (its later stages never read padding rows, so they
    stay right).

    Contiguous layout (`permute`): padding rows (m_indices -1) get the e4m3 code 448 in every
    column; under the psum layout, whose gap and tail scales are unspecified (docs/tolerance.md
    "Permute and padding"), their scales become the largest fp32 (packed: 2^127 in every byte).
    Under m_indices (or grouped_layout auto) the padding scales stay +0.0: the contract fixes them.
    Batched layout (`dispatch`, ep:N+ll): rows at or past masked_m of each batch get the code 448
    and the largest scale: the masked GEMM reads only the first masked_m rows (DeepGEMM's
    `m_grouped_fp8_gemm_nt_masked`), and DeepEP's reused receive buffers hold an earlier batch
    there.
    """
    if Stage.DISPATCH in golden:
        d = golden[Stage.DISPATCH]
        codes, scales, masked_m = d["a_batched"], d["a_scale_batched"], d["masked_m"]
        rows = torch.arange(codes.shape[1], device=masked_m.device)
        pad = rows[None, :] >= masked_m.to(torch.int64)[:, None]  # [E_l, max_tokens]
        return _replaced(
            golden,
            Stage.DISPATCH,
            a_batched=_max_codes(codes, pad),
            a_scale_batched=_max_scales(scales, pad),
        )
    perm = golden[Stage.PERMUTE]
    pad = perm["m_indices"] == -1
    entries = {"a_perm": _max_codes(perm["a_perm"], pad)}
    if problem.grouped_layout is GroupedLayout.PSUM:
        entries["a_scale_perm"] = _max_scales(perm["a_scale_perm"], pad)
    return _replaced(golden, Stage.PERMUTE, **entries)


def _max_codes(codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of the e4m3 `codes` with the `rows` (a bool mask over the leading dims) at 448."""
    out = codes.clone()
    out.view(torch.uint8)[rows] = FP8_MAX_CODE  # index_put has no fp8 kernel: write the bytes
    return out


def _max_scales(scales: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of fp32 or packed-UE8M0 `scales` with the `rows` at the format's largest scale."""
    out = scales.clone()
    out[rows] = PACKED_MAX_WORD if scales.dtype == torch.int32 else FP32_MAX
    return out


def _replaced(trace: Trace, stage: str, **entries: object) -> Trace:
    """A copy of `trace` whose `stage` has `entries` replaced; `trace` itself is left untouched."""
    out = Trace(trace.backend, trace.rank)
    for name, outputs in trace.items():
        out.add(name, {**outputs, **entries} if name == stage else outputs)
    return out
