"""moe-verify: stage-by-stage verification of DeepGEMM fused-MoE paths against a PyTorch golden."""

from __future__ import annotations

# `verify` names both a submodule and the function; binding the function here, after the
# submodule import, makes `from moe_verify import verify` the function in every import order.
from moe_verify.inputs import make_inputs  # noqa: E402
from moe_verify.spec import (
    LL_STAGES,
    STAGES,
    Activation,
    Backend,
    MoEInputs,
    MoEProblem,
    Placement,
    QuantizedWeight,
    Recipe,
    Routing,
    ScaleFmt,
    StageSkipped,
    Topology,
    TopologyKind,
    Trace,
)
from moe_verify.verify import verify  # noqa: E402

__all__ = [
    "LL_STAGES",
    "STAGES",
    "Activation",
    "Backend",
    "MoEInputs",
    "MoEProblem",
    "Placement",
    "QuantizedWeight",
    "Recipe",
    "Routing",
    "ScaleFmt",
    "StageSkipped",
    "Topology",
    "TopologyKind",
    "Trace",
    "make_inputs",
    "verify",
]
