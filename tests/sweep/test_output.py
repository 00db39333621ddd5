"""Where a sweep writes: its results (a line per case, the verdict) on stdout, so a CI job that
keeps only stdout has them; the progress bar on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_verify.cli import main

pytestmark = pytest.mark.cpu

ONE_CASE = ["--preset", "smoke", "--filter", "fp8_block-tp1-T1-H128", "--in-process"]


def test_the_case_lines_and_the_verdict_go_to_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", *ONE_CASE, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "PASS fp8_block-tp1-T1-H128-I128-E4-k2-softmax" in out, (out, err)
    assert out.splitlines()[-1].endswith(f"of 1 cases; summaries in {tmp_path}"), out
    assert "summaries in" not in err and "PASS fp8_block" not in err, err
