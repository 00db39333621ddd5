"""The shared vocabulary: recipes, scale formats, topologies, the problem, inputs and the Trace.

Every backend (the golden in `reference/`, the DeepGEMM path in `optimized/`, a user's own kernels)
speaks these types, so traces from any two of them compare stage by stage. Nothing here computes
MoE math; it only names things and validates them. It imports torch and nothing else of the
project: reference/, optimized/ and tolerance/ all stand on it (tests/spec/test_layering.py).

One idea per module: checks (argument checks, bounds), arith (ceil division, rounding up), stages,
recipes, activation, routing, topology, problem, inputs, trace, context (what the harness hands a
stage), protocol (the stage methods every backend has), arch. Every name is re-exported here, so
`from moe_verify.spec import X` is the way to import any of them.
"""

from moe_verify.spec.activation import Activation
from moe_verify.spec.arch import (
    DeviceLike,
    cc_major,
    compute_capability,
    is_sm90,
    is_sm90_major,
    is_sm100,
    is_sm100_major,
)
from moe_verify.spec.arith import ceil_div, round_up
from moe_verify.spec.checks import (
    ALIGNMENT_STEP,
    MAX_ALIGNMENT,
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_RANKS,
    MAX_SEED,
    MAX_SHARED_EXPERTS,
    MAX_TOKENS,
    check_bool,
    check_device,
    check_enum,
    check_float,
    check_int,
    check_output_dir,
    check_output_file,
    check_type,
    exact_keys,
)
from moe_verify.spec.context import NO_BUFFERS, Buffers, NoBuffers, Outputs, RankShard, StageContext
from moe_verify.spec.inputs import MoEInputs, QuantizedWeight
from moe_verify.spec.problem import MoEProblem
from moe_verify.spec.protocol import (
    RANK_STAGES,
    Backend,
    StageDelegate,
    call_stage,
    check_backend_object,
    missing_stages,
    run_stages,
    stage_method,
)
from moe_verify.spec.recipes import (
    E2M1_MAX,
    FP8_MAX,
    LL_BLOCK_ROWS,
    ActQuantRecipe,
    Engine,
    GatherRecipe,
    GemmRecipe,
    GroupedLayout,
    InputQuantRecipe,
    MSumRecipe,
    Recipe,
    ScaleFmt,
)
from moe_verify.spec.routing import Routing, check_routing
from moe_verify.spec.stages import (
    GEMM_OUTPUT,
    GEMM_WEIGHT,
    LL_STAGES,
    MODE_CHOICES,
    PER_SLOT_OUTPUTS,
    REPORT_STAGES,
    STAGES,
    SUITE_CODE,
    Mode,
    Stage,
    Status,
)
from moe_verify.spec.topology import Placement, Topology, TopologyKind, explicit_lists
from moe_verify.spec.trace import StageFailure, StageSkipped, StageViolation, Trace

__all__ = [
    "ALIGNMENT_STEP",
    "E2M1_MAX",
    "FP8_MAX",
    "GEMM_OUTPUT",
    "SUITE_CODE",
    "GEMM_WEIGHT",
    "LL_BLOCK_ROWS",
    "LL_STAGES",
    "MAX_ALIGNMENT",
    "MAX_EXPERTS",
    "MAX_HIDDEN",
    "MAX_INTERMEDIATE",
    "MAX_RANKS",
    "MAX_SEED",
    "MAX_SHARED_EXPERTS",
    "MAX_TOKENS",
    "MODE_CHOICES",
    "NO_BUFFERS",
    "PER_SLOT_OUTPUTS",
    "RANK_STAGES",
    "REPORT_STAGES",
    "STAGES",
    "ActQuantRecipe",
    "Activation",
    "Backend",
    "Buffers",
    "DeviceLike",
    "Engine",
    "GatherRecipe",
    "GemmRecipe",
    "GroupedLayout",
    "InputQuantRecipe",
    "MSumRecipe",
    "MoEInputs",
    "MoEProblem",
    "Mode",
    "NoBuffers",
    "Outputs",
    "Placement",
    "QuantizedWeight",
    "RankShard",
    "Recipe",
    "Routing",
    "ScaleFmt",
    "Stage",
    "StageContext",
    "StageDelegate",
    "StageFailure",
    "StageSkipped",
    "StageViolation",
    "Status",
    "Topology",
    "TopologyKind",
    "Trace",
    "call_stage",
    "cc_major",
    "ceil_div",
    "check_backend_object",
    "check_bool",
    "check_device",
    "check_enum",
    "check_float",
    "check_int",
    "check_output_dir",
    "check_output_file",
    "check_routing",
    "check_type",
    "compute_capability",
    "exact_keys",
    "explicit_lists",
    "is_sm100",
    "is_sm100_major",
    "is_sm90",
    "is_sm90_major",
    "missing_stages",
    "round_up",
    "run_stages",
    "stage_method",
]
