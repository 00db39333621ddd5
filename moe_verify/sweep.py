"""`moe-verify sweep`: a preset case list with progress, junit XML, JSON and a markdown matrix.

With `isolate=True` each case runs in its own subprocess: an illegal memory access or a hang kills
that case only, and the breadcrumb file names the stage that was in flight.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from moe_verify.cases import preset
from moe_verify.spec import REPORT_STAGES, Mode, MoEProblem, Status

CASE_TIMEOUT_S = 1800


@dataclass
class CaseOutcome:
    problem: MoEProblem
    status: Status  # PASS, FAIL or ERROR
    seconds: float
    summary: str
    report: dict | None = None  # Report.to_dict() when the case produced one
    messages: list[str] = field(default_factory=list)


@dataclass
class SweepSummary:
    outcomes: list[CaseOutcome]

    @property
    def passed(self) -> bool:
        return all(o.status is Status.PASS for o in self.outcomes)


def _run_in_process(problem: MoEProblem, backend: str, mode: str, engine: str) -> CaseOutcome:
    from moe_verify.verification import verify

    start = time.perf_counter()
    try:
        report = verify(problem, backend=backend, mode=mode, engine=engine)
    except Exception as exc:  # noqa: BLE001 - one broken case never takes the sweep down
        return CaseOutcome(
            problem,
            Status.ERROR,
            time.perf_counter() - start,
            f"ERROR {problem.id}: {type(exc).__name__}: {exc}",
        )
    return CaseOutcome(
        problem,
        Status.PASS if report.passed else Status.FAIL,
        time.perf_counter() - start,
        report.summary_line(),
        report.to_dict(),
        report.failure_messages(),
    )


def _run_isolated(problem: MoEProblem, backend: str, mode: str, engine: str) -> CaseOutcome:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        case_json, report_json = Path(tmp) / "case.json", Path(tmp) / "report.json"
        crumb = Path(tmp) / "breadcrumb.json"
        case_json.write_text(json.dumps(problem.to_dict()))
        cmd = [
            sys.executable,
            "-m",
            "moe_verify.cli",
            "run",
            "--problem-json",
            str(case_json),
            "--backend",
            backend,
            "--mode",
            mode,
            "--engine",
            engine,
            "--json",
            str(report_json),
        ]
        env = dict(os.environ, MOE_VERIFY_BREADCRUMB=str(crumb))
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S
            )
            rc, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            rc, tail = None, [f"timed out after {CASE_TIMEOUT_S} s (hang?)"]
        seconds = time.perf_counter() - start
        if rc in (0, 1) and report_json.exists():
            report = json.loads(report_json.read_text())
            status = Status.PASS if report["passed"] else Status.FAIL
            return CaseOutcome(
                problem,
                status,
                seconds,
                f"{status.upper()} {problem.id} first failure: {report['first_failure']}",
                report,
            )
        where = crumb.read_text().strip() if crumb.exists() else "before the first stage"
        return CaseOutcome(
            problem,
            Status.ERROR,
            seconds,
            f"ERROR {problem.id}: subprocess exit {rc} while in {where}: {' | '.join(tail)}",
        )


def sweep(
    preset_name: str,
    backend: str = "optimized",
    mode: str = "both",
    engine: str = "auto",
    out_dir: Path = Path("moe-verify-out"),
    isolate: bool = False,
    filter_text: str | None = None,
) -> SweepSummary:
    cases = [c for c in preset(preset_name) if not filter_text or filter_text in c.id]
    if not cases:
        raise ValueError(f"sweep: no case of preset {preset_name!r} matches {filter_text!r}")
    run = _run_isolated if isolate else _run_in_process
    outcomes = []
    for n, problem in enumerate(cases, 1):
        outcome = run(problem, backend, mode, engine)
        outcomes.append(outcome)
        print(
            f"{progress_bar(n, len(cases))} {outcome.seconds:7.1f}s {outcome.summary}",
            file=sys.stderr,
            flush=True,
        )
    summary = SweepSummary(outcomes)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "junit.xml").write_text(junit_xml(summary, preset_name))
    (out_dir / "summary.json").write_text(json.dumps(summary_dict(summary), indent=2))
    (out_dir / "summary.md").write_text(markdown_matrix(summary, preset_name))
    passed = sum(o.status is Status.PASS for o in outcomes)
    print(f"{passed}/{len(outcomes)} cases passed; summaries in {out_dir}", file=sys.stderr)
    return summary


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """'[########------------]  8/20': one line per finished case (CI logs keep every line)."""
    filled = width * done // max(total, 1)
    digits = len(str(total))
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{digits}}/{total}"


def summary_dict(summary: SweepSummary) -> dict:
    return {
        "passed": summary.passed,
        "cases": [
            {
                "id": o.problem.id,
                "status": o.status,
                "seconds": round(o.seconds, 3),
                "summary": o.summary,
                "report": o.report,
            }
            for o in summary.outcomes
        ],
    }


def junit_xml(summary: SweepSummary, name: str) -> str:
    suite = ET.Element(
        "testsuite",
        name=f"moe-verify-{name}",
        tests=str(len(summary.outcomes)),
        failures=str(sum(o.status is Status.FAIL for o in summary.outcomes)),
        errors=str(sum(o.status is Status.ERROR for o in summary.outcomes)),
    )
    for o in summary.outcomes:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"{o.problem.recipe}.{o.problem.topology}",
            name=o.problem.id,
            time=f"{o.seconds:.3f}",
        )
        if o.status.failing:
            tag = "failure" if o.status is Status.FAIL else "error"
            elem = ET.SubElement(case, tag, message=o.summary)
            elem.text = "\n".join(o.messages) or o.summary
    return ET.tostring(suite, encoding="unicode")


def _stage_status(report: dict | None, mode: str, stage: str) -> str:
    if report is None or report.get(mode) is None:
        return "-"
    statuses = {r["status"] for r in report[mode] if r["stage"] == stage}
    for s in (Status.ERROR, Status.FAIL, Status.SKIP, Status.PASS):
        if s in statuses:
            return s.value
    return "-"


def markdown_matrix(summary: SweepSummary, name: str) -> str:
    """One row per case (recipe x topology x shape), one column per stage, isolated/chained."""
    stages = REPORT_STAGES
    lines = [
        f"# moe-verify sweep `{name}`",
        "",
        f"{sum(o.status is Status.PASS for o in summary.outcomes)}/{len(summary.outcomes)} "
        "cases pass. Cells: isolated / chained.",
        "",
        "| case | recipe | topology | " + " | ".join(stages) + " | time |",
        "|" + " --- |" * (len(stages) + 4),
    ]
    for o in summary.outcomes:
        cells = [" / ".join(_stage_status(o.report, m, s) for m in Mode) for s in stages]
        lines.append(
            f"| {o.problem.id} | {o.problem.recipe} | {o.problem.topology} | "
            + " | ".join(cells)
            + f" | {o.seconds:.1f}s |"
        )
    failures = [o for o in summary.outcomes if o.status is not Status.PASS]
    if failures:
        lines += ["", "## failures", ""]
        lines += [f"- {o.summary}" for o in failures]
    return "\n".join(lines) + "\n"
