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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify import progress
from moe_verify.contain import deadline
from moe_verify.device import default_device
from moe_verify.dump import dump_case, load_case
from moe_verify.inputs import check_inputs, make_inputs
from moe_verify.poison import poison_padding
from moe_verify.preflight import preflight
from moe_verify.runner import RankRun, resolve_backend, run_golden, run_rank
from moe_verify.spec import (
    LL_BLOCK_ROWS,
    Backend,
    Engine,
    GemmRecipe,
    Mode,
    MoEInputs,
    MoEProblem,
    Recipe,
    ScaleFmt,
    Stage,
    StageSkipped,
    Status,
    TopologyKind,
    Trace,
    check_bool,
)
from reference.activation import fused_act_quant_recipe, sm90_triton_recipe
from reference.gate_table import gate_table_provenance
from reference.moe import ReferenceBackend
from reference.recipes import act_quant_recipes
from reference.topology import reduce_ranks
from tolerance.compare import StageResult, compare, compare_stage
from tolerance.invariance import INVARIANCES, Invariance, agreement
from tolerance.provenance import with_provenance
from tolerance.recipes import HARDWARE_ACT_RECIPES, same_bits
from tolerance.report import Report
from tolerance.slots import slot_order


@dataclass(frozen=True)
class Twin:
    """The tested side's second run of a metamorphic pair: its backend and problem (the same
    problem, or one that differs only in the setting), the pair's label and the invariance."""

    backend: Backend
    problem: MoEProblem
    label: str
    invariance: Invariance


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
    recorded table's is declared as that recipe first (`declare_hardware_gate`)."""
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


# Zero tolerance on SM90 (docs/tolerance.md#zero-tolerance-on-sm90) ------------------------------

# The scale formats DeepGEMM's SM90 FP8 GEMM reads (fp32 scales; ceil-UE8M0 ones are fp32 too).
_SM90_FORMATS = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
_GEMM_OUTPUTS = {Stage.GEMM1: "mm1", Stage.GEMM2: "mm2"}


def sm90_device(t: torch.Tensor) -> bool:
    """The tensor lies on a CUDA device of compute capability major 9 (Hopper): the one place
    that decides whether a GEMM's output came from SM90 hardware."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def check_gemm_recipe(
    problem: MoEProblem, gemm_recipe: GemmRecipe | str | None
) -> GemmRecipe | None:
    """`gemm_recipe` as a GemmRecipe (None: automatic); a ValueError where an explicit
    tensor_core cannot apply (not the SM90 fp8_block recipe with fp32 or ceil-UE8M0 scales)."""
    if gemm_recipe is None:
        return None
    try:
        recipe = GemmRecipe(gemm_recipe)
    except ValueError:
        known = [r.value for r in GemmRecipe]
        raise ValueError(
            f"gemm_recipe: expected one of {known} or None, got {gemm_recipe!r}"
        ) from None
    if recipe is GemmRecipe.TENSOR_CORE:
        if problem.recipe is not Recipe.FP8_BLOCK or problem.scale_fmt not in _SM90_FORMATS:
            raise ValueError(
                f"gemm_recipe tensor_core models SM90's fp8_block GEMM with fp32 or ceil-UE8M0 "
                f"scales, got recipe {problem.recipe}, scale format {problem.scale_fmt}"
            )
    return recipe


def gemm_recipe_applies(
    problem: MoEProblem, tested: Trace, stage: str, gemm_recipe: GemmRecipe | str | None
) -> bool:
    """Whether `stage` (gemm1 or gemm2) of `tested` is held to the tensor-core recipe: asked for
    (gemm_recipe tensor_core), or automatically (None) where the tested stage reports engine
    "deepgemm" or declares the recipe (the suite's Triton engine compiled for SM90 promotes as
    DeepGEMM does) and its output lies on an SM90 GPU (`sm90_device`), for fp8_block with fp32
    or ceil-UE8M0 scales; never for gemm_recipe fp32_dequant, nor where the stage did not run."""
    recipe = GemmRecipe(gemm_recipe) if gemm_recipe is not None else None
    if recipe is GemmRecipe.FP32_DEQUANT or stage not in tested or tested.failure(stage):
        return False
    if problem.recipe is not Recipe.FP8_BLOCK or problem.scale_fmt not in _SM90_FORMATS:
        return False
    if recipe is GemmRecipe.TENSOR_CORE:
        return True
    out = tested[stage].get(_GEMM_OUTPUTS[stage])
    engine, declared = tested[stage].get("engine"), tested[stage].get("recipe")
    model = engine == Engine.DEEPGEMM or declared == GemmRecipe.TENSOR_CORE
    return model and isinstance(out, torch.Tensor) and sm90_device(out)


def with_gemm_recipe(
    problem: MoEProblem,
    inputs: MoEInputs,
    golden: Backend,
    golden_trace: Trace,
    tested: Trace,
    gemm_recipe: GemmRecipe | str | None,
) -> Trace:
    """The golden trace with the tensor-core recipe added to each GEMM stage it applies to
    (`gemm_recipe_applies`), computed only then: the model costs 10-100x the fp32 GEMM. It runs
    after the tested side because the tested stage says which engine ran it; the comparison then
    holds that stage bit for bit to the recipe (tolerance/bounded_stages.py `gemm_checks`)."""
    reference = golden if isinstance(golden, ReferenceBackend) else ReferenceBackend()
    for stage in _GEMM_OUTPUTS:
        if stage in golden_trace and gemm_recipe_applies(problem, tested, stage, gemm_recipe):
            golden_trace = reference.with_tensor_core(problem, inputs, golden_trace, stage)
    return golden_trace


def declare_hardware_gate(problem: MoEProblem, tested: Trace) -> None:
    """Declare, for a tested act_quant that declares no recipe itself, the recipe whose gate is
    the recorded H200 table (reference/gate_table.py), where the stage reports it computed its
    gate as that table was recorded: compiled by the same Triton version on a GPU of the same
    compute capability ("gate_triton", "gate_capability"; optimized/kernels/act_quant.py
    `gate_source`), and the problem has that recipe. The stage is then held to it bit for bit
    (tolerance/recipes.py `hardware_check`). Anything else (another Triton, the interpreter,
    someone else's kernel) keeps the matcher and its bounds."""
    if Stage.ACT_QUANT not in tested or tested.failure(Stage.ACT_QUANT) is not None:
        return
    outs = tested[Stage.ACT_QUANT]
    if outs.get("recipe") is not None or not table_gate(outs):
        return
    twin = sm90_triton_recipe(fused_act_quant_recipe(problem.scale_fmt), problem.activation)
    if twin is not None and twin in act_quant_recipes(problem):
        outs["recipe"] = twin.value


def table_gate(outs: dict) -> bool:
    """A stage's outputs say its gate was computed as the recorded H200 table was: by the same
    Triton version on a GPU of the same compute capability (optimized/kernels/act_quant.py
    `gate_source`)."""
    table = gate_table_provenance()
    facts = (outs.get("gate_triton"), outs.get("gate_capability"))
    return "gate_triton" in outs and facts == (table.get("triton"), table.get("capability"))


def sm90_shared(tested: Trace) -> bool:
    """The tested shared experts ran as SM90 computes them: both GEMMs declare the tensor-core
    recipe, on an SM90 GPU, and the gate is the table's (`table_gate`)."""
    if Stage.SHARED not in tested or tested.failure(Stage.SHARED) is not None:
        return False
    outs = tested[Stage.SHARED]
    out = outs.get("out")
    declared = outs.get("recipe") == GemmRecipe.TENSOR_CORE
    return declared and table_gate(outs) and isinstance(out, torch.Tensor) and sm90_device(out)


def with_sm90_chain(
    problem: MoEProblem,
    inputs: MoEInputs,
    golden: Backend,
    golden_trace: Trace,
    tested: Trace,
    gemm_recipe: GemmRecipe | str | None,
) -> Trace | None:
    """The golden's SM90 chain (reference/moe.py `sm90_chain`) that a chained `tested` run is
    held to bit for bit, or None (compared against `golden_trace` with the chained bounds).

    Automatically (gemm_recipe None) where both tested GEMMs are held to the tensor-core recipe
    (`gemm_recipe_applies`) and the tested act_quant declares a recipe with the H200's Triton
    gate that the problem has: the chain is then defined to the bit, and the golden computes it
    with that recipe. Asked for (tensor_core), with any legitimate act_quant recipe the tested
    stage declares. A tested act_quant that declares none keeps the chained bounds either way:
    the chain's gemm2 would read one recipe's a2q while the matcher could pass the stage on
    another. The shared experts join the chain where they ran as SM90 computes them
    (`sm90_shared`), else keep their bounds. Only after the tested run, which says what ran."""
    recipe = GemmRecipe(gemm_recipe) if gemm_recipe is not None else None
    if recipe is GemmRecipe.FP32_DEQUANT or Stage.GEMM2 not in golden_trace:
        return None
    if any(not gemm_recipe_applies(problem, tested, s, gemm_recipe) for s in _GEMM_OUTPUTS):
        return None
    legit = act_quant_recipes(problem)
    declared = tested[Stage.ACT_QUANT].get("recipe") if Stage.ACT_QUANT in tested else None
    act = next((r for r in legit if r == declared), None)
    if act is None or (recipe is None and act not in HARDWARE_ACT_RECIPES):
        return None  # the chain's gemm2 reads the act_quant recipe the tested stage computes
    if not same_quantized_input(golden_trace, tested):
        return None  # another legitimate quant_input recipe: the chain would start elsewhere
    reference = golden if isinstance(golden, ReferenceBackend) else ReferenceBackend()
    slots, weights = legitimately_other_route(golden_trace, tested)
    shared = sm90_shared(tested)
    return reference.sm90_chain(problem, inputs, golden_trace, act, slots, weights, shared)


def same_quantized_input(golden: Trace, tested: Trace) -> bool:
    """The tested quant_input's codes and scales are bit for bit the golden's own recipe's, so
    the golden's SM90 chain starts from the operands the tested GEMMs read. (A tested quant
    that matches another legitimate recipe keeps the chained bounds.)"""
    if tested.failure(Stage.QUANT_INPUT) is not None:
        return False
    g, t = golden[Stage.QUANT_INPUT], tested[Stage.QUANT_INPUT]
    return all(
        isinstance(t.get(name), torch.Tensor) and same_bits(t[name].to(g[name].device), g[name])
        for name in ("a1q", "a1q_scale")
    )


def legitimately_other_route(
    golden: Trace, tested: Trace
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(slots, weights) for the SM90 chain's gather, from a tested route that routes every
    token to the golden's experts but is not bit for bit the golden's route: `slots` (the
    golden's slot of each tested slot, tolerance/slots.py `slot_order`) where some token lists
    its experts in another order, `weights` (the tested ones) where they are not the golden's
    bit for bit once in the same order. Both are legitimate: the order inside a token is not
    semantic, and each side renormalizes in its own sum order (a few ulps, which the route check
    bounds: tolerance/policy.py `renormalized_weight_ulps`). (None, None) where the route is the
    golden's, or routes elsewhere (the route check then fails, and names the stage)."""
    if tested.failure(Stage.ROUTE) is not None:
        return None, None
    g, t = golden[Stage.ROUTE], tested[Stage.ROUTE]
    ids, weights = t.get("topk_ids"), t.get("topk_weights")
    g_ids, g_weights = g["topk_ids"], g["topk_weights"]
    if not isinstance(ids, torch.Tensor) or not isinstance(weights, torch.Tensor):
        return None, None
    if ids.shape != g_ids.shape or weights.shape != g_weights.shape:
        return None, None
    ids, weights = ids.to(g_ids.device).long(), weights.to(g_weights.device)
    slots = slot_order(g_ids, ids)
    if not torch.equal(g_ids.long().gather(1, slots), ids):
        return None, None
    in_order = bool((slots == torch.arange(ids.shape[1], device=ids.device)).all())
    same = same_bits(weights, g_weights.gather(1, slots))
    return (None if in_order else slots), (None if same else weights)


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


def with_agreement(
    results: list[StageResult], first: RankRun, second: RankRun, mode: Mode, twin: Twin
) -> list[StageResult]:
    """`results` with each stage's agreement check of the metamorphic pair added (a stage whose
    two runs disagree fails, even where each run alone was within its tolerance of the golden)."""
    a, b = first.tested[mode], second.tested[mode]
    layouts = (a, b) if mode is Mode.CHAINED else (first.golden, second.golden)
    out = []
    for r in results:
        check = agreement(r.stage, a, b, twin.label, layouts, twin.invariance)
        if check is not None:
            status = r.status
            if not check.passed and status in (Status.PASS, Status.SKIP):
                status = Status.FAIL
            r = dataclasses.replace(r, checks=[*r.checks, check], status=status)
        out.append(r)
    return out


def invariance_pair(
    problem: MoEProblem, kind: str, backend: str, engine: Engine | str
) -> tuple[Backend, Backend, MoEProblem, str]:
    """The two tested backends and the second run's problem of the invariance `kind`
    (tolerance/invariance.py INVARIANCES), and the pair's label; a ValueError saying why where
    the setting has no second legal value here."""
    if kind not in INVARIANCES or kind == "poison":
        known = [k for k in INVARIANCES if k != "poison"]
        raise ValueError(
            f"invariance: expected one of {known} (two poisons: --workspace --poison A "
            f"--poison B), got {kind!r}"
        )
    from optimized import OptimizedBackend

    first = resolve_backend(backend, engine)
    if not isinstance(first, OptimizedBackend):
        raise ValueError(
            f"invariance {kind}: its settings are the optimized backend's (or a module:Class "
            f"subclass of it), got backend {backend!r}"
        )
    cls = type(first)
    deepgemm_only = kind in ("expected_m", "num_sms")
    if deepgemm_only and Engine(engine) is not Engine.DEEPGEMM:
        raise ValueError(f"invariance {kind}: a hint of DeepGEMM's, so it needs --engine deepgemm")
    if kind == "alignment":
        other = {128: 64, 64: 128}.get(problem.alignment)
        if other is None:
            raise ValueError(
                f"invariance alignment: pairs 64 with 128 (both legal SM90 BLOCK_Ms); the "
                f"problem's alignment is {problem.alignment}"
            )
        second = dataclasses.replace(problem, alignment=other)
        return first, cls(engine=engine), second, f"{problem.alignment} vs {other}"
    if kind == "m_sum":
        if problem.topology.kind in (TopologyKind.EP_HT, TopologyKind.EP_LL):
            raise ValueError(
                f"invariance m_sum: {problem.topology} has no upper-bound M_sum to compare "
                "(ep:N+ht is exact, ep:N+ll batched)"
            )
        return first, cls(engine=engine, exact_m_sum=True), problem, "upper bound vs exact"
    if kind == "ll_capacity":
        if problem.topology.kind is not TopologyKind.EP_LL:
            raise ValueError(
                f"invariance ll_capacity: the batch capacity (DeepEP's max_tokens) of the "
                f"ep:N+ll layout; topology {problem.topology} has no batches"
            )
        rows = problem.ll_max_tokens
        doubled = 2 * max(rows, LL_BLOCK_ROWS)
        second = dataclasses.replace(problem, ll_capacity=doubled)
        return first, cls(engine=engine), second, f"{rows} vs {doubled} rows"
    if kind == "expected_m":
        if problem.topology.kind is not TopologyKind.EP_LL:
            raise ValueError("invariance expected_m: the masked GEMM's hint needs ep:N+ll")
        hint = max(1, problem.tokens)
        return first, cls(engine=engine, expected_m=hint), problem, f"mean batch vs {hint}"
    return first, cls(engine=engine, num_sms=100), problem, "all SMs vs 100"


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
