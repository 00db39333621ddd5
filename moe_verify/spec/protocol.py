"""The stage protocol: what every MoE implementation under test provides.

A backend is any object with a `name` and one method per stage it runs, each with the one
signature `stage(ctx: StageContext) -> outputs` (outputs named as docs/stage-contract.md says).
The golden (`reference.ReferenceBackend`), the DeepGEMM path (`optimized.OptimizedBackend`), the
engine adapters and a user's own class all implement it, and every command calls the same
methods: run, sweep, replay, torchrun ranks, graph, bench --production, invariance, sanitize,
calibrate. Subclassing `OptimizedBackend` is one way to own one stage; wrapping it is another
(`StageDelegate` forwards every stage you do not write).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from moe_verify.spec.checks import check_int, check_type
from moe_verify.spec.context import NO_BUFFERS, Buffers, Outputs, RankShard, ShardOf, StageContext
from moe_verify.spec.fused import FusedGroup, fused_groups, plan
from moe_verify.spec.inputs import MoEInputs
from moe_verify.spec.problem import MoEProblem
from moe_verify.spec.recipes import Engine
from moe_verify.spec.stages import STAGES, Stage
from moe_verify.spec.trace import Trace

# The stages a rank computes (reduce is made across ranks by the harness).
RANK_STAGES: tuple[Stage, ...] = tuple(s for s in Stage if s is not Stage.REDUCE)


@runtime_checkable
class Backend(Protocol):
    """An MoE implementation under test: a name and one method per stage. A backend needs only
    the methods of the stages its problems run (`dispatch` for ep:N+ll, `shared` with shared
    experts); `missing_stages` says which are absent."""

    name: str

    def route(self, ctx: StageContext) -> Outputs: ...
    def quant_input(self, ctx: StageContext) -> Outputs: ...
    def align(self, ctx: StageContext) -> Outputs: ...
    def permute(self, ctx: StageContext) -> Outputs: ...
    def gemm1(self, ctx: StageContext) -> Outputs: ...
    def act_quant(self, ctx: StageContext) -> Outputs: ...
    def gemm2(self, ctx: StageContext) -> Outputs: ...
    def gather(self, ctx: StageContext) -> Outputs: ...


def stage_method(backend: object, stage: str | Stage) -> Any:
    """The method of `backend` that runs `stage`; a ValueError naming both when there is none."""
    try:
        known = Stage(stage)
    except ValueError:
        known = None
    if known is None or known is Stage.REDUCE:
        names = ", ".join(s.value for s in RANK_STAGES)
        raise ValueError(f"{stage!r} is not a stage a backend runs (one of {names})")
    method = getattr(backend, known.value, None)
    if not callable(method):
        raise ValueError(
            f"backend {getattr(backend, 'name', type(backend).__name__)!r} has no method "
            f"{known.value}(ctx) for stage {known.value}"
        )
    return method


def call_stage(backend: object, stage: str | Stage, ctx: StageContext) -> Outputs:
    """`backend`'s outputs of `stage` for `ctx` (no verification: see moe_verify.run)."""
    outputs = stage_method(backend, stage)(ctx)
    if not isinstance(outputs, dict):
        raise TypeError(
            f"{getattr(backend, 'name', type(backend).__name__)}.{Stage(stage).value} returned "
            f"{type(outputs).__name__}; a stage returns a dict of named outputs"
        )
    return outputs


def call_group(backend: object, group: FusedGroup, ctx: StageContext) -> dict[str, Outputs]:
    """`backend`'s outputs of the fused `group` for `ctx`: stage name -> outputs, for the stages
    it exposes (its last always); a TypeError or ValueError naming the group otherwise."""
    where = f"{getattr(backend, 'name', type(backend).__name__)}.{group.method}"
    returned = getattr(backend, group.method)(ctx)
    if not isinstance(returned, dict):
        raise TypeError(
            f"{where} returned {type(returned).__name__}; a fused group returns a dict of stage "
            "name -> named outputs"
        )
    names = [s.value for s in group.stages]
    unknown = [k for k in returned if k not in names]
    if unknown:
        raise ValueError(f"{where} returned {unknown}, not stages of its group {group.name}")
    if group.last.value not in returned:
        raise ValueError(
            f"{where} returned no {group.last.value} outputs: the group's last stage is what the "
            "stages after it read"
        )
    for stage, outputs in returned.items():
        if not isinstance(outputs, dict):
            raise TypeError(f"{where}: {stage} is {type(outputs).__name__}, not a dict of outputs")
    return {s: returned[s] for s in names if s in returned}


def missing_stages(backend: object, stages: tuple[Stage, ...] = RANK_STAGES) -> list[str]:
    """The stages of `stages` that `backend` has no method for and no fused group computes."""
    fused = {s for g in fused_groups(backend) for s in g.stages}
    return [
        s.value for s in stages if s not in fused and not callable(getattr(backend, s.value, None))
    ]


def check_backend_object(backend: object, what: str = "backend") -> None:
    """A TypeError naming what is missing when `backend` is not a Backend: a name and the eight
    stages of the contiguous layout, each a method or inside a declared fused group (dispatch
    and shared are asked for where a problem runs them)."""
    if isinstance(backend, type):
        raise TypeError(f"{what}: expected a backend instance, got the class {backend.__name__}")
    missing = [] if isinstance(getattr(backend, "name", None), str) else ["name (a str)"]
    missing += [f"{s}(ctx)" for s in missing_stages(backend, STAGES)]
    if missing:
        raise TypeError(
            f"{what} {type(backend).__name__} is not a backend: it lacks {', '.join(missing)} "
            "(docs/your-kernel.md, the stage protocol)"
        )


def run_stages(
    backend: object,
    problem: MoEProblem,
    inputs: MoEInputs,
    rank: int = 0,
    *,
    shard_of: ShardOf | None = None,
    buffers: Buffers = NO_BUFFERS,
    engine: Engine | None = None,
) -> Trace:
    """Chain `backend`'s stages over the problem's stages on one rank, plainly: no protection,
    no contract checks, no comparison (`moe_verify.verify` does those). `shard_of` builds the
    rank's shard for stages that read `ctx.shard`; `engine` fixes the GEMM engine."""
    check_type("problem", problem, MoEProblem)
    check_type("inputs", inputs, MoEInputs)
    check_int(f"rank (topology {problem.topology})", rank, 0, problem.topology.size - 1)
    trace = Trace(getattr(backend, "name", type(backend).__name__), rank)
    for step in plan(problem.stages, fused_groups(backend)):
        ctx = StageContext(
            problem, inputs, trace, rank, buffers=buffers, engine=engine, shard_of=shard_of
        )
        if isinstance(step, FusedGroup):
            for stage, outputs in call_group(backend, step, ctx).items():
                trace.add(stage, outputs)
        else:
            trace.add(step, call_stage(backend, step, ctx))
    return trace


class StageDelegate:
    """Forwards every stage to `inner`: subclass it, write the stage you own, and call
    `self.inner.<stage>(ctx)` where you want the inner backend's outputs. The class is a backend
    in its own right, not a subclass of `inner`'s class."""

    def __init__(self, inner: object, name: str | None = None) -> None:
        self.inner = inner
        self.name = name or f"{type(self).__name__}({getattr(inner, 'name', '?')})"

    def route(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.ROUTE, ctx)

    def quant_input(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.QUANT_INPUT, ctx)

    def align(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.ALIGN, ctx)

    def permute(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.PERMUTE, ctx)

    def dispatch(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.DISPATCH, ctx)

    def gemm1(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.GEMM1, ctx)

    def act_quant(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.ACT_QUANT, ctx)

    def gemm2(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.GEMM2, ctx)

    def gather(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.GATHER, ctx)

    def shared(self, ctx: StageContext) -> Outputs:
        return call_stage(self.inner, Stage.SHARED, ctx)


__all__ = [
    "RANK_STAGES",
    "Backend",
    "RankShard",
    "StageContext",
    "StageDelegate",
    "call_group",
    "call_stage",
    "check_backend_object",
    "missing_stages",
    "run_stages",
    "stage_method",
]
