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

from collections.abc import Callable
from functools import partial

import torch

from moe_verify.spec import (
    GEMM_OUTPUT,
    Mode,
    MoEProblem,
    Stage,
    Status,
    Trace,
    check_device,
    check_enum,
    check_type,
)
from tolerance.policy import CONTRACT_REASON, policy_for
from tolerance.results import CheckResult, ContractError, StageResult, Worst
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
) -> StageResult:
    """Compare one stage; never raises for a broken trace (status fail/skip/error instead).

    device: where to compare (both sides are moved there); the golden's device by default.
    """
    stage, mode, device = _checked(stage, golden, other, problem, mode, device)
    early = not_compared(stage, golden, other)
    if early is not None:
        return early
    comparer = _COMPARERS.get(stage)
    if Stage.DISPATCH in golden:  # batched layout: compare it as a contiguous one
        golden, other = flatten_batched(golden), flatten_batched(other)
        if stage == Stage.DISPATCH:
            comparer = permute_checks
    if comparer is None:
        return StageResult(stage, Status.ERROR, [], f"no comparison is defined for stage '{stage}'")
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    try:
        check = hardware_check(stage, golden, other, Mode(mode), policy_for(stage, problem, mode))
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
    if Mode(mode) is Mode.CHAINED:
        other = aligned_slots(golden, other)
    if Stage.DISPATCH in golden:
        golden, other = flatten_batched(golden), flatten_batched(other)
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    check = policy_for(stage, problem, mode)
    return bounded_values(Ctx(golden, other, problem, check, Mode(mode), where), stage)


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
    return [
        compare_stage(stage, golden, other, problem, mode=mode, device=device) for stage in names
    ]
