"""Run a backend against the golden on one rank, in chained and isolated mode, crash-safe.

Whatever a backend's stage does, it becomes that stage's result, never the end of the run: a
`StageSkipped` is a skip; a `StageViolation`, an in-place write into what the stage was handed, or
outputs that break the stage contract (tolerance/contract.py) are a failed check; anything else it
raises, including SystemExit (even exit(0)), a KeyboardInterrupt that is not the user's Ctrl-C, or
the case timeout running out (moe_verify/run/contain.py), is an error. Once the case timeout ran
out,
every later stage skips. In chained mode the stages after a stage that did not pass skip with its
reason. Each stage synchronizes the GPU, reports its start (moe_verify.common.progress) and leaves a
breadcrumb (the case and stage in flight), so an illegal memory access still says where it was.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_verify.common import progress
from moe_verify.common.loader import class_spec, load_class
from moe_verify.common.timing import phase
from moe_verify.run.contain import CaseTimeout, expired, terminated, user_interrupted
from moe_verify.run.options import check_backend
from moe_verify.run.poison import poisoned_allocations
from moe_verify.run.protect import Guarded, guards_own_upstream
from moe_verify.spec import (
    NO_BUFFERS,
    Backend,
    Buffers,
    Engine,
    FusedGroup,
    Mode,
    MoEInputs,
    MoEProblem,
    Outputs,
    Stage,
    StageContext,
    StageSkipped,
    StageViolation,
    Step,
    Trace,
    call_group,
    check_backend_object,
    fused_groups,
    plan,
    stage_method,
)
from optimized.topology import ShardCache
from reference.topology import REDUCE_INPUTS
from tolerance.contract import contract_violations
from tolerance.stages import columns

# Stages whose permuted scales have a padding contract (+0.0 fp32, no 0xFF byte): they run with
# uninitialised allocations poisoned, so a padding row left as torch.empty garbage fails every
# time instead of passing on zeroed pages (moe_verify/run/poison.py).
POISONED_STAGES = frozenset({Stage.PERMUTE, Stage.DISPATCH})

# The side of a golden's run, where progress and breadcrumbs name the tested side's mode.
GOLDEN_SIDE = "golden"
# How much of a failed stage's reason the skips after it repeat.
SHORT_REASON = 120


# Engines adapted in moe_verify/adapters/: name -> (module, backend class, its "cannot load here"
# exception), each built with the engine its GEMM stages fall back to.
ADAPTERS = {
    "vllm": ("vllm", "VllmBackend", "VllmUnavailable"),
    "sglang": ("sglang", "SglangBackend", "SglangUnavailable"),
    "lmdeploy": ("lmdeploy", "LmdeployBackend", "LmdeployUnavailable"),
}


def resolve_backend(spec: str | type | Backend, engine: Engine | str = Engine.AUTO) -> Backend:
    """'optimized', 'golden', 'vllm' (vLLM's installed kernels, docs/vllm.md), 'lmdeploy'
    (LMDeploy's fused_moe_v3_fp8 kernels, moe_verify/adapters/lmdeploy.py), 'sglang'
    (SGLang's, moe_verify/adapters/sglang.py), 'package.module:Class' or a class (any class of
    the stage protocol, moe_verify/spec/protocol.py), built here; an instance is returned as it
    is. `engine` goes to the optimized backend, its subclasses and the adapters."""
    if not isinstance(spec, (str, type)):
        check_backend_object(spec)
        return spec
    if spec == "optimized":
        from optimized import OptimizedBackend

        return OptimizedBackend(engine=engine)
    if spec == "golden":
        from reference import ReferenceBackend

        return ReferenceBackend()
    if spec in ADAPTERS:
        module_name, class_name, unavailable = ADAPTERS[spec]
        module = importlib.import_module(f"moe_verify.adapters.{module_name}")
        try:
            return getattr(module, class_name)(engine=engine)
        except getattr(module, unavailable) as exc:
            raise ValueError(f"backend {spec!r}: {exc}") from exc
    cls = load_class(check_backend(spec), "backend") if isinstance(spec, str) else spec
    name = spec if isinstance(spec, str) else class_spec(cls)
    options: dict[str, object] = {}
    if _takes_engine(cls):
        options["engine"] = engine  # --engine holds for every class whose constructor takes it
    try:
        backend = cls(**options)
    except Exception as exc:  # noqa: BLE001 - the user's constructor: named, its error kept
        raise ValueError(
            f"backend {name!r}: its constructor {cls.__qualname__}({_args(options)}) raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        check_backend_object(backend)
    except TypeError as exc:
        raise ValueError(f"backend {name!r}: {exc}") from None
    if not options and Engine(engine) is not Engine.AUTO:
        raise ValueError(
            f"backend {name!r}: --engine {engine} applies to backends whose constructor takes "
            "`engine` (optimized.OptimizedBackend, its subclasses, your own)"
        )
    return backend


def _args(options: dict[str, object]) -> str:
    return ", ".join(f"{k}={str(v)!r}" for k, v in options.items())


def _takes_engine(cls: type) -> bool:
    try:
        return "engine" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: pass nothing
        return False


def production_backend(spec: str | Backend, engine: Engine | str = Engine.AUTO) -> str:
    """Register the backend `spec` names (`resolve_backend`'s specs: 'optimized', 'vllm',
    'module:Class', a class or an instance) for production mode, a fresh instance each time, and
    return the name the op runs it by. Production mode runs any backend of the stage protocol:
    its stage methods, called with a graph-safe context."""
    from optimized import op
    from reference import ReferenceBackend

    backend = resolve_backend(spec, engine)
    name = spec if isinstance(spec, str) else class_spec(type(backend))
    if isinstance(backend, ReferenceBackend):
        raise ValueError(
            f"backend {name!r} is the golden: production mode compares a backend under test "
            "with it, so it has no production mode of its own"
        )
    groups = fused_groups(backend)
    if groups:
        raise ValueError(
            f"backend {name!r} declares the fused group {groups[0].name}: production mode (graph, "
            "bench --production) runs one method per stage and does not run fused groups yet; "
            "moe-verify run, sweep and torchrun judge them (docs/stage-contract.md"
            "#fused-stage-groups)"
        )
    return op.register_backend(backend, name)


@dataclass
class RankRun:
    """Traces of one rank: the golden's, and the tested backend's in each mode that ran."""

    rank: int
    golden: Trace
    tested: dict[Mode, Trace] = field(default_factory=dict)
    # The golden a chained run is compared against when it is not `golden`: its SM90 chain
    # (reference/moe.py `sm90_chain`), where every stage is held bit for bit.
    chained_golden: Trace | None = None

    def golden_for(self, mode: Mode) -> Trace:
        """The golden trace the tested side's run in `mode` is compared against."""
        if Mode(mode) is Mode.CHAINED and self.chained_golden is not None:
            return self.chained_golden
        return self.golden

    def for_reduce(self) -> RankRun:
        """Only what the cross-rank reduce reads (route, gather, shared), so a rank's large
        intermediates can be freed once they are compared (DeepSeek-V3 at EP8 holds ~4 GB per
        trace)."""
        chained = self.chained_golden
        return RankRun(
            self.rank,
            self.golden.only(REDUCE_INPUTS),
            {m: t.only(REDUCE_INPUTS) for m, t in self.tested.items()},
            chained.only(REDUCE_INPUTS) if chained is not None else None,
        )


def _breadcrumb(problem: MoEProblem, rank: int, stage: str, side: str) -> None:
    path = os.environ.get("MOE_VERIFY_BREADCRUMB")
    if path:
        Path(path).write_text(
            json.dumps({"case": problem.id, "rank": rank, "stage": stage, "mode": side}) + "\n"
        )


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class DeviceLost(RuntimeError):
    """A stage left the GPU unusable (an illegal memory access is sticky: every later CUDA call
    in this process fails), so the case cannot go on; the message names the stage that did it.
    A sweep contains it by running each case in its own process."""


def _device_lost() -> bool:
    """After a stage raised: is the process's CUDA context still usable?"""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return True
    return False


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _at(exc: BaseException) -> str:
    """' (at file.py:line)' of the innermost frame that raised, or '' without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


@dataclass
class Side:
    """A backend as the harness runs it: its stage methods, the buffers the harness hands them
    (moe_verify's guarded, poisoned workspaces, or none) and its rank shards, built once per
    inputs object for every stage and mode."""

    backend: Backend
    buffers: Buffers = NO_BUFFERS
    shards: ShardCache = field(default_factory=ShardCache)

    @property
    def name(self) -> str:
        return self.backend.name

    def context(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> StageContext:
        """A verification context: host validation on, the side's buffers, the rank's shard of
        `inputs` (the protected copy the stage is handed, so a write into a weight is seen)."""
        return StageContext(
            problem,
            inputs,
            upstream,
            rank,
            buffers=self.buffers,
            shard_of=self.shards,
        )

    def run(self, stage: str, ctx: StageContext) -> Outputs:
        """The stage's outputs; a write outside the workspaces handed out (their guard bands) is
        the stage's StageViolation, also when the stage raised."""
        return self.run_step(stage, ctx)[str(stage)]

    def steps(self, problem: MoEProblem) -> tuple[Step, ...]:
        """The steps this side runs `problem`'s stages in (its fused groups, moe_verify.spec)."""
        return plan(problem.stages, fused_groups(self.backend))

    def run_step(self, step: Step | str, ctx: StageContext) -> dict[str, Outputs]:
        """Stage name -> outputs of a stage, or of the stages a fused group exposes; a write
        outside the workspaces handed out (their guard bands) is the step's StageViolation, also
        when it raised."""
        stage = step.name if isinstance(step, FusedGroup) else str(step)
        try:
            outputs = _call_step(self.backend, step, ctx)
        except StageSkipped:
            self.buffers.guard_hits()  # re-armed; a stage that did not run wrote nothing
            raise
        except Exception as exc:
            hits = self.buffers.guard_hits()
            if hits:  # the stage failed and wrote out of bounds: report both
                raise StageViolation(f"{type(exc).__name__}: {exc}; and {stage} {hits}") from exc
            raise
        hits = self.buffers.guard_hits()
        if hits:
            raise StageViolation(f"{stage} {hits}")
        return outputs


def _call_step(backend: Backend, step: Step | str, ctx: StageContext) -> dict[str, Outputs]:
    if isinstance(step, FusedGroup):
        return call_group(backend, step, ctx)
    return {str(step): stage_method(backend, step)(ctx)}


def as_side(backend: Backend | Side) -> Side:
    """`backend` as the harness runs it (a plain backend: no workspaces)."""
    return backend if isinstance(backend, Side) else Side(backend)


def run_one_stage(
    backend: Backend | Side,
    stage: str,
    problem: MoEProblem,
    inputs: MoEInputs,
    upstream: Trace,
    rank: int = 0,
) -> Outputs:
    """One stage of `backend` with a verification context (host validation on, the side's
    workspaces, the rank's shard of `inputs`), its outputs as returned: no protection, no
    contract check, no comparison (`run_stage_into` adds those)."""
    side = as_side(backend)
    return side.run(stage, side.context(problem, inputs, upstream, rank))


def run_stage_into(
    trace: Trace,
    backend: Backend | Side,
    stage: Step | str,
    problem: MoEProblem,
    inputs: MoEInputs,
    upstream: Trace,
    mode: Mode,
    golden: bool = False,
) -> None:
    """Run one stage (or fused group) of `backend` on `upstream` and record in `trace` its
    outputs, or why there are none (see the module docstring). The tested side (`golden` False)
    is handed protected copies of `upstream` and `inputs`, and a write into them is that stage's
    failure. A fused group's failure is recorded at its last stage, the one the stages after it
    read. The golden's timeout, the user's Ctrl-C and a SIGTERM propagate: none is a verdict on
    a stage."""
    group = stage if isinstance(stage, FusedGroup) else None
    at = str(group.last) if group is not None else str(stage)  # where a failure is recorded
    name = group.name if group is not None else at
    if group is not None:
        trace.mark_fused([str(s) for s in group.stages], group.name)
    timeout = expired()
    if timeout is not None:
        if golden:  # no golden, no verdict: the case ends with its timeout
            raise CaseTimeout(timeout.seconds, timeout.where)
        trace.add_skipped(at, f"the case timeout ran out during {timeout.where}")
        return
    where = GOLDEN_SIDE if golden else str(Mode(mode))
    progress.stage_started(trace.rank, where, name)
    _breadcrumb(problem, trace.rank, name, where)
    members = group.stages if group is not None else (at,)
    poisoned = any(s in POISONED_STAGES for s in members)
    poison = poisoned_allocations() if poisoned else contextlib.nullcontext()
    own = Mode(mode) is Mode.CHAINED  # the upstream is the tested side's own trace
    guard = None if golden else Guarded(upstream, inputs, not own or guards_own_upstream())
    handed_upstream = upstream if guard is None else guard.upstream
    handed_inputs = inputs if guard is None else guard.inputs
    side = as_side(backend)
    try:
        with poison:
            outputs = side.run_step(
                stage, side.context(problem, handed_inputs, handed_upstream, trace.rank)
            )
        _sync()  # an asynchronous kernel fault surfaces here, attributed to this stage
    except StageSkipped as exc:
        trace.add_skipped(at, str(exc))
        return
    except StageViolation as exc:
        trace.add_violation(at, str(exc))
        return
    except CaseTimeout as exc:
        if golden:
            raise
        trace.add_error(at, f"timed out after {exc.seconds:g} s{_at(exc)}")
        return
    except KeyboardInterrupt as exc:
        if user_interrupted():
            raise
        trace.add_error(at, f"raised KeyboardInterrupt{_at(exc)}")
        return
    except SystemExit as exc:
        if terminated():
            raise
        trace.add_error(at, f"called exit({exc.code!r}){_at(exc)}")
        return
    except BaseException as exc:  # noqa: BLE001 - reported per stage, never fatal to the run
        if _device_lost():
            raise DeviceLost(
                f"{problem.id} rank {trace.rank} {where} {name} left the GPU unusable, so the "
                f"case ends here: {type(exc).__name__}: {_first_line(exc)}{_at(exc)}"
            ) from exc
        trace.add_error(at, f"{type(exc).__name__}: {exc}{_at(exc)}")
        return
    writes = [] if guard is None else guard.writes()
    if writes:
        trace.add_violation(at, "wrote in place into " + "; ".join(writes))
        return
    _add_checked(trace, outputs, problem, upstream, name)


def _add_checked(
    trace: Trace, outputs: dict[str, Outputs], problem: MoEProblem, upstream: Trace, name: str
) -> None:
    """Each stage's outputs into `trace` after the stage contract: a stage that breaks it is
    recorded as a violation, and the stages of the same fused group after it as skipped."""
    seen = upstream.only(upstream.stages)
    broken: str | None = None
    for stage, outs in outputs.items():
        if broken is not None:
            trace.add_skipped(stage, f"the fused group {name} broke the {broken} contract")
            continue
        violations = contract_violations(stage, problem, seen, outs, trace.rank)
        if violations:
            trace.add_violation(stage, "; ".join(violations))
            broken = stage
            continue
        trace.add(stage, outs)
        seen.add(stage, outs)


def _short(text: str) -> str:
    return text if len(text) <= SHORT_REASON else text[: SHORT_REASON - 3] + "..."


def run_chained(
    backend: Backend | Side, problem: MoEProblem, inputs: MoEInputs, rank: int, golden: bool = False
) -> Trace:
    """Every stage on the backend's own upstream; after a stage that did not pass (skipped,
    raised, broke the contract), the rest skip."""
    trace = Trace(backend.name, rank)
    blocked: str | None = None
    for step in as_side(backend).steps(problem):
        last = str(step.last if isinstance(step, FusedGroup) else step)
        if blocked is not None:
            why = _short(str(trace.failure(blocked)))
            trace.add_skipped(last, f"upstream stage {blocked} did not run: {why}")
            continue
        run_stage_into(trace, backend, step, problem, inputs, trace, Mode.CHAINED, golden)
        if trace.failure(last):
            blocked = last
    return trace


def run_isolated(
    backend: Backend | Side, problem: MoEProblem, inputs: MoEInputs, golden: Trace, rank: int
) -> Trace:
    """Each stage fed the golden's upstream (`fed_upstream`): a divergence belongs to exactly
    that stage."""
    trace = Trace(backend.name, rank)
    for step in as_side(backend).steps(problem):
        members = step.stages if isinstance(step, FusedGroup) else (step,)
        lacking = next((s for s in members if golden.failure(s)), None)
        if lacking is not None:
            trace.add_skipped(members[-1], f"the golden has no {lacking} output to compare")
            continue
        upstream = fed_upstream(golden, trace, step)
        run_stage_into(trace, backend, step, problem, inputs, upstream, Mode.ISOLATED)
    return trace


def fed_upstream(golden: Trace, tested: Trace, stage: Step | str) -> Trace:
    """The golden's upstream of `stage` as an isolated tested stage is handed it: the golden's
    route in the routed-scaling reading the tested route declared (its "recipe", one of the
    golden route's "recipe_outputs": scale_on_output gets the unscaled weights, and the route
    declares it, so the tested gather applies the factor once), else the golden's upstream as it
    is. The readings are one routing, two conventions for where the factor goes; a gather fed
    the other convention's weights would scale twice or not at all (docs/stage-contract.md
    #routed-scaling), and its mm1 in the column order the tested gemm1 declared. A fused group
    is handed the golden's stages before its last one that are not its own: what its stages
    read from outside it."""
    if isinstance(stage, FusedGroup):
        before = golden.stages[: golden.stages.index(stage.last)]
        upstream = golden.only([s for s in before if s not in stage.stages])
    else:
        upstream = golden.upto(stage)
    # the golden's mm1 in the column order the tested gemm1 declared (tolerance/stages/columns.py)
    upstream = columns.in_order(upstream, columns.declared(tested))
    if Stage.ROUTE not in upstream or Stage.ROUTE not in tested or tested.failure(Stage.ROUTE):
        return upstream
    route = upstream[Stage.ROUTE]
    declared = tested[Stage.ROUTE].get("recipe")
    readings = route.get("recipe_outputs")
    if not isinstance(readings, dict) or declared not in readings or declared == route["recipe"]:
        return upstream
    # the reading's tensors under the contract's names; the golden's other readings left out
    plain = {k: v for k, v in route.items() if "@" not in k and k != "recipe_outputs"}
    bound = {name: route[key] for name, key in readings[declared].items()}
    fed = Trace(upstream.backend, upstream.rank)
    for name, outputs in upstream.items():
        fed.add(name, {**plain, **bound, "recipe": declared} if name == Stage.ROUTE else outputs)
    return fed


def run_golden(golden: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace:
    """The golden's trace of `rank`; a golden that cannot run a stage (or breaks its contract) is
    an error, not a verdict."""
    trace = run_chained(golden, problem, inputs, rank, golden=True)
    failed = [s for s in trace if trace.failure(s)]
    if failed:
        raise RuntimeError(
            f"{problem.id} rank {rank}: the golden itself failed at {failed[0]}: "
            f"{trace.failure(failed[0])}"
        )
    return trace


def run_rank(
    problem: MoEProblem,
    inputs: MoEInputs,
    tested: Backend | Side,
    golden: Backend,
    rank: int,
    modes: tuple[Mode, ...],
    golden_trace: Trace | None = None,
) -> RankRun:
    """The golden of `rank` (or the one given), then the tested backend in each of `modes`."""
    if golden_trace is None:
        with phase("golden"):
            golden_trace = run_golden(golden, problem, inputs, rank)
    run = RankRun(rank, golden_trace)
    for mode in modes:
        with phase(str(Mode(mode))):
            if Mode(mode) is Mode.CHAINED:
                run.tested[Mode.CHAINED] = run_chained(tested, problem, inputs, rank)
            else:
                run.tested[Mode.ISOLATED] = run_isolated(
                    tested, problem, inputs, golden_trace, rank
                )
    return run
