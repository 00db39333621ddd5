"""`verify(problem)`: run the golden and a backend on every rank, compare stage by stage, report.

mode "isolated" feeds each tested stage the golden's upstream, so the first failing stage is the
culprit; "chained" runs the tested backend end to end, which is what a user gets; "both" reports
the two side by side (the table shows the isolated culprit with the chained result beside it).

`verify_rank` is the one unit every caller builds on: run one rank (the golden, then the tested
backend in each mode), compare, and tag the results (rank, GEMM engine, provenance). `verify`
loops it over the ranks and adds the cross-rank `reduce`; the torchrun worker runs it on its own
rank; calibrate and bench call it for their traces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify.dump import dump_case, load_case
from moe_verify.inputs import make_inputs
from moe_verify.runner import RankRun, resolve_backend, run_rank
from moe_verify.spec import (
    Backend,
    Engine,
    Mode,
    MoEInputs,
    MoEProblem,
    Stage,
    StageSkipped,
    TopologyKind,
    Trace,
)
from reference.topology import reduce_ranks
from tolerance.compare import StageResult, compare, compare_stage
from tolerance.provenance import with_provenance
from tolerance.report import Report


@dataclass
class RankVerdict:
    """One rank verified: its traces and, per mode, its tagged stage results."""

    run: RankRun
    results: dict[Mode, list[StageResult]]


def verify_rank(
    problem: MoEProblem,
    inputs: MoEInputs,
    tested: Backend,
    golden: Backend,
    rank: int,
    modes: tuple[Mode, ...],
    *,
    golden_trace: Trace | None = None,
    compare_device: torch.device | str | None = None,
) -> RankVerdict:
    """Run, compare and tag one rank: the golden of `rank` (or `golden_trace`, already run), the
    tested backend in each of `modes`, every stage of the rank compared on `compare_device` (the
    golden's device by default)."""
    run = run_rank(problem, inputs, tested, golden, rank, modes, golden_trace)
    return RankVerdict(run, {m: compare_rank(problem, run, m, compare_device) for m in modes})


def compare_rank(
    problem: MoEProblem, run: RankRun, mode: Mode, device: torch.device | str | None = None
) -> list[StageResult]:
    """One rank's stage results in `mode`, tagged with the rank (when there are several), the GEMM
    engine the tested side reported, and for provenance-tagged cases the tokens each row holds."""
    tested = run.tested[mode]
    results = compare(run.golden, tested, problem, list(problem.stages), mode=mode, device=device)
    rank = run.rank if problem.topology.size > 1 else None
    results = [
        dataclasses.replace(r, rank=rank, engine=engine_of(tested, r.stage)) for r in results
    ]
    if problem.provenance:
        results = [with_provenance(r, tested, run.rank) for r in results]
    return results


def reduce_traces(problem: MoEProblem, runs: list[RankRun], mode: Mode) -> tuple[Trace, Trace]:
    """The golden's and the tested side's `reduce` stage, each from its own ranks' traces."""
    golden, tested = Trace("golden"), Trace(runs[0].tested[mode].backend)
    for trace, ranks in (
        (golden, [r.golden for r in runs]),
        (tested, [r.tested[mode] for r in runs]),
    ):
        try:
            trace.add(Stage.REDUCE, {"out": reduce_ranks(ranks, problem)})
        except StageSkipped as exc:
            trace.add_skipped(Stage.REDUCE, str(exc))
    return golden, tested


def compare_reduce(
    problem: MoEProblem, runs: list[RankRun], mode: Mode, device: torch.device | str | None = None
) -> StageResult:
    """The cross-rank `reduce` of the tested side's ranks against the golden's ranks."""
    golden, tested = reduce_traces(problem, runs, mode)
    return compare_stage(Stage.REDUCE, golden, tested, problem, mode=mode, device=device)


def has_reduce(problem: MoEProblem) -> bool:
    """Several ranks are summed, or shared experts are added: the runner's finish is checked."""
    return problem.topology.size > 1 or problem.shared_experts > 0


def verify(
    problem: MoEProblem,
    backend: str | Backend = "optimized",
    mode: Mode | str = "isolated",
    *,
    inputs: MoEInputs | None = None,
    device: torch.device | str | None = None,
    engine: Engine | str = Engine.AUTO,
    dump_dir: Path | None = None,
    compare_device: torch.device | str | None = None,
) -> Report:
    """Verify `backend` against the golden on `problem`; see the module docstring for modes.

    `backend` is "optimized", "golden", "module:Class", or a Backend instance. On failure with
    `dump_dir`, the inputs and every trace are written there for `moe-verify replay`. Stages are
    compared on the golden's device unless `compare_device` names another (e.g. "cpu" to spend no
    GPU memory on the comparison's float64 temporaries).
    """
    modes = Mode.select(mode)
    tested = resolve_backend(backend, engine)
    golden = resolve_backend("golden")
    if inputs is None:
        inputs = make_inputs(problem, device)
    # Rank by rank: compare, then keep only what the reduce needs (every trace when dumping),
    # so memory holds one rank's intermediates at a time.
    runs: list[RankRun] = []
    per_rank: list[dict[Mode, list[StageResult]]] = []
    for rank in range(problem.topology.size):
        verdict = verify_rank(
            problem, inputs, tested, golden, rank, modes, compare_device=compare_device
        )
        per_rank.append(verdict.results)
        runs.append(verdict.run if dump_dir is not None else verdict.run.for_reduce())
        del verdict
    results = {}
    for m in modes:
        # stage by stage, ranks ascending within a stage; then the reduce
        ordered = [r[m][i] for i in range(len(per_rank[0][m])) for r in per_rank]
        if has_reduce(problem):
            ordered.append(compare_reduce(problem, runs, m, compare_device))
        results[m] = ordered
    report = Report(
        problem,
        tested.name,
        modes[0],
        isolated=results.get(Mode.ISOLATED),
        chained=results.get(Mode.CHAINED),
        golden=golden.name,
        rank_experts=rank_experts(problem),
    )
    if dump_dir is not None and not report.passed:
        dump_case(Path(dump_dir), problem, inputs, runs, report)
    return report


def replay(
    directory: Path,
    backend: str | Backend = "optimized",
    engine: Engine | str = Engine.AUTO,
    mode: Mode | str = "both",
) -> Report:
    """Re-run a dumped case on the dumped inputs (bit-identical to the failing run)."""
    problem, inputs = load_case(directory)
    return verify(problem, backend=backend, mode=mode, inputs=inputs, engine=engine)


def rank_experts(problem: MoEProblem) -> dict[int, list[int]] | None:
    """EP topologies: the global (logical) experts each rank hosts, for the report."""
    if problem.topology.kind is TopologyKind.TP:
        return None
    from reference.topology import placement

    return dict(enumerate(placement(problem)))


def engine_of(trace: Trace, stage: str) -> str | None:
    engine = trace[stage].get("engine") if stage in trace else None
    return engine if isinstance(engine, str) else None
