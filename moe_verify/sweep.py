"""`moe-verify sweep`: a preset (or a given list of cases) with progress, junit XML, JSON and a
markdown matrix, every case bounded and every crash contained.

By default the cases run in a worker process (moe_verify/sweep_worker.py, in a process group of
its own) that imports torch, Triton and the backends once and then runs one case after another:
an illegal memory access, an abort, an exit or a hang ends that case only (the breadcrumb file
names the stage that was in flight, the worker's log of the case keeps faulthandler's report),
and a fresh worker takes the next case. A worker also goes after any case that errored, since a
CUDA error leaves its context unusable and a backend that raised may have left state behind; a
case that passed or failed a check keeps it. `isolate=False` runs the cases in this process under
the per-case deadline; that survives a backend that raises, exits or hangs in Python, but not a
SIGSEGV or an abort, which end the sweep (the summaries of the cases finished before it are on
disk).

progress.json (the case in flight, the counts), junit.xml and summary.md are rewritten before and
after every case; summary.json, which holds every case's full report (the nightly's grow to tens
of MB), at most every SUMMARY_JSON_EVERY_S seconds and when the sweep ends, also by SIGINT or
SIGTERM (rewriting it after every case made a 354-case sweep quadratic: half its wall time on
the H200); in process (`isolate=False`, where a kernel's SIGSEGV ends the sweep at once) after
every case still. Every file is written atomically, so a sweep that is killed leaves valid
files; one whose worker-mode parent is killed by SIGKILL leaves a summary.json at most that many
seconds old.

A case is PASS, FAIL (a check failed) or ERROR (it crashed, timed out, a backend raised, or the
harness failed); the exit code is 0 when every case passed, 2 when any errored, else 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_verify.args import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from moe_verify.cases import preset
from moe_verify.contain import (
    DEFAULT_CASE_TIMEOUT_S,
    KILL_GRACE_S,
    CaseTimeout,
    Completed,
    kill_group,
    read_until,
    terminate_as_exit,
    terminated,
    user_interrupted,
    watch_interrupts,
)
from moe_verify.options import RunOptions, options_of
from moe_verify.progress import SweepBar
from moe_verify.spec import REPORT_STAGES, Mode, MoEProblem, Status

# The worker protocol's files (moe_verify/sweep_worker.py): the runner's per-stage breadcrumb
# (the parent points MOE_VERIFY_BREADCRUMB here and clears it after each case), what a worker
# writes before its first case (a failing import), and each case's outcome and log.
BREADCRUMB = "breadcrumb.json"
STARTUP_LOG = "startup.log"


def outcome_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.json"


def log_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.log"


# A case in a worker gets this much beyond the case timeout to start a worker (import torch,
# Triton, CUDA context) and to end a case stuck outside Python (contain.HARD_GRACE_S).
STARTUP_GRACE_S = 120.0
# Lines of a crashed case's stderr kept in its junit error: the last ones, or from faulthandler's
# "Fatal Python error" on (the Python stack of every thread at the crash).
STDERR_LINES = 60
SUMMARY_JSON_EVERY_S = 30.0
# What a sweep runs with when built from keyword arguments: both modes, the CLI's case timeout.
SWEEP_DEFAULTS = {"mode": "both", "case_timeout_s": DEFAULT_CASE_TIMEOUT_S}
CRASH_REPORT = "Fatal Python error"


@dataclass
class CaseOutcome:
    problem: MoEProblem
    status: Status  # PASS, FAIL or ERROR
    seconds: float
    summary: str
    report: dict | None = None  # Report.to_dict() when the case produced one
    messages: list[str] = field(default_factory=list)
    worker: int | None = None  # the pid of the worker process that ran it (None: in process)


@dataclass
class SweepSummary:
    outcomes: list[CaseOutcome]
    total: int = 0  # cases the sweep set out to run (outcomes holds those finished so far)
    running: str | None = None  # the case in flight when the files were written

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
        """0 every case passed, 2 any case errored (or the sweep did not finish), else 1."""
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
    fix was the EP-local Kimi size in moe_verify/nightly.py.)"""
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
    ERROR, except the user's Ctrl-C and our SIGTERM, which propagate. The case's memory is
    released before the next case (`release_memory`)."""
    from moe_verify.verification import verify

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
    else:
        return _from_report(problem, report.to_dict(), time.perf_counter() - start)
    finally:
        report = None
        release_memory()


def _error(problem: MoEProblem, start: float, what: str) -> CaseOutcome:
    line = f"ERROR {problem.id}: {what}"
    return CaseOutcome(problem, Status.ERROR, time.perf_counter() - start, line, messages=[line])


class _Worker:
    """One worker child (moe_verify/sweep_worker.py) in a session of its own, its log before the
    first case in `folder`/STARTUP_LOG."""

    def __init__(self, folder: Path) -> None:
        # The sweep's bar is the progress; a case's own bar would only bury its log's tail, where
        # faulthandler leaves the Python stack of a crash.
        env = dict(
            os.environ,
            MOE_VERIFY_BREADCRUMB=str(folder / BREADCRUMB),
            MOE_VERIFY_PROGRESS="0",
            PYTHONFAULTHANDLER="1",
        )
        cmd = [sys.executable, "-m", "moe_verify.sweep_worker", str(folder)]
        with open(folder / STARTUP_LOG, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self.pending = b""  # what it wrote of its next reply
        self.busy = False  # a case was sent and its reply has not come

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, request: dict, limit: float | None) -> Completed | None:
        """Send one case and wait up to `limit` seconds (None: no limit) for it to be done: None
        when it is; else how the worker ended (it died, or ran out of time and was killed)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.busy = True
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died between cases; its exit says how
            return self.end(timed_out=False)
        end = time.monotonic() + limit if limit else None

        def take(chunk: bytes) -> bool:
            self.pending += chunk
            return b"\n" in self.pending

        if b"\n" not in self.pending:
            ended = read_until(self.proc.stdout.fileno(), end, take)
            if ended != "done":
                return self.end(timed_out=ended == "deadline")
        line, _, self.pending = self.pending.partition(b"\n")
        self.busy = False
        if json.loads(line) != {"done": request["name"]}:
            raise RuntimeError(
                f"sweep worker {self.pid}: expected the reply {{'done': {request['name']!r}}}, "
                f"got {line[:200]!r}"
            )
        return None

    def end(self, timed_out: bool) -> Completed:
        """Kill the worker's process group (after it exits by itself, unless it timed out) and
        say how it ended."""
        if not timed_out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(KILL_GRACE_S)
        kill_group(self.proc)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        rc = self.proc.returncode
        name = signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else None
        return Completed(rc, "", "", timed_out, name)

    def close(self) -> None:
        """EOF ends a worker between cases (its group is killed if it does not go in time); one
        busy with a case (the sweep was interrupted) is killed at once."""
        if not self.busy and self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.end(timed_out=self.busy)


class _Isolated:
    """Runs cases in a worker, started when needed and replaced after any case that errored; the
    cases' files go to `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.worker: _Worker | None = None
        self.cases = 0

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def __call__(self, problem: MoEProblem, options: RunOptions) -> CaseOutcome:
        start = time.perf_counter()
        self.cases += 1
        name = str(self.cases)
        request = {"name": name, "problem": problem.to_dict(), "options": options.to_dict()}
        if self.worker is None:
            self.worker = _Worker(self.folder)
        worker = self.worker
        timeout = options.case_timeout_s
        limit = timeout + STARTUP_GRACE_S if timeout else None
        done = worker.run(request, limit)
        seconds = time.perf_counter() - start
        crumb = self.folder / BREADCRUMB
        where = crumb.read_text().strip() if crumb.exists() else "before the first stage"
        crumb.unlink(missing_ok=True)  # the next case's stages write their own
        if done is None:
            result = json.loads(outcome_path(self.folder, name).read_text())
            for path in (outcome_path(self.folder, name), log_path(self.folder, name)):
                path.unlink(missing_ok=True)  # kept only for a case that crashed its worker
            outcome = CaseOutcome(
                problem,
                Status(result["status"]),
                seconds,
                result["summary"],
                result["report"],
                result["messages"],
                worker.pid,
            )
            if outcome.status is Status.ERROR:
                self.close()
            return outcome
        self.worker = None  # `run` killed it
        log = log_path(self.folder, name)
        if not log.exists():  # it died before it took the case
            log = self.folder / STARTUP_LOG
        text = log.read_text(errors="replace")
        return _crashed(problem, seconds, done, limit, where, text, worker.pid)


def _crashed(
    problem: MoEProblem,
    seconds: float,
    done: Completed,
    limit: float | None,
    where: str,
    log: str,
    worker: int,
) -> CaseOutcome:
    """The ERROR of a case whose worker (`worker`, its pid) died or ran out of time: how it
    ended, the stage in flight, and its log from faulthandler's crash report on (else the log's
    last lines)."""
    exit_text = done.exit_text
    if done.timed_out:
        exit_text += f" after {limit:g} s (the case timeout plus {STARTUP_GRACE_S:g} s)"
    lines = log.strip().splitlines()
    crash = next((i for i, line in enumerate(lines) if line.startswith(CRASH_REPORT)), None)
    excerpt = lines[crash : crash + STDERR_LINES] if crash is not None else lines[-STDERR_LINES:]
    summary = f"ERROR {problem.id}: worker {exit_text} while in {where}"
    if excerpt:
        summary += f": {excerpt[0] if crash is not None else excerpt[-1]}"
    detail = [f"{problem.id}: worker {exit_text}", f"in flight: {where}"]
    if excerpt:
        detail += ["stderr (crash report):" if crash is not None else "stderr (last lines):"]
        detail += excerpt
    return CaseOutcome(problem, Status.ERROR, seconds, summary, messages=detail, worker=worker)


@contextlib.contextmanager
def _runner(isolate: bool) -> Iterator[Callable[..., CaseOutcome]]:
    """The function that runs one case: in a worker (which never outlives the sweep), or here."""
    if not isolate:
        yield run_in_process
        return
    with tempfile.TemporaryDirectory(prefix="moe-verify-sweep-") as tmp:
        isolated = _Isolated(Path(tmp))
        try:
            yield isolated
        finally:
            isolated.close()


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


def select_cases(
    cases: str | list[MoEProblem], filter_text: str | None = None, shard: str | None = None
) -> list[MoEProblem]:
    """A preset's cases (by name) or the given ones, those whose id contains `filter_text`, then
    the shard 'i/n' of them (case j goes to shard j % n + 1: every shard gets a mix)."""
    name = cases if isinstance(cases, str) else "cases"
    chosen = preset(cases) if isinstance(cases, str) else list(cases)
    chosen = [c for c in chosen if not filter_text or filter_text in c.id]
    if not chosen:
        raise ValueError(f"sweep: no case of {name!r} matches the filter {filter_text!r}")
    if shard is not None:
        from moe_verify.nightly import shard as take_shard

        chosen = take_shard(chosen, shard)
        if not chosen:
            raise ValueError(f"--shard {shard}: this shard of {name!r} holds no case")
    return chosen


def sweep(
    cases: str | list[MoEProblem],
    options: RunOptions | None = None,
    *,
    out_dir: Path = Path("moe-verify-out"),
    isolate: bool = True,
    filter_text: str | None = None,
    shard: str | None = None,
    **run: Any,
) -> SweepSummary:
    """Run a preset (by name) or the given cases, each as `options` say (moe_verify/options.py
    RunOptions: its case timeout bounds each case, its plot directory gets a heatmap of each
    failing stage); see the module docstring. RunOptions' fields as keyword arguments (the form
    of the call before RunOptions) build the options over SWEEP_DEFAULTS instead. `shard` 'i/n'
    runs the i-th of n interleaved shards of the chosen cases (`select_cases`). The summaries go
    to `out_dir`, which must be writable. SIGINT or SIGTERM kill the case in flight and end the
    sweep (KeyboardInterrupt or SystemExit propagates), the finished cases' summaries already
    written."""
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

    try:
        with watch_interrupts(), terminate_as_exit(), _runner(isolate) as run:
            for problem in chosen:
                summary.running = problem.id
                progress()
                outcome = run(problem, options)
                summary.outcomes.append(outcome)
                summary.running = None
                progress()
                bar.advance(f"{outcome.seconds:7.1f}s {outcome.summary}")
    finally:
        write_summaries(summary, name, out_dir)  # also when SIGINT or SIGTERM ends the sweep
        bar.close()
    print(f"{summary.tally()}; summaries in {out_dir}", file=sys.stderr, flush=True)
    return summary


def progress_dict(summary: SweepSummary) -> dict:
    """The sweep's state without the reports: cheap to rewrite around every case."""
    return {
        "passed": summary.passed,
        "exit_code": summary.exit_code,
        "finished": len(summary.outcomes),
        "total": summary.total,
        "running": summary.running,
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
            f"| {o.problem.id} | {o.status.upper()} | {o.problem.recipe} | {o.problem.topology} | "
            + " | ".join(cells)
            + f" | {o.seconds:.1f}s |"
        )
    if summary.running:
        lines += ["", f"In flight when written: {summary.running}"]
    failures = [o for o in summary.outcomes if o.status is not Status.PASS]
    if failures:
        lines += ["", "## failures and errors", ""]
        lines += [f"- {o.summary}" for o in failures]
    return "\n".join(lines) + "\n"
