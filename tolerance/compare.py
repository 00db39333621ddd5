"""Stage-by-stage comparison of one backend's Trace against the golden's, per the policy table.

Each stage is compared as docs/stage-contract.md names it, with the Check that
`policy_for(stage, problem, mode)` returns. Permuted buffers are never compared by absolute row:
rows are keyed by (token, k). The permute stage is read through each side's own `inv_perm`. For
the stages after it (gemm1, act_quant, gemm2) the key is the permute the stage *consumed*: in
isolated mode the backend ran on the golden's upstream, so its rows sit where the golden's
`inv_perm` says; in chained mode they sit where the backend's own `inv_perm` says.

Live slots are those with golden `inv_perm[t, k] >= 0`; padding rows are checked only for their
contract values (m_indices -1, fp32 scales +0.0, packed scale bytes not 0xFF), never for data.
A stage a trace records as skipped (StageSkipped) is reported as skipped, one recorded as raised
as an error (`Trace.failure`); neither is ever a pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch

from moe_verify.spec import (
    COLUMN_ORDER,
    GEMM_OUTPUT,
    Gemm1Columns,
    Mode,
    MoEProblem,
    Stage,
    Status,
    Trace,
    check_device,
    check_enum,
    check_type,
)
from tolerance.policy import COLUMN_ORDER_REASON, CONTRACT_REASON, policy_for
from tolerance.results import CheckResult, ContractError, StageResult, Worst
from tolerance.stages import columns, router_weight
from tolerance.stages.bounded import (
    act_quant_checks,
    bounded_values,
    gemm_checks,
    token_output_checks,
)
from tolerance.stages.context import Ctx, comparison_device
from tolerance.stages.exact import align_checks, quant_input_checks, route_checks
from tolerance.stages.layouts import flatten_batched
from tolerance.stages.permute import permute_checks
from tolerance.stages.recipes import chained_copy_golden, hardware_check
from tolerance.stages.slots import aligned_slots

__all__ = [  # the entry points, and the result types callers read with them
    "CheckResult",
    "ContractError",
    "StageResult",
    "Worst",
    "compare",
    "compare_stage",
    "default_stages",
    "keyed_values",
    "not_compared",
]


_COMPARERS: dict[str, Callable[[Ctx], list[CheckResult]]] = {
    Stage.ROUTE: route_checks,
    Stage.QUANT_INPUT: quant_input_checks,
    Stage.ALIGN: align_checks,
    Stage.PERMUTE: permute_checks,
    Stage.GEMM1: partial(gemm_checks, stage=Stage.GEMM1, name=GEMM_OUTPUT[Stage.GEMM1]),
    Stage.ACT_QUANT: act_quant_checks,
    Stage.GEMM2: partial(gemm_checks, stage=Stage.GEMM2, name=GEMM_OUTPUT[Stage.GEMM2]),
    Stage.GATHER: partial(token_output_checks, stage=Stage.GATHER),
    Stage.SHARED: partial(token_output_checks, stage=Stage.SHARED),
    Stage.REDUCE: partial(token_output_checks, stage=Stage.REDUCE),
}


# Entry points ------------------------------------------------------------------------------------


def _checked(
    stage: object, golden: object, other: object, problem: object, mode: object, device: object
) -> tuple[Stage, Mode, torch.device | None]:
    """The entry points' arguments, each refused by name when it is not what they compare."""
    check_type("golden", golden, Trace)
    check_type("other", other, Trace)
    check_type("problem", problem, MoEProblem)
    return (
        check_enum("stage", stage, Stage),
        check_enum("mode", mode, Mode),
        None if device is None else check_device("device", device),
    )


def default_stages(problem: MoEProblem, golden: Trace, other: Trace) -> list[str]:
    """The topology's stages, plus `reduce` when either trace has it."""
    names = list(problem.stages)
    if Stage.REDUCE in golden or Stage.REDUCE in other:
        names.append(Stage.REDUCE)
    return names


def not_compared(stage: str, golden: Trace, other: Trace) -> StageResult | None:
    """A skip (stage missing or skipped on either side), error (a side raised in the stage) or
    fail (a side broke the stage contract) result when `stage` cannot be compared; None when it
    can. The other side is checked first."""
    for trace, who in ((other, other.backend), (golden, f"golden ({golden.backend})")):
        failure = trace.failure(stage)
        if failure is None:
            continue
        if stage not in trace:
            reason = f"{who} trace has no '{stage}' stage (not run)"
        elif failure.status is Status.ERROR:
            reason = f"{who} raised in {stage}: {failure.reason}"
        elif failure.status is Status.FAIL:
            reason = f"{who} broke the {stage} contract: {failure.reason}"
        else:
            reason = f"{who} skipped {stage}: {failure.reason}"
        return StageResult(stage, failure.status, [], reason)
    return None


def compare_stage(
    stage: str,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    *,
    mode: Mode | str = Mode.ISOLATED,
    device: torch.device | str | None = None,
    fed_own: bool = False,
) -> StageResult:
    """Compare one stage; never raises for a broken trace (status fail/skip/error instead).

    device: where to compare (both sides are moved there); the golden's device by default.
    fed_own: the stage ran on the tested side's own upstream although `mode` is isolated (a
    stage inside a fused group after its first): judged by the chained bounds.
    """
    stage, mode, device = _checked(stage, golden, other, problem, mode, device)
    early = not_compared(stage, golden, other)
    if early is not None:
        return early
    declared_order = columns.declared(other)
    other = columns.gate_first(other)
    result = _compare_stage(stage, golden, other, problem, mode, device, fed_own)
    mm1 = columns.mm1_of(other) if stage == Stage.GEMM1 else None
    if mm1 is not None and result.status is Status.FAIL:
        swapped = other.replaced(Stage.GEMM1, **{columns.MM1: columns.swap_halves(mm1)})
        if _compare_stage(stage, golden, swapped, problem, mode, device, fed_own).status is (
            Status.PASS
        ):
            result.checks.insert(0, column_order_check(declared_order))  # named first
    if stage == Stage.QUANT_INPUT:
        result = _router_weight_judged(result, golden, other, problem, mode, device, fed_own)
    return result


def _router_weight_judged(
    result: StageResult,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    mode: Mode,
    device: torch.device | None,
    fed_own: bool,
) -> StageResult:
    """quant_input's `result`, failed with a "router weight" check named first where the tested
    quant_input applies the weight elsewhere than the problem says: it declares so, or it fails
    and matches the golden's outputs in the other convention (tolerance/stages/router_weight.py).
    """
    wanted, said = problem.router_weight, router_weight.declared(other)
    if result.status not in (Status.PASS, Status.FAIL):  # the comparison itself raised
        return result
    if said is not None and said is not wanted:
        check = router_weight.router_weight_check(wanted, said, said=True)
    elif result.status is Status.FAIL:
        applied = router_weight.other_than(wanted)
        alt = router_weight.golden_in(golden, applied)
        if alt is None:
            return result
        rerun = _compare_stage(Stage.QUANT_INPUT, alt, other, problem, mode, device, fed_own)
        if rerun.status is not Status.PASS:
            return result
        check = router_weight.router_weight_check(wanted, applied, said=False)
    else:
        return result
    return dataclasses.replace(result, status=Status.FAIL, checks=[check, *result.checks])


def column_order_check(declared_order: Gemm1Columns) -> CheckResult:
    """The failed check that says gemm1's halves would match exchanged."""
    other = next(c for c in Gemm1Columns if c is not declared_order)
    return CheckResult(
        "column order",
        False,
        1,
        0,
        COLUMN_ORDER_REASON,
        None,
        f"mm1 matches the golden with its halves exchanged: this gemm1 writes {other.value} "
        f"columns but declares {declared_order.value}; return {COLUMN_ORDER}="
        f"'{other.value}' from gemm1 if that is its convention",
    )


def _compare_stage(
    stage: Stage,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    mode: Mode,
    device: torch.device | None,
    fed_own: bool,
) -> StageResult:
    comparer = _COMPARERS.get(stage)
    if Stage.DISPATCH in golden:  # batched layout: compare it as a contiguous one
        golden, other = flatten_batched(golden), flatten_batched(other)
        if stage == Stage.DISPATCH:
            comparer = permute_checks
    if comparer is None:
        return StageResult(stage, Status.ERROR, [], f"no comparison is defined for stage '{stage}'")
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    try:
        bounds = Mode.CHAINED if fed_own else Mode(mode)
        check = hardware_check(stage, golden, other, bounds, policy_for(stage, problem, bounds))
        ctx = Ctx(golden, other, problem, check, Mode(mode), where)
        checks = comparer(chained_copy_golden(ctx, stage))
    except ContractError as exc:
        contract = CheckResult("contract", False, 1, 0, CONTRACT_REASON, None, str(exc))
        return StageResult(stage, Status.FAIL, [contract])
    except Exception as exc:  # a comparison bug must not take the whole report down
        return StageResult(stage, Status.ERROR, [], f"{type(exc).__name__}: {exc}")
    status = Status.PASS if all(c.passed for c in checks) else Status.FAIL
    recipe = next((c.recipe for c in checks if c.recipe is not None), None)
    return StageResult(stage, status, checks, recipe=recipe)


def keyed_values(
    stage: str,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    mode: Mode | str = Mode.ISOLATED,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tested, golden) values of a bounded stage, row-aligned exactly as its checks key them.

    gemm1 / gemm2: the mm1 / mm2 row of every live (token, k) slot; act_quant: the dequantized
    a2q x a2q_scale of those rows, fp32; gather / shared / reduce: out, one row per token. Slots
    are keyed by the permute the stage consumed (the golden's in isolated mode, the tested side's
    own when chained); a batched low-latency layout is read as a contiguous one. Both tensors lie
    on `device` (the comparison device by default). Raises ContractError when the stage cannot be
    keyed: not run on a side, a shape off the contract, or a live slot whose row lies outside the
    tested tensor (compare reports those as skip/error or a failed check).
    """
    stage, mode, device = _checked(stage, golden, other, problem, mode, device)
    early = not_compared(stage, golden, other)
    if early is not None:
        raise ContractError(f"{stage} cannot be keyed: {early.reason}")
    other = columns.gate_first(other)
    if Mode(mode) is Mode.CHAINED:
        other = aligned_slots(golden, other)
    if Stage.DISPATCH in golden:
        golden, other = flatten_batched(golden), flatten_batched(other)
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    check = policy_for(stage, problem, mode)
    return bounded_values(Ctx(golden, other, problem, check, Mode(mode), where), stage)


def first_fused(trace: Trace, group: str) -> str:
    """The first stage (in trace order of the problem) the fused group named `group` computed."""
    return next(s for s, g in trace.fused.items() if g == group)


def compare(
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    stages: list[str] | None = None,
    *,
    mode: Mode | str = Mode.ISOLATED,
    device: torch.device | str | None = None,
) -> list[StageResult]:
    """Compare `other` against `golden` stage by stage (all of `default_stages` unless given).

    mode: "isolated" when each of `other`'s stages ran on the golden's upstream, "chained" when it
    ran end to end on its own; it picks the policy rows and which inv_perm keys permuted rows.
    device: where to compare, the golden's device by default (`comparison_device`).
    """
    _checked(Stage.ROUTE, golden, other, problem, mode, device)
    mode = Mode(mode)
    names = list(stages) if stages is not None else default_stages(problem, golden, other)
    if mode is Mode.CHAINED:  # the tested side's own route: its slots in the golden's order
        other = aligned_slots(golden, other)
    results = []
    for stage in names:
        group = other.fused.get(stage)
        if group is None:
            results.append(compare_stage(stage, golden, other, problem, mode=mode, device=device))
        elif stage in other:  # exposed by its fused group: judged, named with the group
            own = stage != first_fused(other, group)  # fed by the group's own earlier stages
            result = compare_stage(
                stage, golden, other, problem, mode=mode, device=device, fed_own=own
            )
            results.append(dataclasses.replace(result, group=group))
        # a stage the group kept inside is judged where the group's outputs are
    return results
