"""The shared vocabulary: recipes, scale formats, topologies, the problem, inputs and the Trace.

Every backend (the golden in `reference/`, the DeepGEMM path in `optimized/`, a user's own kernels)
speaks these types, so traces from any two of them compare stage by stage. Nothing here computes
MoE math; it only names things and validates them. It imports torch and nothing else of the
project: reference/, optimized/ and tolerance/ all stand on it (tests/spec/test_layering.py).
Its names load lazily, each with its module: the CLI checks its flags against the recipes, the
problem's defaults and the modes without importing torch, which the tensors' modules (inputs,
trace, context, protocol, arch) import.

One idea per module: checks (argument checks, bounds), arith (ceil division, rounding up), stages,
recipes, activation, routing, topology, problem, inputs, trace, context (what the harness hands a
stage), protocol (the stage methods every backend has), fused (one method for several stages),
arch. Every name is re-exported here, so
`from moe_verify.spec import X` is the way to import any of them.
"""

from __future__ import annotations

import importlib
from typing import Any

# module -> the names it defines that the package re-exports
_MODULES = {
    "activation": ("Activation",),
    "arch": (
        "DeviceLike",
        "cc_major",
        "compute_capability",
        "is_sm90",
        "is_sm90_major",
        "is_sm100",
        "is_sm100_major",
    ),
    "arith": ("ceil_div", "round_up"),
    "checks": (
        "ALIGNMENT_STEP",
        "MAX_ALIGNMENT",
        "MAX_EXPERTS",
        "MAX_HIDDEN",
        "MAX_INTERMEDIATE",
        "MAX_RANKS",
        "MAX_SEED",
        "MAX_SHARED_EXPERTS",
        "MAX_TOKENS",
        "check_bool",
        "check_device",
        "check_enum",
        "check_float",
        "check_int",
        "check_output_dir",
        "check_output_file",
        "check_type",
        "exact_keys",
    ),
    "context": ("NO_BUFFERS", "Buffers", "NoBuffers", "Outputs", "RankShard", "StageContext"),
    "fused": ("FusedGroup", "Step", "fused_groups", "group_of", "plan"),
    "inputs": ("MoEInputs", "QuantizedWeight"),
    "problem": ("MoEProblem",),
    "protocol": (
        "RANK_STAGES",
        "Backend",
        "StageDelegate",
        "call_group",
        "call_stage",
        "check_backend_object",
        "missing_stages",
        "run_stages",
        "stage_method",
    ),
    "recipes": (
        "E2M1_MAX",
        "FP8_MAX",
        "LL_BLOCK_ROWS",
        "ActQuantRecipe",
        "Engine",
        "GatherRecipe",
        "GemmRecipe",
        "GroupedLayout",
        "InputQuantRecipe",
        "MSumRecipe",
        "Recipe",
        "RoutedScalingRecipe",
        "ScaleFmt",
    ),
    "routing": ("Routing", "check_routing", "routed_scale_on_output"),
    "stages": (
        "COLUMN_ORDER",
        "EXIT_CODES",
        "GEMM_OUTPUT",
        "GEMM_WEIGHT",
        "INVARIANCE_KINDS",
        "BATCHED_STAGES",
        "MODE_CHOICES",
        "PER_SLOT_OUTPUTS",
        "REPORT_STAGES",
        "ROUTER_WEIGHT",
        "ROUTER_WEIGHT_OUTPUTS",
        "STAGES",
        "SUITE_CODE",
        "Gemm1Columns",
        "RouterWeight",
        "Mode",
        "Stage",
        "Status",
    ),
    "topology": ("Placement", "Topology", "TopologyKind", "explicit_lists"),
    "trace": ("StageFailure", "StageSkipped", "StageViolation", "Trace"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A re-exported name, or a submodule, imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
