"""What a sanitized `moe-verify run` found and where: the stage an error belongs to (the runner's
breadcrumb, read the moment the first error line arrives, cross-checked by the kernel's name:
each of our kernels belongs to known stages, KERNEL_STAGES) and the report (`SanitizeReport`):
the tool, the error count, the first error, the child's exit code and verdict line, the slowdown
and the exit code of `run --sanitize`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from moe_verify.args import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from moe_verify.sanitize.output import SanitizerError

# Our kernels and the stages that launch them (optimized/backend.py); the breadcrumb picks among
# several. A kernel not listed (a backend's own, vLLM's, torch's) takes the breadcrumb's stage.
KERNEL_STAGES: dict[str, tuple[str, ...]] = {
    "_quantize_fp8_groups_kernel": ("quant_input", "shared"),
    "_quantize_mxfp8_kernel": ("quant_input", "shared"),
    "_pack_ue8m0_kernel": ("quant_input", "shared"),
    "_count_kernel": ("align",),
    "_segments_kernel": ("permute",),
    "_scatter_kernel": ("permute",),
    "_grouped_gemm_kernel": ("gemm1", "gemm2", "shared"),
    "_silu_mul_quant_kernel": ("act_quant", "shared"),
    "_ep_gather_kernel": ("gather",),
}
# Every DeepGEMM kernel is a grouped GEMM of ours (optimized/deepgemm/).
DEEPGEMM_STAGES = ("gemm1", "gemm2", "shared")


@dataclass(frozen=True)
class Crumb:
    """The runner's breadcrumb: the case and stage in flight (moe_verify/run/runner.py)."""

    case: str
    rank: int
    stage: str
    mode: str

    @staticmethod
    def read(path: Path) -> Crumb | None:
        try:
            data = json.loads(path.read_text())
            return Crumb(
                str(data["case"]), int(data["rank"]), str(data["stage"]), str(data["mode"])
            )
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or caught mid-write
            return None


def kernel_stages(kernel_base: str | None) -> tuple[str, ...]:
    """The stages that launch `kernel_base` (KERNEL_STAGES, DeepGEMM's), () when not ours."""
    if not kernel_base:
        return ()
    if kernel_base.startswith("deep_gemm::"):
        return DEEPGEMM_STAGES
    name = kernel_base.rsplit("::", 1)[-1]
    for kernel, stages in KERNEL_STAGES.items():
        # Triton 2.x named a kernel by its signature too (_scatter_kernel_0d1d2d)
        if re.fullmatch(rf"{re.escape(kernel)}(?:_\d\w*)?", name):
            return stages
    return ()


@dataclass(frozen=True)
class Attribution:
    """The stage an error belongs to, and how that was found."""

    stage: str | None
    rank: int | None
    side: str | None  # golden, isolated or chained
    how: str


def attribute(error: SanitizerError | None, crumb: Crumb | None) -> Attribution:
    """The stage of `error`: the breadcrumb's when the kernel is one of that stage's (or not one
    of ours); the kernel's own when the breadcrumb disagrees or is missing."""
    if error is None:
        return Attribution(None, None, None, "no error")
    stages = kernel_stages(error.kernel_base)
    rank = crumb.rank if crumb else None
    side = crumb.mode if crumb else None
    if crumb is not None and (not stages or crumb.stage in stages):
        how = (
            "from the breadcrumb; the kernel is one of this stage's"
            if stages
            else "from the breadcrumb (the kernel is not one of the suite's)"
        )
        return Attribution(crumb.stage, rank, side, how)
    if len(stages) == 1:
        why = f"the breadcrumb said {crumb.stage}" if crumb else "no breadcrumb"
        return Attribution(stages[0], rank, side, f"from the kernel's name ({why})")
    if stages:
        why = f"the breadcrumb said {crumb.stage}" if crumb else "no breadcrumb to pick one"
        return Attribution(None, rank, side, f"the kernel runs in {' or '.join(stages)} ({why})")
    return Attribution(
        None, None, None, "no breadcrumb (before the first stage) and not our kernel"
    )


@dataclass
class SanitizeReport:
    """One sanitized case: what the sanitizer found, where, and what the run itself said."""

    tool: str
    case: str
    command: list[str]
    errors: int
    first: SanitizerError | None
    where: Attribution
    child_rc: int
    verdict: str | None
    wall_s: float
    timed_out: bool
    failure: str | None  # the sanitizer could not run
    crumb: Crumb | None = None  # the breadcrumb the stage came from
    baseline_s: float | None = None
    baseline_rc: int | None = None
    child_output: list[str] = field(default_factory=list)

    @property
    def slowdown(self) -> float | None:
        if not self.baseline_s:
            return None
        return self.wall_s / self.baseline_s

    @property
    def exit_code(self) -> int:
        if self.errors:
            return EXIT_FAIL
        if self.failure or self.timed_out:
            return EXIT_ERROR
        if self.child_rc == EXIT_PASS:
            return EXIT_PASS
        return EXIT_FAIL if self.child_rc == EXIT_FAIL else EXIT_ERROR

    def _where_text(self) -> str:
        w = self.where
        stage = f"stage {w.stage}" if w.stage else "stage unknown"
        extra = [f"rank {w.rank}"] if w.rank is not None else []
        extra += [f"{w.side} side"] if w.side else []
        return f"{stage} ({', '.join([*extra, w.how])})"

    def _timing(self) -> str:
        ratio = self.slowdown
        if ratio is None:
            return f"The sanitized run took {self.wall_s:.1f} s."
        runs = f"{self.wall_s:.1f} s vs {self.baseline_s:.1f} s without it"
        if self.baseline_rc not in (None, self.child_rc):
            # The sanitized run stopped at the fault, so the two runs did different work.
            return (
                f"Under {self.tool} the case ended at the fault after {self.wall_s:.1f} s; without "
                f"it the case ran to exit {self.baseline_rc} in {self.baseline_s:.1f} s (no "
                "slowdown measured)."
            )
        return f"Under {self.tool} the case ran {ratio:.1f}x slower ({runs})."

    def to_summary(self) -> str:
        """One paragraph: the verdict, the first error with its kernel, stage and case, the run's
        own exit and verdict, and the slowdown."""
        head = (
            f"{self.tool}: {self.errors} error{'s' if self.errors != 1 else ''} in case {self.case}"
        )
        parts = []
        if self.failure:
            why = self.failure.rstrip(".")
            parts.append(f"{head}; the sanitizer could not check it: {why}.")
        elif self.timed_out:
            parts.append(f"{head} before the run was killed at its timeout.")
        elif not self.errors:
            parts.append(f"{head}.")
        if self.first is not None and self.errors:
            e = self.first
            kernel = f"kernel {e.kernel_base or e.kernel}" if e.kernel else "no kernel named"
            at = f" at {e.location}" if e.location else ""
            detail = []
            if e.thread:
                detail.append(f"thread {e.thread} in block {e.block}")
            if e.address:
                detail.append(f"address {e.address}")
            tail = f"; {', '.join(detail)}" if detail else ""
            lead = f"{head} before the run was killed at its timeout" if self.timed_out else head
            parts.append(
                f"{lead}; the first: {e.kind} in {kernel}{at}, {self._where_text()}{tail}."
            )
        run = f"exit {self.child_rc}" + (f", {self.verdict!r}" if self.verdict else "")
        parts.append(f"The run itself: {run}.")
        parts.append(self._timing())
        parts.append(f"Exit {self.exit_code}.")
        return " ".join(parts)
