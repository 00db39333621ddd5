"""Routing modes: how `make_inputs` picks each token's experts, and the parameters each takes."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from moe_verify.spec.recipes import RoutedScalingRecipe


class Routing(enum.StrEnum):
    """How topk ids and weights are produced by `make_inputs` (each names the edge it exercises)."""

    SOFTMAX = "softmax"  # softmax top-k over random logits, renormalized
    GROUPED = "grouped"  # DeepSeek-V3: sigmoid + correction bias, top groups, routed scaling
    UNIFORM = "uniform"  # every expert gets (almost) the same number of slots
    SKEW = "skew"  # one hot expert takes about half of all slots
    EMPTY_FIRST = "empty_first"  # expert 0 receives nothing
    EMPTY_MIDDLE = "empty_middle"  # expert E//2 receives nothing
    EMPTY_LAST = "empty_last"  # expert E-1 receives nothing
    ONE_EXPERT = "one_expert"  # every token's first slot goes to one expert, the rest are -1
    INVALID_SLOTS = "invalid_slots"  # about a quarter of the slots are -1, some tokens entirely
    DUPLICATES = "duplicates"  # ids drawn with replacement: a token may hit one expert twice


# Routing modes that fix ids and weights directly instead of routing logits
# (moe_verify/run/inputs.py).
_FIXED_ID_ROUTINGS = (
    Routing.UNIFORM,
    Routing.ONE_EXPERT,
    Routing.INVALID_SLOTS,
    Routing.DUPLICATES,
)


def check_routing(
    routing: Routing,
    *,
    num_experts: int,
    topk: int,
    num_expert_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool,
) -> None:
    """Routing parameters a routing mode would silently ignore are refused: only grouped
    routing applies routed_scaling_factor (reference/routing.py grouped_topk,
    optimized/routing.py _grouped), and only the router-driven modes renormalize (the
    structural ones fix ids and weights directly, moe_verify/run/inputs.py). num_expert_group and
    topk_group are left alone outside grouped routing: callers share one set of group
    parameters across routing modes (tests/reference/test_routing_inputs.py)."""
    r = routing
    if r is Routing.GROUPED:
        groups = num_expert_group
        if num_experts % groups:
            raise ValueError(
                f"MoEProblem.num_expert_group: expected a divisor of num_experts="
                f"{num_experts}, got {groups}"
            )
        kept = topk_group * (num_experts // groups)
        if topk > kept:
            raise ValueError(
                f"MoEProblem.topk: expected at most the {kept} experts left after keeping "
                f"topk_group={topk_group} of {groups} groups, got {topk}"
            )
    elif routed_scaling_factor != 1.0:
        raise ValueError(
            f"MoEProblem.routed_scaling_factor: expected 1.0 with routing {r.value!r} (only "
            f"'grouped' routing applies it), got {routed_scaling_factor!r}"
        )
    if r in _FIXED_ID_ROUTINGS and not renormalize:
        raise ValueError(
            f"MoEProblem.renormalize: expected True with routing {r.value!r} (it fixes ids and "
            "weights directly; renormalize applies to softmax, grouped, skew and empty_*), "
            "got False"
        )
    if r in (Routing.EMPTY_FIRST, Routing.EMPTY_MIDDLE, Routing.EMPTY_LAST):
        if topk >= num_experts:
            raise ValueError(
                f"MoEProblem.topk: expected < num_experts={num_experts} with routing "
                f"{r.value!r} (an expert must be left empty), got {topk}"
            )


def routed_scale_on_output(route: Mapping[str, object], routed_scaling_factor: float) -> float:
    """The factor a gather multiplies each token's fp32 sum by before its one rounding:
    `routed_scaling_factor` where the route stage it reads declares scale_on_output (its
    topk_weights are unscaled), else 1.0 (the weights already carry the factor, or there is
    none). Production mode hands the op's route, which declares nothing: its weights are the
    caller's scaled ones (docs/stage-contract.md#routed-scaling)."""
    if route.get("recipe") == RoutedScalingRecipe.SCALE_ON_OUTPUT:
        return float(routed_scaling_factor)
    return 1.0
