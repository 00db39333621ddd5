"""Where the top-k router weight is applied: in the gather, or on the input before quant_input.

The problem says which (`MoEProblem.router_weight`, moe_verify.spec.RouterWeight) and the golden
follows it; a quant_input may say which one it applies (its `router_weight` entry). A quant_input
that applies the other one fails with a "router weight" check named first: where it declares the
other, or where its outputs match the golden's in the other (the golden computes both for top-1
problems, listed by ROUTER_WEIGHT_OUTPUTS; docs/stage-contract.md#router-weight).
"""

from __future__ import annotations

from moe_verify.spec import (
    ROUTER_WEIGHT,
    ROUTER_WEIGHT_OUTPUTS,
    RouterWeight,
    Stage,
    Trace,
)
from tolerance.policy import ROUTER_WEIGHT_REASON
from tolerance.results import CheckResult

_WHERE = {
    RouterWeight.GATHER: "in the gather's weighted sum",
    RouterWeight.INPUT: "on the input before quantization",
}


def declared(trace: Trace) -> RouterWeight | None:
    """The convention `trace`'s quant_input declares; None where it declares none, or a value
    the contract refuses (tolerance/contract.py names it)."""
    if Stage.QUANT_INPUT not in trace or trace.failure(Stage.QUANT_INPUT):
        return None
    value = trace[Stage.QUANT_INPUT].get(ROUTER_WEIGHT)
    return RouterWeight(value) if value in set(RouterWeight) else None


def other_than(convention: RouterWeight) -> RouterWeight:
    return next(c for c in RouterWeight if c is not convention)


def golden_in(golden: Trace, convention: RouterWeight) -> Trace | None:
    """The golden trace with its quant_input's outputs those of `convention` (which it computes
    beside its own for top-1 problems); None where it has none."""
    outputs = golden[Stage.QUANT_INPUT]
    keys = (outputs.get(ROUTER_WEIGHT_OUTPUTS) or {}).get(convention.value)
    if not isinstance(keys, dict):
        return None
    return golden.replaced(Stage.QUANT_INPUT, **{k: outputs[v] for k, v in keys.items()})


def router_weight_check(
    problem_says: RouterWeight, applied: RouterWeight, said: bool
) -> CheckResult:
    """The failed check naming a quant_input that applies the weight `applied` where the
    problem's convention is `problem_says`: by its declaration (`said`), or by its outputs."""
    said_how = f"this quant_input declares {ROUTER_WEIGHT}='{applied.value}'"
    how = said_how if said else f"a1q matches the golden's under {ROUTER_WEIGHT}='{applied.value}'"
    return CheckResult(
        "router weight",
        False,
        1,
        0,
        ROUTER_WEIGHT_REASON,
        None,
        f"{how} (the weight {_WHERE[applied]}), but the problem's is '{problem_says.value}' "
        f"(the weight {_WHERE[problem_says]}; MoEProblem.router_weight, --router-weight)",
    )
