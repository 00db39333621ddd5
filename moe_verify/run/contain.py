"""Every run bounded, every crash contained: a per-case deadline, the user's Ctrl-C told apart
from a backend's KeyboardInterrupt, and subprocesses that never outlive us.

`deadline` bounds one in-process case: in the main thread SIGALRM raises `CaseTimeout` where the
case is (a stage of a backend that loops or sleeps); a case stuck in C code (a hung kernel, a CUDA
synchronize that never returns) cannot take a Python exception, so a watchdog thread ends the
process a grace period later, after one line on stderr naming the case and stage in flight.
`run_contained` runs a command in its own process group and kills the whole group on timeout, and
also when we are interrupted or terminated while waiting, so a hung child never outlives us;
`read_until` reads a child's pipe as it arrives up to a deadline, for the callers that act on its
output while it runs (a sweep's worker, the sanitizer's stream).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Literal

# The CLI's default per-case limit (0 or None: no limit). A nightly case on the GPU takes
# seconds to a few minutes; the CPU's Triton interpreter needs minutes for the largest.
DEFAULT_CASE_TIMEOUT_S = 900.0
# After the deadline, how long a case stuck outside Python may go on before the process ends.
HARD_GRACE_S = 10.0
# After SIGTERM to a child's process group, how long before SIGKILL.
KILL_GRACE_S = 5.0
# Exit status of a process the watchdog ends (the CLI's "error").
HARD_EXIT_CODE = 2


class CaseTimeout(BaseException):
    """The per-case deadline ran out. A BaseException, so a backend's `except Exception` cannot
    swallow it; the runner records it as an error at the stage it interrupted."""

    def __init__(self, seconds: float, where: str) -> None:
        super().__init__(f"the case timeout ran out after {seconds:g} s, in {where}")
        self.seconds = seconds
        self.where = where


# -- the user's interrupt ---------------------------------------------------------------------

_user_interrupted = False
_watchers = 0


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _user_interrupted
    _user_interrupted = True
    raise KeyboardInterrupt


def user_interrupted() -> bool:
    """True once the user pressed Ctrl-C (SIGINT) under `watch_interrupts`; also True when no
    `watch_interrupts` is active, because then a KeyboardInterrupt cannot be told apart and must
    be taken as the user's."""
    return _user_interrupted or _watchers == 0


@contextlib.contextmanager
def watch_interrupts() -> Iterator[None]:
    """SIGINT records that the user interrupted, then raises KeyboardInterrupt as usual, so a
    backend that raises KeyboardInterrupt itself is an error of that backend, not a Ctrl-C.
    Nests; outside the main thread it does nothing (only the main thread gets signals)."""
    global _watchers, _user_interrupted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if _watchers == 0:
        _user_interrupted = False
    _watchers += 1
    try:
        yield
    finally:
        _watchers -= 1
        signal.signal(signal.SIGINT, previous)


_terminated = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminated
    _terminated = True
    raise SystemExit(128 + signum)


def terminated() -> bool:
    """True once SIGTERM arrived under `terminate_as_exit`: a SystemExit that is ours to obey,
    not a backend's exit() to report."""
    return _terminated


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) instead of ending the process at once, so `finally` blocks
    run (a child's process group is killed, summaries stay written). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the per-case deadline --------------------------------------------------------------------

# The CaseTimeout of the innermost active deadline that ran out (None while time is left): the
# runner skips every later stage of the case with its reason.
_expired: list[CaseTimeout | None] = []


def expired() -> CaseTimeout | None:
    """The timeout of the active deadline once it ran out, else None."""
    return _expired[-1] if _expired else None


def _watchdog(seconds: float, where: Callable[[], str], done: threading.Event) -> None:
    if done.wait(seconds + HARD_GRACE_S):
        return
    print(
        f"moe-verify: error: the case timeout of {seconds:g} s ran out in {where()} and it did "
        f"not stop within {HARD_GRACE_S:g} s (stuck outside Python: a hung kernel or sync?); "
        f"exiting with {HARD_EXIT_CODE}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(HARD_EXIT_CODE)


@contextlib.contextmanager
def deadline(seconds: float | None, where: Callable[[], str]) -> Iterator[None]:
    """Bound the block to `seconds` (None or 0: no limit). `where()` names the case and stage in
    flight for the messages. In the main thread CaseTimeout is raised into the block when time is
    up; in any thread the process ends HARD_GRACE_S later if the block still has not left. The
    previous SIGALRM handler and timer are restored on exit; SIGINT is watched meanwhile."""
    if not seconds:
        with watch_interrupts():
            yield
        return
    if seconds < 0:
        raise ValueError(f"case timeout: expected seconds >= 0 (0: no limit), got {seconds!r}")
    done = threading.Event()
    threading.Thread(
        target=_watchdog, args=(seconds, where, done), name="moe-verify-deadline", daemon=True
    ).start()
    main = threading.current_thread() is threading.main_thread()
    _expired.append(None)

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        timeout = CaseTimeout(seconds, where())
        _expired[-1] = timeout
        raise timeout

    start = time.monotonic()
    previous, outer_left = None, 0.0
    if main:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with watch_interrupts():
            yield
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        done.set()
        _expired.pop()
        if outer_left:  # an enclosing deadline keeps what it had left (at least a tick)
            left = outer_left - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))


# -- subprocesses -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Completed:
    """How a contained command ended: its exit status (negative: the signal that killed it, as
    subprocess reports it), its output, whether it ran out of time, and the signal's name."""

    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    signal: str | None

    @property
    def exit_text(self) -> str:
        """'exit 1', 'killed by SIGSEGV', or 'timed out after the limit (killed by SIGTERM)'."""
        what = f"killed by {self.signal}" if self.signal else f"exit {self.rc}"
        return f"timed out ({what})" if self.timed_out else what


# A read of a child's pipe, as much as has arrived up to this many bytes.
READ_CHUNK = 1 << 16


def read_until(
    fd: int, end: float | None, take: Callable[[bytes], bool]
) -> Literal["done", "eof", "deadline"]:
    """Read the pipe `fd` chunk by chunk as its writer sends it, handing each chunk to `take`,
    until `take` returns True ("done": the caller has what it waited for), every writer closed it
    ("eof"), or the time.monotonic() `end` passed ("deadline"; None: no limit). Every chunk that
    arrived before the deadline has been taken; a writer that hangs is the caller's to kill."""
    while True:
        left = None if end is None else end - time.monotonic()
        if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
            return "deadline"
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return "eof"
        if take(chunk):
            return "done"


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the child's whole process group, SIGKILL after KILL_GRACE_S if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _drain(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a killed child wrote. A grandchild in a session of its own (a torchrun worker) may
    still hold the pipes open: wait KILL_GRACE_S for them, then keep what came."""
    try:
        return proc.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return "", "(its output was lost: a process it started held the pipes open)"


def run_contained(cmd: list[str], timeout_s: float | None, env: dict | None = None) -> Completed:
    """Run `cmd` in its own process group (a new session) with its output captured. After
    `timeout_s` (None or 0: no limit) the whole group is killed; if we are interrupted (SIGINT) or
    terminated (SIGTERM) while waiting, the group is killed first and the interrupt propagates."""
    with terminate_as_exit():
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        timed_out = False
        try:
            try:
                out, err = proc.communicate(timeout=timeout_s or None)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(proc)
                out, err = _drain(proc)
        except BaseException:
            kill_group(proc)
            raise
    rc = proc.returncode
    name = signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else None
    return Completed(rc, out or "", err or "", timed_out, name)
