"""The registry's SGLang entry (finding 2, a control of vLLM's finding 1) asserted on the installed
SGLang: its align, permute and gather skip stale expert ids.

SGLang's quantizers are JIT CUDA, so `moe-verify graph` (finding 1's machinery) cannot run it on
a CPU; the check plants the stale ids in isolated mode instead, in the -1 slots of the sglang
matrix's invalid_slots row under ep:4 (test_sglang_matrix.py: it passes there): `StaleIdsPlanted`
hands SGLang's three stages the route with each -1 slot holding 123456789, 2071690107 or E (one
past the expert count), as CUDA-graph padding rows hold them, while the golden skips those slots.
The control holds when the three stages still match the golden.

The check can fail: `StaleIdsCounted` plants ids inside the expert range instead, what an
unbounded kernel counts when its out-of-bounds read lands on a local expert; align then no longer
matches the golden.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_verify.adapters import sglang as adapter
from moe_verify.adapters.sglang import SglangBackend
from moe_verify.findings.registry import Finding
from moe_verify.findings.verdict import Observation
from moe_verify.production.graph import STALE_IDS
from moe_verify.run.verify import verify
from moe_verify.spec import Routing, Stage, StageContext, Status, TopologyKind
from optimized.backend import Outputs
from tests.adapters.test_sglang_matrix import MATRIX
from tests.findings.tier import assert_agrees, assert_turned, entries

pytestmark = pytest.mark.sglang

ROW = next(
    p for p in MATRIX if p.routing is Routing.INVALID_SLOTS and p.topology.kind is TopologyKind.EP
)
STAGES = (Stage.ALIGN, Stage.PERMUTE, Stage.GATHER)


class StaleIdsPlanted(SglangBackend):
    """SGLang's align, permute and gather handed stale ids in the route's -1 slots."""

    def planted(self, ctx: StageContext) -> torch.Tensor:
        e = ctx.problem.num_experts
        return torch.tensor([*STALE_IDS, e])

    def _stale(self, ctx: StageContext) -> StageContext:
        ids = ctx.upstream["route"]["topk_ids"]
        plant = self.planted(ctx).to(ids)
        fill = plant.repeat(ids.numel() // plant.numel() + 1)[: ids.numel()].view_as(ids)
        route = ctx.upstream.replaced("route", topk_ids=torch.where(ids < 0, fill, ids))
        return ctx.replace(upstream=route)

    def align(self, ctx: StageContext) -> Outputs:
        return super().align(self._stale(ctx))

    def permute(self, ctx: StageContext) -> Outputs:
        return super().permute(self._stale(ctx))

    def gather(self, ctx: StageContext) -> Outputs:
        return super().gather(self._stale(ctx))


class StaleIdsCounted(StaleIdsPlanted):
    """The -1 slots hold ids inside the expert range: counted, as an unbounded read that lands
    on a local expert would be."""

    def planted(self, ctx: StageContext) -> torch.Tensor:
        return super().planted(ctx) % ctx.problem.num_experts


def stale_ids_skipped(backend: type[SglangBackend]) -> Observation:
    report = verify(ROW, backend=backend(), mode="isolated")
    results = [r for r in report.isolated or [] if r.stage in STAGES]  # one per stage and rank
    failing = sorted({r.stage for r in results if r.status is not Status.PASS})
    seen = {r.stage for r in results} == set(STAGES) and not failing
    return Observation(seen, f"{ROW.id}: " + (f"{failing} did not pass" if failing else "passed"))


# finding id -> (its check, the kernels with its property broken)
CHECKS: dict[int, tuple[Callable[[type[SglangBackend]], Observation], type[SglangBackend]]] = {
    2: (stale_ids_skipped, StaleIdsCounted),
}


@pytest.mark.parametrize("finding", entries("sglang"))
def test_finding_on_the_installed_release(finding: Finding) -> None:
    check, _ = CHECKS[finding.id]
    assert_agrees(finding, adapter.installed_version(), check(StaleIdsPlanted))


@pytest.mark.parametrize("finding", entries("sglang"))
def test_the_check_sees_a_kernel_without_the_property(finding: Finding) -> None:
    check, broken = CHECKS[finding.id]
    assert_turned(finding, adapter.installed_version(), check(broken))
