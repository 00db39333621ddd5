"""`verify(problem)`: run the golden and a backend on every rank, compare stage by stage, report.

mode "isolated" feeds each tested stage the golden's upstream, so the first failing stage is the
culprit; "chained" runs the tested backend end to end, which is what a user gets; "both" reports
the two side by side (the table shows the isolated culprit with the chained result beside it).

`verify_rank` is the one unit every caller builds on: run one rank (the golden, then the tested
backend in each mode), compare, and tag the results (rank, GEMM engine, provenance). `verify`
loops it over the ranks and adds the cross-rank `reduce`; the torchrun worker runs it on its own
rank; calibrate and bench call it for their traces. Which golden a GEMM is held to bit for bit
on SM90 is moe_verify/sm90_chain.py's choice; the second run of a metamorphic pair (two poisons,
an invariance) and its agreement check are moe_verify/invariance_runs.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify import progress
from moe_verify.contain import deadline
from moe_verify.device import default_device
from moe_verify.dump import dump_case, load_case
from moe_verify.inputs import check_inputs, make_inputs
from moe_verify.invariance_runs import Twin, invariance_pair, with_agreement
from moe_verify.poison import poison_padding
from moe_verify.preflight import preflight
from moe_verify.runner import RankRun, resolve_backend, run_golden, run_rank
from moe_verify.sm90_chain import (
    check_gemm_recipe,
    declare_hardware_gate,
    with_gemm_recipe,
    with_sm90_chain,
)
from moe_verify.spec import (
    Backend,
    Engine,
    GemmRecipe,
    Mode,
    MoEInputs,
    MoEProblem,
    Stage,
    StageSkipped,
    TopologyKind,
    Trace,
    check_bool,
)
from reference.topology import reduce_ranks
from tolerance.compare import StageResult, compare, compare_stage
from tolerance.invariance import INVARIANCES
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
    gemm_recipe: GemmRecipe | str | None = None,
) -> RankVerdict:
    """Run, compare and tag one rank: the golden of `rank` (or `golden_trace`, already run), the
    tested backend in each of `modes`, every stage of the rank compared on `compare_device` (the
    golden's device by default). Isolated GEMM stages are held bit for bit to the golden's
    tensor-core recipe where `gemm_recipe_applies` (`with_gemm_recipe`); a chained run to the
    golden's SM90 chain where `with_sm90_chain` builds one; a tested act_quant whose gate is the
    recorded table's is declared as that recipe first (`declare_hardware_gate`; all four in
    moe_verify/sm90_chain.py)."""
    run = run_rank(problem, inputs, tested, golden, rank, modes, golden_trace)
    for trace in run.tested.values():
        declare_hardware_gate(problem, trace)
    if Mode.ISOLATED in run.tested:
        run.golden = with_gemm_recipe(
            problem, inputs, golden, run.golden, run.tested[Mode.ISOLATED], gemm_recipe
        )
    if Mode.CHAINED in run.tested:
        run.chained_golden = with_sm90_chain(
            problem, inputs, golden, run.golden, run.tested[Mode.CHAINED], gemm_recipe
        )
    return RankVerdict(run, {m: compare_rank(problem, run, m, compare_device) for m in modes})


def compare_rank(
    problem: MoEProblem, run: RankRun, mode: Mode, device: torch.device | str | None = None
) -> list[StageResult]:
    """One rank's stage results in `mode`, tagged with the rank (when there are several), the GEMM
    engine the tested side reported, and for provenance-tagged cases the tokens each row holds."""
    tested = run.tested[mode]
    golden = run.golden_for(mode)
    results = compare(golden, tested, problem, list(problem.stages), mode=mode, device=device)
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
        (golden, [r.golden_for(mode) for r in runs]),
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


def reduce_maps(problem: MoEProblem, runs: list[RankRun], mode: Mode) -> list:
    """The plots' data of a failing cross-rank `reduce` (one panel: it is every rank's sum)."""
    from moe_verify.plot import error_maps

    golden, tested = reduce_traces(problem, runs, mode)
    return error_maps(problem, RankRun(0, golden, {mode: tested}), mode, [Stage.REDUCE])


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
    case_timeout_s: float | None = None,
    plot_dir: Path | None = None,
    workspace: bool = False,
    poison: int | Sequence[int] | None = None,
    padding_poison: bool = False,
    gemm_recipe: GemmRecipe | str | None = None,
) -> Report:
    """Verify `backend` against the golden on `problem`; see the module docstring for modes.

    `backend` is "optimized", "golden", "vllm", "module:Class", or a Backend instance. Given
    `inputs` must match the problem (`check_inputs`); otherwise they are made from its seed after a
    memory pre-flight. On failure with `dump_dir`, the inputs and every trace are written there for
    `moe-verify replay`; with `plot_dir`, one heatmap per failing stage (moe_verify/plot.py).
    Stages are compared on the golden's device unless `compare_device` names another (e.g. "cpu"
    to spend no GPU memory on the comparison's float64 temporaries). `case_timeout_s` bounds the
    whole case (moe_verify/contain.py). `workspace` and `poison` build the optimized backend with
    reused, poisoned workspaces; two poison bytes run the tested side once under each, and every
    stage must also agree bit for bit between the two (tolerance/invariance.py).

    `padding_poison`: the golden's padding rows (permute, or the batches past masked_m under
    ep:N+ll) hold stale worst-case values (moe_verify/poison.py `poison_padding`) before any
    isolated stage reads them, so a GEMM that lets padding reach live rows fails (FlashInfer
    #3650). It changes what isolated mode feeds the tested stages only: chained mode runs the
    tested side on its own outputs and is unaffected, so mode "chained" alone is refused.

    `gemm_recipe`: what gemm1 / gemm2 are held to. None (automatic): bit for bit to the golden's
    tensor-core recipe where the tested stage ran DeepGEMM on an SM90 GPU (or declares the
    recipe), isolated on the same operands and chained against the golden's SM90 chain, every
    stage then bit for bit (`with_sm90_chain`), else bounded against fp32 dequant math;
    "tensor_core": bit for bit wherever the SM90 fp8_block recipe applies (on a CPU too: the
    Triton interpreter's exact math then fails it); "fp32_dequant": bounded always. The bound is
    reported beside a bitwise verdict (docs/tolerance.md#zero-tolerance-on-sm90).
    """
    modes = Mode.select(mode)
    gemm_recipe = check_gemm_recipe(problem, gemm_recipe)
    padding_poison = check_bool("padding_poison", padding_poison)
    if padding_poison:
        check_padding_poison(modes)
    poisons = _poisons(poison)
    if not isinstance(backend, str) and (workspace or poisons):
        raise ValueError(
            f"workspace={workspace}, poison={poison}: they build the backend, so pass it by name "
            f"(e.g. {backend_spec(backend)!r}), not as an instance already built"
        )
    tested = resolve_backend(
        backend, engine, workspace=workspace, poison=poisons[0] if poisons else None
    )
    twin = (
        resolve_backend(backend, engine, workspace=workspace, poison=poisons[1])
        if len(poisons) == 2
        else None
    )
    golden = resolve_backend("golden")
    inputs = case_inputs(problem, inputs, device)
    sides = 1 + len(modes) * (2 if twin is not None else 1)
    steps = problem.topology.size * len(problem.stages) * sides
    where = lambda: f"{problem.id}, {progress.where()}"  # what a timeout names
    with deadline(case_timeout_s, where), progress.case_bar(problem.id, steps):
        label = " vs ".join(f"0x{b:02x}" for b in poisons)
        report, runs, maps = _verify_ranks(
            problem,
            inputs,
            tested,
            Twin(twin, problem, label, INVARIANCES["poison"]) if twin is not None else None,
            golden,
            modes,
            dump_dir,
            plot_dir,
            compare_device,
            padding_poison=padding_poison,
            gemm_recipe=gemm_recipe,
        )
    if poisons:
        report.files["poison"] = [f"0x{b:02x}" for b in poisons]
    if padding_poison:
        padded = Stage.DISPATCH if problem.topology.kind is TopologyKind.EP_LL else Stage.PERMUTE
        report.files["padding_poison"] = [str(padded)]
    if plot_dir is not None and maps:
        from moe_verify.plot import write_plots

        report.files["plots"] = [str(f) for f in write_plots(problem, maps, Path(plot_dir))]
    if dump_dir is not None and not report.passed:
        spec = backend if isinstance(backend, str) else backend_spec(backend)
        where = dump_case(
            Path(dump_dir),
            problem,
            inputs,
            runs,
            report,
            backend=spec,
            engine=str(getattr(tested, "engine", None) or Engine(engine)),
            mode=str(mode),
            workspace=workspace,
            poison=list(poisons),
            padding_poison=padding_poison,
            gemm_recipe=None if gemm_recipe is None else str(gemm_recipe),
        )
        report.files["dump"] = [str(where)]
    return report


def check_padding_poison(modes: tuple[Mode, ...]) -> None:
    """The padding poison needs isolated mode."""
    if Mode.ISOLATED not in modes:
        raise ValueError(
            "padding_poison: it poisons the golden's upstream, which only isolated mode feeds to "
            "the tested stages; mode 'chained' would run unpoisoned (use 'isolated' or 'both')"
        )


def case_inputs(
    problem: MoEProblem, inputs: MoEInputs | None, device: torch.device | str | None
) -> MoEInputs:
    """The given inputs once checked against the problem, else new ones from its seed after a
    memory pre-flight."""
    if inputs is not None:
        check_inputs(problem, inputs)
        return inputs
    preflight(problem, device if device is not None else default_device())
    return make_inputs(problem, device)


def _verify_ranks(
    problem: MoEProblem,
    inputs: MoEInputs,
    tested: Backend,
    twin: Twin | None,
    golden: Backend,
    modes: tuple[Mode, ...],
    dump_dir: Path | None,
    plot_dir: Path | None,
    compare_device: torch.device | str | None,
    *,
    padding_poison: bool = False,
    gemm_recipe: GemmRecipe | None = None,
) -> tuple[Report, list[RankRun], list]:
    """Every rank verified, then the reduce; the report, the kept runs and the plots' data.
    `twin`: the tested side's second run of a metamorphic pair, every stage of which must agree
    bit for bit with the first. `padding_poison`: each rank's golden with its padding rows
    poisoned (`poison_padding`), the one golden both the tested side and a twin read.
    `gemm_recipe`: as `verify`'s."""
    # Rank by rank: compare, then keep only what the reduce needs (every trace when dumping),
    # so memory holds one rank's intermediates at a time.
    runs: list[RankRun] = []
    per_rank: list[dict[Mode, list[StageResult]]] = []
    maps: list = []
    for rank in range(problem.topology.size):
        poisoned = (
            poison_padding(run_golden(golden, problem, inputs, rank), problem)
            if padding_poison
            else None
        )
        verdict = verify_rank(
            problem, inputs, tested, golden, rank, modes,
            golden_trace=poisoned, compare_device=compare_device, gemm_recipe=gemm_recipe,
        )  # fmt: skip
        if twin is not None:
            # A twin on the same problem reads the same golden; on a variant, its own.
            same = twin.problem == problem
            other = run_rank(
                twin.problem, inputs, twin.backend, golden, rank, modes,
                verdict.run.golden if same else None,
            )  # fmt: skip
            verdict.results.update(
                {m: with_agreement(verdict.results[m], verdict.run, other, m, twin) for m in modes}
            )
        if plot_dir is not None:
            from moe_verify.plot import error_maps

            for m in modes:
                failing = [r.stage for r in verdict.results[m] if r.status.failing]
                if failing:
                    maps += error_maps(problem, verdict.run, m, failing)
        per_rank.append(verdict.results)
        runs.append(verdict.run if dump_dir is not None else verdict.run.for_reduce())
        del verdict
    results = {}
    for m in modes:
        # stage by stage, ranks ascending within a stage; then the reduce
        ordered = [r[m][i] for i in range(len(per_rank[0][m])) for r in per_rank]
        if has_reduce(problem):
            reduced = compare_reduce(problem, runs, m, compare_device)
            ordered.append(reduced)
            if plot_dir is not None and reduced.status.failing:
                maps += reduce_maps(problem, runs, m)
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
    return report, runs, maps


def verify_invariance(
    problem: MoEProblem,
    kind: str,
    backend: str = "optimized",
    mode: Mode | str = "isolated",
    *,
    engine: Engine | str = Engine.AUTO,
    inputs: MoEInputs | None = None,
    device: torch.device | str | None = None,
    case_timeout_s: float | None = None,
) -> Report:
    """Verify `backend` against the golden on `problem`, and run it a second time with only the
    setting `kind` changed: every stage must also agree bit for bit between the two runs, a check
    named after the setting and the pair (tolerance/invariance.py). A setting of the tested side
    alone (m_sum, expected_m, num_sms) reaches the later stages in chained mode; in isolated mode
    each stage reads the golden's upstream, so only the stage that the setting changes sees it.
    A setting of the problem (alignment, ll_capacity) gives the second run its own golden, whose
    upstream its isolated stages read."""
    modes = Mode.select(mode)
    tested, second, second_problem, label = invariance_pair(problem, kind, backend, engine)
    golden = resolve_backend("golden")
    inputs = case_inputs(problem, inputs, device)
    twin = Twin(second, second_problem, label, INVARIANCES[kind])
    steps = problem.topology.size * len(problem.stages) * (1 + 2 * len(modes))
    where = lambda: f"{problem.id}, {progress.where()}"  # what a timeout names
    with deadline(case_timeout_s, where), progress.case_bar(problem.id, steps):
        report, _, _ = _verify_ranks(problem, inputs, tested, twin, golden, modes, None, None, None)
    report.files["invariance"] = [f"{kind}: {label}"]
    return report


def _poisons(poison: int | Sequence[int] | None) -> tuple[int, ...]:
    """None, one byte or two distinct bytes, each in 0..255."""
    if poison is None:
        return ()
    values = (poison,) if isinstance(poison, int) else tuple(poison)
    if not 1 <= len(values) <= 2:
        raise ValueError(f"poison: expected one or two bytes, got {len(values)}: {values}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0xFF:
            raise ValueError(f"poison: expected a byte in 0..255, got {v!r}")
    if len(values) == 2 and values[0] == values[1]:
        raise ValueError(f"poison: a two-poison run needs two different bytes, got {values}")
    return values


def backend_spec(backend: Backend) -> str:
    """'module:Class' of a Backend instance, as `--backend` takes it (for dumps and replay)."""
    cls = type(backend)
    return f"{cls.__module__}:{cls.__qualname__}"


def replay(
    directory: Path,
    backend: str | Backend | None = None,
    engine: Engine | str | None = None,
    mode: Mode | str | None = None,
) -> Report:
    """Re-run a dumped case on the dumped inputs (bit-identical to the failing run), with the
    backend, engine, mode and workspace options the dump recorded unless others are given, and
    its padding poison and GEMM recipe (what the case was checked against) always.
    `directory` is the case directory or a dump directory holding exactly one case."""
    case = load_case(directory)
    chosen = backend if backend is not None else case.backend
    if chosen is None:
        raise ValueError(
            f"dump {case.path} does not record its backend (an older dump): pass --backend"
        )
    return verify(
        case.problem,
        backend=chosen,
        mode=mode if mode is not None else (case.mode or "both"),
        inputs=case.inputs,
        engine=engine if engine is not None else (case.engine or Engine.AUTO),
        workspace=case.workspace if backend is None else False,
        poison=(case.poison or None) if backend is None else None,
        padding_poison=case.padding_poison,
        gemm_recipe=case.gemm_recipe,
    )


def rank_experts(problem: MoEProblem) -> dict[int, list[int]] | None:
    """EP topologies: the global (logical) experts each rank hosts, for the report."""
    if problem.topology.kind is TopologyKind.TP:
        return None
    from reference.topology import placement

    return dict(enumerate(placement(problem)))


def engine_of(trace: Trace, stage: str) -> str | None:
    engine = trace[stage].get("engine") if stage in trace else None
    return engine if isinstance(engine, str) else None
