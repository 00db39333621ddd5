"""multi_gpu tier: real ranks with NCCL (one process per GPU) against the golden.

`moe-verify run --launcher torchrun` on each rank's real shard, with the real all-reduce or
combine, every rank and the reduced output compared with the golden; each case is also run
emulated on one GPU (`--launcher none`) and both wall times are printed, for
docs/gpu-results.md. A case needs as many GPUs as ranks and is skipped, saying so, with fewer.

- 2 GPUs: ep:2 and tp:2 on the DeepSeek-V3 EP8-local case at T = 1024 (passed on 2 x H200,
  docs/gpu-results.md, 2026-11-30).
- 4 GPUs: ep:4, tp:4, ep:4+ht, ep:4+ll on the same case.
- 8 GPUs: ep:8, ep:8+ht, ep:8+ll at DeepSeek-V3 scale (E = 256, k = 8, H = 7168, I = 2048,
  T = 4096 global, grouped routing), and tp:8 at I = 2048 (E = 32).
- A bug on the last rank only (tests/tester/wrong_backends.py LastExpertDroppedOnLastRank), at
  ep:4 and ep:8: named with its rank, at gather.

Each case runs twice (torchrun, then emulated); at 8 ranks a case can take minutes, so on a
lent machine with a per-command limit run them one at a time, by node id:
`pytest -m multi_gpu "tests/gpu/test_multi_gpu.py::test_nccl_ranks_match_golden[ep:8]"`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multi_gpu
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1800

DSV3_LOCAL = ["-T", "1024", "-H", "7168", "-I", "2048", "-E", "32", "-k", "8"]
DSV3 = ["-T", "4096", "-H", "7168", "-I", "2048", "-E", "256", "-k", "8", "--routing", "grouped"]
DSV3 += ["--num-expert-group", "8", "--topk-group", "4"]
CASES = [
    ("ep:2", DSV3_LOCAL),
    ("tp:2", DSV3_LOCAL),
    ("ep:4", DSV3_LOCAL),
    ("tp:4", DSV3_LOCAL),
    ("ep:4+ht", DSV3_LOCAL),
    ("ep:4+ll", DSV3_LOCAL),
    ("ep:8", DSV3),
    ("ep:8+ht", DSV3),
    ("ep:8+ll", DSV3),
    ("tp:8", DSV3_LOCAL),
]
LAST_RANK_BUG = "tests.tester.wrong_backends:LastExpertDroppedOnLastRank"


def _ranks(topology: str) -> int:
    return int(topology.split(":")[1].split("+")[0])


def _needs_gpus(topology: str) -> None:
    have = torch.cuda.device_count()
    if have < _ranks(topology):
        pytest.skip(f"{topology} needs {_ranks(topology)} GPUs, this machine has {have}")


def _run(
    topology: str, flags: list[str], out: Path, *extra: str, launcher: str = "torchrun"
) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-m", "moe_verify.cli", "run", "--launcher", launcher]
    cmd += ["--topology", topology, *flags, *extra, "--json", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("topology, flags", CASES, ids=[t for t, _ in CASES])
def test_nccl_ranks_match_golden(topology: str, flags: list[str], tmp_path: Path, record_property):
    _needs_gpus(topology)
    proc, real_s = _run(topology, flags, tmp_path / "real.json")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "real.json").read_text())
    assert report["passed"] and "nccl" in report["backend"], report.get("first_failure")
    ranks = {r["rank"] for r in report["chained"] if r["rank"] is not None}
    assert ranks == set(range(_ranks(topology))), ranks
    assert any(r["stage"] == "reduce" for r in report["chained"])
    emulated, emulated_s = _run(topology, flags, tmp_path / "emulated.json", launcher="none")
    assert emulated.returncode == 0, emulated.stdout[-4000:] + emulated.stderr[-4000:]
    record_property("wall_s", {"torchrun": real_s, "emulated": emulated_s})
    print(f"\n{topology}: torchrun {real_s:.1f} s, emulated on one GPU {emulated_s:.1f} s")


@pytest.mark.parametrize("topology", ["ep:4", "ep:8"])
def test_a_bug_on_the_last_rank_is_named(topology: str, tmp_path: Path) -> None:
    _needs_gpus(topology)
    last = _ranks(topology) - 1
    flags = ["-T", "256", "-H", "1024", "-I", "512", "-E", str(2 * last + 3), "-k", "2"]
    proc, _ = _run(topology, flags, tmp_path / "report.json", "--backend", LAST_RANK_BUG)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_ranks"] == [last], report["failed_ranks"]
    assert report["first_failure"] == "gather", report["first_failure"]
    assert f"gather@r{last}" in proc.stdout
