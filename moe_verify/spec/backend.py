"""What every MoE implementation under test provides, and the default way to chain its stages."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from moe_verify.spec.checks import check_int, check_type
from moe_verify.spec.inputs import MoEInputs
from moe_verify.spec.problem import MoEProblem
from moe_verify.spec.trace import Trace


@runtime_checkable
class Backend(Protocol):
    """What every MoE implementation under test provides: a name, each stage on its own, and the
    chained run (`moe-verify run --backend module:Class` loads a user's)."""

    name: str

    def run_stage(
        self, stage: str, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> dict[str, object]: ...

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace: ...


def run_stages(backend: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace:
    """Chain `backend.run_stage` over the topology's stages (the default `run`)."""
    check_type("problem", problem, MoEProblem)
    check_type("inputs", inputs, MoEInputs)
    check_int(f"rank (topology {problem.topology})", rank, 0, problem.topology.size - 1)
    trace = Trace(backend.name, rank)
    for stage in problem.stages:
        trace.add(stage, backend.run_stage(stage, problem, inputs, trace, rank))
    return trace
