"""Run a backend against the golden on one rank, in chained and isolated mode, crash-safe.

A stage that raises `StageSkipped` is recorded as skipped (`Trace.add_skipped`); any other
exception as an error (`Trace.add_error`), so one bad stage never takes the run down. In chained
mode the stages after a stage that did not run are skipped with that reason. Each stage
synchronizes the GPU and leaves a breadcrumb (the case and stage in flight) so an illegal memory
access still says where it was.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_verify.poison import poisoned_allocations
from moe_verify.spec import (
    Backend,
    Engine,
    Mode,
    MoEInputs,
    MoEProblem,
    Stage,
    StageSkipped,
    Trace,
)
from reference.topology import REDUCE_INPUTS

# Stages whose permuted scales have a padding contract (+0.0 fp32, no 0xFF byte): they run with
# uninitialised allocations poisoned, so a padding row left as torch.empty garbage fails every
# time instead of passing on zeroed pages (moe_verify/poison.py).
POISONED_STAGES = frozenset({Stage.PERMUTE, Stage.DISPATCH})


def resolve_backend(spec: str | Backend, engine: Engine | str = Engine.AUTO) -> Backend:
    """'optimized', 'golden', 'vllm' (vLLM's installed kernels, docs/vllm.md), or
    'package.module:Class' (any class with the Backend protocol)."""
    if not isinstance(spec, str):
        return spec
    if spec == "optimized":
        from optimized import OptimizedBackend

        return OptimizedBackend(engine=engine)
    if spec == "golden":
        from reference import ReferenceBackend

        return ReferenceBackend()
    if spec == "vllm":
        from moe_verify.adapters.vllm import VllmBackend, VllmUnavailable

        try:
            return VllmBackend(engine=engine)
        except VllmUnavailable as exc:
            raise ValueError(f"backend 'vllm': {exc}") from exc
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"backend: expected 'optimized', 'golden', 'vllm' or 'module:Class', got {spec!r}"
        )
    if (
        os.getcwd() not in sys.path
    ):  # a user's module in the current directory, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"backend {spec!r}: cannot load it ({exc})") from exc
    backend = cls()
    missing = [m for m in ("name", "run_stage") if not hasattr(backend, m)]
    if missing:
        raise ValueError(f"backend {spec!r} lacks {missing} of the Backend protocol")
    return backend


@dataclass
class RankRun:
    """Traces of one rank: the golden's, and the tested backend's in each mode that ran."""

    rank: int
    golden: Trace
    tested: dict[Mode, Trace] = field(default_factory=dict)

    def for_reduce(self) -> RankRun:
        """Only what the cross-rank reduce reads (route, gather, shared), so a rank's large
        intermediates can be freed once they are compared (DeepSeek-V3 at EP8 holds ~4 GB per
        trace)."""
        return RankRun(
            self.rank,
            self.golden.only(REDUCE_INPUTS),
            {m: t.only(REDUCE_INPUTS) for m, t in self.tested.items()},
        )


def _breadcrumb(problem: MoEProblem, rank: int, stage: str, mode: Mode) -> None:
    path = os.environ.get("MOE_VERIFY_BREADCRUMB")
    if path:
        Path(path).write_text(
            json.dumps({"case": problem.id, "rank": rank, "stage": stage, "mode": mode}) + "\n"
        )


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_stage_into(
    trace: Trace,
    backend: Backend,
    stage: str,
    problem: MoEProblem,
    inputs: MoEInputs,
    upstream: Trace,
    mode: Mode,
) -> None:
    """Run one stage of `backend` on `upstream` and record its outputs, skip or error in `trace`."""
    _breadcrumb(problem, trace.rank, stage, mode)
    poison = poisoned_allocations() if stage in POISONED_STAGES else contextlib.nullcontext()
    try:
        with poison:
            outputs = backend.run_stage(stage, problem, inputs, upstream, trace.rank)
        _sync()  # an asynchronous kernel fault surfaces here, attributed to this stage
    except StageSkipped as exc:
        trace.add_skipped(stage, str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - reported per stage, never fatal to the run
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        trace.add_error(stage, f"{type(exc).__name__}: {exc} (at {where})")
        return
    trace.add(stage, outputs)


def run_chained(backend: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace:
    """Every stage on the backend's own upstream; after a stage that did not run, the rest skip."""
    trace = Trace(backend.name, rank)
    blocked: str | None = None
    for stage in problem.stages:
        if blocked is not None:
            trace.add_skipped(stage, f"upstream stage {blocked} did not run")
            continue
        run_stage_into(trace, backend, stage, problem, inputs, trace, Mode.CHAINED)
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
    """The golden's trace of `rank`; a golden that cannot run a stage is an error, not a verdict."""
    trace = run_chained(golden, problem, inputs, rank)
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
    gold = golden_trace if golden_trace is not None else run_golden(golden, problem, inputs, rank)
    run = RankRun(rank, gold)
    for mode in modes:
        if Mode(mode) is Mode.CHAINED:
            run.tested[Mode.CHAINED] = run_chained(tested, problem, inputs, rank)
        else:
            run.tested[Mode.ISOLATED] = run_isolated(tested, problem, inputs, gold, rank)
    return run
