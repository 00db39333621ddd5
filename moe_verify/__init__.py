"""moe-verify: stage-by-stage verification of DeepGEMM fused-MoE paths against a PyTorch golden.

The package is the shared vocabulary (`moe_verify.spec`) that reference/, optimized/ and tolerance/
import, and the harness built on them. Its names load lazily, so importing the vocabulary never
imports the harness (and never triton: optimized/ decides how Triton runs).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it
_EXPORTS = {
    **dict.fromkeys(
        (
            "BATCHED_STAGES",
            "STAGES",
            "Activation",
            "Backend",
            "Engine",
            "MoEInputs",
            "MoEProblem",
            "Mode",
            "Placement",
            "QuantizedWeight",
            "Recipe",
            "Routing",
            "ScaleFmt",
            "Stage",
            "StageSkipped",
            "Status",
            "Topology",
            "TopologyKind",
            "Trace",
        ),
        "moe_verify.spec",
    ),
    "make_inputs": "moe_verify.run.inputs",
    "RunOptions": "moe_verify.run.options",
    "verify": "moe_verify.run.verify",
    "verify_rank": "moe_verify.run.verify",
    "replay": "moe_verify.run.verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_verify' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
