"""Contained workers for `moe-verify sweep`: cases run in worker processes, N at once.

A worker (moe_verify/sweep/worker.py, in a process group of its own) imports torch, Triton and the
backends once and then runs the cases it is sent, one after another. An illegal memory access, an
abort, an exit (even `os._exit(0)`) or a hang ends that case only: the breadcrumb file names the
stage that was in flight, the case's log keeps faulthandler's report, and a fresh worker takes the
slot's next case. A worker also goes after any case that errored, since a CUDA error leaves its
context unusable and a backend that raised may have left state behind; a case that passed or
failed a check keeps it.

`run_pool` keeps `jobs` such slots busy from one queue, largest estimate first, and polls their
reply pipes together, so a slot whose case ends (a reply, the worker's death, or its deadline) takes
the next case at once while the others go on. The slots share the machine's GPUs: with one GPU every
worker runs on it; with several, slot i is pinned to the i-th of them, round robin, through
CUDA_VISIBLE_DEVICES. Before a case starts on a device, the memory pre-flight's estimate of it
(moe_verify/run/preflight.py) plus those of the cases in flight there must fit in MEMORY_SHARE of
the
device's memory; otherwise the case waits for one to finish (a case alone on its device always
starts, and its own pre-flight then decides). Every worker shares the JIT caches
(moe_verify/common/jit_cache.py), so a shape one worker compiled is a cache hit for the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moe_verify.common.jit_cache import shared_jit_caches
from moe_verify.run.contain import KILL_GRACE_S, READ_CHUNK, Completed, kill_group
from moe_verify.run.options import RunOptions
from moe_verify.spec import MoEProblem, Status

# The worker protocol's files: the runner's per-stage breadcrumb (each worker's
# MOE_VERIFY_BREADCRUMB points here; the slot clears it after each case), what a worker writes
# before its first case (a failing import), and each case's outcome and log.
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
CRASH_REPORT = "Fatal Python error"

# Default workers with GPUs: one per GIB_PER_WORKER of each GPU's memory, at most GPU_JOBS on one
# GPU, and no more than one per two cores (each worker runs the golden's host side and feeds its
# kernels). On one H200 (140 GiB, 16 cores) that is 8, measured at b077d38 (docs/gpu-results.md,
# 2026-12-03): the nightly 326 s cold and 255 s warm, every case passing, none run again for
# lack of memory; four workers took 524 s cold and 313-315 s warm (2026-12-02). While one worker
# compiles a shape or runs the golden on the host, the others keep the GPU busy (its utilization
# averaged 89% warm); the memory gate holds back a case whose estimate does not fit beside those
# running, and a case that runs out of memory beside others runs again alone.
GPU_JOBS = 8
GIB_PER_WORKER = 16
# Default workers without a GPU: one per core up to four. The Triton interpreter and the golden
# are CPU-bound there, so more workers than cores only share the same cores.
CPU_JOBS = 4
# The share of a device's memory the pre-flight estimates of the cases in flight on it may take
# together, less WORKER_BYTES for each worker on it; the rest is the allocators' slack.
MEMORY_SHARE = 0.85
# What a worker holds on its GPU outside its cases' tensors: the CUDA context, the loaded
# kernels (Triton's, DeepGEMM's, cuBLAS's) and cuBLAS's workspace.
WORKER_BYTES = 1 << 30
# Each worker's BLAS and OpenMP threads, when several workers share the cores: the cores divided
# among the workers (oversubscribed OpenBLAS threads made the CPU tier ~1.6x slower on 2 cores).
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class CaseOutcome:
    problem: MoEProblem
    status: Status  # PASS, FAIL or ERROR
    seconds: float
    summary: str
    report: dict | None = None  # Report.to_dict() when the case produced one
    messages: list[str] = field(default_factory=list)
    worker: int | None = None  # the pid of the worker process that ran it (None: in process)
    # The most GPU memory PyTorch's allocator held during the case and the most its tensors took
    # (sweep.gpu_peaks; None: no GPU, or not known, e.g. the worker died), and the pre-flight
    # estimate the memory gate used for it.
    peak_gpu_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    estimate_bytes: int | None = None
    # Where the case's time went: seconds per phase of verify (moe_verify/common/timing.py); None
    # when
    # the case ended with its worker.
    phase_seconds: dict[str, float] | None = None
    # When the case ran out of memory beside other cases and was run again alone on its device
    # (the outcome is then the second run's): the first run's line that said so.
    retried: str | None = None


# The words an ERROR carries when the case ran out of memory: torch's CUDA out-of-memory error
# and the pre-flight's refusal, as the runner and the sweep name them (type name first), and
# the CUDA runtime's own message for a failed allocation outside PyTorch's allocator.
OUT_OF_MEMORY_WORDS = ("OutOfMemoryError", "DoesNotFit", "out of memory")


def out_of_memory(outcome: CaseOutcome) -> str | None:
    """The line that says the case errored for want of memory (not a crash, a timeout or a
    wrong result), or None; a full message before the summary line, which may be cut short."""
    if outcome.status is not Status.ERROR:
        return None
    lines = [*outcome.messages, outcome.summary]
    return next((line for line in lines if any(w in line for w in OUT_OF_MEMORY_WORDS)), None)


def check_jobs(jobs: object) -> int:
    """`jobs` as a count of workers: a ValueError naming the argument unless an int >= 1."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected an int >= 1 (worker processes), got {jobs!r}")
    return jobs


def jobs_arg(text: str) -> int:
    """`--jobs`' value, for argparse: an int >= 1, else an error naming the text."""
    try:
        return check_jobs(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int >= 1 (worker processes), got {text!r}"
        ) from None


def visible_gpus() -> list[str]:
    """The GPUs the workers share, as CUDA_VISIBLE_DEVICES entries: those it names already (as
    many as CUDA counts), else one index per device; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [d.strip() for d in named.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def gpu_memory(count: int) -> list[int]:
    """Total bytes of each of the first `count` visible GPUs."""
    import torch

    return [torch.cuda.get_device_properties(i).total_memory for i in range(count)]


def default_jobs() -> int:
    """Workers when none are asked for: with GPUs, one per GIB_PER_WORKER of each GPU's memory up
    to GPU_JOBS on each (at least one per GPU), no more than one per two cores; without, one per
    core up to CPU_JOBS. See those constants for why."""
    cpus = os.cpu_count() or 1
    gpus = visible_gpus()
    if gpus:
        per_gpu = [
            min(GPU_JOBS, max(1, m // (GIB_PER_WORKER << 30))) for m in gpu_memory(len(gpus))
        ]
        return max(1, min(sum(per_gpu), max(len(gpus), cpus // 2)))
    return max(1, min(CPU_JOBS, cpus))


@dataclass
class RunningCase:
    """The case a slot runs: its index in the sweep, when it started, its deadline (monotonic;
    None: no limit) and the limit that deadline came from, its memory estimate, whether it runs
    alone on its device (a re-run after running out of memory) and whether another case ran
    on its device while it did."""

    index: int
    problem: MoEProblem
    started: float
    end: float | None
    limit: float | None
    estimate: int
    alone: bool = False
    crowded: bool = False


@dataclass
class Device:
    """Where slots run: one GPU (its CUDA_VISIBLE_DEVICES entry, None: the machine's only GPU or
    the CPU), the bytes the cases in flight on it may be estimated to take, and the cases there."""

    gpu: str | None
    budget: int | None  # None: not gated (its memory is unknown)
    running: list[RunningCase] = field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return sum(r.estimate for r in self.running)

    @property
    def cases(self) -> int:
        return len(self.running)

    def fits(self, estimate: int) -> bool:
        """A case may start here: nothing runs here, or it fits beside what does (and that is
        not a case that must run alone)."""
        if self.cases == 0:
            return True
        if any(r.alone for r in self.running):
            return False
        return self.budget is None or self.in_flight + estimate <= self.budget

    def take(self, running: RunningCase) -> None:
        """`running` starts here: it and every case already here now have company."""
        for other in self.running:
            other.crowded = True
        running.crowded = bool(self.running)
        self.running.append(running)

    def release(self, running: RunningCase) -> None:
        self.running.remove(running)

    def reserve(self, workers: int) -> None:
        """Take WORKER_BYTES per worker on this device out of the budget: what each holds
        outside its cases' tensors."""
        if self.budget is not None:
            self.budget -= workers * WORKER_BYTES


def devices() -> list[Device]:
    """One Device per visible GPU (pinned when there are several), else the CPU; each with
    MEMORY_SHARE of its memory as its budget."""
    from moe_verify.run.preflight import free_bytes

    gpus = visible_gpus()
    if not gpus:
        free = free_bytes("cpu")
        return [Device(None, None if free is None else int(free * MEMORY_SHARE))]
    memory = gpu_memory(len(gpus))
    pinned = len(gpus) > 1
    return [
        Device(gpu if pinned else None, int(m * MEMORY_SHARE))
        for gpu, m in zip(gpus, memory, strict=True)
    ]


def worker_environment(
    folder: Path, gpu: str | None, jobs: int, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """A worker's environment: `base` with the shared JIT caches, its GPU (when pinned), its share
    of the cores for BLAS and OpenMP (when several workers run; a value set already stands), and
    the protocol's settings. The sweep's bar is the progress; a case's own bar would only bury
    its log's tail, where faulthandler leaves the Python stack of a crash."""
    env = dict(base)
    shared_jit_caches(env)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if jobs > 1:
        threads = str(max(1, (os.cpu_count() or 1) // jobs))
        for var in THREAD_VARS:
            env.setdefault(var, threads)
    env.update(
        MOE_VERIFY_BREADCRUMB=str(folder / BREADCRUMB),
        MOE_VERIFY_PROGRESS="0",
        PYTHONFAULTHANDLER="1",
    )
    return env


class _Worker:
    """One worker child (moe_verify/sweep/worker.py) in a session of its own, its log before the
    first case in `folder`/STARTUP_LOG."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "moe_verify.sweep.worker", str(folder)]
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
        self.expected = ""  # the name of the case sent

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fileno(self) -> int:
        """The reply pipe, for select."""
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def send(self, request: dict) -> None:
        """Send one case. A worker that died between cases cannot take it: its reply pipe is then
        at its end, and `receive` says so."""
        assert self.proc.stdin is not None
        self.busy = True
        self.expected = request["name"]
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()

    def receive(self) -> Literal["done", "eof"] | None:
        """Read what arrived on the reply pipe (call when select finds it readable): "done" when
        the reply to the case sent is complete, "eof" when the worker closed the pipe (it died),
        None while the reply is partial."""
        chunk = os.read(self.fileno(), READ_CHUNK)
        if not chunk:
            return "eof"
        self.pending += chunk
        if b"\n" not in self.pending:
            return None
        line, _, self.pending = self.pending.partition(b"\n")
        self.busy = False
        if json.loads(line) != {"done": self.expected}:
            raise RuntimeError(
                f"sweep worker {self.pid}: expected the reply {{'done': {self.expected!r}}}, "
                f"got {line[:200]!r}"
            )
        return "done"

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


class _Slot:
    """One place a case runs: a worker (started when needed, replaced after any case that
    errored), its folder for the protocol's files, its device."""

    def __init__(self, folder: Path, device: Device, jobs: int) -> None:
        self.folder = folder
        self.device = device
        self.env = worker_environment(folder, device.gpu, jobs)
        self.worker: _Worker | None = None
        self.running: RunningCase | None = None

    def start(
        self,
        index: int,
        problem: MoEProblem,
        options: RunOptions,
        estimate: int,
        alone: bool = False,
    ) -> None:
        if self.worker is None:
            self.worker = _Worker(self.folder, self.env)
        timeout = options.case_timeout_s
        limit = timeout + STARTUP_GRACE_S if timeout else None
        end = time.monotonic() + limit if limit else None
        self.running = RunningCase(
            index, problem, time.perf_counter(), end, limit, estimate, alone=alone
        )
        self.device.take(self.running)
        name = str(index)
        request = {"name": name, "problem": problem.to_dict(), "options": options.to_dict()}
        self.worker.send(request)

    def finish(self, done: Completed | None) -> tuple[RunningCase, CaseOutcome]:
        """The case that was in flight and its outcome: its worker's report (`done` None: it
        replied), or the ERROR of a worker that died or ran out of time (`done`: how it ended)."""
        running, worker = self.running, self.worker
        assert running is not None and worker is not None
        self.running = None
        self.device.release(running)
        seconds = time.perf_counter() - running.started
        name = str(running.index)
        crumb = self.folder / BREADCRUMB
        where = crumb.read_text().strip() if crumb.exists() else "before the first stage"
        crumb.unlink(missing_ok=True)  # the next case's stages write their own
        if done is None:
            result = json.loads(outcome_path(self.folder, name).read_text())
            for path in (outcome_path(self.folder, name), log_path(self.folder, name)):
                path.unlink(missing_ok=True)  # kept only for a case that crashed its worker
            outcome = CaseOutcome(
                running.problem,
                Status(result["status"]),
                seconds,
                result["summary"],
                result["report"],
                result["messages"],
                worker.pid,
                peak_gpu_bytes=result.get("peak_gpu_bytes"),
                peak_allocated_bytes=result.get("peak_allocated_bytes"),
                phase_seconds=result.get("phase_seconds"),
            )
            if outcome.status is Status.ERROR:
                self.close()
        else:
            self.worker = None  # `end` killed it
            log = log_path(self.folder, name)
            if not log.exists():  # it died before it took the case
                log = self.folder / STARTUP_LOG
            text = log.read_text(errors="replace")
            outcome = crashed(
                running.problem, seconds, done, running.limit, where, text, worker.pid
            )
        outcome.estimate_bytes = running.estimate
        return running, outcome

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def crashed(
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


def _ended(busy: list[_Slot]) -> list[tuple[_Slot, Completed | None]]:
    """Wait until a busy slot's case ends, or the nearest deadline: the slots whose case ended,
    each with how its worker ended (None: it replied)."""
    ends = [s.running.end for s in busy if s.running is not None and s.running.end is not None]
    timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
    pipes = {s.worker.fileno(): s for s in busy if s.worker is not None}
    readable, _, _ = select.select(list(pipes), [], [], timeout)
    ended: dict[int, tuple[_Slot, Completed | None]] = {}
    for fd in readable:
        slot = pipes[fd]
        assert slot.worker is not None
        got = slot.worker.receive()
        if got == "done":
            ended[id(slot)] = (slot, None)
        elif got == "eof":
            ended[id(slot)] = (slot, slot.worker.end(timed_out=False))
    now = time.monotonic()
    for slot in busy:
        running = slot.running
        if id(slot) in ended or running is None or running.end is None or now < running.end:
            continue
        assert slot.worker is not None
        ended[id(slot)] = (slot, slot.worker.end(timed_out=True))
    return list(ended.values())


def dispatch_order(estimates: Sequence[int]) -> list[int]:
    """Case indices, the largest pre-flight estimate first (ties in case order). The estimate
    grows with the case's work, so the long cases start first and the short ones fill in around
    them: in case order the nightly's last minute on an H200 was its largest cases running alone."""
    return sorted(range(len(estimates)), key=lambda i: (-estimates[i], i))


def take_next(queue: list[int], estimates: Sequence[int], device: Device) -> int | None:
    """Remove and return the first queued case that fits `device` now, or None: a large case
    waiting for memory does not hold back the smaller ones behind it."""
    index = next((i for i in queue if device.fits(estimates[i])), None)
    if index is not None:
        queue.remove(index)
    return index


def run_again_alone(running: RunningCase, outcome: CaseOutcome) -> bool:
    """A case that ran out of memory while another case ran on its device is run once more,
    alone there: the memory gate admitted it on estimates, so the shortage may be the company's,
    not the case's. Alone, the outcome stands, whatever it is."""
    return not running.alone and running.crowded and out_of_memory(outcome) is not None


def run_pool(
    cases: Sequence[MoEProblem],
    options: RunOptions,
    jobs: int,
    started: Callable[[int], None],
    finished: Callable[[int, CaseOutcome], None],
) -> None:
    """Run `cases` in `jobs` contained workers (at most one per case), taking the largest first
    (`dispatch_order`) and, when it does not fit its device yet, the next that does; `started(i)`
    when case i is sent to a worker, `finished(i, outcome)` when it ends, in the order cases end.
    A case that ran out of memory beside others (`run_again_alone`) is not finished but run
    again as soon as a device is free of other cases; meanwhile no new case starts, so that one
    drains, and its outcome then notes the first run (`CaseOutcome.retried`). Each slot keeps
    the protocol's files in a temporary directory of its own. Every worker and directory is gone
    on return, also when an interrupt (KeyboardInterrupt, SystemExit) ends the sweep."""
    from moe_verify.run.preflight import estimate

    check_jobs(jobs)
    places = devices()
    estimates = [estimate(p).total for p in cases]
    queue = dispatch_order(estimates)
    again: list[int] = []  # cases that ran out of memory beside others, to run alone
    first_runs: dict[int, str] = {}  # such a case -> its first run's out-of-memory line
    slots: list[_Slot] = []
    with contextlib.ExitStack() as stack:
        for i in range(min(jobs, len(cases))):
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-verify-sweep-"))
            slots.append(_Slot(Path(folder), places[i % len(places)], jobs))
            stack.callback(slots[-1].close)
        for place in places:
            place.reserve(sum(s.device is place for s in slots))
        while queue or again or any(s.running for s in slots):
            for slot in slots:
                if slot.running:
                    continue
                if again:  # nothing new starts until a device is free for it
                    if slot.device.cases == 0:
                        index = again.pop(0)
                        slot.start(index, cases[index], options, estimates[index], alone=True)
                        started(index)
                    continue
                index = take_next(queue, estimates, slot.device)
                if index is not None:
                    slot.start(index, cases[index], options, estimates[index])
                    started(index)
            for slot, done in _ended([s for s in slots if s.running is not None]):
                running, outcome = slot.finish(done)
                if run_again_alone(running, outcome):
                    again.append(running.index)
                    first_runs[running.index] = out_of_memory(outcome) or outcome.summary
                    continue
                first = first_runs.pop(running.index, None)
                if first is not None:
                    outcome.retried = first
                    outcome.messages.append(
                        f"first run, beside other cases on its device: {first}; "
                        "this outcome is the run alone"
                    )
                finished(running.index, outcome)
