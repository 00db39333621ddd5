"""OptimizedBackend's public per-stage hooks: one method per stage, named after it, called by
run_stage; a name that is no stage of one rank is refused."""

from __future__ import annotations

import pytest

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.spec import Engine, MoEProblem, Stage, StageContext, Trace, stage_method
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu

RANK_STAGES = [s for s in Stage if s is not Stage.REDUCE]
SMALL = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)


@pytest.mark.parametrize("stage", RANK_STAGES, ids=str)
def test_every_stage_has_a_public_hook(stage: Stage) -> None:
    backend = OptimizedBackend()
    assert stage_method(backend, stage) == getattr(backend, stage.value)
    assert stage_method(backend, stage.value) == getattr(backend, stage.value)


@pytest.mark.parametrize("stage", ["reduce", "_permute", "run"])
def test_a_name_that_is_no_stage_is_refused(stage: str) -> None:
    inputs = make_inputs(SMALL, "cpu")
    with pytest.raises(ValueError, match="is not a stage a backend runs"):
        run_one_stage(OptimizedBackend(), stage, SMALL, inputs, Trace("optimized"), 0)


class MarksRoute(OptimizedBackend):
    def route(self, ctx: StageContext) -> dict[str, object]:
        return {**super().route(ctx), "marked": True}


def test_run_stage_calls_the_overridden_hook() -> None:
    out = run_one_stage(MarksRoute(), "route", SMALL, make_inputs(SMALL, "cpu"), Trace("x"), 0)
    assert out["marked"] is True


def test_engine_accepts_plain_names() -> None:
    assert OptimizedBackend(engine="triton").engine is Engine.TRITON
    with pytest.raises(ValueError, match="engine: expected one of"):
        OptimizedBackend(engine="cuda")
