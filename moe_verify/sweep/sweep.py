"""`moe-verify sweep`: a preset (or a given list of cases) with progress, junit XML, JSON and a
markdown matrix, every case bounded and every crash contained.

By default the cases run in contained worker processes, `jobs` of them at once
(moe_verify/sweep/pool.py): an illegal memory access, an abort, an exit or a hang ends that case
only (the breadcrumb file names the stage that was in flight, the worker's log of the case keeps
faulthandler's report), a fresh worker takes that slot's next case, and the other workers go on.
`isolate=False` runs the cases one at a time in this process under the per-case deadline; that
survives a backend that raises, exits or hangs in Python, but not a SIGSEGV or an abort, which end
the sweep (the summaries of the cases finished before it are on disk).

Whatever the order the cases finish in, every file lists them in case order. progress.json (the
cases in flight, the counts), junit.xml and summary.md are rewritten whenever a case starts or
ends; summary.json, which holds every case's full report (the nightly's grow to tens of MB), at
most every SUMMARY_JSON_EVERY_S seconds and when the sweep ends, also by SIGINT or SIGTERM
(rewriting it after every case made a 354-case sweep quadratic: half its wall time on the H200);
in process (`isolate=False`, where a kernel's SIGSEGV ends the sweep at once) after every case
still. Every file is written atomically, so a sweep that is killed leaves valid files; one whose
parent is killed by SIGKILL leaves a summary.json at most that many seconds old.

The JIT caches (DeepGEMM's, Triton's, inductor's) that are not set are pointed at one stable
per-user directory (moe_verify/common/jit_cache.py) in this process's environment, so every worker,
the
in-process cases and the next sweep share them.

A case is PASS, FAIL (a check failed) or ERROR (it crashed, timed out, a backend raised, or the
harness failed); the exit code is 0 when every case passed, 2 when any errored, else 1; 130 when
Ctrl-C stopped the sweep, 143 when SIGTERM did (progress.json's `exit_code` says the same).

Each finished case's line and, at the end, the verdict line (the tally, where the summaries are)
go to stdout, what a CI job keeps; the progress bar goes to stderr. A sweep stopped by Ctrl-C or
SIGTERM prints, in the verdict's place, which signal, how many cases ran, the cases cut off and the
path of the partial summary (`stopped_line`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_verify.args import EXIT_ERROR, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_PASS
from moe_verify.common import timing
from moe_verify.common.jit_cache import shared_jit_caches
from moe_verify.common.progress import SweepBar
from moe_verify.run.contain import (
    DEFAULT_CASE_TIMEOUT_S,
    CaseTimeout,
    terminate_as_exit,
    terminated,
    user_interrupted,
    watch_interrupts,
)
from moe_verify.run.options import RunOptions, options_of
from moe_verify.spec import REPORT_STAGES, Mode, MoEProblem, Status
from moe_verify.sweep.cases import select_cases
from moe_verify.sweep.pool import CaseOutcome, check_jobs, run_pool

SUMMARY_JSON_EVERY_S = 30.0
# What a sweep runs with when built from keyword arguments: both modes, the CLI's case timeout.
SWEEP_DEFAULTS = {"mode": "both", "case_timeout_s": DEFAULT_CASE_TIMEOUT_S}


@dataclass
class SweepSummary:
    outcomes: list[CaseOutcome]  # in case order, whatever the order the cases finished in
    total: int = 0  # cases the sweep set out to run (outcomes holds those finished so far)
    # The cases in flight when the files were written: index in the sweep -> case id.
    in_flight: dict[int, str] = field(default_factory=dict)
    # The index in the sweep of each outcome (parallel to outcomes; empty when built directly).
    indices: list[int] = field(default_factory=list)
    # The exit code of the signal that stopped the sweep (130 Ctrl-C, 143 SIGTERM), else None.
    stopped_by: int | None = None

    @property
    def running(self) -> str | None:
        """The first case in flight (in case order), or None."""
        return self.in_flight[min(self.in_flight)] if self.in_flight else None

    def add(self, index: int, outcome: CaseOutcome) -> None:
        """Record case `index`'s outcome in its place in case order; it is no longer in flight."""
        at = bisect.bisect(self.indices, index)
        self.indices.insert(at, index)
        self.outcomes.insert(at, outcome)
        self.in_flight.pop(index, None)

    def count(self, status: Status) -> int:
        return sum(o.status is status for o in self.outcomes)

    @property
    def complete(self) -> bool:
        return len(self.outcomes) >= self.total

    @property
    def passed(self) -> bool:
        """Every case ran, and passed."""
        return self.complete and all(o.status is Status.PASS for o in self.outcomes)

    @property
    def exit_code(self) -> int:
        """0 every case passed, 2 any case errored (or the sweep did not finish), else 1; 130 or
        143 when Ctrl-C or SIGTERM stopped it (as the process exits)."""
        if self.stopped_by is not None:
            return self.stopped_by
        if self.count(Status.ERROR) or not self.complete:
            return EXIT_ERROR
        return EXIT_FAIL if self.count(Status.FAIL) else EXIT_PASS

    def tally(self) -> str:
        return (
            f"{self.count(Status.PASS)} passed, {self.count(Status.FAIL)} failed, "
            f"{self.count(Status.ERROR)} errors of {self.total} cases"
        )


def case_status(report: dict) -> Status:
    """A case's status from its report: ERROR when any stage errored in any mode, FAIL when any
    check failed, else PASS."""
    statuses = {r["status"] for m in Mode for r in report.get(m) or []}
    if Status.ERROR in statuses:
        return Status.ERROR
    return Status.FAIL if Status.FAIL in statuses else Status.PASS


def _from_report(problem: MoEProblem, report: dict, seconds: float) -> CaseOutcome:
    from tolerance.report import Report

    rebuilt = Report.from_dict(report)
    return CaseOutcome(
        problem,
        case_status(report),
        seconds,
        rebuilt.summary_line(),
        report,
        rebuilt.failure_messages(),
    )


def release_memory() -> None:
    """Free what a finished case may leave: anything a reference cycle still holds (a full
    collection), and the blocks PyTorch's caching allocator keeps reserved after the case freed
    them, so the next case, or a replacement worker, starts with the GPU's memory free. (On the
    H200 the third all-384-expert Kimi-like case of the nightly ran out of memory in the worker
    that had run two; no cross-case leak was found on the CPU, so this is a precaution, and the
    fix was the EP-local Kimi size in moe_verify/sweep/nightly.py.)"""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a context a kernel broke raises here: the case's own
        pass  # outcome (its ERROR) stands, and the worker is replaced after an error anyway


def run_in_process(problem: MoEProblem, options: RunOptions) -> CaseOutcome:
    """One case in this process under its deadline; whatever the backend raises is the case's
    ERROR, except the user's Ctrl-C and our SIGTERM, which propagate. The outcome carries the
    GPU memory the case took at most (`gpu_peaks`) and where its time went
    (moe_verify/common/timing.py); the case's memory is released before the next case
    (`release_memory`)."""
    reset_gpu_peak()
    timing.reset()
    try:
        outcome = _run_case(problem, options)
    finally:
        release_memory()
    outcome.peak_gpu_bytes, outcome.peak_allocated_bytes = gpu_peaks()
    outcome.phase_seconds = timing.phase_seconds()
    return outcome


def _run_case(problem: MoEProblem, options: RunOptions) -> CaseOutcome:
    from moe_verify.run.verify import verify

    start = time.perf_counter()
    try:
        report = verify(problem, options=options)
    except KeyboardInterrupt:
        if user_interrupted():
            raise
        return _error(problem, start, "raised KeyboardInterrupt outside a stage")
    except SystemExit as exc:
        if terminated():
            raise
        return _error(problem, start, f"called exit({exc.code!r}) outside a stage")
    except CaseTimeout as exc:
        return _error(problem, start, str(exc))
    except BaseException as exc:  # noqa: BLE001 - one broken case never takes the sweep down
        return _error(problem, start, f"{type(exc).__name__}: {exc}")
    return _from_report(problem, report.to_dict(), time.perf_counter() - start)


def _cuda_in_use() -> Any:
    """torch, when this process has a CUDA context; else None (nothing to measure, and asking
    would create one)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None


def reset_gpu_peak() -> None:
    """Start counting the allocator's peak afresh, for the case about to run."""
    torch = _cuda_in_use()
    if torch is not None:
        with contextlib.suppress(Exception):  # a context a kernel broke: nothing to measure
            torch.cuda.reset_peak_memory_stats()


def gpu_peaks() -> tuple[int | None, int | None]:
    """The most GPU memory PyTorch's caching allocator held since `reset_gpu_peak` (its reserved
    bytes: what the device could not give to anyone else), and the most its live tensors took
    (allocated bytes: what a pre-flight estimate estimates; the difference is the allocator's
    caching and rounding). (None, None) without a CUDA context or when the context is broken.
    Memory outside the allocator (the context, cuBLAS's workspace, a library's own cudaMalloc) is
    in neither."""
    torch = _cuda_in_use()
    if torch is None:
        return None, None
    try:
        return int(torch.cuda.max_memory_reserved()), int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001 - a context a kernel broke raises here
        return None, None


def _error(problem: MoEProblem, start: float, what: str) -> CaseOutcome:
    line = f"ERROR {problem.id}: {what}"
    return CaseOutcome(problem, Status.ERROR, time.perf_counter() - start, line, messages=[line])


def _writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".moe-verify-probe-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"out_dir: expected a writable directory for the summaries, got {str(out_dir)!r} "
            f"({exc.strerror or exc})"
        ) from None


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file in the same directory and os.replace, so a
    reader (or a sweep killed mid-write) never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_summaries(summary: SweepSummary, name: str, out_dir: Path, full: bool = True) -> None:
    """progress.json, junit.xml and summary.md of the cases finished so far, and summary.json
    when `full`."""
    write_atomic(out_dir / "progress.json", json.dumps(progress_dict(summary), indent=2) + "\n")
    write_atomic(out_dir / "junit.xml", junit_xml(summary, name))
    if full:
        write_atomic(out_dir / "summary.json", json.dumps(summary_dict(summary), indent=2) + "\n")
    write_atomic(out_dir / "summary.md", markdown_matrix(summary, name))


def sweep(
    cases: str | list[MoEProblem],
    options: RunOptions | None = None,
    *,
    out_dir: Path = Path("moe-verify-out"),
    isolate: bool = True,
    filter_text: str | None = None,
    shard: str | None = None,
    jobs: int = 1,
    **run: Any,
) -> SweepSummary:
    """Run a preset (by name) or the given cases, each as `options` say (moe_verify/run/options.py
    RunOptions: its case timeout bounds each case, its plot directory gets a heatmap of each
    failing stage); see the module docstring. RunOptions' fields as keyword arguments (the form
    of the call before RunOptions) build the options over SWEEP_DEFAULTS instead. `shard` 'i/n'
    runs the i-th of n interleaved shards of the chosen cases (`select_cases`). `jobs` contained
    workers run the cases concurrently (moe_verify/sweep/pool.py; `isolate=False` runs one at a
    time: jobs must then be 1). The summaries go to `out_dir`, which must be writable. SIGINT or
    SIGTERM kill the cases in flight and end the sweep (KeyboardInterrupt or SystemExit
    propagates), the finished cases' summaries already written."""
    check_jobs(jobs)
    if jobs > 1 and not isolate:
        raise ValueError(
            f"jobs: {jobs} workers need isolate=True (in process the cases run one at a time)"
        )
    options = options_of("sweep", options, run, SWEEP_DEFAULTS)
    options.check_launcher("isolated" if isolate else "none")
    if isolate:  # absolute: the worker writes where asked whatever its directory
        options = dataclasses.replace(
            options,
            dump_dir=None if options.dump_dir is None else options.dump_dir.resolve(),
            plot_dir=None if options.plot_dir is None else options.plot_dir.resolve(),
        )
    name = cases if isinstance(cases, str) else "cases"
    chosen = select_cases(cases, filter_text, shard)
    if shard:
        name = f"{name} shard {shard}"
    out_dir = Path(out_dir)
    _writable(out_dir)
    shared_jit_caches()
    summary = SweepSummary([], total=len(chosen))
    bar = SweepBar(len(chosen), name)
    last_full = time.monotonic()
    write_summaries(summary, name, out_dir)

    def progress() -> None:
        nonlocal last_full
        # In process, a kernel's SIGSEGV ends the sweep with no `finally`: write it all, always.
        full = not isolate or time.monotonic() - last_full >= SUMMARY_JSON_EVERY_S
        write_summaries(summary, name, out_dir, full)
        if full:
            last_full = time.monotonic()

    def started(index: int) -> None:
        summary.in_flight[index] = chosen[index].id
        progress()

    def finished(index: int, outcome: CaseOutcome) -> None:
        summary.add(index, outcome)
        progress()
        bar.advance(f"{outcome.seconds:7.1f}s {outcome.summary}")

    try:
        with watch_interrupts(), terminate_as_exit():
            if isolate:
                run_pool(chosen, options, jobs, started, finished)
            else:
                for index, problem in enumerate(chosen):
                    started(index)
                    finished(index, run_in_process(problem, options))
    except KeyboardInterrupt:
        summary.stopped_by = EXIT_INTERRUPTED
        raise
    except SystemExit as exc:
        if terminated():
            summary.stopped_by = exc.code if isinstance(exc.code, int) else None
        raise
    finally:
        write_summaries(summary, name, out_dir)  # also when SIGINT or SIGTERM ends the sweep
        bar.close()
        if summary.stopped_by is not None:  # in the verdict's place, on stdout
            print(stopped_line(summary, name, out_dir), flush=True)
    print(f"{summary.tally()}; summaries in {out_dir}", flush=True)  # the verdict: stdout
    return summary


def stopped_line(summary: SweepSummary, name: str, out_dir: Path) -> str:
    """What a sweep ended by Ctrl-C or SIGTERM says: which signal, how many cases ran, the cases
    cut off in flight, and where the partial summary is."""
    how = (
        "interrupted (Ctrl-C)" if summary.stopped_by == EXIT_INTERRUPTED else "terminated (SIGTERM)"
    )
    cut = [summary.in_flight[i] for i in sorted(summary.in_flight)]
    cut_off = f"; cut off in flight: {', '.join(cut)}" if cut else ""
    return (
        f"sweep {name} {how}, exit {summary.stopped_by}: {len(summary.outcomes)} of "
        f"{summary.total} cases ran ({summary.tally()}){cut_off}; partial summary in "
        f"{out_dir / 'summary.json'} (summary.md, junit.xml beside it)"
    )


def progress_dict(summary: SweepSummary) -> dict:
    """The sweep's state without the reports: cheap to rewrite around every case."""
    return {
        "passed": summary.passed,
        "exit_code": summary.exit_code,
        "finished": len(summary.outcomes),
        "total": summary.total,
        "running": summary.running,
        "in_flight": [summary.in_flight[i] for i in sorted(summary.in_flight)],
        "counts": {s.value: summary.count(s) for s in (Status.PASS, Status.FAIL, Status.ERROR)},
    }


def summary_dict(summary: SweepSummary) -> dict:
    return {
        **progress_dict(summary),
        "cases": [
            {
                "id": o.problem.id,
                "status": o.status,
                "seconds": round(o.seconds, 3),
                "summary": o.summary,
                "messages": o.messages,
                "report": o.report,
                "worker": o.worker,
                "peak_gpu_bytes": o.peak_gpu_bytes,
                "peak_allocated_bytes": o.peak_allocated_bytes,
                "estimate_bytes": o.estimate_bytes,
                "retried": o.retried,
                "phase_seconds": o.phase_seconds,
            }
            for o in summary.outcomes
        ],
    }


def junit_xml(summary: SweepSummary, name: str) -> str:
    suite = ET.Element(
        "testsuite",
        name=f"moe-verify-{name}",
        tests=str(len(summary.outcomes)),
        failures=str(summary.count(Status.FAIL)),
        errors=str(summary.count(Status.ERROR)),
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
    return ET.tostring(suite, encoding="unicode") + "\n"


def _stage_status(report: dict | None, mode: str, stage: str) -> str:
    if report is None or report.get(mode) is None:
        return "-"
    statuses = {r["status"] for r in report[mode] if r["stage"] == stage}
    for s in (Status.ERROR, Status.FAIL, Status.SKIP, Status.PASS):
        if s in statuses:
            return s.value
    return "-"


def markdown_matrix(summary: SweepSummary, name: str) -> str:
    """One row per case (recipe x topology x shape), one column per stage of any layout
    (REPORT_STAGES: dispatch for ep:N+ll, shared, reduce), isolated / chained."""
    stages = REPORT_STAGES
    done = "" if summary.complete else f" (unfinished: {len(summary.outcomes)} ran)"
    lines = [
        f"# moe-verify sweep `{name}`",
        "",
        f"{summary.tally()}{done}. Cells: isolated / chained.",
        "",
        "| case | status | recipe | topology | " + " | ".join(stages) + " | time |",
        "|" + " --- |" * (len(stages) + 5),
    ]
    for o in summary.outcomes:
        cells = [" / ".join(_stage_status(o.report, m, s) for m in Mode) for s in stages]
        lines.append(
            f"| {o.problem.id} | {o.status.upper()}{' (run again alone)' if o.retried else ''} "
            f"| {o.problem.recipe} | {o.problem.topology} | "
            + " | ".join(cells)
            + f" | {o.seconds:.1f}s |"
        )
    if summary.in_flight:
        running = ", ".join(summary.in_flight[i] for i in sorted(summary.in_flight))
        lines += ["", f"In flight when written: {running}"]
    failures = [o for o in summary.outcomes if o.status is not Status.PASS]
    if failures:
        lines += ["", "## failures and errors", ""]
        lines += [f"- {o.summary}" for o in failures]
    return "\n".join(lines) + "\n"
