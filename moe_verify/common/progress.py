"""Progress on stderr, per case, rank and stage (tqdm): a long CPU case is never silent.

`case_bar` wraps one case: the runner calls `stage_started` as each stage of each side begins,
and the bar shows where the case is, once the case has run `DELAY_S` (a short case prints
nothing). `SweepBar` counts a sweep's cases and keeps one log line per finished case. `steps`
counts the items of any other long command (calibrate's cases and seeds, audit-e8m0's layers,
bench's stages), shown once it has run `DELAY_S`. On a terminal the bars redraw in place; in a
CI log (stderr not a TTY) each redraw is a line of its own, at most every `LOG_INTERVAL_S`, so a
log gets a line now and then rather than carriage returns glued to the report. Nothing goes to
stdout. `MOE_VERIFY_PROGRESS=0` turns them off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TypeVar

from tqdm import tqdm

LOG_INTERVAL_S = 15.0
DELAY_S = 3.0

_case: tqdm | None = None
_where = "before the first stage"
_T = TypeVar("_T")


def _enabled() -> bool:
    return os.environ.get("MOE_VERIFY_PROGRESS", "1") != "0"


def _interval() -> float:
    return 0.2 if sys.stderr.isatty() else LOG_INTERVAL_S


class _LogLines:
    """A stream for tqdm in a log: every redraw becomes one line; the blanking a closing bar
    writes (spaces between carriage returns) is dropped."""

    def write(self, text: str) -> None:
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                sys.stderr.write(part.rstrip() + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def _stream() -> object:
    return sys.stderr if sys.stderr.isatty() else _LogLines()


@contextlib.contextmanager
def case_bar(case_id: str, total_stages: int) -> Iterator[None]:
    """A bar over one case's `total_stages` stage runs (every side, mode and rank)."""
    global _case
    outer = _case
    bar = tqdm(
        total=total_stages,
        desc=case_id,
        unit="stage",
        file=_stream(),
        leave=False,
        delay=DELAY_S,
        mininterval=_interval(),
        disable=not _enabled(),
        dynamic_ncols=True,
    )
    _case = bar
    global _where
    _where = "before the first stage"
    try:
        yield
    finally:
        bar.close()
        _case = outer


def stage_started(rank: int, side: str, stage: str) -> None:
    """`side` (golden, or the tested backend's mode) begins `stage` of `rank`."""
    global _where
    _where = f"rank {rank} {side} {stage}"
    if _case is None:
        return
    _case.set_postfix_str(f"rank {rank} {side} {stage}", refresh=False)
    _case.update(1)


def where() -> str:
    """The stage that began last ('rank 0 isolated gemm1'): what a timeout reports."""
    return _where


def steps(
    items: Iterable[_T],
    desc: str,
    unit: str,
    total: int | None = None,
    label: Callable[[_T], str] | None = None,
) -> Iterator[_T]:
    """`items`, one at a time, with a bar over them named `desc` counting `unit`s; `label(item)`
    says which item is in flight (the bar's postfix). Shown once the loop has run `DELAY_S`."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=_stream(),
        leave=False,
        delay=DELAY_S,
        mininterval=_interval(),
        disable=not _enabled(),
        dynamic_ncols=True,
    )
    try:
        for item in items:
            if label is not None:
                bar.set_postfix_str(label(item), refresh=False)
            yield item
            bar.update(1)
    finally:
        bar.close()


class SweepBar:
    """A bar over a sweep's cases (stderr); each finished case leaves its summary line on stdout,
    where a CI job that keeps only stdout finds the results."""

    def __init__(self, total: int, name: str) -> None:
        self._bar = tqdm(
            total=total,
            desc=f"sweep {name}",
            unit="case",
            file=_stream(),
            mininterval=_interval(),
            disable=not _enabled(),
            dynamic_ncols=True,
        )
        self._enabled = _enabled()

    def advance(self, line: str) -> None:
        if self._enabled:
            self._bar.write(line, file=sys.stdout)  # clears and redraws the bar around it
            sys.stdout.flush()
        else:
            print(line, flush=True)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
