"""Counting host reads leaves torch.compile as it found it: a first compile inside
`HostReads().counting()` (torch's functions patched) must not make a later fullgraph compile of
torch.where fail as "marked as skipped" (moe_verify/production/host_reads.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
# A fresh process: the pytest worker may have imported torch._dynamo already. backend="eager":
# the skip is dynamo's (its trace rules), met before any backend runs, so inductor's C++ compile
# (about 15 s on 2 cores) adds nothing to the check; without the fix this still fails with
# "Attempted to call function marked as skipped ... where".
SCRIPT = """
import torch
from moe_verify.production.host_reads import HostReads

x = torch.arange(8)
with HostReads().counting() as reads:
    torch.compile(lambda t: t + 1, backend="eager")(x)
    torch.arange(3).nonzero()
assert reads.reads == ["nonzero"], reads.reads
where = torch.compile(lambda t: torch.where(t == 0, 5, t - 1), fullgraph=True, backend="eager")
out = where(x)
assert out.tolist() == [5, 0, 1, 2, 3, 4, 5, 6], out
print("ok")
"""


def test_a_compile_inside_counting_leaves_later_fullgraph_compiles_working() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
