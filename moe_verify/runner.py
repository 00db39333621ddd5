"""Run a backend against the golden on one rank, in chained and isolated mode, crash-safe.

Whatever a backend's stage does, it becomes that stage's result, never the end of the run: a
`StageSkipped` is a skip; a `StageViolation`, an in-place write into what the stage was handed, or
outputs that break the stage contract (tolerance/contract.py) are a failed check; anything else it
raises, including SystemExit (even exit(0)), a KeyboardInterrupt that is not the user's Ctrl-C, or
the case timeout running out (moe_verify/contain.py), is an error. Once the case timeout ran out,
every later stage skips. In chained mode the stages after a stage that did not pass skip with its
reason. Each stage synchronizes the GPU, reports its start (moe_verify.progress) and leaves a
breadcrumb (the case and stage in flight), so an illegal memory access still says where it was.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_verify import progress
from moe_verify.contain import CaseTimeout, expired, terminated, user_interrupted
from moe_verify.loader import class_spec, load_class
from moe_verify.options import check_backend
from moe_verify.poison import poisoned_allocations
from moe_verify.protect import Guarded, guards_own_upstream
from moe_verify.spec import (
    Backend,
    Engine,
    Mode,
    MoEInputs,
    MoEProblem,
    Stage,
    StageSkipped,
    StageViolation,
    Trace,
)
from moe_verify.timing import phase
from reference.topology import REDUCE_INPUTS
from tolerance.contract import contract_violations

# Stages whose permuted scales have a padding contract (+0.0 fp32, no 0xFF byte): they run with
# uninitialised allocations poisoned, so a padding row left as torch.empty garbage fails every
# time instead of passing on zeroed pages (moe_verify/poison.py).
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


def resolve_backend(
    spec: str | type | Backend,
    engine: Engine | str = Engine.AUTO,
    workspace: bool = False,
    poison: int | None = None,
) -> Backend:
    """'optimized', 'golden', 'vllm' (vLLM's installed kernels, docs/vllm.md), 'lmdeploy'
    (LMDeploy's fused_moe_v3_fp8 kernels, moe_verify/adapters/lmdeploy.py), 'sglang'
    (SGLang's, moe_verify/adapters/sglang.py),
    'package.module:Class' or a class (any class with the Backend protocol), built here; an
    instance is returned as it is. `workspace` and `poison` (optimized/workspace.py) go to the
    optimized backend and to subclasses of it."""
    if not isinstance(spec, (str, type)):
        return spec
    workspaces = (
        {"workspace": workspace, "poison": poison} if workspace or poison is not None else {}
    )

    def refuse() -> None:
        if workspaces:
            raise ValueError(
                f"backend {spec!r}: workspace={workspace}, poison={poison} apply to the optimized "
                "backend and module:Class subclasses of optimized.OptimizedBackend only"
            )

    if spec == "optimized":
        from optimized import OptimizedBackend

        return OptimizedBackend(engine=engine, **workspaces)
    if spec == "golden":
        from reference import ReferenceBackend

        refuse()
        return ReferenceBackend()
    if spec in ADAPTERS:
        refuse()
        module_name, class_name, unavailable = ADAPTERS[spec]
        module = importlib.import_module(f"moe_verify.adapters.{module_name}")
        try:
            return getattr(module, class_name)(engine=engine)
        except getattr(module, unavailable) as exc:
            raise ValueError(f"backend {spec!r}: {exc}") from exc
    cls = load_class(check_backend(spec), "backend") if isinstance(spec, str) else spec
    from optimized import OptimizedBackend

    options: dict[str, object] = dict(workspaces)
    if issubclass(cls, OptimizedBackend):
        options["engine"] = engine  # --engine holds for the optimized path's subclasses too
    else:
        refuse()
        if Engine(engine) is not Engine.AUTO:
            raise ValueError(
                f"backend {spec!r}: --engine {engine} applies to the optimized backend and "
                "module:Class subclasses of optimized.OptimizedBackend only"
            )
    try:
        backend = cls(**options)
    except TypeError as exc:  # a subclass whose constructor takes other arguments
        if not workspaces:
            raise
        raise ValueError(f"backend {spec!r} cannot take {workspaces} ({exc})") from exc
    missing = [m for m in ("name", "run_stage") if not hasattr(backend, m)]
    if missing:
        raise ValueError(f"backend {spec!r} lacks {missing} of the Backend protocol")
    return backend


def production_backend(spec: str | Backend, engine: Engine | str = Engine.AUTO) -> str:
    """Register the backend `spec` names (`resolve_backend`'s specs: 'optimized', 'vllm',
    'module:Class', a class or an instance) for production mode, a fresh instance each time, and
    return the name the op runs it by. Production mode runs the stage methods of an
    optimized.OptimizedBackend (or a subclass) graph-safe, so only those are taken."""
    from optimized import OptimizedBackend, op

    if spec == "optimized":
        return op.register_backend(OptimizedBackend())
    backend = resolve_backend(spec, engine)
    name = spec if isinstance(spec, str) else class_spec(type(backend))
    if not isinstance(backend, OptimizedBackend):
        raise ValueError(
            f"backend {name!r} ({type(backend).__name__}) has no production mode: the op runs "
            "the stage methods of optimized.OptimizedBackend graph-safe, so graph and bench "
            "--production take OptimizedBackend and its subclasses (the class `run --backend` "
            "takes, written once)"
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


def run_stage_into(
    trace: Trace,
    backend: Backend,
    stage: str,
    problem: MoEProblem,
    inputs: MoEInputs,
    upstream: Trace,
    mode: Mode,
    golden: bool = False,
) -> None:
    """Run one stage of `backend` on `upstream` and record in `trace` its outputs, or why there
    are none (see the module docstring). The tested side (`golden` False) is handed protected
    copies of `upstream` and `inputs`, and a write into them is that stage's failure. The
    golden's timeout, the user's Ctrl-C and a SIGTERM propagate: none is a verdict on a stage."""
    timeout = expired()
    if timeout is not None:
        if golden:  # no golden, no verdict: the case ends with its timeout
            raise CaseTimeout(timeout.seconds, timeout.where)
        trace.add_skipped(stage, f"the case timeout ran out during {timeout.where}")
        return
    side = GOLDEN_SIDE if golden else str(Mode(mode))
    progress.stage_started(trace.rank, side, stage)
    _breadcrumb(problem, trace.rank, stage, side)
    poison = poisoned_allocations() if stage in POISONED_STAGES else contextlib.nullcontext()
    own = Mode(mode) is Mode.CHAINED  # the upstream is the tested side's own trace
    guard = None if golden else Guarded(upstream, inputs, not own or guards_own_upstream())
    handed_upstream = upstream if guard is None else guard.upstream
    handed_inputs = inputs if guard is None else guard.inputs
    try:
        with poison:
            outputs = backend.run_stage(stage, problem, handed_inputs, handed_upstream, trace.rank)
        _sync()  # an asynchronous kernel fault surfaces here, attributed to this stage
    except StageSkipped as exc:
        trace.add_skipped(stage, str(exc))
        return
    except StageViolation as exc:
        trace.add_violation(stage, str(exc))
        return
    except CaseTimeout as exc:
        if golden:
            raise
        trace.add_error(stage, f"timed out after {exc.seconds:g} s{_at(exc)}")
        return
    except KeyboardInterrupt as exc:
        if user_interrupted():
            raise
        trace.add_error(stage, f"raised KeyboardInterrupt{_at(exc)}")
        return
    except SystemExit as exc:
        if terminated():
            raise
        trace.add_error(stage, f"called exit({exc.code!r}){_at(exc)}")
        return
    except BaseException as exc:  # noqa: BLE001 - reported per stage, never fatal to the run
        if _device_lost():
            raise DeviceLost(
                f"{problem.id} rank {trace.rank} {side} {stage} left the GPU unusable, so the case "
                f"ends here: {type(exc).__name__}: {_first_line(exc)}{_at(exc)}"
            ) from exc
        trace.add_error(stage, f"{type(exc).__name__}: {exc}{_at(exc)}")
        return
    writes = [] if guard is None else guard.writes()
    if writes:
        trace.add_violation(stage, "wrote in place into " + "; ".join(writes))
        return
    violations = contract_violations(stage, problem, upstream, outputs, trace.rank)
    if violations:
        trace.add_violation(stage, "; ".join(violations))
        return
    trace.add(stage, outputs)


def _short(text: str) -> str:
    return text if len(text) <= SHORT_REASON else text[: SHORT_REASON - 3] + "..."


def run_chained(
    backend: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int, golden: bool = False
) -> Trace:
    """Every stage on the backend's own upstream; after a stage that did not pass (skipped,
    raised, broke the contract), the rest skip."""
    trace = Trace(backend.name, rank)
    blocked: str | None = None
    for stage in problem.stages:
        if blocked is not None:
            why = _short(str(trace.failure(blocked)))
            trace.add_skipped(stage, f"upstream stage {blocked} did not run: {why}")
            continue
        run_stage_into(trace, backend, stage, problem, inputs, trace, Mode.CHAINED, golden)
        if trace.failure(stage):
            blocked = stage
    return trace


def run_isolated(
    backend: Backend, problem: MoEProblem, inputs: MoEInputs, golden: Trace, rank: int
) -> Trace:
    """Each stage fed the golden's upstream: a divergence belongs to exactly that stage."""
    trace = Trace(backend.name, rank)
    for stage in problem.stages:
        if golden.failure(stage):
            trace.add_skipped(stage, f"the golden has no {stage} output to compare")
            continue
        run_stage_into(trace, backend, stage, problem, inputs, golden.upto(stage), Mode.ISOLATED)
    return trace


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
    tested: Backend,
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
