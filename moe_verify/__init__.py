"""moe-verify: stage-by-stage verification of DeepGEMM fused-MoE paths against a PyTorch golden."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from moe_verify.inputs import make_inputs
    from moe_verify.verify import verify

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


def __getattr__(name: str) -> Any:
    # Imported lazily so `import moe_verify` stays light and never pulls triton or deep_gemm.
    if name == "make_inputs":
        from moe_verify.inputs import make_inputs

        return make_inputs
    if name == "verify":
        from moe_verify.verify import verify

        return verify
    raise AttributeError(f"module 'moe_verify' has no attribute {name!r}")
