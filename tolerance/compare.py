"""Stage-by-stage comparison of one backend's Trace against the golden's, per the policy table.

Each stage is compared as docs/stage-contract.md names it, with the Check that
`policy_for(stage, problem, mode)` returns. Permuted buffers are never compared by absolute row:
rows are keyed by (token, k). The permute stage is read through each side's own `inv_perm`. For
the stages after it (gemm1, act_quant, gemm2) the key is the permute the stage *consumed*: in
isolated mode the backend ran on the golden's upstream, so its rows sit where the golden's
`inv_perm` says; in chained mode they sit where the backend's own `inv_perm` says.

Live slots are those with golden `inv_perm[t, k] >= 0`; padding rows are checked only for their
contract values (m_indices -1, fp32 scales +0.0, packed scale bytes not 0xFF), never for data.
A stage recorded as `{SKIP_KEY: reason}` (StageSkipped) is reported as skipped, one recorded as
`{ERROR_KEY: message}` (the stage raised) as an error; neither is ever a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from moe_verify.spec import REDUCE_STAGE, MoEProblem, Trace
from tolerance.bounded_stages import act_quant_checks, gemm_checks, token_output_checks
from tolerance.checks import Ctx, comparison_device
from tolerance.exact_stages import align_checks, permute_checks, quant_input_checks, route_checks
from tolerance.layouts import flatten_batched
from tolerance.policy import CONTRACT_REASON, MODES, policy_for
from tolerance.results import (
    ERROR_KEY,
    SKIP_KEY,
    CheckResult,
    ContractError,
    StageResult,
    Worst,
)

__all__ = [  # the entry points, and the result types callers read with them
    "ERROR_KEY",
    "SKIP_KEY",
    "CheckResult",
    "ContractError",
    "StageResult",
    "Worst",
    "compare",
    "compare_stage",
    "default_stages",
    "not_compared",
]


_COMPARERS: dict[str, Callable[[Ctx], list[CheckResult]]] = {
    "route": route_checks,
    "quant_input": quant_input_checks,
    "align": align_checks,
    "permute": permute_checks,
    "gemm1": partial(gemm_checks, stage="gemm1", name="mm1"),
    "act_quant": act_quant_checks,
    "gemm2": partial(gemm_checks, stage="gemm2", name="mm2"),
    "gather": partial(token_output_checks, stage="gather"),
    "shared": partial(token_output_checks, stage="shared"),
    REDUCE_STAGE: partial(token_output_checks, stage=REDUCE_STAGE),
}


# Entry points ------------------------------------------------------------------------------------


def default_stages(problem: MoEProblem, golden: Trace, other: Trace) -> list[str]:
    """The topology's stages, plus `reduce` when either trace has it."""
    names = list(problem.stages)
    if REDUCE_STAGE in golden or REDUCE_STAGE in other:
        names.append(REDUCE_STAGE)
    return names


def not_compared(stage: str, golden: Trace, other: Trace) -> StageResult | None:
    """A skip (stage missing or skipped on either side) or error (a side raised in the stage)
    result when `stage` cannot be compared; None when it can. The other side is checked first."""
    for trace, who in ((other, other.backend), (golden, f"golden ({golden.backend})")):
        if stage not in trace:
            return StageResult(stage, "skip", [], f"{who} trace has no {stage!r} stage (not run)")
        outs = trace[stage]
        if ERROR_KEY in outs:
            return StageResult(stage, "error", [], f"{who} raised in {stage}: {outs[ERROR_KEY]}")
        if SKIP_KEY in outs:
            return StageResult(stage, "skip", [], f"{who} skipped {stage}: {outs[SKIP_KEY]}")
    return None


def compare_stage(
    stage: str,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    *,
    mode: str = "isolated",
    device: torch.device | str | None = None,
) -> StageResult:
    """Compare one stage; never raises for a broken trace (status fail/skip/error instead).

    device: where to compare (both sides are moved there); the golden's device by default.
    """
    early = not_compared(stage, golden, other)
    if early is not None:
        return early
    comparer = _COMPARERS.get(stage)
    if "dispatch" in golden:  # batched layout: compare it as a contiguous one
        golden, other = flatten_batched(golden), flatten_batched(other)
        if stage == "dispatch":
            comparer = permute_checks
    if comparer is None:
        return StageResult(stage, "error", [], f"no comparison is defined for stage {stage!r}")
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    try:
        check = policy_for(stage, problem, mode)
        checks = comparer(Ctx(golden, other, problem, check, mode, where))
    except ContractError as exc:
        contract = CheckResult("contract", False, 1, 0, CONTRACT_REASON, None, str(exc))
        return StageResult(stage, "fail", [contract])
    except Exception as exc:  # a comparison bug must not take the whole report down
        return StageResult(stage, "error", [], f"{type(exc).__name__}: {exc}")
    return StageResult(stage, "pass" if all(c.passed for c in checks) else "fail", checks)


def compare(
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    stages: list[str] | None = None,
    *,
    mode: str = "isolated",
    device: torch.device | str | None = None,
) -> list[StageResult]:
    """Compare `other` against `golden` stage by stage (all of `default_stages` unless given).

    mode: "isolated" when each of `other`'s stages ran on the golden's upstream, "chained" when it
    ran end to end on its own; it picks the policy rows and which inv_perm keys permuted rows.
    device: where to compare, the golden's device by default (`comparison_device`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = list(stages) if stages is not None else default_stages(problem, golden, other)
    return [
        compare_stage(stage, golden, other, problem, mode=mode, device=device) for stage in names
    ]
