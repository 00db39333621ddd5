"""Reused kernel workspaces, as vLLM's are: poisoned before each use, fenced by guard bands.

A workspace is allocated once per (name, shape, dtype, device) and handed to the kernel that
writes that stage output. With a poison byte it is filled before every use, so an element a kernel
leaves unwritten shows up (the same case under two poisons must agree bitwise on everything it
promises). Each workspace sits between two guard bands of a canary pattern, checked after every
stage, so a kernel writing past either end of its output fails that stage by name.
"""

from __future__ import annotations

import functools
import math

import torch

# Bytes of canary on each side of a workspace: a multiple of 512, so the workspace keeps the
# allocation's alignment (TMA needs 16-byte aligned addresses).
GUARD_BYTES = 4096

# (name, shape, dtype, device): one workspace each.
WorkspaceKey = tuple[str, tuple[int, ...], torch.dtype, torch.device]


@functools.cache
def _canary(device: torch.device) -> torch.Tensor:
    """The guard bands' pattern: every byte value, scrambled, so no constant fill (a poison, a
    zeroing, a memset) can leave a band as it was."""
    return ((torch.arange(GUARD_BYTES) * 151 + 89) % 256).to(torch.uint8).to(device)


class Workspaces:
    """The workspaces of one backend. Off (`enabled=False`), `get` returns None and kernels
    allocate their outputs, and `own` hands outputs through unchanged."""

    def __init__(self, enabled: bool = False, poison: int | None = None) -> None:
        if poison is not None and not (enabled and 0 <= poison <= 255):
            raise ValueError(f"poison: a byte 0..255 with workspace=True, got {poison!r}")
        self.enabled = enabled
        self.poison = poison
        # What the kernels write, and each one's whole allocation: guard, buffer, guard (uint8).
        self.buffers: dict[WorkspaceKey, torch.Tensor] = {}
        self.guarded: dict[WorkspaceKey, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The reused (and, with a poison, freshly poisoned) workspace `name`; None when off."""
        if not self.enabled:
            return None
        key = (name, tuple(shape), dtype, device)
        if key not in self.buffers:
            nbytes = math.prod(shape) * dtype.itemsize
            whole = torch.empty(nbytes + 2 * GUARD_BYTES, dtype=torch.uint8, device=device)
            canary = _canary(device)
            whole[:GUARD_BYTES] = canary
            whole[GUARD_BYTES + nbytes :] = canary
            self.guarded[key] = whole
            self.buffers[key] = whole[GUARD_BYTES : GUARD_BYTES + nbytes].view(dtype).view(shape)
        buf = self.buffers[key]
        if self.poison is not None:
            buf.view(torch.uint8).fill_(self.poison)
        return buf

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A stage output the trace may keep: a copy when it lives in a reused workspace."""
        return t.clone() if self.enabled else t

    def guard_hits(self) -> str:
        """What changed in the guard bands since the last look ("" when nothing did): an
        out-of-bounds write that did not fault. Every band is re-armed, so the next stage is
        judged on its own writes. (A backend that writes after `run_stage` returns is charged to
        the next stage.)"""
        hits = []
        for (name, shape, dtype, _), whole in self.guarded.items():
            canary = _canary(whole.device)
            for side, band in (("before", whole[:GUARD_BYTES]), ("after", whole[-GUARD_BYTES:])):
                changed = (band != canary).nonzero()[:, 0]
                if changed.numel() == 0:
                    continue
                band.copy_(canary)
                if side == "before":
                    where = f"nearest at byte {int(changed[-1]) - GUARD_BYTES} before its start"
                else:
                    where = f"nearest at byte +{int(changed[0])} past its end"
                hits.append(
                    f"changed {changed.numel()} bytes of the guard band {side} workspace "
                    f"{name!r} ({dtype} {tuple(shape)}), {where}"
                )
        return "; ".join(hits)
