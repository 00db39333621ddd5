"""A folder of wrong answers: backends that each get ONE stage wrong, the way a real bug did.

Every class is the optimized path (`OptimizedBackend`) with one stage hook (the public method
named after the stage) overridden. The override runs the correct stage and then corrupts its
outputs (or, where the bug is a wrong input to an otherwise correct kernel, feeds the correct
stage that wrong input), so each wrong answer reads as "the right thing, then the bug". The
docstring names the field bug it imitates (its public issue or PR, or the vLLM code it concerns)
and its class:

- (a) races and stale reads in the permute's bookkeeping (segment starts, m_indices);
- (b) out-of-bounds accesses: index overflow, ignored strides, broken alignment, empty inputs;
- (c) what padding rows hold: their data and scales must be valid (zero, or a power of two
  where the kernel asserts one) and never read as NaN;
- (d) scale format, layout and packing mismatches (fp32 vs UE8M0, row- vs column-major,
  byte order in a packed word);
- (e) misrouting that depends on the rank or the topology (rank 0 right, the others wrong).

Outputs are fresh tensors of this backend, so they are corrupted in place; the upstream Trace may
be the golden's (isolated mode) and is never written: `_with` builds a modified copy instead.
"""

from __future__ import annotations

import torch

from moe_verify.examples import SwappedExpertRows, row_view
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.spec import FP8_MAX, STAGES, MoEInputs, MoEProblem, StageContext, Trace
from optimized.backend import OptimizedBackend
from optimized.kernels import slot_counts
from reference.topology import placement

Outputs = dict[str, object]
FP8 = torch.float8_e4m3fn


def _with(up: Trace, stage: str, **entries: object) -> Trace:
    """A copy of `up` whose `stage` has `entries` replaced; `up` itself is left untouched."""
    out = Trace(up.backend, up.rank)
    for name, outputs in up.items():
        out.add(name, {**outputs, **entries} if name == stage else outputs)
    return out


def _reverse_bytes_(packed: torch.Tensor) -> None:
    """Reverse the four E8M0 bytes of every int32 word, in place (strides kept): group 4p + j
    lands in byte 3 - j, a big-endian packing of the little-endian layout DeepGEMM reads."""
    word = packed.to(torch.int64) & 0xFFFFFFFF
    flipped = sum(((word >> (8 * j)) & 0xFF) << (8 * (3 - j)) for j in range(4))
    packed.copy_(torch.where(flipped >= 2**31, flipped - 2**32, flipped).to(torch.int32))


def _double_codes(q: torch.Tensor) -> torch.Tensor:
    """fp8 codes requantized against a scale half as large: x2, saturating at +-448."""
    return (q.float() * 2).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# -- route ----------------------------------------------------------------------------------------


class MisroutedToken(OptimizedBackend):
    """route: token 0's first slot names an expert the router did not pick (the lowest expert
    the token does not use), as a top-k kernel that writes one slot from the wrong column does.

    Class (e): a slot counted for one expert and written to another; the route-side twin of
    SlotInWrongSegment, which misroutes one slot in the permute instead.
    """

    name = "misrouted_token"

    def route(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().route(ctx)
        ids = out["topk_ids"].clone()
        used = set(ids[0].tolist())
        ids[0, 0] = min(e for e in range(p.num_experts) if e not in used)
        out["topk_ids"] = ids
        return out


class RoutedScalingTwice(OptimizedBackend):
    """route: routed_scaling_factor applied twice (in the router and again on its weights).

    Applied twice or not at all, the factor gives finite, plausible outputs with no error; where
    it is applied (the router or the model) differs by model and version (DeepSeek grouped
    routing).
    """

    name = "routed_scaling_twice"

    def route(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        out = super().route(ctx)
        out["topk_weights"] = out["topk_weights"] * p.routed_scaling_factor
        return out


# -- quant_input ----------------------------------------------------------------------------------


class FloorInputScales(OptimizedBackend):
    """quant_input: UE8M0 scales rounded down (floor) instead of up (ceil), codes requantized
    against them, so every group's max saturates at 448.

    floor(log2 s) = ceil(log2 s) - 1 unless amax/448 is an exact power of two, which no group of
    random data is. Imitates a UE8M0 packer that takes the fp32 exponent bits (a floor) instead
    of rounding up, vLLM's old MXFP8 torch fallback `floor(log2 amax)`, and the scale/payload
    contract of transformers issue #47030 (scales rounded without requantizing the codes).
    """

    name = "floor_input_scales"

    def quant_input(self, ctx: StageContext) -> Outputs:
        out = super().quant_input(ctx)
        out["a1q_scale"] = out["a1q_scale"] / 2
        out["a1q"] = _double_codes(out["a1q"])
        return out


# -- align ----------------------------------------------------------------------------------------


class MSumOneBlockShort(OptimizedBackend):
    """align: M_sum one alignment block short of what the segments need (an off-by-one in the
    exact sum: sum_e round_up(count_e, A) - A).

    M_sum sizes the permuted workspace; one block short, the last expert's segment runs past it
    (vLLM 0.32 `compute_aligned_M_and_alignment` in fused_moe/deep_gemm_utils.py; class (b), as
    SGLang PR #6348 and ROCm/aiter PR #2447). A larger M_sum than the golden's, even one no
    formula gives, is legitimate; only one below the segments is a bug.
    """

    name = "m_sum_one_block_short"

    def align(self, ctx: StageContext) -> Outputs:
        out = super().align(ctx)
        out["M_sum"] = slot_counts.aligned_m_sum_exact(out["counts"], out["alignment"])
        out["M_sum"] -= out["alignment"]
        return out


class MSumNotAligned(OptimizedBackend):
    """align: M_sum one row past a multiple of the alignment (the bound computed without its
    final round_up).

    DeepGEMM tiles M_sum in BLOCK_M = A blocks: a ragged last block reads past every buffer of
    M_sum rows (vLLM 0.32's ep_scatter host wrapper asserts M_sum % A == 0).
    """

    name = "m_sum_not_aligned"

    def align(self, ctx: StageContext) -> Outputs:
        out = super().align(ctx)
        out["M_sum"] += 1
        return out


class HalfAlignment(OptimizedBackend):
    """align: the layout is padded to A/2 while the GEMM tiles M by A.

    ROCm/vllm PR #980 (BLOCK_SIZE_M = 64 against alignment 128: half the output uninitialised,
    hidden by a tolerance bump); A != DeepGEMM's BLOCK_M puts two experts in one block, as does
    DeepGEMM's process-global contiguous-layout alignment changed under the permute.
    """

    name = "half_alignment"

    def align(self, ctx: StageContext) -> Outputs:
        p = ctx.problem
        return super().align(ctx.replace(problem=p.replace(alignment=p.alignment // 2)))


class ExpertMapIgnoredOnRank1(OptimizedBackend):
    """align, rank 1 only: expert counts computed from global ids as if they were local ids.

    vllm-gaudi PR #1796 (global ids passed where local ids were required: rank 0 correct, ranks
    1..N-1 drop contributions) and vLLM PR #19515 (a workspace sized by the global expert count
    instead of the local one), class (e). On rank 0 of a linear placement global and local ids
    coincide, so only rank 1 is wrong.
    """

    name = "expert_map_ignored_on_rank1"

    def align(self, ctx: StageContext) -> Outputs:
        up, rank = ctx.upstream, ctx.rank
        out = super().align(ctx)
        if rank == 1:
            ids = up["route"]["topk_ids"]
            local = len(out["counts"])
            out["counts"] = slot_counts.count_expert_tokens(ids, local, None, validate=False)
        return out


# -- permute --------------------------------------------------------------------------------------

# SwappedExpertRows (class (a): two slots' rows trade places in the permuted buffer) lives in
# moe_verify/examples/permute.py, where the README's examples load it from; its case is below.


class SlotInWrongSegment(OptimizedBackend):
    """permute: one slot claims its row from another expert's cursor, so its bytes land in that
    expert's segment (the first row past its live rows) and inv_perm points there; the row it
    should have used is left zero. m_indices, written from the counts, stay correct.

    vLLM PR #34991 (ep_scatter reads a garbage `expert_start_loc` entry and writes into the
    wrong segment); counts that disagree with the slots run the cursor into the next segment
    the same way, class (e).
    """

    name = "slot_in_wrong_segment"

    def permute(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().permute(ctx)
        inv, m, start = out["inv_perm"], out["m_indices"], out["expert_start"]
        counts, align = up["align"]["counts"].tolist(), up["align"]["alignment"]
        t, k = (int(i) for i in (inv >= 0).nonzero()[0])
        old = int(inv[t, k])
        other = next(e for e, c in enumerate(counts) if e != int(m[old]) and c % align)
        new = int(start[other]) + counts[other]
        for name in ("a_perm", "a_scale_perm"):
            rows = row_view(out[name])
            rows[new] = rows[old]
            rows[old] = 0
        inv[t, k] = new
        return out


class PaddingMIndicesZero(OptimizedBackend):
    """permute: m_indices of padding rows left 0 (torch.zeros) instead of -1.

    DeepGEMM's contiguous layout skips -1 rows and computes the others with their expert; a 0
    makes expert 0 compute padding (vLLM PR #17934: the -1 skip contract; ROCm/aiter PR #2447:
    stale sorted expert ids for non-local experts), class (c).
    """

    name = "padding_m_indices_zero"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        out["m_indices"][out["m_indices"] == -1] = 0
        return out


class UnalignedSegments(OptimizedBackend):
    """permute: expert segments packed back to back, not padded to the alignment.

    DeepGEMM issue #178 (the contiguous kernel expects every group's rows padded to 128); two
    experts' rows in one BLOCK_M block are computed with one expert's weights.
    """

    name = "unaligned_segments"

    def permute(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        return super().permute(ctx.replace(upstream=_with(up, "align", alignment=1)))


class SegmentMIndicesWrong(OptimizedBackend):
    """permute: the live rows of one expert's segment (the first one with live rows) carry the
    next local expert's id in m_indices; the rows themselves and expert_ends stay right.

    The m_indices fill of ep_scatter's first kernel writing another program's expert (vLLM 0.32
    `_fwd_kernel_ep_scatter_1`: one program per expert fills its own segment), class (e):
    DeepGEMM then multiplies that segment by the wrong expert's weights.
    """

    name = "segment_m_indices_wrong"

    def permute(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().permute(ctx)
        counts = up["align"]["counts"].tolist()
        e = next(i for i, c in enumerate(counts) if c)
        start = int(out["expert_start"][e])
        out["m_indices"][start : start + counts[e]] = (e + 1) % len(counts)
        return out


class ExpertEndsOffByOne(OptimizedBackend):
    """permute (psum layout): one expert's cumulative end one row too far, so the first gap row
    of its segment counts as live.

    vLLM 0.32's psum ends are aligned_start + count (`build_psum_group_end`); ending at
    start + count + 1 (an inclusive end) makes DeepGEMM and act_quant compute a padding row as
    that expert's, and a - 1 would drop its last live row.
    """

    name = "expert_ends_off_by_one"

    def permute(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().permute(ctx)
        align = up["align"]["alignment"]
        e = next(i for i, c in enumerate(up["align"]["counts"].tolist()) if c % align)
        out["expert_ends"][e] += 1
        return out


class InvPermOffByOne(OptimizedBackend):
    """permute: inv_perm holds the row cursor after the increment (atomic_add's new value) while
    the data went to the row claimed before it, so every slot points one row too far.

    The row index vLLM's ep_gather follows for each slot; an off-by-one row as in
    huggingface/kernels-community issue #1153.
    """

    name = "inv_perm_off_by_one"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        inv = out["inv_perm"]
        inv[inv >= 0] += 1
        return out


class GarbagePaddingScales(OptimizedBackend):
    """permute: fp32 scales of padding rows left uninitialised (torch.empty), here a value that is
    not a power of two.

    vLLM PR #49784 (vLLM allocated padded scale rows with torch.empty and ep_scatter writes live
    rows only; DeepGEMM 2.6 then asserts every scale is a power of two: CUDA_ERROR_LAUNCH_FAILED)
    and SGLang PRs #32385 / #32386 (the same on the masked path), class (c).
    """

    name = "garbage_padding_scales"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        out["a_scale_perm"][out["m_indices"] == -1] = 0.3
        return out


class NanPaddingPackedScales(OptimizedBackend):
    """permute (packed UE8M0): padding rows' scale words all 0xFF bytes, which the kernel reads
    as NaN.

    vLLM PR #38148 (padding scales from torch.empty read as NaN, cascading into the KV cache);
    the E8M0 byte 0xFF is NaN to the kernel, class (c).
    """

    name = "nan_padding_packed_scales"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        out["a_scale_perm"][out["m_indices"] == -1] = -1
        return out


class PermutedScaleBytesReversed(OptimizedBackend):
    """permute (MXFP8): packed UE8M0 scale bytes in the wrong order inside each int32 word.

    SGLang issue #29038 (packed UE8M0 scales viewed with the wrong shape, mismatched with their
    groups) and PaddleFleet PR #1474 (layout bugs hidden when a row has a single group); vLLM
    0.32's `_fwd_kernel_ep_scatter_2` packs four bytes per word, class (d).
    """

    name = "permuted_scale_bytes_reversed"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        _reverse_bytes_(out["a_scale_perm"])
        return out


# -- gemm1 ----------------------------------------------------------------------------------------


class StaleGemm1Row(OptimizedBackend):
    """gemm1: one live row of mm1 keeps the value of a previous call (another seed), as a reused
    workspace row the kernel never rewrote.

    vLLM's a1q_perm / mm1 / mm2 workspaces alias, so reordering kernels corrupts rows;
    rtp-llm PR #1098 (stale reads, caught by poison pre-fill) and vLLM PR #51750 (metadata
    stale across CUDA-graph replays).
    """

    name = "stale_gemm1_row"

    def gemm1(self, ctx: StageContext) -> Outputs:
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        out = super().gemm1(ctx)
        row = int(up["permute"]["inv_perm"].max())  # the last live row
        out["mm1"][row] = self._previous_mm1(p, x, rank)[row]
        return out

    def _previous_mm1(self, p: MoEProblem, x: MoEInputs, rank: int) -> torch.Tensor:
        """mm1 of the same shapes on the next seed: what the workspace held from the last call."""
        previous = p.replace(seed=p.seed + 1)
        inputs = make_inputs(previous, x.hidden_states.device)
        backend = OptimizedBackend(self.engine)
        trace = Trace(backend.name, rank)
        for stage in STAGES[: STAGES.index("gemm1") + 1]:
            trace.add(stage, run_one_stage(backend, stage, previous, inputs, trace, rank))
        return trace["gemm1"]["mm1"]


class HalfGridGemm1(OptimizedBackend):
    """gemm1: only the first half of every alignment block is computed; the rest stays zero.

    ROCm/vllm PR #980 (BLOCK_SIZE_M 64 against alignment 128 launched half the blocks: half the
    MoE output uninitialised for small M, hidden by a tolerance bump 2e-2 -> 3e-2).
    """

    name = "half_grid_gemm1"

    def gemm1(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().gemm1(ctx)
        align = up["align"]["alignment"]
        rows = torch.arange(out["mm1"].shape[0], device=out["mm1"].device)
        out["mm1"][rows % align >= align // 2] = 0
        return out


# -- act_quant ------------------------------------------------------------------------------------


class GateUpSwapped(OptimizedBackend):
    """act_quant: the [gate | up] halves of mm1 read in the wrong order (silu(up) * gate).

    Interleaved w13 checkpoints, or a w1/w3 swap between TRT-LLM / FlashInfer conventions:
    plausible but wrong outputs that small-magnitude tests cannot tell apart.
    """

    name = "gate_up_swapped"

    def act_quant(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        mm1 = up["gemm1"]["mm1"]
        half = mm1.shape[1] // 2
        swapped = torch.cat([mm1[:, half:], mm1[:, :half]], dim=1)
        return super().act_quant(ctx.replace(upstream=_with(up, "gemm1", mm1=swapped)))


class FloorActScales(OptimizedBackend):
    """act_quant: UE8M0 scales (fp32 storage, the ceil format) floored instead of ceiled, codes
    requantized against them.

    The act_quant twin of FloorInputScales (transformers issue #47030).
    """

    name = "floor_act_scales"

    def act_quant(self, ctx: StageContext) -> Outputs:
        out = super().act_quant(ctx)
        out["a2q_scale"].mul_(0.5)  # in place: the column-major strides stay
        out["a2q"] = _double_codes(out["a2q"])
        return out


class ActScaleBytesReversed(OptimizedBackend):
    """act_quant (packed UE8M0): scale bytes in the wrong order inside each int32 word.

    SGLang issue #29038 (UE8M0 scale packing mismatched with the groups, DeepSeek-V4 W4A8
    accuracy) and SGLang PR #9946 (UE8M0 / column-major scale quant on Blackwell), class (d).
    """

    name = "act_scale_bytes_reversed"

    def act_quant(self, ctx: StageContext) -> Outputs:
        out = super().act_quant(ctx)
        _reverse_bytes_(out["a2q_scale"])
        return out


class ActScaleWrittenRowMajor(OptimizedBackend):
    """act_quant: scales stored row-major into a buffer whose strides say column-major (1, M).

    vLLM issue #42118 / PR #42089 (scales arrive in the wrong layout: row-major vs swizzled) and
    SGLang PR #13896 (a kernel ignores stride(1), as vLLM 0.32's fp32 ep_scatter does for the
    scales), class (d).
    """

    name = "act_scale_written_row_major"

    def act_quant(self, ctx: StageContext) -> Outputs:
        out = super().act_quant(ctx)
        s = out["a2q_scale"]
        wrong = torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device=s.device)
        wrong.as_strided((s.numel(),), (1,)).copy_(s.contiguous().view(-1))
        out["a2q_scale"] = wrong
        return out


# -- gemm2 ----------------------------------------------------------------------------------------


class Gemm2IgnoresScaleStrides(OptimizedBackend):
    """gemm2: the activation scales are read as column-major (1, M), the layout this backend's own
    act_quant writes, whatever the strides say (the contract allows any).

    vLLM issue #42118 (with dp=1 the scales were quantized straight into the layout the kernel
    reads, so no test fed it another), SGLang PR #13896 (stride(1) ignored). End to end the
    bug is invisible: only a stage fed another producer's layout (isolated mode) exposes it.
    """

    name = "gemm2_ignores_scale_strides"

    def gemm2(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        s = up["act_quant"]["a2q_scale"]
        assumed = torch.as_strided(s, s.shape, (1, s.shape[0]))
        return super().gemm2(ctx.replace(upstream=_with(up, "act_quant", a2q_scale=assumed)))


class NanExpertOutput(OptimizedBackend):
    """gemm2: every row of one expert (that of the first live slot) comes out NaN.

    vLLM PR #38148 (NaN from padding scales cascading into the KV cache), SGLang issue #33106
    (uninitialised rows give NaN with one GEMM backend) and SGLang PR #28664 (NaN logits from a
    scale format mismatch).
    """

    name = "nan_expert_output"

    def gemm2(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().gemm2(ctx)
        m, inv = up["permute"]["m_indices"], up["permute"]["inv_perm"]
        expert = m[inv[inv >= 0][0]]
        out["mm2"][m == expert] = float("nan")
        return out


# -- gather ---------------------------------------------------------------------------------------


class TopkWeightsIgnored(OptimizedBackend):
    """gather: every slot weighted 1 instead of its router weight.

    vLLM 0.32 fused_moe/topk_weight_and_reduce.py: the weights are applied in the experts, on
    the input (`apply_router_weight_on_input`), or not at all, by variant.
    """

    name = "topk_weights_ignored"

    def gather(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        ones = torch.ones_like(up["route"]["topk_weights"])
        return super().gather(ctx.replace(upstream=_with(up, "route", topk_weights=ones)))


class Bf16GatherAccumulation(OptimizedBackend):
    """gather: the weighted sum over k accumulated in bf16 (rounded after every slot) instead of
    fp32 with one final rounding.

    vLLM's ep_gather accumulates in fp32 and rounds to bf16 once; ROCm/vllm PR #980's lesson: a
    loose tolerance would accept it. A wrong accumulator cannot be made by post-processing the
    correct output, so this one recomputes the sum.
    """

    name = "bf16_gather_accumulation"

    def gather(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        mm2, inv = up["gemm2"]["mm2"], up["permute"]["inv_perm"].long()
        weights = up["route"]["topk_weights"]
        acc = torch.zeros(inv.shape[0], mm2.shape[1], dtype=torch.bfloat16, device=mm2.device)
        for k in range(inv.shape[1]):
            live = (inv[:, k] >= 0)[:, None]
            term = mm2[inv[:, k].clamp(min=0)].float() * weights[:, k, None]
            acc = torch.where(live, (acc.float() + term).to(torch.bfloat16), acc)
        return {"out": acc}


class InvalidSlotGathered(OptimizedBackend):
    """gather: a -1 slot is not skipped; its row index is clamped to 0, so it adds its weight
    times mm2 row 0.

    Tokens whose every slot is -1 must give exact zeros, and inv_perm of skipped slots is
    uninitialised in vLLM, so reading it fetches an arbitrary row; vLLM PR #17934 (the -1 skip
    contract).
    """

    name = "invalid_slot_gathered"

    def gather(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        out = super().gather(ctx)
        route, mm2 = up["route"], up["gemm2"]["mm2"]
        dead = (route["topk_weights"] * (route["topk_ids"] < 0)).sum(dim=1, keepdim=True)
        out["out"] = (out["out"].float() + dead * mm2[0].float()).to(torch.bfloat16)
        return out


class LastExpertDroppedOnLastRank(OptimizedBackend):
    """gather, the last rank only: the slots of its highest expert get no weight.

    A per-rank off-by-one that only the last rank reaches: under vLLM's placement the first
    E % N ranks hold one expert more than the rest, so a loop bound or offset that is right on
    rank 0 can be one short on the last rank. vLLM issue #39211 (a fault on one EP rank, always
    the same one) and vllm-gaudi PR #1796 (ranks dropping contributions silently), class (e).
    Written for the linear placement, whose route ids are the ones the ranks hold (no EPLB
    replicas).
    """

    name = "last_expert_dropped_on_last_rank"

    def gather(self, ctx: StageContext) -> Outputs:
        p, up, rank = ctx.problem, ctx.upstream, ctx.rank
        if rank != p.topology.size - 1:
            return super().gather(ctx)
        route = up["route"]
        dropped = route["topk_ids"] == placement(p)[rank][-1]
        weights = torch.where(dropped, 0.0, route["topk_weights"])
        return super().gather(ctx.replace(upstream=_with(up, "route", topk_weights=weights)))


WRONG_BACKENDS: tuple[type[OptimizedBackend], ...] = (
    MisroutedToken,
    RoutedScalingTwice,
    FloorInputScales,
    MSumOneBlockShort,
    MSumNotAligned,
    HalfAlignment,
    ExpertMapIgnoredOnRank1,
    SwappedExpertRows,
    SlotInWrongSegment,
    PaddingMIndicesZero,
    UnalignedSegments,
    SegmentMIndicesWrong,
    ExpertEndsOffByOne,
    InvPermOffByOne,
    GarbagePaddingScales,
    NanPaddingPackedScales,
    PermutedScaleBytesReversed,
    StaleGemm1Row,
    HalfGridGemm1,
    GateUpSwapped,
    FloorActScales,
    ActScaleBytesReversed,
    ActScaleWrittenRowMajor,
    Gemm2IgnoresScaleStrides,
    NanExpertOutput,
    TopkWeightsIgnored,
    Bf16GatherAccumulation,
    InvalidSlotGathered,
    LastExpertDroppedOnLastRank,
)
