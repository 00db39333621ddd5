"""The CLI's messages (issue 38): usage errors before any heavy import, defaults in --help,
backend loading that names the class, output paths checked before the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]

# main() in a fresh interpreter: its exit code, then whether torch was ever imported.
_USAGE_CHILD = """
import sys
from moe_verify.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print("exit", exc.code)
print("torch imported", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", "-T", "abc"], "--tokens/-T"),  # a type check
        (["run", "--recipe", "nope"], "--recipe"),  # a choice
        (["sweep", "--mode", "nope"], "--mode"),  # another command's flag
        (["run", "--case-timeout", "-1"], "--case-timeout"),  # a checked value
    ],
    ids=["tokens", "recipe", "sweep-mode", "case-timeout"],
)
def test_a_usage_error_exits_2_before_torch_is_imported(argv: list[str], flag: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _USAGE_CHILD, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.stdout.split("\n")[:2] == ["exit 2", "torch imported False"], run.stdout + run.stderr
    assert f"argument {flag}" in run.stderr
