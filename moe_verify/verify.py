"""`verify(problem)`: run the golden and a backend on every rank, compare stage by stage, report.

mode "isolated" feeds each tested stage the golden's upstream, so the first failing stage is the
culprit; "chained" runs the tested backend end to end, which is what a user gets; "both" reports
the two side by side (the table shows the isolated culprit with the chained result beside it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moe_verify.inputs import make_inputs
from moe_verify.provenance import check_permuted_tokens
from moe_verify.runner import RankRun, reduce_ranks, resolve_backend, run_rank
from moe_verify.spec import REDUCE_STAGE, Backend, MoEInputs, MoEProblem, TopologyKind, Trace
from tolerance.compare import CheckResult, StageResult, Worst, compare, compare_stage
from tolerance.report import Report

_MODES = {"isolated": ("isolated",), "chained": ("chained",), "both": ("isolated", "chained")}


def verify(
    problem: MoEProblem,
    backend: str | Backend = "optimized",
    mode: str = "isolated",
    *,
    inputs: MoEInputs | None = None,
    device: torch.device | str | None = None,
    engine: str = "auto",
    dump_dir: Path | None = None,
    compare_device: torch.device | str | None = None,
) -> Report:
    """Verify `backend` against the golden on `problem`; see the module docstring for modes.

    `backend` is "optimized", "golden", "module:Class", or a Backend instance. On failure with
    `dump_dir`, the inputs and every trace are written there for `moe-verify replay`. Stages are
    compared on the golden's device unless `compare_device` names another (e.g. "cpu" to spend no
    GPU memory on the comparison's float64 temporaries).
    """
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {sorted(_MODES)}, got {mode!r}")
    modes = _MODES[mode]
    tested = resolve_backend(backend, engine)
    golden = resolve_backend("golden")
    if inputs is None:
        inputs = make_inputs(problem, device)
    # Rank by rank: compare, then keep only what the reduce needs (every trace when dumping),
    # so memory holds one rank's intermediates at a time.
    runs: list[RankRun] = []
    per_rank: dict[str, list[list[StageResult]]] = {m: [] for m in modes}
    for rank in range(problem.topology.size):
        run = run_rank(problem, inputs, tested, golden, modes, rank)
        for m in modes:
            per_rank[m].append(_compare_rank(problem, run, m, compare_device))
        runs.append(run if dump_dir is not None else run.for_reduce())
        del run
    results = {m: _merge_ranks(problem, runs, per_rank[m], m, compare_device) for m in modes}
    report = Report(
        problem,
        tested.name,
        modes[0],
        isolated=results.get("isolated"),
        chained=results.get("chained"),
        golden=golden.name,
        rank_experts=rank_experts(problem),
    )
    if dump_dir is not None and not report.passed:
        from moe_verify.dump import dump_case

        dump_case(Path(dump_dir), problem, inputs, runs, report)
    return report


def _compare_rank(
    problem: MoEProblem, run: RankRun, mode: str, device: torch.device | str | None
) -> list[StageResult]:
    """One rank's stage results in `mode` (ranks tagged when there are several)."""
    other: Trace = getattr(run, mode)
    results = compare(run.golden, other, problem, list(problem.stages), mode=mode, device=device)
    multi = problem.topology.size > 1
    results = [
        dataclasses.replace(r, rank=run.rank if multi else None, engine=engine_of(other, r.stage))
        for r in results
    ]
    if problem.provenance:
        results = [with_provenance(r, other, run.rank) for r in results]
    return results


def _merge_ranks(
    problem: MoEProblem,
    runs: list[RankRun],
    per_rank: list[list[StageResult]],
    mode: str,
    device: torch.device | str | None,
) -> list[StageResult]:
    """Per stage, every rank's result, then `reduce` (the runner's finish)."""
    ordered = [results[i] for i in range(len(per_rank[0])) for results in per_rank]
    if len(runs) > 1 or problem.shared_experts:  # the runner's finish: ranks summed, shared added
        ordered.append(_compare_reduce(problem, runs, mode, device))
    return ordered


def rank_experts(problem: MoEProblem) -> dict[int, list[int]] | None:
    """EP topologies: the global (logical) experts each rank hosts, for the report."""
    if problem.topology.kind is TopologyKind.TP:
        return None
    from reference.topology import placement

    return dict(enumerate(placement(problem)))


def with_provenance(result: StageResult, trace: Trace, rank: int) -> StageResult:
    """Permute of a provenance-tagged case: name the token each misplaced row really holds."""
    if result.stage != "permute" or "permute" not in trace or "a_perm" not in trace["permute"]:
        return result
    perm = trace["permute"]
    route = trace["route"]
    wrong = check_permuted_tokens(
        route["topk_ids"], perm["inv_perm"], perm["a_perm"], route.get("token_index")
    )
    worst = None
    if wrong:
        t, k, e, found = wrong[0]
        worst = Worst(token=t, k=k, expert=e, rank=rank, golden=t, other=found)
    listed = ", ".join(f"(t={t}, k={k}, e={e}) holds token {f}" for t, k, e, f in wrong[:5])
    check = CheckResult(
        "provenance",
        not wrong,
        len(wrong),
        0,
        "provenance-tagged tokens: each live slot's permuted row must carry its own token index "
        "(exact in every recipe, moe_verify/provenance.py)",
        worst,
        f"{len(wrong)} live slots hold another token's row" + (f": {listed}" if wrong else ""),
    )
    status = result.status if not wrong or result.status == "error" else "fail"
    return dataclasses.replace(result, checks=[*result.checks, check], status=status)


def engine_of(trace: Trace, stage: str) -> str | None:
    engine = trace[stage].get("engine") if stage in trace else None
    return engine if isinstance(engine, str) else None


def _compare_reduce(
    problem: MoEProblem, runs: list[RankRun], mode: str, device: torch.device | str | None
) -> StageResult:
    golden = Trace("golden")
    golden.add(REDUCE_STAGE, reduce_ranks([r.golden for r in runs], problem))
    other = Trace(getattr(runs[0], mode).backend)
    other.add(REDUCE_STAGE, reduce_ranks([getattr(r, mode) for r in runs], problem))
    return compare_stage(REDUCE_STAGE, golden, other, problem, mode=mode, device=device)
