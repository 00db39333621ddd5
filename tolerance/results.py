"""What a comparison returns: the worst coordinates, one check, one stage's results."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_verify.spec import Status, Trace

# How many of a failed check's rows (live slots, tokens) its failure lines name beside the count.
FIRST_ROWS = 4
# The units of `CheckResult.beyond` that count rows, and the coordinates naming one.
_ROW_UNITS = ("slots", "tokens", "rows")
_ROW_COORDS = ("token", "k", "expert", "rank")


def entry(trace: Trace, stage: str, name: str) -> object:
    """trace[stage][name], or a ContractError naming what the stage has instead."""
    outs = trace[stage]
    if name not in outs:
        raise ContractError(f"{trace.backend} {stage} has no {name!r} (it has {sorted(outs)})")
    return outs[name]


@dataclass(frozen=True)
class Worst:
    """Where the worst (or first) difference is, and the value on each side.

    expert is the global expert id (the golden's topk_ids[token, k]) where known; row is the row
    of the other side's permuted buffer for permuted-layout stages.
    """

    token: int | None = None
    k: int | None = None
    expert: int | None = None
    rank: int | None = None
    column: int | None = None
    golden: float | int | None = None
    other: float | int | None = None
    row: int | None = None

    def __post_init__(self) -> None:
        # Reports outlive the traces: a tensor here would pin device memory and print as
        # tensor(..., device='cuda:0'), so every field must be a plain number.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, (int, float)):
                raise TypeError(f"Worst.{f.name} must be a number, got {type(value).__name__}")

    def coords(self) -> str:
        """'(token 2, k 1, expert 3, rank 0, column 17)', '-' where unknown."""
        names = ("token", "k", "expert", "rank", "column")
        parts = [f"{n} {'-' if getattr(self, n) is None else getattr(self, n)}" for n in names]
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class CheckResult:
    """One check of one stage: the measured value against its limit, with the limit's reason."""

    name: str
    passed: bool
    value: float
    limit: float
    reason: str
    worst: Worst | None = None
    detail: str = ""
    # The legitimate recipe this check found the tested side implements (or declared); the
    # stage's StageResult.recipe is the first one its checks name.
    recipe: str | None = None
    # How many units are beyond the check's bound, by unit, finest first: {"elements": 17,
    # "slots": 3} (for an exact check: how many differ). Empty where the check measures one
    # number for the whole stage (calc_diff, M_sum, a shape).
    beyond: dict[str, int] = field(default_factory=dict)
    # The first rows beyond the bound (live slots in (token, k) order, or tokens), at most
    # FIRST_ROWS: where to look beside the worst one. Empty where the check has no such rows.
    first_rows: tuple[Worst, ...] = ()

    def beyond_text(self) -> str:
        """'17 elements in 3 slots beyond', '2 slots beyond' (an exact check: 2 differ); ''
        where nothing is counted."""
        if not self.beyond:
            return ""
        units = (
            f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"
            for unit, n in self.beyond.items()
        )
        return " in ".join(units) + " beyond"

    def rows_text(self, named: int = FIRST_ROWS) -> str:
        """'slots (token, k, expert, rank): (0, 1, 2, 0), (3, 0, 1, 0) and 5 more': the first
        `named` rows beyond the bound, the others counted; '' where fewer than two rows are known
        (the worst coordinates name a lone one)."""
        if len(self.first_rows) < 2 or named < 1:
            return ""
        rows = self.first_rows[:named]
        coords = [c for c in _ROW_COORDS if any(getattr(w, c) is not None for w in rows)]
        listed = ", ".join(
            "("
            + ", ".join("-" if getattr(w, c) is None else str(getattr(w, c)) for c in coords)
            + ")"
            for w in rows
        )
        unit = next((u for u in reversed(self.beyond) if u in _ROW_UNITS), "rows")
        more = max(self.beyond.get(unit, 0), len(self.first_rows)) - len(rows)
        return f"{unit} ({', '.join(coords)}): {listed}" + (f" and {more} more" if more else "")


@dataclass(frozen=True)
class StageResult:
    """All checks of one stage. status: pass, fail, skip (reason says why) or error (the
    comparison itself raised; reason holds the exception)."""

    stage: str
    status: Status
    checks: list[CheckResult] = field(default_factory=list)
    reason: str = ""
    rank: int | None = None  # the rank whose trace this is (None: single rank or cross-rank)
    # The code the tested side reported running the stage: the GEMM engine for GEMM stages, or
    # moe_verify.spec.SUITE_CODE where an adapter ran the suite's own code in the engine's place.
    engine: str | None = None
    # The legitimate recipe the tested side matched (or declared), for stages with several
    # correct implementations ("quant_input: triton_reciprocal"); None where only one exists.
    recipe: str | None = None
    # The fused group that computed the stage ('quant_input+permute'), for a backend that runs
    # several stages in one method (moe_verify/spec/fused.py); None for a stage of its own.
    group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))  # also from JSON's strings

    @property
    def label(self) -> str:
        """'gemm1@r1 [deepgemm]': stage, rank when multi-rank, engine when reported, and the
        fused group that computed it ('permute in quant_input+permute')."""
        text = self.stage if self.rank is None else f"{self.stage}@r{self.rank}"
        text = text if self.engine is None else f"{text} [{self.engine}]"
        return text if self.group is None else f"{text} in {self.group}"

    @property
    def failed_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]


class ContractError(Exception):
    """A trace's stage outputs break the stage contract (missing entry, wrong dtype or shape)."""
