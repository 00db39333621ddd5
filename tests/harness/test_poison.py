"""Poisoned allocations (moe_verify/poison.py): the permute's uninitialised memory is 0xFF, so a
padding-scale bug that leaves torch.empty garbage fails every run, not only on dirty pages."""

from __future__ import annotations

import pytest
import torch

from moe_verify.inputs import make_inputs
from moe_verify.poison import POISON_BYTE, poisoned_allocations
from moe_verify.runner import POISONED_STAGES, run_stage_into
from moe_verify.spec import Mode, MoEInputs, MoEProblem, Stage, Trace
from moe_verify.verification import verify
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu


def _all_poison(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(torch.uint8) == POISON_BYTE).all())


@pytest.mark.parametrize(
    "alloc",
    [
        lambda: torch.empty(3, 5),
        lambda: torch.empty_strided((5, 2), (1, 8), dtype=torch.int32),  # TMA-aligned packed
        lambda: torch.empty_like(torch.ones(4, dtype=torch.bfloat16)),
        lambda: torch.ones(2).new_empty(7, dtype=torch.float8_e4m3fn),
    ],
    ids=["empty", "empty_strided", "empty_like", "new_empty"],
)
def test_uninitialised_allocations_are_poisoned(alloc) -> None:
    originals = (torch.empty, torch.empty_strided, torch.empty_like, torch.Tensor.new_empty)
    with poisoned_allocations():
        t = alloc()
    storage = torch.tensor(t.untyped_storage().tolist(), dtype=torch.int64)  # gaps included
    assert bool((storage == POISON_BYTE).all()), storage.unique().tolist()
    now = (torch.empty, torch.empty_strided, torch.empty_like, torch.Tensor.new_empty)
    assert all(a is b for a, b in zip(now, originals, strict=True)), "allocators not restored"


def test_initialised_allocations_are_untouched() -> None:
    with poisoned_allocations():
        z = torch.zeros(4)
    assert bool((z == 0).all())


def test_the_permute_stage_runs_poisoned() -> None:
    """run_stage_into poisons exactly the stages with a padding contract on their scales."""
    assert POISONED_STAGES == {Stage.PERMUTE, Stage.DISPATCH}

    class Allocates:
        name = "allocates"
        buffer: torch.Tensor | None = None

        def run_stage(self, stage, problem, inputs, upstream, rank):
            self.buffer = torch.empty(8, dtype=torch.float32)
            return {"buffer": self.buffer}

    original = torch.empty
    problem = MoEProblem()
    backend = Allocates()
    trace = Trace("allocates")
    run_stage_into(
        trace,
        backend,
        Stage.PERMUTE,
        problem,
        make_inputs(problem, "cpu"),
        Trace("up"),
        Mode.ISOLATED,
    )
    assert backend.buffer is not None and _all_poison(backend.buffer)
    assert torch.empty is original


class EmptyPaddingScales(OptimizedBackend):
    """permute: the permuted scales re-allocated with torch.empty and only the live rows copied
    in, as vLLM did before it zeroed them (ref/anchors.md #6)."""

    name = "empty_padding_scales"

    def permute(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> dict[str, object]:
        out = super().permute(p, x, up, rank)
        live = out["m_indices"] >= 0
        scales = torch.empty_like(out["a_scale_perm"])
        scales[live] = out["a_scale_perm"][live]
        out["a_scale_perm"] = scales
        return out


def test_unzeroed_padding_scales_fail_every_time() -> None:
    problem = MoEProblem(
        tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32,
        scale_fmt="float32_ceil_ue8m0", grouped_layout="m_indices",
    )  # fmt: skip
    report = verify(problem, backend=EmptyPaddingScales(engine="triton"), mode="isolated")
    failing = {r.stage: [c.name for c in r.checks if not c.passed] for r in report.isolated or []}
    failing = {s: c for s, c in failing.items() if c}
    assert failing == {"permute": ["padding scales"]}, report.summary_line()
