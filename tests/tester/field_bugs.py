"""Bug classes reported from the field in 2026 (vLLM, SGLang, DeepGEMM, FlashInfer, Triton) as
wrong backends.

Each class is the optimized path (`OptimizedBackend`; for a bug that lives only under graph
replay, the same class run by `moe-verify graph`) with ONE stage method overridden, the way the
field bug sat in a real kernel or its host code; the docstring names the bug (its public
thread), what it does wrong and the stage that must catch it. `CATCHES` says, per class, the
problem (and poison) that reaches the bug and where the suite must catch it, so the GPU tier can
reuse the table.

Three classes need inputs that random draws never reach, all made by the product:

- `MoEProblem.tiny_tokens` (moe_verify/run/inputs.py): tokens whose every group's amax is below
  448 * 2^-127, so their MXFP8 scale is E8M0 byte 0 (2^-127), the code Triton's decoder read as
  zero (Triton #11624);
- `verify(..., padding_poison=True)` (moe_verify/run/poison.py `poison_padding`): padding rows of
  the golden's permuted activations at the largest e4m3 code and, where the layout leaves them
  unspecified (psum gap and tail rows), their scales at the largest fp32, so a GEMM that computes
  padding rows overflows to Inf there (FlashInfer #3650: random inputs hid it, since every
  padding row of a fresh scatter is zero);
- the stale ids of vLLM PR #41834 come from `moe_verify.production.graph` (its padded replays plant
them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_verify.examples import PaddingInfBleedsIntoTile
from moe_verify.spec import (
    ActQuantRecipe,
    GroupedLayout,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    ScaleFmt,
    StageContext,
    Topology,
)
from optimized.backend import OptimizedBackend, Outputs
from optimized.kernels import slot_counts
from tests.tester.recipe_backends import bf16_steps
from tests.tester.wrong_backends import _with


def _fp32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _packed_bytes(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 packed UE8M0 [M, P] (any strides; group 4p + j in byte j of word p) -> int32 [M, G]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [(words >> (8 * j)) & 0xFF for j in range(4)]
    return torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, :groups].to(torch.int32)


# -- quant_input ---------------------------------------------------------------------------------


class CeilScaleAfterQuant(OptimizedBackend):
    """quant_input (SGLang PRs #28418/#28307): the group is quantized against its plain fp32
    scale amax/448, and the scale is ceiled to a power of two only afterwards; the codes are
    never requantized against the ceiled scale.

    Every dequantized value comes out ceil(s)/s times too large (SGLang measured a mean of 1.31,
    max 1.99, on DeepSeek-V4's wo_a: quantization error x14.1). The scales alone look right: they
    are the golden's bit for bit (a power-of-two check such as SGLANG_DEEPGEMM_SANITY_CHECK
    passes), so only quant_input's codes can catch it.
    """

    name = "ceil_scale_after_quant"

    def quant_input(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().quant_input(ctx.replace(problem=p.replace(scale_fmt=ScaleFmt.FLOAT32)))
        bits = _fp32_bits(out["a1q_scale"])
        exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        out["a1q_scale"] = _from_bits((exponent + (mantissa != 0).to(torch.int32)) << 23)
        return out


class NonPow2ScalesIntoUe8m0(OptimizedBackend):
    """quant_input (SGLang #39193): the non-UE8M0 branch (DEEPGEMM_SCALE_UE8M0 false) hands
    a UE8M0 consumer plain fp32 scales amax/448, which are not powers of two.

    The consumer keeps only their exponent field (DeepGEMM's fp32 -> UE8M0 transform, or this
    suite's packer once its host check is off, as in production mode): the mantissa is truncated,
    every value shrinks by 2^floor(log2 s)/s (silently ~25% wrong, as reported). The stage that
    breaks the contract is quant_input, whose UE8M0 scales must be powers of two; the golden's
    are 2^ceil(log2 s), one exponent step above the truncated ones.
    """

    name = "non_pow2_scales_into_ue8m0"

    def quant_input(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        return super().quant_input(ctx.replace(problem=p.replace(scale_fmt=ScaleFmt.FLOAT32)))


# -- gemm1 ---------------------------------------------------------------------------------------


def decode_e8m0_zero_as_zero(byte: torch.Tensor) -> torch.Tensor:
    """Triton's old `_e8m0_to_f32` (#11624): fp32 bits = byte << 23, so byte 0 gives +0.0 where
    it means 2^-127 (the subnormal 0x00400000), and 255 gives +Inf where it means NaN."""
    return _from_bits(byte.to(torch.int32) << 23)


class E8m0ZeroByteAsZero(OptimizedBackend):
    """gemm1 (Triton PRs #11624 / #11737): the GEMM decodes the activations' E8M0 scale bytes
    with a shift into the exponent field, which reads byte 0 (2^-127) as 0.0, as `tl.dot_scaled`
    and the interpreter's `_e8m0_to_f32` did.

    Any MX path (MXFP8's 1x32 E8M0 activation scales here) with a group whose amax / 448 is at
    most 2^-127 has byte 0: that group's products all vanish. Random data never gets there
    (amax ~ 1); a token of tiny activations (`MoEProblem.tiny_tokens`) does, and its every mm1
    element comes out zero. gemm1 is the first stage that decodes the bytes, so it must catch
    it, naming the token. The decoded scales are handed to the same GEMM as fp32 (exact: powers
    of two).
    """

    name = "e8m0_zero_byte_as_zero"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        packed = up["permute"]["a_scale_perm"]
        byte = _packed_bytes(packed, p.hidden // p.recipe.act_group)
        decoded = decode_e8m0_zero_as_zero(byte)
        return super().gemm1(ctx.replace(upstream=_with(up, "permute", a_scale_perm=decoded)))


def scale_bytes_as_numbers(scale: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales as a loader writes them after byte-viewing their float8_e8m0fnu
    checkpoint tensor into an fp32 destination: each exponent byte copied as a number (2^-7,
    byte 120, becomes 120.0)."""
    return ((_fp32_bits(scale) >> 23) & 0xFF).float().view_as(scale)


class E8m0BytesCopiedAsNumbers(OptimizedBackend):
    """gemm1 (vLLM #43416, fix PR #51946): the FP8 experts' fp32 block scales were loaded by
    `copy_` from a byte view of the checkpoint's float8_e8m0fnu scales, so each holds its
    exponent byte as a number (120.0 for 2^-7) instead of the power of two it encodes.

    DeepSeek-V4-Flash on SM90 (fp32 scales, ceil-UE8M0 format) gave garbled text and raised
    nothing. The load writes every expert scale so; gemm1 is the first stage that reads one
    (w13), and must catch it on every live row, naming the experts. The right decoder existed
    but was reachable from an SM100 branch only.
    """

    name = "e8m0_bytes_copied_as_numbers"

    def gemm1(self, ctx: StageContext) -> Outputs:
        x = ctx.inputs
        w = x.w13_q
        loaded = QuantizedWeight(w.q, scale_bytes_as_numbers(w.scale), w.block)
        return super().gemm1(ctx.replace(inputs=dataclasses.replace(x, w13_q=loaded)))


# -- act_quant -----------------------------------------------------------------------------------


class ScaleFmtFromArch(OptimizedBackend):
    """act_quant (vLLM PR #28358, review P1): the scale format is taken from the GPU arch
    (`DeepGemmQuantScaleFMT.from_target_arch()`: SM100 means packed UE8M0) instead of the E8M0
    switch (`is_deep_gemm_e8m0_used()`), so with VLLM_USE_DEEP_GEMM_E8M0=0 on Blackwell act_quant
    emits int32 packed scales where GEMM2 expects fp32.

    `arch` is the (major, minor) this kernel believes it runs on. act_quant must catch it: its
    a2q_scale breaks the stage contract of the problem's format (int32 where fp32 is due).
    """

    name = "scale_fmt_from_arch"
    arch = (10, 0)

    def act_quant(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        fmt = ScaleFmt.UE8M0_PACKED if self.arch[0] >= 10 else ScaleFmt.FLOAT32_CEIL_UE8M0
        return super().act_quant(ctx.replace(problem=p.replace(scale_fmt=fmt)))


WARPS = 8  # the LL kernel's warps for H >= 4096 (vLLM PR #28366)
MANY_WARPS_FROM = 4096 // 128  # groups from which it launches WARPS warps


class LlActQuantWarpRemainder(OptimizedBackend):
    """act_quant (vLLM PR #28366): the low-latency kernel persistent_masked_m_silu_mul_quant
    (bf16 steps, vLLM tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py) launches 8 warps
    from H >= 4096 on and gives each warp G // 8 of a row's G groups, assuming they split
    evenly: with G = 33 (E, T, H) = (8, 128, 128 * 33), group 32 of every row is never computed
    and keeps what its buffer held (zero here, a fresh page).

    Reached on the batched layout (ep:N+ll) with I = 128 * 33; act_quant must catch it, naming
    the rows and the unwritten columns 4096..4223. Below 32 groups (one warp) it is right.
    """

    name = "ll_act_quant_warp_remainder"

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        q, s = bf16_steps(up["gemm1"]["mm1"], p.scale_fmt)
        groups = s.shape[-1]
        if groups >= MANY_WARPS_FROM:
            done = groups // WARPS * WARPS
            q.view(torch.uint8)[..., done * 128 :] = 0
            s[..., done:] = 0.0
        return {"a2q": q, "a2q_scale": s, "recipe": ActQuantRecipe.BF16_STEPS.value}


# -- production (graph replay) -------------------------------------------------------------------


class LocalCountBoundsIds(OptimizedBackend):
    """align (vLLM tests/kernels/moe/test_expert_map_bounds.py, PR #41834): the count kernel
    guards its expert_map read with the one expert count it is given, the LOCAL one
    (`0 <= id < E_l`), instead of the table size: stale positive ids (123456789 in CUDA-graph
    padding rows) are skipped, but so is every valid global id >= E_l.

    vLLM's fix bounds by the global count "because the local count is not a safe bound under EP".
    Without an expert map (TP) local and global ids coincide and every replay passes, stale ones
    included; under EP (linear) rank 0 hosts ids < E_l and stays right, and every replay must
    fail at `align` on rank 1, whose experts all lose their tokens.
    """

    name = "local_count_bounds_ids"

    def align(self, ctx: StageContext) -> Outputs:
        upstream = ctx.upstream
        out = super().align(ctx)
        sh = ctx.shard
        ids = upstream["route"]["topk_ids"]
        bounded = torch.where((ids >= 0) & (ids < sh.num_local_experts), ids, -1)
        out["counts"] = slot_counts.count_expert_tokens(
            bounded, sh.num_local_experts, sh.expert_map, validate=ctx.validate
        )
        return out


# -- the table -----------------------------------------------------------------------------------

# Four experts, top-2, A = 32, one 128-column group per row (as tests/tester/test_wrong_backends).
BASE = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
MXFP8 = BASE.replace(recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED)
TINY = MXFP8.replace(tiny_tokens=1)  # token 0's four 1x32 groups have E8M0 byte 0
CEIL = BASE.replace(scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0)
PACKED = BASE.replace(scale_fmt=ScaleFmt.UE8M0_PACKED)
PSUM = BASE.replace(grouped_layout=GroupedLayout.PSUM)  # vLLM's SM90 layout for fp8_block
# The LL layout with vLLM #28366's 33 groups of 128; one rank and one expert (the bug is per row,
# and each expert's batch is 128 rows of an 8448-column GEMM1, the interpreter's costliest call).
LL_33_GROUPS = BASE.replace(
    tokens=4, num_experts=1, topk=1, intermediate=128 * 33, topology=Topology.parse("ep:1+ll")
)


@dataclass(frozen=True)
class Catch:
    """A wrong backend, its field bug (the public thread), the case that reaches it, and the
    stage isolated mode must name. `poisoned`: the golden's permute padding poisoned
    (`verify(..., padding_poison=True)`). `names`: text the failure messages must contain (the
    rows, columns or entry blamed)."""

    backend: type[OptimizedBackend]
    bug: str
    problem: MoEProblem
    stage: str
    names: tuple[str, ...] = ()
    poisoned: bool = False

    @property
    def id(self) -> str:
        return self.backend.name


CATCHES: tuple[Catch, ...] = (
    Catch(E8m0ZeroByteAsZero, "Triton #11624", TINY, "gemm1", ("token 0",)),
    Catch(E8m0BytesCopiedAsNumbers, "vLLM #43416", CEIL, "gemm1", ("expert",)),
    # ^ SM90's fp32 power-of-two weight scales, as DeepSeek-V4's FP8 experts load them
    Catch(CeilScaleAfterQuant, "SGLang #28418", CEIL, "quant_input", ("token",)),
    Catch(NonPow2ScalesIntoUe8m0, "SGLang #39193", PACKED, "quant_input", ("token",)),
    # ^ packed UE8M0: the permute's packer keeps only the exponent field
    Catch(ScaleFmtFromArch, "vLLM #28358", BASE, "act_quant", ("a2q_scale", "int32")),
    # ^ E8M0 off (float32 scales), on what the kernel takes for an SM100
    Catch(LlActQuantWarpRemainder, "vLLM #28366", LL_33_GROUPS, "act_quant", ("column 4", "token")),
    Catch(PaddingInfBleedsIntoTile, "FlashInfer #3650", PSUM, "gemm1", ("NaN",), poisoned=True),
    # ^ ~8 live rows per 32-row segment: every expert has gap rows in its last tile
)


@dataclass(frozen=True)
class GraphCatch:
    """A wrong backend for production mode, its field bug, the topology, and per default replay
    (names from `moe_verify.production.graph.default_replays`) the first failure `verify_graph`
    must report,
    or None where that replay must pass; `ranks` the ranks whose stage fails."""

    backend: type[OptimizedBackend]
    bug: str
    topology: str
    replays: tuple[tuple[str, str | None], ...]
    ranks: tuple[int, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.backend.name}-{self.topology}"


GRAPH_CATCHES: tuple[GraphCatch, ...] = (
    GraphCatch(
        LocalCountBoundsIds,
        "vLLM PR #41834",
        "tp:1",  # no expert map: the local count is the table size, stale ids are skipped
        (("capture-softmax", None), ("one-live", None)),  # one-live: 7 rows of stale ids
    ),
    GraphCatch(
        LocalCountBoundsIds,
        "vLLM PR #41834",
        "ep:2",  # rank 1 hosts experts 2, 3: global ids >= E_l = 2
        (("capture-softmax", "align"), ("half-live", "align")),  # with and without stale ids
        ranks=(1,),
    ),
)
