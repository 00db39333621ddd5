"""The verification Report: per-stage results of one case, its verdict, and its renderings.

A Report holds the results of one mode or of both (`isolated`, `chained`); its `mode` says which:
"isolated", "chained" or "both", and so do its header, verdict line and JSON, which count each
mode's passes and failures apart. The culprit of a failing case is the first failing stage in
isolated mode (a divergence there belongs to that stage alone); without an isolated failure, the
first failing stage in chained mode.

The verdict is ERROR when a stage errored (a side raised, crashed or timed out), else FAIL when a
check failed, else SKIP when no stage was compared at all, else PASS; `EXIT_CODES` maps it to the
process exit code of `moe-verify` (SKIP is not a pass: nothing was verified).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from moe_verify.spec import EXIT_CODES as EXIT_CODES  # the verdict's exit code, beside Status
from moe_verify.spec import Mode, MoEProblem, Status
from tolerance.compare import CheckResult, StageResult, Worst
from tolerance.policy import comparison_mode

_COLUMNS = ("stage", "status", "check", "value", "limit", "worst coordinates", "reason")

# Longest failure line of the default view; the full text is under -v (to_table).
LINE_WIDTH = 200
# What a failure line may add to LINE_WIDTH to name the first rows beyond the bound: each line
# fits its essentials and the rows, not one at the cost of the other.
ROWS_WIDTH = 100
_DOC_REF = re.compile(r"docs/[\w./-]+\.md(?:#[\w-]+)?")
# A report of both modes (`--mode both`, moe_verify.spec.Mode.select's name for the pair).
BOTH = "both"


@dataclass
class Report:
    """One case's verification: the problem, the backend, and per-stage results per mode.

    mode: "isolated", "chained" or "both" (BOTH), what was run; a report given both lists is a
    report of both modes, whatever `mode` says. `results` returns the primary mode's: isolated
    where it ran (it names the culprit), else chained.
    """

    problem: MoEProblem
    backend: str
    mode: Mode | str = Mode.ISOLATED
    isolated: list[StageResult] | None = None
    chained: list[StageResult] | None = None
    golden: str = "reference"
    # EP: the global experts each rank hosts, so a rank-dependent failure names its experts.
    rank_experts: dict[int, list[int]] | None = None
    # What the run wrote, by kind: {"dump": [case dir], "plots": [png, ...]}.
    files: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode == BOTH or (self.isolated is not None and self.chained is not None):
            self.mode = BOTH
            self.isolated = [] if self.isolated is None else self.isolated
            self.chained = [] if self.chained is None else self.chained
            return
        self.mode = comparison_mode(self.mode)
        if getattr(self, self.mode) is None:
            setattr(self, self.mode, [])

    @property
    def case_id(self) -> str:
        return self.problem.id

    @property
    def primary(self) -> Mode:
        """The mode `results` returns: isolated, where it ran."""
        return Mode.ISOLATED if self.isolated is not None else Mode.CHAINED

    @property
    def results(self) -> list[StageResult]:
        """The stage results of the primary mode."""
        return getattr(self, self.primary)

    def modes(self) -> list[tuple[str, list[StageResult]]]:
        """(mode, results) for each mode present, isolated first."""
        return [(m, getattr(self, m)) for m in Mode if getattr(self, m) is not None]

    @property
    def passed(self) -> bool:
        """No stage failed or errored in any mode (skipped stages do not fail a case)."""
        return all(not r.status.failing for _, results in self.modes() for r in results)

    @property
    def passed_strict(self) -> bool:
        """passed, and no stage skipped either: for CI that must not accept a backend (or a
        machine) that declines stages, e.g. DeepGEMM demanded where it cannot run."""
        return self.passed and all(
            r.status is Status.PASS for _, results in self.modes() for r in results
        )

    @property
    def verdict(self) -> Status:
        """ERROR if any stage errored, else FAIL if any check failed, else SKIP if no stage was
        compared (every one skipped), else PASS."""
        statuses = {r.status for _, results in self.modes() for r in results}
        for status in (Status.ERROR, Status.FAIL):
            if status in statuses:
                return status
        return Status.PASS if Status.PASS in statuses else Status.SKIP

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 2 ERROR or SKIP (EXIT_CODES)."""
        return EXIT_CODES[self.verdict]

    def skipped(self) -> dict[str, list[str]]:
        """reason -> the stages skipped for it (ranks and modes folded), in stage order."""
        out: dict[str, list[str]] = {}
        for _, results in self.modes():
            for r in results:
                if r.status is Status.SKIP and r.stage not in out.setdefault(r.reason, []):
                    out[r.reason].append(r.stage)
        return out

    def skip_note(self) -> str:
        """'gemm1, gemm2 skipped: <reason>' (one reason), 'gemm1, shared skipped; first reason:
        <reason>' (several; the skipped section of to_summary lists each), '' when nothing was."""
        skipped = self.skipped()
        if not skipped:
            return ""
        stages = ", ".join(dict.fromkeys(s for names in skipped.values() for s in names))
        reason = _clip(next(iter(skipped)) or "no reason given", LINE_WIDTH // 2)
        if len(skipped) == 1:
            return f"{stages} skipped: {reason}"
        return f"{stages} skipped; first of {len(skipped)} reasons: {reason}"

    @property
    def first_failure(self) -> str | None:
        """The first failing stage in isolated mode, else in chained mode; None if none fails."""
        first = self.first_failing_result
        return None if first is None else first.stage

    @property
    def first_failing_result(self) -> StageResult | None:
        """The culprit's result (with its rank), isolated mode first."""
        for _, results in self.modes():
            for r in results:
                if r.status.failing:
                    return r
        return None

    @property
    def first_failing_mode(self) -> Mode | None:
        """The mode the culprit failed in: isolated where a stage failed there."""
        for mode, results in self.modes():
            if any(r.status.failing for r in results):
                return mode
        return None

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks with a failing stage in any mode (rank-dependent misrouting shows up here)."""
        ranks = {
            r.rank
            for _, results in self.modes()
            for r in results
            if r.status.failing and r.rank is not None
        }
        return sorted(ranks)

    def engine(self, stage: str, mode: str | None = None) -> str | None:
        """The engine the tested side reported for `stage` (first rank that ran it)."""
        for r in getattr(self, mode or self.primary) or []:
            if r.stage == stage and r.engine is not None:
                return r.engine
        return None

    def recipes(self, mode: str | None = None) -> dict[str, str]:
        """stage -> the legitimate recipe(s) it matched or declared
        (docs/tolerance.md#legitimate-recipes), ranks folded ("a / b" where ranks differ), for
        stages that name one."""
        out: dict[str, list[str]] = {}
        for r in getattr(self, mode or self.primary) or []:
            if r.recipe is not None and r.recipe not in out.setdefault(r.stage, []):
                out[r.stage].append(r.recipe)
        return {stage: " / ".join(names) for stage, names in out.items() if names}

    def counts(self, mode: str | None = None) -> dict[str, int]:
        """status -> how many stage results have it in `mode`, or in every mode run (None)."""
        runs = self.modes() if mode is None else [(mode, getattr(self, mode) or [])]
        out = {s.value: 0 for s in Status}
        for _, results in runs:
            for r in results:
                out[r.status] += 1
        return out

    def mode_counts(self) -> dict[str, dict[str, int]]:
        """mode -> its `counts`, for each mode run (isolated first)."""
        return {str(mode): self.counts(mode) for mode, _ in self.modes()}

    def tally(self) -> str:
        """'7 pass, 1 fail'; of both modes each apart: 'isolated: 7 pass, 1 fail; chained: 5
        pass, 3 fail'."""

        def one(counts: dict[str, int]) -> str:
            return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no stages"

        if self.mode != BOTH:
            return one(self.counts())
        return "; ".join(f"{mode}: {one(c)}" for mode, c in self.mode_counts().items())

    # Failure text ----------------------------------------------------------------------------

    def failure_messages(self) -> list[str]:
        """One line per failed check (the case, stage, check, limit and its reason, the worst
        coordinates, the values on both sides, NaN/Inf counts), every mode and rank, isolated
        first; a limit's reason is spelled out the first time only (the full view, -v)."""
        lines = []
        seen: set[str] = set()
        for mode, results in self.modes():
            for r in results:
                if r.status is Status.ERROR:
                    lines.append(
                        f"{self.case_id} [{mode}] stage {stage_label(r)}: ERROR {r.reason}"
                    )
                for c in r.failed_checks:
                    lines.append(failure_message(self.case_id, mode, r, c, c.reason in seen))
                    seen.add(c.reason)
        return lines

    def failure_lines(self) -> list[str]:
        """The default view's failures: one line per (mode, stage) of at most LINE_WIDTH
        characters (the first failed check, where and by how much, the other failed checks by
        name, and where its limit is explained); every check of every rank is under -v."""
        lines = []
        for mode, results in self.modes():
            by_stage: dict[str, list[StageResult]] = {}
            for r in results:
                if r.status.failing:
                    by_stage.setdefault(r.stage, []).append(r)
            lines.extend(concise_failure(mode, failing) for failing in by_stage.values())
        return lines

    def summary_line(self) -> str:
        """'FAIL <case> [backend, mode] first failure: <stage> (<check>: value > limit) ...',
        'PASS <case> [backend, mode] <tally> (<stages> skipped: <reason>)', or 'SKIP <case> ...
        every tested stage was skipped: ...'."""
        verdict = self.verdict
        head = f"{verdict.upper()} {self.case_id} [{self.backend}, {self.mode}]"
        skipped = self.skip_note()
        if verdict is Status.SKIP:
            return f"{head} every tested stage was skipped: {skipped or 'no stages'}"
        tally = self.tally()
        if skipped:
            tally += f" ({skipped})"
        recipes = self.recipes()
        named = "; recipes: " + ", ".join(f"{s} {r}" for s, r in recipes.items()) if recipes else ""
        if verdict is Status.PASS:
            return f"{head} {tally}{named}"
        result = self.first_failing_result
        assert result is not None
        stage = stage_label(result)
        if self.mode == BOTH:
            stage = f"{stage} [{self.first_failing_mode}]"
        first = result.failed_checks[0] if result.failed_checks else None
        what = (
            f"{first.name}: {_fmt(first.value)} > {_fmt(first.limit)}{_beyond(first)}"
            if first
            else f"error: {_clip(result.reason, LINE_WIDTH // 2)}"
        )
        where = f" at {first.worst.coords()}" if first and first.worst else ""
        return f"{head} first failure: {stage} ({what}){where}; {tally}{named}"

    # Serialization ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (non-finite floats become the strings 'nan', 'inf', '-inf')."""
        return {
            "case": self.case_id,
            "backend": self.backend,
            "golden": self.golden,
            "mode": str(self.mode),
            "verdict": str(self.verdict),
            "passed": self.passed,
            "first_failure": self.first_failure,
            "first_failure_mode": self.first_failing_mode,
            "counts": self.mode_counts(),
            "failed_ranks": self.failed_ranks,
            "rank_experts": self.rank_experts,
            "files": self.files,
            "problem": self.problem.to_dict(),
            **{m.value: _results_to_list(getattr(self, m)) for m in Mode},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Report:
        """Inverse of to_dict (the derived fields 'case', 'verdict', 'passed', 'first_failure',
        'first_failure_mode' and 'counts' are ignored)."""
        return Report(
            problem=MoEProblem.from_dict(d["problem"]),
            backend=d["backend"],
            mode=d["mode"],
            isolated=_results_from_list(d.get(Mode.ISOLATED)),
            chained=_results_from_list(d.get(Mode.CHAINED)),
            golden=d.get("golden", "reference"),
            rank_experts={int(r): e for r, e in d["rank_experts"].items()}
            if d.get("rank_experts")
            else None,
            files={kind: list(paths) for kind, paths in d.get("files", {}).items()},
        )

    # Renderings ------------------------------------------------------------------------------

    def to_table(self, reason_width: int = 60) -> str:
        """Terminal table: stage | status | check | value | limit | worst coordinates | reason,
        under a header naming the case and its first failure, over the full failure messages."""
        lines = [self._header()]
        for mode, results in self.modes():
            rows = [_COLUMNS]
            for r in results:
                rows.extend(_stage_rows(r, reason_width))
            widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
            lines.append(f"-- {mode} --")
            for n, row in enumerate(rows):
                lines.append(
                    "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                )
                if n == 0:
                    lines.append("  ".join("-" * w for w in widths))
        failures = self.failure_messages()
        if failures:
            lines.append("failures:")
            lines.extend(f"  {m}" for m in failures)
        lines.append(self.summary_line())
        return "\n".join(lines)

    def to_summary(self) -> str:
        """One line per stage: its isolated and chained status side by side, the check closest
        to (or over) its limit, and where; each skip reason once; one line per failing (mode,
        stage); the summary line last. The CLI's default view."""
        lines = [self._header()]
        by_mode = {mode: {(r.stage, r.rank): r for r in results} for mode, results in self.modes()}
        keys: list[tuple[str, int | None]] = []
        for _, results in self.modes():
            keys += [(r.stage, r.rank) for r in results if (r.stage, r.rank) not in keys]
        rows = [("stage", "isolated", "chained", "tightest check (value / limit)", "where")]
        for key in keys:
            iso = by_mode.get(Mode.ISOLATED, {}).get(key)
            ch = by_mode.get(Mode.CHAINED, {}).get(key)
            shown = [r for r in (iso, ch) if r is not None]
            label = next((stage_label(r) for r in shown if r.engine), stage_label(shown[0]))
            # A failed check first: a stage that passes isolated and fails chained shows why.
            tight = next((r for r in shown if r.failed_checks), shown[0])
            check = _tightest(tight)
            side = "[chained] " if tight is ch and iso is not None and check else ""
            rows.append(
                (
                    label,
                    iso.status if iso else "-",
                    ch.status if ch else "-",
                    f"{side}{check.name}: {_fmt(check.value)} / {_fmt(check.limit)}"
                    if check
                    else "",
                    check.worst.coords() if check and check.worst else "",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for n, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        skipped = self.skipped()
        if skipped:
            lines.append("skipped:")
            lines.extend(f"  {', '.join(stages)}: {reason}" for reason, stages in skipped.items())
        failures = self.failure_lines()
        if failures:
            lines.append("failures (-v: every check of every rank, with the limits' reasons):")
            lines.extend(f"  {m}" for m in failures)
        lines.append(self.summary_line())
        return "\n".join(lines)

    def to_markdown(self) -> str:
        lines = [
            f"## {self.case_id}: {self.verdict.upper()}",
            "",
            f"- backend: `{self.backend}` vs golden `{self.golden}`, mode: {self.mode}",
            f"- first failure: {self.first_failure or 'none'}"
            + (f" ({self.first_failing_mode})" if self.mode == BOTH and self.first_failure else ""),
            f"- stages: {self.tally()}",
        ]
        if self.skipped():
            lines.append(f"- skipped: {_md_cell(self.skip_note())}")
        for mode, results in self.modes():
            lines += ["", f"### {mode}", "", "| " + " | ".join(_COLUMNS) + " |"]
            lines.append("|" + " --- |" * len(_COLUMNS))
            for r in results:
                for row in _stage_rows(r, reason_width=None):
                    lines.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
        failures = self.failure_messages()
        if failures:
            lines += ["", "### failures", ""]
            lines.extend(f"- {_md_cell(m)}" for m in failures)
        return "\n".join(lines) + "\n"

    def _header(self) -> str:
        verdict = self.verdict
        note = ""
        if verdict is Status.SKIP:
            note = " (every tested stage was skipped)"
        elif self.skipped():
            stages = dict.fromkeys(s for stages in self.skipped().values() for s in stages)
            note = f" ({', '.join(stages)} skipped)"
        first = self.first_failure or "none"
        if self.mode == BOTH and self.first_failure:
            first += f" ({self.first_failing_mode})"
        head = (
            f"case {self.case_id}  backend {self.backend} vs {self.golden}  mode {self.mode}  "
            f"verdict {verdict.upper()}{note}  first failure: {first}"
        )
        ranks = self.failed_ranks
        if ranks and self.rank_experts:
            hosts = "; ".join(
                f"rank {r} hosts experts {self.rank_experts.get(r, [])}" for r in ranks
            )
            head += f"\nfailing ranks: {ranks} ({hosts})"
        return head


def _tightest(result: StageResult) -> CheckResult | None:
    """A failed check if any, else the bounded check (limit > 0) with the largest value / limit;
    a must-be-zero check (nan_inf: 0 / 0) only where the stage has no bounded one."""
    if not result.checks:
        return None
    failed = result.failed_checks
    if failed:
        return failed[0]

    def limit(c: CheckResult) -> float:
        try:
            return float(c.limit)
        except (TypeError, ValueError):
            return 0.0

    bounded = [c for c in result.checks if limit(c) > 0]
    if not bounded:
        return result.checks[0]
    return max(bounded, key=lambda c: float(c.value) / limit(c))


def failure_message(
    case_id: str, mode: str, stage: StageResult, check: CheckResult, reason_above: bool = False
) -> str:
    """Case, stage, check, value vs limit and its reason (or "reason above" where an earlier line
    spelled out the same one), worst coordinates, both values, and the stage's NaN/Inf counts;
    each clause once."""
    reason = "reason above" if reason_above else check.reason
    parts = [
        f"{case_id} [{mode}] stage {stage_label(stage)}, check {check.name}: "
        f"{_fmt(check.value)} > limit {_fmt(check.limit)} ({reason})"
    ]
    if check.beyond:
        parts.append(check.beyond_text())
    if check.rows_text():
        parts.append(check.rows_text())
    if check.worst is not None:
        w = check.worst
        row = f", row {w.row}" if w.row is not None else ""
        parts.append(f"worst at {w.coords()}{row}: golden {_fmt(w.golden)}, other {_fmt(w.other)}")
    if check.detail:
        parts.append(check.detail)
    nan_inf = next((c for c in stage.checks if c.name == "nan_inf"), None)
    if nan_inf is None:
        parts.append("NaN/Inf: not counted (bitwise stage)")
    elif nan_inf is not check:
        parts.append(f"NaN/Inf: {nan_inf.detail}")
    return "; ".join(_once(parts))


def concise_failure(mode: str, failing: list[StageResult]) -> str:
    """One failing stage of one mode on one line (the failing ranks folded): '[mode] stage: check
    value > limit, <count> beyond at (coordinates): golden x, other y; <the first rows beyond>;
    first clause of the detail; also <other failed checks> (where docs/ explains the limit)', at
    most LINE_WIDTH characters plus the rows' (at most ROWS_WIDTH)."""
    first = failing[0]
    ranks = [r.rank for r in failing if r.rank is not None]
    head = f"[{mode}] {stage_label(first)}"
    if len(ranks) > 1:
        head += f" (ranks {', '.join(map(str, ranks))} fail)"
    checks = first.failed_checks
    if first.status is Status.ERROR or not checks:
        return _clip(f"{head}: ERROR {first.reason}", LINE_WIDTH)
    check = checks[0]
    text = f"{head}: {check.name} {_fmt(check.value)} > {_fmt(check.limit)}{_beyond(check)}"
    if check.worst is not None:
        w = check.worst
        text += f" at {w.coords()}: golden {_fmt(w.golden)}, other {_fmt(w.other)}"
    rows = _fitted_rows(check)
    others = dict.fromkeys(c.name for r in failing for c in r.failed_checks if c is not check)
    others.pop(check.name, None)
    refs = _DOC_REF.findall(check.reason)
    where = f" ({refs[0] if refs else _clip(check.reason, 60)})"
    # What the line has left after the essentials goes to the detail's first clause (whole or
    # not at all), then to the other failed checks: by name where they fit, else by count.
    room = LINE_WIDTH - len(text) - len(where)
    n = len(others)
    also = f"; +{n} more failed check{'s' if n > 1 else ''}" if others else ""
    detail = f"; {check.detail.split('; ')[0]}" if check.detail else ""
    tail = ""
    if len(detail) <= room - len(also):
        tail += detail
        room -= len(detail)
    named = f"; also {', '.join(others)}" if others else ""
    tail += named if len(named) <= room else also if len(also) <= room else ""
    # The first rows beyond the bound come beside the worst, in room of their own (ROWS_WIDTH).
    return _clip(text + rows + tail, LINE_WIDTH + len(rows) - len(where)) + where


def _fitted_rows(check: CheckResult) -> str:
    """'; slots (token, k, expert, rank): ...' naming as many of the check's first rows beyond
    the bound as fit in ROWS_WIDTH; '' where the check knows fewer than two."""
    for named in range(len(check.first_rows), 0, -1):
        text = check.rows_text(named)
        if text and len(text) + 2 <= ROWS_WIDTH:
            return f"; {text}"
    return ""


def _beyond(check: CheckResult) -> str:
    """', 17 elements in 3 slots beyond' after a failed check's value and limit; '' where the
    check counts no units."""
    return f", {check.beyond_text()}" if check.beyond else ""


def _once(parts: list[str]) -> list[str]:
    """The '; '-separated clauses of `parts`, each once (a check's detail and the NaN/Inf count's
    detail both carry the stage's recipe note)."""
    seen: dict[str, None] = {}
    for part in parts:
        for clause in part.split("; "):
            seen.setdefault(clause)
    return list(seen)


def stage_label(r: StageResult) -> str:
    """'quant_input (triton_reciprocal)', 'gemm1@r1 [deepgemm]': the stage's label and the
    legitimate recipe it matched or declared, where it names one."""
    return r.label if r.recipe is None else f"{r.label} ({r.recipe})"


def _stage_rows(r: StageResult, reason_width: int | None) -> list[tuple[str, ...]]:
    if not r.checks:
        return [(stage_label(r), r.status, "-", "", "", "", _clip(r.reason, reason_width))]
    rows = []
    for n, c in enumerate(r.checks):
        worst = ""
        if c.worst is not None:
            w = c.worst
            worst = (
                f"t={_dash(w.token)} k={_dash(w.k)} e={_dash(w.expert)} r={_dash(w.rank)} "
                f"col={_dash(w.column)}: {_fmt(w.golden)} vs {_fmt(w.other)}"
            )
        rows.append(
            (
                stage_label(r) if n == 0 else "",
                (r.status if n == 0 else "") if c.passed else "FAIL",
                c.name,
                _fmt(c.value),
                _fmt(c.limit),
                worst,
                _clip(c.reason, reason_width),
            )
        )
    return rows


def _results_to_list(results: list[StageResult] | None) -> list[dict[str, Any]] | None:
    if results is None:
        return None
    return [_json_safe(asdict(r)) for r in results]


def _results_from_list(items: list[dict[str, Any]] | None) -> list[StageResult] | None:
    if items is None:
        return None
    out = []
    for item in items:
        checks = []
        for c in item["checks"]:
            worst = c.get("worst")
            first_rows = tuple(
                Worst(**{k: _from_json_number(v) for k, v in w.items()})
                for w in c.get("first_rows") or ()
            )
            checks.append(
                CheckResult(
                    name=c["name"],
                    passed=c["passed"],
                    value=_from_json_number(c["value"]),
                    limit=_from_json_number(c["limit"]),
                    reason=c["reason"],
                    worst=None
                    if worst is None
                    else Worst(**{k: _from_json_number(v) for k, v in worst.items()}),
                    detail=c["detail"],
                    recipe=c.get("recipe"),
                    beyond=dict(c.get("beyond") or {}),
                    first_rows=first_rows,
                )
            )
        out.append(
            StageResult(
                item["stage"],
                item["status"],
                checks,
                item.get("reason", ""),
                item.get("rank"),
                item.get("engine"),
                item.get("recipe"),
                item.get("group"),
            )
        )
    return out


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _from_json_number(x: Any) -> Any:
    return float(x) if x in ("nan", "inf", "-inf") else x


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isfinite(v) and abs(v) < 1e6 and v == int(v):
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _clip(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: width - 3] + "..."


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
