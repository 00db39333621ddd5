"""Run a backend against the golden on every rank, in chained and isolated mode, crash-safe.

A stage that raises `StageSkipped` is recorded as {"skipped": reason}; any other exception as
{"error": message}, so one bad stage never takes the run down. In chained mode the stages after
a stage that did not run are skipped with that reason. Each stage synchronizes the GPU and leaves
a breadcrumb (the case and stage in flight) so an illegal memory access still says where it was.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify.device import prepare_triton
from moe_verify.spec import (
    REDUCE_STAGE,
    Backend,
    MoEInputs,
    MoEProblem,
    StageSkipped,
    TopologyKind,
    Trace,
)

MODES = ("isolated", "chained")


def resolve_backend(spec: str | Backend, engine: str = "auto") -> Backend:
    """'optimized', 'golden', or 'package.module:Class' (any class with the Backend protocol)."""
    if not isinstance(spec, str):
        return spec
    if spec == "optimized":
        prepare_triton()
        from optimized.backend import OptimizedBackend

        return OptimizedBackend(engine=engine)
    if spec == "golden":
        from reference.moe import ReferenceBackend

        return ReferenceBackend()
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"backend: expected 'optimized', 'golden' or 'module:Class', got {spec!r}")
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
    """Traces of one rank: the golden's, and the backend's in each mode that ran."""

    rank: int
    golden: Trace
    chained: Trace | None = None
    isolated: Trace | None = None

    def for_reduce(self) -> RankRun:
        """Only what `reduce_ranks` reads (route, gather, shared), so a rank's large
        intermediates can be freed once they are compared (DeepSeek-V3 at EP8 holds ~4 GB per
        trace)."""
        keep = REDUCE_INPUTS

        def thin(t: Trace | None) -> Trace | None:
            return None if t is None else t.only(keep)

        return RankRun(self.rank, self.golden.only(keep), thin(self.chained), thin(self.isolated))


def _breadcrumb(problem: MoEProblem, rank: int, stage: str, mode: str) -> None:
    path = os.environ.get("MOE_VERIFY_BREADCRUMB")
    if path:
        Path(path).write_text(
            json.dumps({"case": problem.id, "rank": rank, "stage": stage, "mode": mode}) + "\n"
        )


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_stage_safely(
    backend: Backend,
    stage: str,
    problem: MoEProblem,
    inputs: MoEInputs,
    upstream: Trace,
    rank: int,
    mode: str,
) -> dict[str, object]:
    _breadcrumb(problem, rank, stage, mode)
    try:
        outputs = backend.run_stage(stage, problem, inputs, upstream, rank)
        _sync()  # an asynchronous kernel fault surfaces here, attributed to this stage
        return outputs
    except StageSkipped as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported per stage, never fatal to the run
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return {"error": f"{type(exc).__name__}: {exc} (at {Path(tb.filename).name}:{tb.lineno})"}


def did_not_run(outputs: dict[str, object]) -> str | None:
    if "skipped" in outputs:
        return f"skipped: {outputs['skipped']}"
    if "error" in outputs:
        return f"error: {outputs['error']}"
    return None


def run_chained(backend: Backend, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Trace:
    trace = Trace(backend.name, rank)
    blocked: str | None = None
    for stage in problem.stages:
        if blocked is not None:
            trace.add(stage, {"skipped": f"upstream stage {blocked} did not run"})
            continue
        outputs = run_stage_safely(backend, stage, problem, inputs, trace, rank, "chained")
        trace.add(stage, outputs)
        if did_not_run(outputs):
            blocked = stage
    return trace


def run_isolated(
    backend: Backend, problem: MoEProblem, inputs: MoEInputs, golden: Trace, rank: int
) -> Trace:
    """Each stage fed the golden's upstream: a divergence belongs to exactly that stage."""
    trace = Trace(backend.name, rank)
    for stage in problem.stages:
        if stage not in golden or did_not_run(golden[stage]):
            trace.add(stage, {"skipped": f"the golden has no {stage} output to compare"})
            continue
        trace.add(
            stage,
            run_stage_safely(backend, stage, problem, inputs, golden.upto(stage), rank, "isolated"),
        )
    return trace


def run_all_ranks(
    problem: MoEProblem,
    inputs: MoEInputs,
    backend: Backend,
    golden: Backend,
    modes: tuple[str, ...] = MODES,
) -> list[RankRun]:
    return [
        run_rank(problem, inputs, backend, golden, modes, rank)
        for rank in range(problem.topology.size)
    ]


def run_rank(
    problem: MoEProblem,
    inputs: MoEInputs,
    backend: Backend,
    golden: Backend,
    modes: tuple[str, ...],
    rank: int,
) -> RankRun:
    """The golden of `rank`, then the backend in each of `modes` on that rank."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    gold = run_chained(golden, problem, inputs, rank)
    failed = [s for s in gold if did_not_run(gold[s])]
    if failed:
        raise RuntimeError(
            f"{problem.id} rank {rank}: the golden itself failed at {failed[0]}: "
            f"{did_not_run(gold[failed[0]])}"
        )
    run = RankRun(rank, gold)
    if "chained" in modes:
        run.chained = run_chained(backend, problem, inputs, rank)
    if "isolated" in modes:
        run.isolated = run_isolated(backend, problem, inputs, gold, rank)
    return run


# The stages `reduce_ranks` reads from each rank's trace.
REDUCE_INPUTS = ("route", "gather", "shared")


def reduce_ranks(traces: list[Trace], problem: MoEProblem) -> dict[str, object]:
    """The cross-rank `reduce` stage from every rank's gather output (emulated all-reduce)."""
    from reference.topology import reduce_partials, reduce_with_shared

    missing = [t.rank for t in traces if "gather" not in t or did_not_run(t["gather"])]
    if missing:
        return {"skipped": f"gather did not run on rank(s) {missing}"}
    outs = [t["gather"]["out"] for t in traces]
    index = [t["route"].get("token_index") for t in traces]
    has_index = any(i is not None for i in index)
    if not problem.shared_experts:
        return {"out": reduce_partials(outs, problem.tokens, index if has_index else None)}
    missing = [t.rank for t in traces if "shared" not in t or did_not_run(t["shared"])]
    if missing:
        return {"skipped": f"shared did not run on rank(s) {missing}"}
    reduced_by_combine = problem.topology.kind in (TopologyKind.EP_HT, TopologyKind.EP_LL)
    shared = [t["shared"]["out"] for t in traces]
    out = reduce_with_shared(
        outs, shared, problem.tokens, index if has_index else None, reduced_by_combine
    )
    return {"out": out}


__all__ = [
    "MODES",
    "REDUCE_STAGE",
    "RankRun",
    "reduce_ranks",
    "resolve_backend",
    "run_all_ranks",
    "run_rank",
    "run_chained",
    "run_isolated",
]
