"""Progress on stderr: in a log (not a TTY) every redraw is a line of its own naming the rank,
side and stage in flight, and nothing is glued to the report by carriage returns."""

from __future__ import annotations

import pytest

from moe_verify.common import progress

pytestmark = pytest.mark.cpu


def _run_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    with progress.case_bar("case-id", 3):
        for stage in ("route", "quant_input", "align"):
            progress.stage_started(0, "golden", stage)


def test_a_log_gets_one_line_per_redraw(monkeypatch, capsys) -> None:
    _run_case(monkeypatch)
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert lines and all(line.startswith("case-id:") for line in lines)
    assert any("rank 0 golden align" in line for line in lines)
    assert progress.where() == "rank 0 golden align"


def test_progress_can_be_turned_off(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MOE_VERIFY_PROGRESS", "0")
    _run_case(monkeypatch)
    assert capsys.readouterr().err == ""
