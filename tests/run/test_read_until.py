"""`read_until`, the one deadline reader of a child's pipe (a sweep's worker, the sanitizer's
stream): a child that prints and then hangs is cut at the deadline with what it printed kept; a
child that exits returns at once; a caller that has what it waited for stops reading."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from moe_verify.run.contain import kill_group, read_until

pytestmark = pytest.mark.cpu

# Starting Python on a loaded 2-core machine takes a second or more: the bounds leave room for it
# and stay far below the hanging child's sleep.
DEADLINE_S = 3.0
HANG_S = 120


@pytest.fixture
def child() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The children a test starts (`_spawn`); each one's group is killed after the test."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        kill_group(proc)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _spawn(started: list[subprocess.Popen[bytes]], code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    started.append(proc)
    return proc


def _collect(got: list[bytes]) -> Callable[[bytes], bool]:
    """A `take` that keeps every chunk in `got` and reads on."""

    def take(chunk: bytes) -> bool:
        got.append(chunk)
        return False

    return take


def test_a_child_that_prints_then_hangs_is_cut_at_the_deadline_with_its_output_kept(
    child: list[subprocess.Popen[bytes]],
) -> None:
    proc = _spawn(child, f"import time; print('first', flush=True); time.sleep({HANG_S})")
    assert proc.stdout is not None
    got: list[bytes] = []
    start = time.monotonic()
    ended = read_until(proc.stdout.fileno(), start + DEADLINE_S, _collect(got))
    waited = time.monotonic() - start
    assert ended == "deadline"
    assert b"".join(got) == b"first\n"
    assert DEADLINE_S <= waited < DEADLINE_S + 2, waited
    assert proc.poll() is None  # the reader only reads: the hung child is the caller's to kill


def test_a_child_that_exits_early_returns_at_once(
    child: list[subprocess.Popen[bytes]],
) -> None:
    proc = _spawn(child, "print('all'); print('done')")
    assert proc.stdout is not None
    got: list[bytes] = []
    start = time.monotonic()
    ended = read_until(proc.stdout.fileno(), start + HANG_S, _collect(got))
    assert ended == "eof" and b"".join(got) == b"all\ndone\n"
    assert time.monotonic() - start < HANG_S / 4  # not the deadline: the exit ended the read


def test_no_deadline_reads_to_the_end(child: list[subprocess.Popen[bytes]]) -> None:
    proc = _spawn(child, "import time; print('a', flush=True); time.sleep(0.5); print('b')")
    assert proc.stdout is not None
    got: list[bytes] = []
    assert read_until(proc.stdout.fileno(), None, _collect(got)) == "eof"
    assert b"".join(got) == b"a\nb\n"


def test_the_caller_stops_reading_once_it_has_what_it_waited_for(
    child: list[subprocess.Popen[bytes]],
) -> None:
    proc = _spawn(child, f"import time; print('reply', flush=True); time.sleep({HANG_S})")
    assert proc.stdout is not None
    got: list[bytes] = []

    def one_line(chunk: bytes) -> bool:
        got.append(chunk)
        return b"\n" in b"".join(got)

    start = time.monotonic()
    assert read_until(proc.stdout.fileno(), start + HANG_S, one_line) == "done"
    assert b"".join(got) == b"reply\n" and time.monotonic() - start < HANG_S / 4


def test_a_deadline_already_past_reads_nothing(child: list[subprocess.Popen[bytes]]) -> None:
    proc = _spawn(child, "print('late')")
    assert proc.stdout is not None
    proc.wait()
    got: list[bytes] = []
    assert read_until(proc.stdout.fileno(), time.monotonic() - 1, _collect(got)) == "deadline"
    assert got == []
