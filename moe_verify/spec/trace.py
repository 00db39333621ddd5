"""The Trace: one rank's staged forward, stage by stage, and why a stage has no outputs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from moe_verify.spec.stages import PER_SLOT_OUTPUTS, Status

# The keys a trace stores for a stage that did not run (kept as data so dumps round-trip).
_SKIPPED = "skipped"
_ERROR = "error"
_VIOLATION = "violation"


@dataclass(frozen=True)
class StageFailure:
    """Why a stage of a trace has no usable outputs: skipped (with the reason), raised (the
    error), or returned outputs that break the stage contract (the violation)."""

    status: Status  # Status.SKIP, Status.ERROR, or Status.FAIL for a contract violation
    reason: str

    def __str__(self) -> str:
        word = {Status.SKIP: "skipped", Status.ERROR: "error", Status.FAIL: "contract violation"}
        return f"{word[self.status]}: {self.reason}"


class Trace:
    """Ordered mapping stage name -> named tensors (and host ints), one rank's staged forward.

    `trace["permute"]["m_indices"]`. Stages are appended in execution order; a stage may carry
    extra named entries (e.g. "engine" on GEMM stages). Non-tensor values (ints, strings) are
    allowed for host-side facts such as M_sum or the GEMM engine used. A stage that did not run
    is recorded with `add_skipped` or `add_error`, and `failure(stage)` says which and why.

    Two host entries have a fixed meaning: "engine" (the GEMM engine that ran a GEMM stage) and
    "recipe" (the legitimate rounding recipe a backend declares it implements for a stage with
    several, e.g. quant_input "triton_reciprocal"; docs/tolerance.md#legitimate-recipes). Without a
    declared recipe a stage passes when it matches one legitimate recipe exactly.
    """

    def __init__(self, backend: str, rank: int = 0) -> None:
        self.backend = backend
        self.rank = rank
        self._stages: dict[str, dict[str, object]] = {}
        # stage -> the fused group that computed it ('quant_input+permute'), for every stage of
        # a group (moe_verify/spec/fused.py); a stage the group did not expose has no outputs
        self.fused: dict[str, str] = {}

    def _like(self) -> Trace:
        """An empty trace of the same backend, rank and fused groups."""
        out = Trace(self.backend, self.rank)
        out.fused = dict(self.fused)
        return out

    def mark_fused(self, stages: Sequence[str], group: str) -> None:
        """`stages` were computed by the fused group named `group` (one call of one method)."""
        self.fused.update(dict.fromkeys(stages, group))

    def add(self, stage: str, outputs: Mapping[str, object]) -> None:
        if stage in self._stages:
            raise ValueError(f"trace of {self.backend!r} already has stage {stage!r}")
        self._stages[stage] = dict(outputs)

    def replaced(self, stage: str, **entries: object) -> Trace:
        """A copy of this trace whose `stage` has `entries` replaced (the tensors are shared,
        this trace is left as it is): how a wrapping stage hands its inner backend a changed
        upstream, `ctx.replace(upstream=ctx.upstream.replaced("align", counts=c))`."""
        if stage not in self._stages:
            raise KeyError(f"trace of {self.backend!r} has no stage {stage!r} to replace")
        out = self._like()
        for name, outputs in self._stages.items():
            out._stages[name] = {**outputs, **entries} if name == stage else dict(outputs)
        return out

    def add_skipped(self, stage: str, reason: str) -> None:
        """`stage` did not run here, for `reason` (e.g. "needs SM100"); never a pass."""
        self.add(stage, {_SKIPPED: reason})

    def add_error(self, stage: str, message: str) -> None:
        """`stage` raised `message`: reported as an error at that stage."""
        self.add(stage, {_ERROR: message})

    def add_violation(self, stage: str, message: str) -> None:
        """`stage` ran but broke the stage contract (a wrong dtype, shape or stride, an in-place
        write into its upstream or inputs): a failed check at that stage, and what it returned
        is not used downstream."""
        self.add(stage, {_VIOLATION: message})

    def failure(self, stage: str) -> StageFailure | None:
        """Why `stage` has no outputs (absent, skipped or raised), or None when it ran."""
        outs = self._stages.get(stage)
        if outs is None and stage in self.fused:
            return StageFailure(
                Status.SKIP, f"computed inside the fused group {self.fused[stage]}, not exposed"
            )
        if outs is None:
            return StageFailure(Status.SKIP, f"{self.backend} has no {stage} stage (not run)")
        if _ERROR in outs:
            return StageFailure(Status.ERROR, str(outs[_ERROR]))
        if _VIOLATION in outs:
            return StageFailure(Status.FAIL, str(outs[_VIOLATION]))
        if _SKIPPED in outs:
            return StageFailure(Status.SKIP, str(outs[_SKIPPED]))
        return None

    def __getitem__(self, stage: str) -> dict[str, object]:
        try:
            return self._stages[stage]
        except KeyError:
            raise KeyError(
                f"trace of {self.backend!r} (rank {self.rank}) has no stage {stage!r}; "
                f"it has {list(self._stages)}"
            ) from None

    def __contains__(self, stage: object) -> bool:
        return stage in self._stages

    def __iter__(self) -> Iterator[str]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def items(self) -> Iterator[tuple[str, dict[str, object]]]:
        return iter(self._stages.items())

    @property
    def stages(self) -> list[str]:
        return list(self._stages)

    def upto(self, stage: str) -> Trace:
        """A copy holding only the stages before `stage` (the `upstream` of that stage)."""
        out = self._like()
        for name, outs in self._stages.items():
            if name == stage:
                break
            out.add(name, outs)
        return out

    def only(self, stages: Sequence[str]) -> Trace:
        """A copy holding only `stages` (those it has), in trace order."""
        out = self._like()
        for name, outs in self._stages.items():
            if name in stages:
                out.add(name, outs)
        return out

    def in_slot_order(self, order: torch.Tensor) -> Trace:
        """A copy whose per-slot outputs (`PER_SLOT_OUTPUTS`, [T, k], and their other recipes'
        `name@recipe`) are read in `order`: out[t, i] = x[t, order[t, i]] (int64 [T, k]); a
        token's k slots re-listed, nothing else touched. Outputs of another shape are left as
        they are (the comparison names them)."""
        out = self._like()
        for name, outs in self._stages.items():
            outs = dict(outs)
            per_slot = PER_SLOT_OUTPUTS.get(name, ())
            for key in [k for k in outs if k.split("@", 1)[0] in per_slot]:
                x = outs.get(key)
                if isinstance(x, torch.Tensor) and x.shape == order.shape:
                    outs[key] = x.gather(1, order.to(x.device))
            out.add(name, outs)
        return out

    def __repr__(self) -> str:
        return f"Trace({self.backend!r}, rank={self.rank}, stages={self.stages})"


class StageSkipped(Exception):
    """Raised by a backend for a stage it cannot run here (the reason says why, e.g. SM100 only).

    The comparison reports the stage as skipped with this reason; it is never silently replaced.
    """


class StageViolation(Exception):
    """Raised by a backend (or the harness) when a stage ran but broke the stage contract, e.g. a
    write past the end of its workspace that did not fault: a failed check at that stage
    (`Trace.add_violation`), not an error."""
