"""The golden cannot be corrupted by a tested stage, and every in-place write is named.

A tested stage is handed `Guarded(upstream, inputs).upstream` and `.inputs` instead of the
originals; after the stage, `.writes()` names every tensor it wrote in place ("quant_input.a1q: 12
of 4096 elements changed"), so the runner blames the write on the stage that made it (an adapter
runs code the suite does not control). Two kinds of tensors, protected two ways on purpose:

- The upstream is copied for every stage. In isolated mode it is the golden's own trace, which
  the comparison reads after the tested stages ran: a write into it would make an earlier stage
  look wrong, so detecting one (a checksum) is not enough, the golden must never see it. A copy
  costs one pass to make and one to compare, and the upstream's memory for the stage's duration
  (stage outputs are up to ~1 GB each at DeepSeek-V3 EP8, a few GB for a late stage's upstream).
  Copies keep the shape, the strides and the bytes (packed UE8M0 scales are MN-major with
  TMA-aligned columns, and a kernel reads the strides); one tensor under two names gets one copy.
  One exception: a chained stage's own upstream under `--sanitize initcheck` is handed as it is
  (`guards_own_upstream` says why).
- The inputs are copied once per inputs object (`guarded_inputs`), not per stage: every stage,
  mode and rank of a case shares them, and so do the golden's runs of later ranks. At DeepSeek-V3
  size (E=256) they are tens of GB (11 GB of FP8 weights, more with the bf16 masters and the
  checkpoint before UE8M0 requant), too much to copy per stage. The tested side gets the copy
  (the same object every stage, so a backend's per-inputs caches hold); the golden keeps the
  original. After each stage the copy is compared with the original, and any tensor that changed
  is reported and restored from it, so the next stage starts from the original. Cost: the
  inputs' memory once more on their device while the case lives (the copy is dropped when the
  original inputs object is freed), and one compare pass per stage, reading both (about 20 ms per
  stage for DeepSeek-V3's inputs on an H200).

Comparisons are bitwise: each element as an integer of its width, so a NaN payload or -0.0 over
+0.0 counts. One pass per tensor, in chunks along the first dimension so the temporary stays near
64M booleans whatever the tensor's size; one host sync per stage for all of them. Call `writes()`
once the stage has finished (the runner synchronizes the device first), also when the stage
raised: a write before the raise is still a write. A guard whose `writes()` was never called is
checked when the next guard of the same inputs is made, so its writes are never blamed on the
next stage. Single-threaded, as the runner is.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass

import torch

from moe_verify.spec import MoEInputs, QuantizedWeight, Trace
from tolerance.metrics import host_ints

__all__ = ["Guarded", "guarded_inputs"]

# `moe-verify run --sanitize TOOL` names the tool to its sanitized child
# (moe_verify/sanitize/run.py).
SANITIZER_TOOL_ENV = "MOE_VERIFY_SANITIZER_TOOL"


def guards_own_upstream() -> bool:
    """Whether a chained stage's upstream, the tested side's own earlier outputs, is copied and
    checked for in-place writes. Not under initcheck: the copy and the check read every byte,
    padding rows the backend's kernels never wrote included (they may: the layout leaves them
    unspecified), and initcheck would report the harness's reads as the case's errors. The plain
    run that `--sanitize` makes first still checks them; the inputs and the golden's upstream
    (isolated mode) are always guarded, every byte of them is written."""
    return os.environ.get(SANITIZER_TOOL_ENV) != "initcheck"


# Elements compared per step: bounds the boolean temporary of one comparison.
_CHUNK_ELEMENTS = 1 << 26
# An integer dtype of each element width: comparing these compares bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements reinterpreted as integers of the same width (same shape and strides)."""
    return t.view(_BITS[t.element_size()])


def _copy(name: str, t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in fresh storage with t's shape, exact strides and bytes: the storage span
    its view covers is copied, so gaps between strided columns (TMA padding) travel too. Exact
    strides also where torch ignores them: DeepGEMM asserts the TMA-aligned column stride of
    packed scales even when they have one column."""
    if t.element_size() not in _BITS:
        raise TypeError(
            f"{name}: expected a tensor with 1, 2, 4 or 8-byte elements to guard, got {t.dtype}"
        )
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    flat = t.detach().as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride())


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements of a and b (same shape) differ in their bits: an int64 scalar on their
    device, not yet read (`_host_counts` reads many at once)."""
    x, y = _bits(a), _bits(b)
    if x.dim() == 0:
        return (x != y).to(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return total
    step = max(1, _CHUNK_ELEMENTS // max(1, x[0].numel()))
    for i in range(0, x.shape[0], step):
        total += torch.count_nonzero(x[i : i + step] != y[i : i + step])
    return total


def _host_counts(counts: list[torch.Tensor]) -> list[int]:
    """Device scalars as Python ints, with one host sync per device rather than one per tensor
    (a stage hands out dozens of tensors; under `sweep --jobs` every sync waits for the GPU's
    other processes)."""
    out: list[int] = [0] * len(counts)
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(counts):
        by_device.setdefault(c.device, []).append(i)
    for index in by_device.values():
        for i, n in zip(index, host_ints(*(counts[i] for i in index)), strict=True):
            out[i] = n
    return out


@dataclass
class _Watch:
    """One handed-out copy, the original it must still equal, and the layout it was handed with
    (a resize_ or set_ in place changes that)."""

    name: str
    original: torch.Tensor
    copy: torch.Tensor
    layout: tuple[tuple[int, ...], tuple[int, ...], int]

    @staticmethod
    def of(name: str, original: torch.Tensor) -> _Watch:
        copy = _copy(name, original)
        return _Watch(name, original, copy, _layout(copy))

    def resized(self, restore: bool) -> str | None:
        """A resize_ or set_ in place by the holder of the copy, or None; with `restore`, the
        copy is the original's bytes again, in its own layout."""
        now = _layout(self.copy)
        if now == self.layout:
            return None
        msg = (
            f"{self.name}: resized or replaced in place: shape {self.layout[0]} strides "
            f"{self.layout[1]} became shape {now[0]} strides {now[1]}"
        )
        if restore:
            self.copy.set_(_copy(self.name, self.original))
            self.layout = _layout(self.copy)
        return msg

    def written(self, changed: int, restore: bool) -> str | None:
        """The holder's writes, `changed` elements of the copy (`_changed`), or None; with
        `restore`, the original's bits are put back so the next holder gets the original."""
        if not changed:
            return None
        if restore:
            _bits(self.copy).copy_(_bits(self.original))
        return f"{self.name}: {changed} of {self.original.numel()} elements changed"


def _check(watches: list[tuple[_Watch, bool]]) -> list[str]:
    """What the holders did to each (watch, restore) copy, in order, one line per tensor written;
    the element counts of all of them read with one host sync (`_host_counts`)."""
    found: dict[int, str] = {}
    kept: list[int] = []
    for i, (watch, restore) in enumerate(watches):
        if (msg := watch.resized(restore)) is not None:
            found[i] = msg
        else:
            kept.append(i)
    counts = _host_counts([_changed(watches[i][0].copy, watches[i][0].original) for i in kept])
    for i, changed in zip(kept, counts, strict=True):
        watch, restore = watches[i]
        if (msg := watch.written(changed, restore)) is not None:
            found[i] = msg
    return [found[i] for i in sorted(found)]


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), tuple(t.stride()), t.data_ptr()


class _TestedInputs:
    """The tested side's copy of one inputs object, and the guard that handed it out last."""

    def __init__(self, inputs: MoEInputs) -> None:
        self.watches: list[_Watch] = []
        copies: dict[int, torch.Tensor] = {}

        def copy(name: str, t: torch.Tensor) -> torch.Tensor:
            if id(t) not in copies:
                self.watches.append(_Watch.of(name, t))
                copies[id(t)] = self.watches[-1].copy
            return copies[id(t)]

        fields: dict[str, object] = {}
        for f in dataclasses.fields(inputs):
            value = getattr(inputs, f.name)
            name = f"inputs.{f.name}"
            if isinstance(value, torch.Tensor):
                value = copy(name, value)
            elif isinstance(value, QuantizedWeight):
                value = QuantizedWeight(
                    copy(f"{name}.q", value.q), copy(f"{name}.scale", value.scale), value.block
                )
            fields[f.name] = value
        self.inputs = MoEInputs(**fields)
        self.holder: Guarded | None = None


# id(original inputs) -> its tested copy; an entry goes when its inputs object is freed (it holds
# the original's tensors, never the object, so it cannot keep the object alive).
_TESTED: dict[int, _TestedInputs] = {}


def _tested(inputs: MoEInputs) -> _TestedInputs:
    key = id(inputs)
    if key not in _TESTED:
        _TESTED[key] = _TestedInputs(inputs)
        weakref.finalize(inputs, _TESTED.pop, key, None)
    return _TESTED[key]


def guarded_inputs(inputs: MoEInputs) -> MoEInputs:
    """The tested side's copy of `inputs`: made the first time, the same object afterwards, for
    as long as `inputs` lives. `Guarded` hands it out; the golden keeps `inputs`."""
    return _tested(inputs).inputs


class Guarded:
    """What one tested stage is handed in place of `upstream` and `inputs`, and what it wrote.

    upstream: copies of the upstream's tensors (same shapes, strides and bytes), its host values
    as they are, the same stage order, backend name and rank; made for this stage.
    inputs: the tested side's copy of `inputs` (`guarded_inputs`), shared by every stage of the
    case.
    writes(): every in-place write since construction, one line per tensor, e.g.
    "quant_input.a1q: 12 of 4096 elements changed", "inputs.w13_q.scale: 1 of 8 elements
    changed"; [] when none. The first call compares (and restores the inputs copy); later calls
    return the same list.
    """

    def __init__(self, upstream: Trace, inputs: MoEInputs, copy_upstream: bool = True) -> None:
        if not isinstance(upstream, Trace):
            raise TypeError(f"upstream: expected a Trace, got {type(upstream).__name__}")
        if not isinstance(inputs, MoEInputs):
            raise TypeError(f"inputs: expected a MoEInputs, got {type(inputs).__name__}")
        self._tested = _tested(inputs)
        previous = self._tested.holder
        if previous is not None:
            previous.writes()  # its writes are its own, not this stage's
        self._tested.holder = self
        self._watches: list[_Watch] = []
        self._writes: list[str] | None = None
        # Without `copy_upstream` the stage gets `upstream` itself, unwatched (guards_own_upstream)
        self._upstream = self._copy_trace(upstream) if copy_upstream else upstream

    def _copy_trace(self, upstream: Trace) -> Trace:
        copies: dict[int, torch.Tensor] = {}
        out = Trace(upstream.backend, upstream.rank)
        for stage, outputs in upstream.items():
            handed: dict[str, object] = {}
            for name, value in outputs.items():
                if isinstance(value, torch.Tensor):
                    if id(value) not in copies:
                        self._watches.append(_Watch.of(f"{stage}.{name}", value))
                        copies[id(value)] = self._watches[-1].copy
                    value = copies[id(value)]
                handed[name] = value
            out.add(stage, handed)
        return out

    @property
    def upstream(self) -> Trace:
        return self._upstream

    @property
    def inputs(self) -> MoEInputs:
        return self._tested.inputs

    def writes(self) -> list[str]:
        if self._writes is None:
            # The upstream's copies stay as written; the inputs' copy is restored. One host sync.
            self._writes = _check(
                [(w, False) for w in self._watches] + [(w, True) for w in self._tested.watches]
            )
            # The upstream copies are only evidence: the handed-out trace keeps them alive if
            # anyone still holds it.
            self._watches = []
            if self._tested.holder is self:
                self._tested.holder = None
        return list(self._writes)
