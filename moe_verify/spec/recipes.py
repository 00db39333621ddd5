"""Quantization recipes, scale formats, GEMM engines and the legitimate rounding recipes.

A recipe names what a layer stores (fp8 blocks, MX groups); a legitimate recipe names one of the
several correct ways vLLM computes a stage (docs/tolerance.md#legitimate-recipes), each of which the
golden models so a backend is held to the one it implements.
"""

from __future__ import annotations

import enum


class GroupedLayout(enum.StrEnum):
    """How the grouped GEMMs learn each row's expert (docs/stage-contract.md#grouped-layouts).

    The contiguous layouts (m_indices, psum) come from one permute plan; `permute` outputs both,
    and the problem says which one the GEMMs and act_quant consume. The masked layout replaces
    align and permute by `dispatch`: each local expert's rows in a batch of its own, read by
    DeepGEMM's masked grouped GEMM. ep:N+ll always runs it; any other topology may.
    """

    AUTO = "auto"  # as vLLM chooses for the recipe, scale format, activation and GPU arch
    M_INDICES = "m_indices"  # per-row local expert, -1 on padding (the per-row grouped layout)
    PSUM = (
        "psum"  # per-expert cumulative row ends (DeepGEMM use_psum_layout=True); gap rows skipped
    )
    # [E_l, M_max, H] batches + masked_m (DeepGEMM m_grouped_fp8_gemm_nt_masked)
    MASKED = "masked"


class MSumRecipe(enum.StrEnum):
    """The legitimate formulas for align's M_sum (docs/stage-contract.md#m_sum).

    Each is a multiple of the alignment A and at least the exact sum, so every one is a valid
    M_sum; a backend may declare the one it implements (the align stage's "recipe" entry).
    """

    MIN_ACTIVE_BOUND = "min_active_bound"  # round_up(M*k + min(M*k, E_l)*(A-1), A): vLLM >= 0.30
    ALL_EXPERTS_BOUND = "all_experts_bound"  # round_up(M*k + E_l*(A-1), A): older vLLM
    EXACT_COUNTS = "exact_counts"  # sum_e round_up(count_e, A): counts on the host (DeepEP HT)
    # A*(m + (M*k - m) // A), m = min(M*k, E_l): the largest exact sum any routing reaches (the
    # tight bound), SGLang 0.5.23 _get_compact_all_tokens (moe_runner/deep_gemm.py)
    TIGHT_BOUND = "tight_bound"


class InputQuantRecipe(enum.StrEnum):
    """The 1 x 128 input quantizers engines run (docs/tolerance.md#legitimate-recipes;
    reference/formats.py models each, docs/tolerance.md#quant_input-recipes says where they
    differ): vLLM's two and LMDeploy's."""

    CUDA_DIVISION = "cuda_division"  # per_token_group_quant.cu: amax / 448, scale floor 1e-10
    TRITON_RECIPROCAL = "triton_reciprocal"  # fp8_utils._per_token_group_quant_fp8: amax * (1/448)
    # LMDeploy 0.18 blocked_gemm_fp8._quant_fp8_kernel: scale amax * (1/448), amax floored at
    # 1e-6 in the input's dtype, codes x * (448 / amax) (not x / scale)
    AMAX_RECIPROCAL = "amax_reciprocal"
    # The same kernel compiled by Triton for an H200: 448 / amax is div.full.f32, read from the
    # recorded table (reference/hardware/quotient_table.py)
    AMAX_RECIPROCAL_SM90_TRITON = "amax_reciprocal_sm90_triton"
    # SGLang 0.5.23's JIT CUDA per_token_group_quant (fp32 scales): amax floored at 1e-10, scale
    # amax * (1/448), codes x * (448 / amax) with nvcc --use_fast_math's division on an H200
    FAST_RECIPROCAL_SM90_CUDA = "fast_reciprocal_sm90_cuda"


class ActQuantRecipe(enum.StrEnum):
    """vLLM's three SwiGLU + FP8 requant kernels (docs/tolerance.md#act_quant-recipes;
    reference/activation.py models each), the Triton two with the hardware's gate, LMDeploy's,
    SGLang's and TensorRT-LLM's."""

    PACKED = "packed"  # silu_mul_quant_fp8_packed_triton: fp32, one bf16 rounding (UE8M0_PACKED)
    COLMAJOR = "colmajor"  # silu_mul_per_token_group_quant_fp8_colmajor: silu_and_mul's roundings
    BF16_STEPS = "bf16_steps"  # persistent_masked_m_silu_mul_quant (CUDA, LL): every step in bf16
    # LMDeploy 0.18 (fused_moe_v3_fp8): silu_and_mul's roundings (colmajor's), then its input
    # quantizer (InputQuantRecipe.AMAX_RECIPROCAL) on the bf16 activations
    COLMAJOR_AMAX_RECIPROCAL = "colmajor_amax_reciprocal"
    # The same two LMDeploy kernels compiled by Triton for an H200: the gate from the recorded
    # Triton table (reference/hardware/gate_table.py), 448 / amax from the recorded quotient table
    COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON = "colmajor_amax_reciprocal_sm90_triton"
    # The two Triton kernels with the gate read from the table recorded on an H200 (Triton 3.6):
    # tl.exp and the approximate division as that GPU computes them
    # (reference/hardware/gate_table.py).
    PACKED_SM90_TRITON = "packed_sm90_triton"
    COLMAJOR_SM90_TRITON = "colmajor_sm90_triton"
    # SGLang 0.5.23 on an H200: silu_and_mul (JIT CUDA, fast math: silu read from the recorded
    # table) times up in fp32, one bf16 rounding (packed's), then its quantizer
    # (InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA)
    PACKED_FAST_RECIPROCAL_SM90_CUDA = "packed_fast_reciprocal_sm90_cuda"
    # TensorRT-LLM's DeepGEMM MoE (NVIDIA/TensorRT-LLM at 03857e0888701052edd74d0209559b09e381f7f8:
    # ops/moe_op_deepgemm.py calls fp8_utils.py silu_and_mul_masked_post_quant_fwd with
    # scale_ue8m0=True): colmajor's roundings, s = 2^ceil(log2(max(amax, 1e-10) / 448)), UE8M0
    # bytes packed four per int32 (UE8M0_PACKED, plain silu, 128-column groups)
    COLMAJOR_CEIL_PACKED = "colmajor_ceil_packed"


class GatherRecipe(enum.StrEnum):
    """How the gather's fp32 weighted sum rounds each step (docs/tolerance.md#gather-recipes):
    the same sum in k order either way, one final rounding to bf16."""

    # acc = fl(acc + fl(x * w)): the product rounded, then the sum (a kernel compiled without
    # FMA contraction, as the suite's own; the Triton interpreter; eager torch)
    MUL_ADD = "mul_add"
    # acc = fma(x, w, acc), one rounding: `acc += x * w` in a Triton kernel compiled for a GPU
    # with Triton's default enable_fp_fusion=True (vLLM's ep_gather, SGLang's
    # post_reorder_deepgemm, LMDeploy's ep_gather)
    FMA = "fma"


class RoutedScalingRecipe(enum.StrEnum):
    """Where grouped routing's routed_scaling_factor multiplies in
    (docs/tolerance.md#routed-scaling): both readings compute the same MoE, and the route stage's
    topk_weights say which one a backend follows. A backend on the second declares it (the route
    stage's "recipe" entry): its gather is then fed and judged in that reading."""

    # the route's topk_weights are the renormalized weights times the factor, and the gather sums
    # them (vLLM 0.32's grouped_topk; the golden's own)
    SCALE_IN_ROUTING = "scale_in_routing"
    # the route's topk_weights are unscaled, and the gather multiplies each token's fp32 sum by
    # the factor before its one rounding (SGLang 0.5.23: TopK leaves the weights unscaled, and
    # the DeepGEMM runner's post_permute_deep_gemm_to_standard hands the factor to
    # post_reorder_deepgemm)
    SCALE_ON_OUTPUT = "scale_on_output"


class GemmRecipe(enum.StrEnum):
    """What a GEMM stage's live rows are held to (docs/tolerance.md#legitimate-recipes,
    docs/tolerance.md#zero-tolerance-on-sm90)."""

    FP32_DEQUANT = "fp32_dequant"  # bounded against exact fp32 math on the same fp8 operands
    TENSOR_CORE = "tensor_core"  # bit for bit against the Hopper tensor core's block accumulation


class Engine(enum.StrEnum):
    """The GEMM engine of the optimized path: DeepGEMM, or its Triton kernels where DeepGEMM cannot
    run the problem (no SM90/SM100 GPU, a recipe it lacks)."""

    AUTO = "auto"  # DeepGEMM where it can run this problem, else Triton
    DEEPGEMM = "deepgemm"
    TRITON = "triton"


# The masked layout's batches (ep:N+ll's among them) hold whole blocks of this many rows (the
# masked GEMM's largest BLOCK_M).
LL_BLOCK_ROWS = 128

# The largest finite e4m3 and e2m1 magnitudes (every quantizer clamps to them).
FP8_MAX = 448.0
E2M1_MAX = 6.0


class Recipe(enum.StrEnum):
    """Quantization recipe of one MoE layer: how its activations and weights are stored."""

    FP8_BLOCK = "fp8_block"  # e4m3 activations 1x128, e4m3 weights 128x128 blocks
    MXFP8 = "mxfp8"  # e4m3 activations and weights, 1x32 groups, E8M0 scales
    MXFP4_W4A8 = "mxfp4_w4a8"  # e4m3 activations 1x128, E2M1 weights 1x32 with E8M0 scales

    @property
    def act_group(self) -> int:
        """K elements sharing one activation scale."""
        return 32 if self is Recipe.MXFP8 else 128

    @property
    def weight_block(self) -> tuple[int, int]:
        """(rows, K elements) sharing one weight scale."""
        return (128, 128) if self is Recipe.FP8_BLOCK else (1, 32)

    @property
    def allowed_scale_fmts(self) -> tuple[ScaleFmt, ...]:
        if self is Recipe.FP8_BLOCK:
            return (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED)
        if self is Recipe.MXFP8:
            # MX activations carry E8M0 bytes; the GEMM consumes them packed four per int32.
            return (ScaleFmt.UE8M0_PACKED,)
        return (ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED)


class ScaleFmt(enum.StrEnum):
    """How activation scales are stored (vLLM's DeepGemmQuantScaleFMT)."""

    FLOAT32 = "float32"  # plain fp32 amax/448
    FLOAT32_CEIL_UE8M0 = "float32_ceil_ue8m0"  # fp32 storage, rounded up to a power of two (SM90)
    UE8M0_PACKED = "ue8m0_packed"  # exponent bytes, 4 per int32, MN-major TMA-aligned (SM100)

    @property
    def is_ue8m0(self) -> bool:
        """True when every scale is a power of two (weights are requantized to UE8M0 too)."""
        return self is not ScaleFmt.FLOAT32
