"""multi_gpu tier: real ranks with NCCL (one process per GPU) against the golden.

Runs `moe-verify run --launcher torchrun` on the DeepSeek-V3 EP8-local FP8-block case at T=1024
over 2 GPUs. Passed on 2 x H200 (docs/gpu-results.md, 2026-11-30).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multi_gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("topology", ["ep:2", "tp:2"])
def test_nccl_ranks_match_golden(topology: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "moe_verify.cli",
        "run",
        "--launcher",
        "torchrun",
        "--topology",
        topology,
        "-T",
        "1024",
        "-H",
        "7168",
        "-I",
        "2048",
        "-E",
        "32",
        "-k",
        "8",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and "nccl" in report["backend"]
    assert {r["rank"] for r in report["chained"] if r["rank"] is not None} == {0, 1}
