"""Device-to-host reads made by Python code, counted and blamed on the stage that made them.

A CUDA graph cannot capture a host read (the value is not known when the graph is recorded), and
outside a graph each one costs a device sync. Production mode promises none on its upper-bound
paths (one, the counts, on the exact-count path), and `moe-verify graph` names the stage of a
user's kernel that reads anyway, with the call and the line that read, instead of failing the
capture with a CUDA error.

`HostReads().counting()` patches, for its duration, the Tensor methods and torch functions that
read device values into the host: a Python value (item, tolist, bool, int, float, index), a host
copy (cpu), or a result shaped by the data (nonzero and kin, where(cond), repeat_interleave
without output_size, boolean-mask indexing). numpy() is not listed: a device tensor needs cpu()
first, and the Triton interpreter calls numpy() on host copies while it emulates a kernel (device
code on a GPU). One read is counted per outermost call, so Tensor.unique calling torch.unique
counts once.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from optimized.production import running_stage

Predicate = Callable[[tuple, dict], bool]


def _reads_a_mask(args: tuple, kwargs: dict) -> bool:
    """x[mask] and x[mask] = v: a boolean index sizes its result from the data."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _always(args: tuple, kwargs: dict) -> bool:
    return True


TENSOR_READS: dict[str, Predicate] = {
    name: _always
    for name in (
        "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero",
        "argwhere", "masked_select", "unique", "unique_consecutive",
    )
} | {"__getitem__": _reads_a_mask, "__setitem__": _reads_a_mask}  # fmt: skip
TORCH_READS: dict[str, Predicate] = {
    name: _always
    for name in ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive")
} | {
    "where": lambda args, kwargs: len(args) + len(kwargs) == 1,
    "repeat_interleave": lambda args, kwargs: (
        len(args) > 1 and isinstance(args[1], torch.Tensor) and "output_size" not in kwargs
    ),
}

_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class Read:
    """One host read: the call (`item`, `tolist`, ...), the production stage running when it was
    made (None outside a production forward) and the line that made it."""

    call: str
    stage: str | None
    where: str

    def __str__(self) -> str:
        at = f" in stage {self.stage}" if self.stage else ""
        return f"{self.call}(){at} at {self.where}"


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module: the code that read."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS and not path.startswith(_TORCH):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostReads:
    """The host reads Python code makes inside `counting()`, in order (`reads`)."""

    def __init__(self) -> None:
        self.found: list[Read] = []
        self._depth = 0

    @property
    def reads(self) -> list[str]:
        """The calls that read, by name."""
        return [r.call for r in self.found]

    def by_stage(self) -> dict[str, Read]:
        """The first read of each production stage that made one."""
        first: dict[str, Read] = {}
        for r in self.found:
            if r.stage is not None:
                first.setdefault(r.stage, r)
        return first

    def _wrap(self, original: Callable, name: str, reads: Predicate) -> Callable:
        def counted(*args: object, **kwargs: object) -> object:
            if self._depth == 0 and reads(args, kwargs):
                self.found.append(Read(name, running_stage(), _caller()))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        # torch.compile notes torch's functions when torch._dynamo is first imported: imported
        # under the patch (a first compile in here), it would note the wrappers, and a later
        # fullgraph compile in this process would fail on torch.where "marked as skipped" (seen
        # on the H200 when a graph test ran before the tensor-core model in one pytest worker).
        import torch._dynamo  # noqa: F401

        patched: list[tuple[object, str, object]] = []
        try:
            for owner, table in ((torch.Tensor, TENSOR_READS), (torch, TORCH_READS)):
                for name, reads in table.items():
                    original = getattr(owner, name)
                    patched.append((owner, name, original))
                    setattr(owner, name, self._wrap(original, name, reads))
            yield self
        finally:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)
