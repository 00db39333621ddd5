"""The registry's vLLM entries (moe_verify/findings/registry.py) asserted on the installed vLLM,
and finding 1's standalone repro run against it.

Finding 1's check is its evidence test's machinery (test_vllm_graph.py `half_live_replay`:
`moe-verify graph` with stale ids planted in the padding rows of a half-live replay, in a
contained child) in both topologies: it reproduces when each replay ends in the stage that
indexes by the stale id first (align under ep:2, permute under tp:1), by a crash or a failed
check. `StaleIdsBounded` is vLLM with those ids turned into -1 before its stages see them, what a
kernel bounding ids by the expert count computes: through the same check, finding 1 must no
longer reproduce.

The repro (`moe-verify repro --finding 1`) runs where moe-verify cannot be imported
(tests/findings/standalone_env.py) and must exit 1 on the installed kernel; on a kernel without
the bug it exits 0 (tests/findings/test_repro.py, no engine needed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_verify.adapters import vllm as adapter
from moe_verify.adapters.vllm import VllmBackend
from moe_verify.findings import repro
from moe_verify.findings.registry import Finding
from moe_verify.findings.verdict import Observation
from moe_verify.spec import StageContext
from optimized.backend import Outputs
from tests.adapters.test_vllm_graph import STALE_ID_READS, half_live_replay
from tests.findings.standalone_env import run_script
from tests.findings.tier import assert_agrees, assert_turned, entries

pytestmark = pytest.mark.vllm


def stale_id_replays(backend: str, tmp_path: Path) -> Observation:
    """Finding 1: where each half-live replay of `backend` ends, against where vLLM's first
    unbounded access is."""
    ends, seen = [], True
    for topology, stage in STALE_ID_READS:
        rc, report = half_live_replay(topology, tmp_path / f"{topology}.json", backend)
        if "crashed" in report:
            end, how = report["at"]["stage"], report["crashed"]
        else:
            end = next(r for r in report["replays"] if r["name"] == "half-live")["first_failure"]
            how = "failed a check" if end else "passed"
        ends.append(f"{topology}: {how}" + (f" at {end}" if end else ""))
        seen = seen and rc == 1 and end == stage
    return Observation(seen, "; ".join(ends))


class StaleIdsBounded(VllmBackend):
    """vLLM with every id outside [0, E) turned into -1 before align, permute and gather see it:
    what kernels bounding ids by the expert count compute (vllm-project/vllm#50845)."""

    @staticmethod
    def _bounded(ctx: StageContext) -> StageContext:
        ids = ctx.upstream["route"]["topk_ids"]
        live = (ids >= 0) & (ids < ctx.problem.num_experts)
        route = ctx.upstream.replaced("route", topk_ids=torch.where(live, ids, -1))
        return ctx.replace(upstream=route)

    def align(self, ctx: StageContext) -> Outputs:
        return super().align(self._bounded(ctx))

    def permute(self, ctx: StageContext) -> Outputs:
        return super().permute(self._bounded(ctx))

    def gather(self, ctx: StageContext) -> Outputs:
        return super().gather(self._bounded(ctx))


# finding id -> (its check, the backend spec without its bug)
CHECKS: dict[int, tuple[Callable[[str, Path], Observation], str]] = {
    1: (stale_id_replays, f"{__name__}:StaleIdsBounded"),
}


@pytest.mark.parametrize("finding", entries("vllm"))
def test_finding_on_the_installed_release(finding: Finding, tmp_path: Path) -> None:
    check, _ = CHECKS[finding.id]
    assert_agrees(finding, adapter.installed_version(), check("vllm", tmp_path))


@pytest.mark.parametrize("finding", entries("vllm"))
def test_the_check_sees_a_kernel_without_the_bug(finding: Finding, tmp_path: Path) -> None:
    check, fixed = CHECKS[finding.id]
    assert_turned(finding, adapter.installed_version(), check(fixed, tmp_path))


def test_the_repro_fails_on_the_installed_kernel(tmp_path: Path) -> None:
    script = repro.write(repro.from_finding(1), tmp_path / "repro")
    done = run_script(script)
    out = done.stdout
    assert done.returncode == 1, out
    # one past the map: a wrong count (the storage's next int32 is local expert 0)
    assert "WRONG: 1 of 2 counts differ" in out and "0         2      10   <- differs" in out, out
    # 123456789 and 2071690107 read far past the map: a crash (CPU), or a fault or wrong count
    stale = out[out.index("\nstale_ids:") :]
    assert "WRONG" in stale, out
