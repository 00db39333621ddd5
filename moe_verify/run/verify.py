"""`verify(problem)`: run the golden and a backend on every rank, compare stage by stage, report.

mode "isolated" feeds each tested stage the golden's upstream, so the first failing stage is the
culprit; "chained" runs the tested backend end to end, which is what a user gets; "both" reports
the two side by side (the table shows the isolated culprit with the chained result beside it).

`verify_rank` is the one unit every caller builds on: run one rank (the golden, then the tested
backend in each mode), compare, and tag the results (rank, GEMM engine, provenance). `verify`
loops it over the ranks and adds the cross-rank `reduce`; the torchrun worker runs it on its own
rank; calibrate and bench call it for their traces. Which golden a GEMM is held to bit for bit
on SM90 is moe_verify/run/sm90_chain.py's choice; the second run of a metamorphic pair (two poisons,
an invariance) and its agreement check are moe_verify/run/invariance.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_verify.common import progress
from moe_verify.common.device import default_device
from moe_verify.common.timing import phase
from moe_verify.run.contain import deadline
from moe_verify.run.dump import dump_case, load_case
from moe_verify.run.inputs import check_inputs, make_inputs
from moe_verify.run.invariance import Twin, invariance_pair, with_agreement
from moe_verify.run.options import RunOptions, options_of
from moe_verify.run.poison import poison_padding
from moe_verify.run.preflight import preflight
from moe_verify.run.runner import RankRun, Side, resolve_backend, run_golden, run_rank
from moe_verify.run.sm90_chain import (
    check_gemm_recipe,
    declare_hardware_gate,
    with_gemm_recipe,
    with_sm90_chain,
)
from moe_verify.run.workspaces import Workspaces
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
    check_device,
    check_enum,
    check_int,
    check_output_dir,
    check_type,
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
    moe_verify/run/sm90_chain.py)."""
    check_type("verify_rank: problem", problem, MoEProblem)
    check_int(
        f"verify_rank: rank (topology {problem.topology})", rank, 0, problem.topology.size - 1
    )
    if isinstance(modes, str) or not isinstance(modes, (tuple, list)):
        raise TypeError(
            f"verify_rank: modes: expected a tuple of modes such as ('isolated', 'chained'), got "
            f"{modes!r} ({type(modes).__name__})"
        )
    modes = tuple(check_enum("verify_rank: modes", m, Mode) for m in modes)
    run = run_rank(problem, inputs, tested, golden, rank, modes, golden_trace)
    for trace in run.tested.values():
        declare_hardware_gate(problem, trace)
    if Mode.ISOLATED in run.tested:
        with phase("golden tensor-core gemms"):
            run.golden = with_gemm_recipe(
                problem, inputs, golden, run.golden, run.tested[Mode.ISOLATED], gemm_recipe
            )
    if Mode.CHAINED in run.tested:
        with phase("golden sm90 chain"):
            run.chained_golden = with_sm90_chain(
                problem, inputs, golden, run.golden, run.tested[Mode.CHAINED], gemm_recipe
            )
    with phase("compare"):
        results = {m: compare_rank(problem, run, m, compare_device) for m in modes}
    return RankVerdict(run, results)


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
    from moe_verify.report.error_measure import error_maps

    golden, tested = reduce_traces(problem, runs, mode)
    return error_maps(problem, RankRun(0, golden, {mode: tested}), mode, [Stage.REDUCE])


def has_reduce(problem: MoEProblem) -> bool:
    """Several ranks are summed, or shared experts are added: the runner's finish is checked."""
    return problem.topology.size > 1 or problem.shared_experts > 0


def verify(
    problem: MoEProblem,
    backend: str | type | Backend | None = None,
    mode: Mode | str | None = None,
    *,
    options: RunOptions | None = None,
    inputs: MoEInputs | None = None,
    device: torch.device | str | None = None,
    **run: Any,
) -> Report:
    """Verify a backend against the golden on `problem` as `options` say (moe_verify/run/options.py
    RunOptions: backend, mode, engine, workspaces and poisons, padding poison, GEMM recipe,
    comparison device, case timeout, dump and plot directories, invariance); see the module
    docstring for modes. The older form of the call, `backend`, `mode` and RunOptions' fields as
    keyword arguments (`verify(problem, backend="golden", mode="both")`), builds the options
    from them; giving both is a ValueError.

    Given `inputs` must match the problem (`check_inputs`); otherwise they are made from its seed
    on `device` (default: the GPU when there is one) after a memory pre-flight. On failure with a
    dump directory, the inputs, every trace and the options go there for `moe-verify replay`;
    with a plot directory, one heatmap per failing stage (moe_verify/report/plot.py).
    `case_timeout_s`
    bounds the whole case (moe_verify/run/contain.py). Two poison bytes run the tested side once
    under
    each, an invariance once with the setting changed (moe_verify/run/invariance.py), and every
    stage must also agree bit for bit between the two runs (tolerance/invariance.py).

    `padding_poison`: the golden's padding rows (permute, or the batches past masked_m under
    ep:N+ll) hold stale worst-case values (moe_verify/run/poison.py `poison_padding`) before any
    isolated stage reads them, so a GEMM that lets padding reach live rows fails (FlashInfer
    #3650). It changes what isolated mode feeds the tested stages only: chained mode runs the
    tested side on its own outputs and is unaffected, so mode "chained" alone is refused.

    `gemm_recipe`: what gemm1 / gemm2 are held to. None (automatic): bit for bit to the golden's
    tensor-core recipe where the tested stage ran DeepGEMM on an SM90 GPU (or declares the
    recipe), isolated on the same operands and chained against the golden's SM90 chain, every
    stage then bit for bit (moe_verify/run/sm90_chain.py `with_sm90_chain`), else bounded against
    fp32 dequant math; "tensor_core": bit for bit wherever the SM90 fp8_block recipe applies (on
    a CPU too: the Triton interpreter's exact math then fails it); "fp32_dequant": bounded
    always. The bound is reported beside a bitwise verdict
    (docs/tolerance.md#zero-tolerance-on-sm90).
    """
    given = {k: v for k, v in (("backend", backend), ("mode", mode)) if v is not None}
    opts = options_of("verify", options, {**given, **run})
    modes = opts.modes
    check_type("verify: problem", problem, MoEProblem)
    check_output_dir("dump_dir", opts.dump_dir)  # before any work, as the CLI's flags are
    check_output_dir("plot_dir", opts.plot_dir)
    if opts.compare_device is not None:
        check_device("compare_device", opts.compare_device, present=True)
    if device is not None and inputs is None:
        check_device("device", device, present=True)
    check_gemm_recipe(problem, opts.gemm_recipe)
    tested, twin = tested_sides(problem, opts)
    golden = resolve_backend("golden")
    with phase("inputs"):
        inputs = case_inputs(problem, inputs, device)
    sides = 1 + len(modes) * (2 if twin is not None else 1)
    steps = problem.topology.size * len(problem.stages) * sides
    where = lambda: f"{problem.id}, {progress.where()}"  # what a timeout names
    with deadline(opts.case_timeout_s, where), progress.case_bar(problem.id, steps):
        report, runs, maps = _verify_ranks(problem, inputs, tested, twin, golden, opts)
    if opts.invariance is not None and twin is not None:
        report.files["invariance"] = [f"{opts.invariance}: {twin.label}"]
    if opts.poison:
        report.files["poison"] = [f"0x{b:02x}" for b in opts.poison]
    if opts.padding_poison:
        padded = Stage.DISPATCH if problem.batched else Stage.PERMUTE
        report.files["padding_poison"] = [str(padded)]
    if opts.plot_dir is not None and maps:
        from moe_verify.report.plot import write_plots

        with writing("plot_dir", opts.plot_dir, report):
            report.files["plots"] = [str(f) for f in write_plots(problem, maps, opts.plot_dir)]
    if opts.dump_dir is not None and not report.passed:
        ran = dataclasses.replace(opts, engine=engine_ran(tested, opts.engine))
        with writing("dump_dir", opts.dump_dir, report):
            where = dump_case(opts.dump_dir, problem, inputs, runs, report, ran)
        report.files["dump"] = [str(where)]
    return report


class OutputNotWritten(OSError):
    """A finished run's dump or plots that could not be written (a full disk: the directory was
    checked before the run); `report` is the run's report, so its verdict is not lost."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


@contextlib.contextmanager
def writing(name: str, path: Path, report: Report) -> Iterator[None]:
    """Writing the output `name` (dump_dir, plot_dir) of the run `report` reports: an OSError
    becomes an OutputNotWritten naming the argument and the path, carrying the report."""
    try:
        yield
    except OSError as exc:
        raise OutputNotWritten(
            f"{name} {path}: not written after the run, whose verdict was {report.verdict.upper()} "
            f"({exc})",
            report,
        ) from exc


def tested_sides(problem: MoEProblem, options: RunOptions) -> tuple[Side, Twin | None]:
    """The tested side (the backend with the workspaces the options ask for), and the second
    run of its metamorphic pair: the invariance's, or the second poison's (the first poison is
    the first run's), or None."""
    if options.invariance is not None:
        kind = options.invariance
        first, second, second_problem, label = invariance_pair(
            problem, kind, options.backend, options.engine
        )
        return Side(first), Twin(Side(second), second_problem, label, INVARIANCES[kind])
    poisons = options.poison
    backend = resolve_backend(options.backend, options.engine)

    def side(poison: int | None) -> Side:
        return Side(backend, Workspaces(options.workspace, poison))

    tested = side(poisons[0] if poisons else None)
    if len(poisons) < 2:
        return tested, None
    label = " vs ".join(f"0x{b:02x}" for b in poisons)
    return tested, Twin(side(poisons[1]), problem, label, INVARIANCES["poison"])


def engine_ran(tested: Backend | Side, asked: Engine) -> Engine:
    """The engine the tested backend says it runs (the optimized one resolves auto), for the
    dump; `asked` where it names none of ours."""
    if isinstance(tested, Side):
        tested = tested.backend
    try:
        return Engine(getattr(tested, "engine", None) or asked)
    except ValueError:  # a backend's own `engine` attribute
        return asked


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
    options: RunOptions,
) -> tuple[Report, list[RankRun], list]:
    """Every rank verified, then the reduce; the report, the kept runs and the plots' data.
    `twin`: the tested side's second run of a metamorphic pair, every stage of which must agree
    bit for bit with the first. With `options.padding_poison`, each rank's golden has its
    padding rows poisoned (`poison_padding`), the one golden both the tested side and a twin
    read."""
    modes, plot = options.modes, options.plot_dir is not None
    # Rank by rank: compare, then keep only what the reduce needs (every trace when dumping),
    # so memory holds one rank's intermediates at a time.
    runs: list[RankRun] = []
    per_rank: list[dict[Mode, list[StageResult]]] = []
    maps: list = []
    for rank in range(problem.topology.size):
        poisoned = (
            poison_padding(run_golden(golden, problem, inputs, rank), problem)
            if options.padding_poison
            else None
        )
        verdict = verify_rank(
            problem, inputs, tested, golden, rank, modes, golden_trace=poisoned,
            compare_device=options.compare_device, gemm_recipe=options.gemm_recipe,
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
        if plot:
            from moe_verify.report.error_measure import error_maps

            for m in modes:
                failing = [r.stage for r in verdict.results[m] if r.status.failing]
                if failing:
                    maps += error_maps(problem, verdict.run, m, failing)
        per_rank.append(verdict.results)
        runs.append(verdict.run if options.dump_dir is not None else verdict.run.for_reduce())
        del verdict
    results = {}
    for m in modes:
        # stage by stage, ranks ascending within a stage; then the reduce
        ordered = [r[m][i] for i in range(len(per_rank[0][m])) for r in per_rank]
        if has_reduce(problem):
            with phase("compare"):
                reduced = compare_reduce(problem, runs, m, options.compare_device)
            ordered.append(reduced)
            if plot and reduced.status.failing:
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
    backend: str | type | Backend = "optimized",
    mode: Mode | str = "isolated",
    *,
    engine: Engine | str = Engine.AUTO,
    inputs: MoEInputs | None = None,
    device: torch.device | str | None = None,
    case_timeout_s: float | None = None,
) -> Report:
    """`verify` with the invariance `kind` (RunOptions.invariance): `backend` verified against
    the golden on `problem`, and run a second time with only the setting `kind` changed: every
    stage must also agree bit for bit between the two runs, a check named after the setting and
    the pair (tolerance/invariance.py). A setting of the tested side alone (m_sum, expected_m,
    num_sms) reaches the later stages in chained mode; in isolated mode each stage reads the
    golden's upstream, so only the stage that the setting changes sees it. A setting of the
    problem (alignment, ll_capacity) gives the second run its own golden, whose upstream its
    isolated stages read."""
    options = RunOptions(
        backend, mode, engine=engine, case_timeout_s=case_timeout_s, invariance=kind
    )
    return verify(problem, options=options, inputs=inputs, device=device)


def replay(
    directory: Path,
    backend: str | type | Backend | None = None,
    engine: Engine | str | None = None,
    mode: Mode | str | None = None,
) -> Report:
    """Re-run a dumped case on the dumped inputs (bit-identical to the failing run) with the
    options the dump recorded (moe_verify/run/options.py RunOptions), its dump and plot directories
    left out; a given `backend` (then without the recorded workspace and poisons, which were the
    recorded backend's), `engine` or `mode` replaces the recorded one. `directory` is the case
    directory or a dump directory holding exactly one case."""
    case = load_case(directory)
    if case.options is None and backend is None:
        raise ValueError(
            f"dump {case.path} does not record its backend (an older dump): pass --backend"
        )
    recorded = case.options or RunOptions(backend, "both")
    changes: dict[str, Any] = {"dump_dir": None, "plot_dir": None}
    if backend is not None:
        changes.update(backend=backend, workspace=False, poison=())
    if engine is not None:
        changes["engine"] = engine
    if mode is not None:
        changes["mode"] = mode
    options = dataclasses.replace(recorded, **changes)
    return verify(case.problem, options=options, inputs=case.inputs)


def rank_experts(problem: MoEProblem) -> dict[int, list[int]] | None:
    """EP topologies: the global (logical) experts each rank hosts, for the report."""
    if problem.topology.kind is TopologyKind.TP:
        return None
    from reference.topology import placement

    return dict(enumerate(placement(problem)))


def engine_of(trace: Trace, stage: str) -> str | None:
    engine = trace[stage].get("engine") if stage in trace else None
    return engine if isinstance(engine, str) else None
