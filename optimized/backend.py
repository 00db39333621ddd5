"""OptimizedBackend: the DeepGEMM MoE path (Triton kernels + DeepGEMM grouped GEMMs), staged.

One implementation of the stage protocol (moe_verify/spec/protocol.py): one method per stage,
`stage(ctx) -> outputs`. Verification calls the methods with a context that validates on the
host and hands guarded workspaces; production mode calls the same methods inside the custom op
with a graph-safe one (no validation, no host reads, buffers carved from the op's workspace, the
op's weights). A user's kernel for one stage overrides that one method, or wraps this class.

Stage for stage it mirrors reference/moe.py, so the two read side by side. GEMM stages pick an
engine like vLLM's TritonOrDeepGemmExperts (`deepgemm.choose_engine`) and record which one ran,
and why. The permute yields both grouped layouts (m_indices and the psum expert_ends) from one
plan; the GEMMs and act_quant read the one `deepgemm.choose_grouped_layout` picks (as vLLM 0.32
does, or as the problem forces) and record it as "layout".
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    GEMM_OUTPUT,
    GEMM_WEIGHT,
    Engine,
    GemmRecipe,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    Outputs,  # noqa: E402 - the vocabulary names it once
    Recipe,
    RouterWeight,
    ScaleFmt,
    Stage,
    StageContext,
    TopologyKind,
    Trace,
    ceil_div,
    check_bool,
    is_sm90,
    round_up,
    run_stages,
)
from optimized import deepgemm
from optimized.deepgemm import EngineChoice, as_engine, choose_engine, choose_grouped_layout
from optimized.dispatch import batch_m_indices, batched_dispatch
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter, slot_counts
from optimized.routing import apply_router_weight_on_input, select_experts
from optimized.topology import ShardCache, tp_down_shard, tp_gate_up_shard
from optimized.triton_compat import interpreter_mode

# The Triton GEMM tile whose SM90 bits were measured to be the tensor core's (docs/gpu-results.md).
MEASURED_BLOCK_ROWS = 128


def gemm_recipe(problem: MoEProblem, engine: Engine, out: torch.Tensor, alignment: int) -> Outputs:
    """{"recipe": "tensor_core"} where the Triton engine's fp8_block GEMM ran compiled on an SM90
    GPU: its chunks then accumulate on the tensor core and are promoted as DeepGEMM's are
    (optimized/kernels/grouped_gemm.py), so its output is the tensor-core recipe's bit for bit
    (measured on the H200: 100.0000% with fp32 and ceil-UE8M0 scales), for the one tile measured:
    128-row blocks (`grouped_gemm.default_block_m(alignment)`; smaller blocks may lower tl.dot to
    another MMA, whose accumulation is not modelled). The shared experts' two GEMMs say it of
    both. DeepGEMM's output says so by its engine; anything else declares nothing."""
    sm90 = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
    if (
        engine is not Engine.TRITON
        or problem.recipe is not Recipe.FP8_BLOCK
        or problem.scale_fmt not in sm90
        or interpreter_mode()
        or grouped_gemm.default_block_m(alignment) != MEASURED_BLOCK_ROWS
        or not is_sm90(out.device)
    ):
        return {}
    return {"recipe": GemmRecipe.TENSOR_CORE.value}


class OptimizedBackend:
    """The path under test. `engine` selects the GEMM engine: auto, deepgemm or triton.

    Each stage is a public method named after it (`route`, `quant_input`, `align`, `permute`,
    `dispatch`, `gemm1`, `act_quant`, `gemm2`, `gather`, `shared`), all with the one signature of
    the stage protocol, `stage(ctx) -> outputs` (moe_verify/spec/protocol.py). To verify your own
    kernel for a stage, subclass and override that method, or wrap an instance
    (`moe_verify.spec.StageDelegate`): `ctx.upstream` holds the outputs of the stages before it
    (yours in chained mode, the golden's in isolated mode; never write to it), and the returned
    names are those of docs/stage-contract.md.

    The class holds kernels and their settings only. What the framework owns comes in the
    context: the rank's weights (`ctx.shard`), the buffers to write into (`ctx.buffers`), whether
    kernels validate on the host (`ctx.validate`), and production mode (`ctx.graph_safe`, where
    `moe-verify graph`, `bench --production` and the op run the same methods with no host reads).
    """

    name = "optimized"

    def __init__(
        self,
        engine: Engine | str = Engine.AUTO,
        *,
        exact_m_sum: bool = False,
        expected_m: int | None = None,
        num_sms: int | None = None,
    ) -> None:
        """The settings that must not change any output (tolerance/invariance.py): exact_m_sum
        sizes the permuted buffer from the counts on every topology (a host read), not only on
        ep:N+ht; expected_m replaces the masked GEMM's scheduling hint; num_sms caps the SMs
        DeepGEMM's GEMMs may use (deep_gemm.set_num_sms). Workspaces and poison are the
        harness's (`RunOptions.workspace`, `.poison`): they come in as `ctx.buffers`."""
        if expected_m is not None and (isinstance(expected_m, bool) or expected_m < 1):
            raise ValueError(f"expected_m: an int >= 1 or None, got {expected_m!r}")
        if num_sms is not None and (isinstance(num_sms, bool) or num_sms < 1):
            raise ValueError(f"num_sms: an int >= 1 or None, got {num_sms!r}")
        self.exact_m_sum = check_bool("exact_m_sum", exact_m_sum)
        self.expected_m = expected_m
        self.num_sms = num_sms
        self.engine = as_engine(engine)

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
        """The stages chained plainly on one rank (no verification: `moe_verify.verify`)."""
        return run_stages(self, problem, inputs, rank, shard_of=ShardCache())

    def choose_engine(self, ctx: StageContext) -> EngineChoice:
        """The GEMM engine of this call: the context's where production mode fixed it, else
        chosen for the call's tokens as vLLM's TritonOrDeepGemmExperts chooses."""
        tokens = ctx.upstream["route"]["topk_ids"].shape[0]
        return choose_engine(ctx.problem, tokens, ctx.engine or self.engine)

    @staticmethod
    def deepgemm_weight_scales(ctx: StageContext, which: str) -> torch.Tensor:
        """This rank's w13/w2 scales in DeepGEMM's layout, transformed once per shard (as vLLM
        does at load time; production mode hands them in already transformed)."""
        w = ctx.shard.weight(which)
        ue8m0 = ctx.problem.scale_fmt.is_ue8m0
        return ctx.shard.prepared_once(
            deepgemm.prepared_scale_key(which, ue8m0),
            lambda: deepgemm.prepare_weight_scales(w, ue8m0),
        )

    # -- stages ----------------------------------------------------------------------------------

    def route(self, ctx: StageContext) -> Outputs:
        problem = ctx.problem
        ids, weights = select_experts(problem, ctx.inputs)
        if problem.topology.kind is not TopologyKind.EP_HT:
            return {"topk_ids": ids, "topk_weights": weights}
        expert_map = ctx.shard.expert_map
        assert expert_map is not None
        local = torch.where(ids >= 0, expert_map[ids.long().clamp(min=0)], -1)
        received = (local >= 0).any(dim=1).nonzero().squeeze(1)
        return {
            "topk_ids": ids[received].to(torch.int64),
            "topk_weights": weights[received],
            "token_index": received,
        }

    def quant_input(self, ctx: StageContext) -> Outputs:
        problem, hidden, route = ctx.problem, ctx.inputs.hidden_states, ctx.upstream["route"]
        if "token_index" in route:  # ep:N+ht: the tokens this rank received
            hidden = hidden[route["token_index"]]
        if problem.router_weight is RouterWeight.INPUT:
            hidden = apply_router_weight_on_input(hidden, route["topk_weights"])
        if problem.recipe is Recipe.MXFP8:
            q, s = quant.quantize_mxfp8(hidden, problem.recipe.act_group)
        else:
            q, s = quant.quantize_fp8_groups(hidden, problem.recipe.act_group, problem.scale_fmt)
        return {"a1q": q, "a1q_scale": s}

    def align(self, ctx: StageContext) -> Outputs:
        problem, sh = ctx.problem, ctx.shard
        ids = ctx.upstream["route"]["topk_ids"]
        counts = slot_counts.count_expert_tokens(
            ids, sh.num_local_experts, sh.expert_map, validate=ctx.validate
        )
        if problem.topology.kind is TopologyKind.EP_HT or self.exact_m_sum:
            # The one host read of the exact-count path (production mode says so: host_syncs).
            m_sum = slot_counts.aligned_m_sum_exact(counts, problem.alignment)
        else:
            m_sum = slot_counts.aligned_m_sum_upper_bound(
                ids.shape[0], ids.shape[1], sh.num_local_experts, problem.alignment
            )
        return {"M_sum": m_sum, "alignment": problem.alignment, "counts": counts}

    def permute(self, ctx: StageContext) -> Outputs:
        up, sh = ctx.upstream, ctx.shard
        align = up["align"]
        a1q = up["quant_input"]["a1q"]
        m_sum = align["M_sum"]
        out = scatter.ep_scatter(
            a1q,
            up["quant_input"]["a1q_scale"],
            up["route"]["topk_ids"],
            align["counts"],
            sh.num_local_experts,
            align["alignment"],
            m_sum,
            sh.expert_map,
            validate=ctx.validate,
            a_perm_out=ctx.buffers.get("a_perm", (m_sum, a1q.shape[1]), a1q.dtype, a1q.device),
            zero_padding=self._zero_padding(ctx),
        )
        return permute_outputs(ctx, out)

    @staticmethod
    def _zero_padding(ctx: StageContext) -> bool:
        """Whether permute zeroes a_perm's padding rows. The psum layout's GEMMs and act_quant
        skip them, so production mode leaves them as the buffer held them (16 of 143 us at
        DeepSeek-V3 EP8-local T=4096 on an H100, docs/perf.md), as vLLM does; verification zeroes
        them, so that a chained run does not depend on what a fresh buffer held (`--poison`
        fills the workspaces to test that on purpose)."""
        psum = choose_grouped_layout(ctx.problem).layout is GroupedLayout.PSUM
        return not (psum and ctx.graph_safe)

    @staticmethod
    def grouped_layout(problem: MoEProblem, upstream: Trace) -> tuple[GroupedLayout, torch.Tensor]:
        """The layout the contiguous GEMMs and act_quant read, and its tensor from the upstream
        permute: m_indices [M_sum], or expert_ends [E_l] for psum."""
        layout = choose_grouped_layout(problem).layout
        name = "expert_ends" if layout is GroupedLayout.PSUM else "m_indices"
        return layout, upstream["permute"][name]

    def gemm1(self, ctx: StageContext) -> Outputs:
        return self._gemm(ctx, Stage.GEMM1)

    def act_quant(self, ctx: StageContext) -> Outputs:
        problem, up = ctx.problem, ctx.upstream
        if problem.recipe is Recipe.MXFP4_W4A8 and problem.activation.kind != "silu":
            raise ValueError("mxfp4_w4a8: the FP4 experts support silu (with optional clamp) only")
        mm1 = up["gemm1"]["mm1"]
        batch = mm1.shape[:-1]
        flat = mm1.reshape(-1, mm1.shape[-1])
        out_q = ctx.buffers.get(
            "a2q", (flat.shape[0], flat.shape[1] // 2), torch.float8_e4m3fn, mm1.device
        )
        if mm1.dim() == 3:  # batched layout: every batch row is quantized, kept [E_l, T, ...]
            q, s = act_quant.silu_mul_quant(
                flat, problem.activation, problem.recipe.act_group, problem.scale_fmt, out_q,
                validate=ctx.validate,
            )  # fmt: skip
            return {
                "a2q": ctx.buffers.own(q).view(*batch, q.shape[-1]),
                "a2q_scale": per_batch_scales(s, batch),
                **act_quant.gate_source(mm1.device),
            }
        layout, grouped = self.grouped_layout(problem, up)
        psum = layout is GroupedLayout.PSUM
        q, s = act_quant.silu_mul_quant(
            flat,
            problem.activation,
            problem.recipe.act_group,
            problem.scale_fmt,
            out_q,
            expert_ends=grouped if psum else None,
            expert_alignment=up["align"]["alignment"] if psum else 0,
            validate=ctx.validate,
        )
        return {
            "a2q": ctx.buffers.own(q),
            "a2q_scale": s,
            "layout": layout.value,
            **act_quant.gate_source(mm1.device),
        }

    def gemm2(self, ctx: StageContext) -> Outputs:
        return self._gemm(ctx, Stage.GEMM2)

    def gather(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        route = up["route"]
        weights = route["topk_weights"]
        if ctx.problem.router_weight is RouterWeight.INPUT:  # applied on the input already
            weights = torch.ones_like(weights)
        if "dispatch" in up:  # LL combine: weighted fp32 sum over each slot's batched row
            mm2, d = up["gemm2"]["mm2"], up["dispatch"]
            rows = torch.where(d["slot"] >= 0, d["slot_expert"] * mm2.shape[1] + d["slot"], -1)
            out = gather.ep_gather(
                mm2.reshape(-1, mm2.shape[-1]),
                d["slot_expert"],
                weights,
                rows.to(torch.int32),
                validate=ctx.validate,
            )
            return {"out": out}
        mm2, ids = up["gemm2"]["mm2"], route["topk_ids"]
        out = gather.ep_gather(
            mm2,
            ids,
            weights,
            up["permute"]["inv_perm"],
            ctx.shard.expert_map,
            validate=ctx.validate,
            out=ctx.buffers.get("out", (ids.shape[0], mm2.shape[1]), torch.bfloat16, mm2.device),
        )
        return {"out": ctx.buffers.own(out)}

    def shared(self, ctx: StageContext) -> Outputs:
        """Shared experts: a dense gated MLP on every token, this rank's intermediate shard, with
        the same kernels (one group: every row is expert 0). vLLM runs it through dense FP8
        linears, not the DeepGEMM MoE path, so the Triton engine computes it here."""
        problem, inputs, rank = ctx.problem, ctx.inputs, ctx.rank
        if inputs.shared_w13 is None or inputs.shared_w2 is None:
            raise ValueError("shared_experts > 0 needs inputs with shared_w13 / shared_w2")
        size = problem.topology.size
        i_s = inputs.shared_w2.shape[2]
        w13 = tp_gate_up_shard(inputs.shared_w13, i_s, i_s // size, rank)
        w2 = tp_down_shard(inputs.shared_w2, i_s // size, rank)
        hidden = inputs.hidden_states
        group = problem.recipe.act_group
        if problem.recipe is Recipe.MXFP8:
            a, bytes_ = quant.quantize_mxfp8(hidden, group)
            a_scale = quant.pack_ue8m0(bytes_)
        else:
            a, a_scale = quant.quantize_fp8_groups(hidden, group, problem.scale_fmt)
        rows = hidden.shape[0]
        if rows == 0:
            return {
                "out": torch.zeros(0, problem.hidden, dtype=torch.bfloat16, device=hidden.device)
            }
        every_row = torch.zeros(rows, dtype=torch.int32, device=hidden.device)
        mm1 = grouped_gemm.grouped_gemm(
            a, a_scale, group, w13.q, w13.scale, w13.block, every_row, rows
        )
        a2, a2_scale = act_quant.silu_mul_quant(mm1, problem.activation, group, problem.scale_fmt)
        out = grouped_gemm.grouped_gemm(
            a2, a2_scale, group, w2.q, w2.scale, w2.block, every_row, rows
        )
        return {
            "out": out,
            "engine": Engine.TRITON,
            **gemm_recipe(problem, Engine.TRITON, out, rows),
            **act_quant.gate_source(out.device),
        }

    # -- batched low-latency layout (ep:N+ll) ----------------------------------------------------

    def dispatch(self, ctx: StageContext) -> Outputs:
        """Stands in for DeepEP's low-latency dispatch (optimized/dispatch.py). expected_m, the
        masked GEMM's scheduling hint, is the mean batch read on the host in verification, and
        the mean of the token bound in production mode (no host read)."""
        problem, up, sh = ctx.problem, ctx.upstream, ctx.shard
        q = up["quant_input"]
        a1q, e_l = q["a1q"], sh.num_local_experts
        t, k = up["route"]["topk_ids"].shape
        rows = e_l * problem.ll_max_tokens
        out = batched_dispatch(
            a1q,
            q["a1q_scale"],
            up["route"]["topk_ids"],
            sh.expert_map,
            e_l,
            problem.ll_max_tokens,
            expected_m=max(1, ceil_div(t * k, max(e_l, 1))) if ctx.graph_safe else None,
            a_out=ctx.buffers.get("a_perm", (rows, a1q.shape[1]), a1q.dtype, a1q.device),
        )
        out["a_batched"] = ctx.buffers.own(out["a_batched"])
        return out

    # -- the two GEMM stages ---------------------------------------------------------------------

    def _gemm(self, ctx: StageContext, stage: Stage) -> Outputs:
        """gemm1 (`mm1 = a_perm @ w13`) or gemm2 (`mm2 = a2q @ w2`) on the engine chosen for
        the call: the masked GEMM over the batches where a dispatch ran, else the contiguous
        grouped GEMM over the permuted rows."""
        up = ctx.upstream
        a, a_scale = gemm_operands(up, stage)
        choice = self.choose_engine(ctx)
        if "dispatch" in up:
            out = self._batched_gemm(ctx, stage, choice, a, a_scale)
            block_rows, record = a.shape[1], {}
        else:
            out = self._grouped_gemm(ctx, stage, choice, a, a_scale)
            block_rows = up["align"]["alignment"]
            record = {"layout": choose_grouped_layout(ctx.problem).layout.value}
        return {
            GEMM_OUTPUT[stage]: out,
            "engine": choice.engine,
            "engine_reason": choice.reason,
            **record,
            **gemm_recipe(ctx.problem, choice.engine, out, block_rows),
        }

    def _batched_gemm(
        self,
        ctx: StageContext,
        stage: Stage,
        choice: EngineChoice,
        a: torch.Tensor,
        a_scale: torch.Tensor,
    ) -> torch.Tensor:
        """[E_l, T_max, N]: the masked grouped GEMM over the dispatch's batches."""
        problem, d = ctx.problem, ctx.upstream["dispatch"]
        e_l, t_max, k = a.shape
        which = GEMM_WEIGHT[stage]
        w = ctx.shard.weight(which)
        buf = ctx.buffers.get(
            GEMM_OUTPUT[stage], (e_l * t_max, w.shape[1]), torch.bfloat16, a.device
        )
        if choice.engine is Engine.DEEPGEMM:
            with deepgemm.sm_count_scope(self.num_sms):
                out = deepgemm.m_grouped_gemm_masked(
                    a,
                    a_scale,
                    w,
                    self.deepgemm_weight_scales(ctx, which),
                    d["masked_m"],
                    self.expected_m or int(d["expected_m"]),
                    use_ue8m0=problem.scale_fmt.is_ue8m0,
                    validate=ctx.validate,
                    out=None if buf is None else buf.view(e_l, t_max, w.shape[1]),
                )
        else:
            out = grouped_gemm.grouped_gemm(
                a.reshape(e_l * t_max, k),
                a_scale.reshape(e_l * t_max, a_scale.shape[-1]),
                problem.recipe.act_group,
                w.q,
                w.scale,
                w.block,
                batch_m_indices(d["masked_m"], t_max),
                t_max,
                validate=ctx.validate,
                out=buf,
            ).view(e_l, t_max, w.shape[1])
        return ctx.buffers.own(out)

    def _grouped_gemm(
        self,
        ctx: StageContext,
        stage: Stage,
        choice: EngineChoice,
        a: torch.Tensor,
        a_scale: torch.Tensor,
    ) -> torch.Tensor:
        """[M_sum, N]: one contiguous grouped GEMM on `choice`'s engine, over the layout the
        problem runs (m_indices, or expert_ends for psum), tiled by the align stage's A (so an
        isolated GEMM tiles the golden's layout as the golden laid it out)."""
        problem, up = ctx.problem, ctx.upstream
        layout, grouped = self.grouped_layout(problem, up)
        alignment = up["align"]["alignment"]
        which = GEMM_WEIGHT[stage]
        w = ctx.shard.weight(which)
        group = problem.recipe.act_group
        psum = layout is GroupedLayout.PSUM
        out = ctx.buffers.get(
            GEMM_OUTPUT[stage], (a.shape[0], w.shape[1]), torch.bfloat16, a.device
        )
        if choice.engine is Engine.TRITON:
            d = grouped_gemm.grouped_gemm(
                a, a_scale, group, w.q, w.scale, w.block, grouped, alignment,
                use_psum_layout=psum, validate=ctx.validate, out=out,
            )  # fmt: skip
        else:
            with deepgemm.sm_count_scope(self.num_sms):
                d = deepgemm.m_grouped_gemm(
                    a,
                    a_scale,
                    group,
                    w,
                    self.deepgemm_weight_scales(ctx, which),
                    grouped,
                    alignment,
                    use_ue8m0=problem.scale_fmt.is_ue8m0,
                    use_psum_layout=psum,
                    validate=ctx.validate,
                    out=out,
                )
        return ctx.buffers.own(d)


def permute_outputs(ctx: StageContext, out: scatter.Scattered) -> Outputs:
    """The permute stage's outputs under the contract's names, from the scatter's result (the
    permuted rows copied out of a reused buffer where one was handed in)."""
    return {
        "a_perm": ctx.buffers.own(out.a_perm),
        "a_scale_perm": out.a_scale_perm,
        "m_indices": out.m_indices,
        "expert_ends": out.expert_ends,
        "inv_perm": out.inv_perm,
        "expert_start": out.expert_start,
        "layout": choose_grouped_layout(ctx.problem).layout.value,
    }


def per_batch_scales(scales: torch.Tensor, batch: torch.Size) -> torch.Tensor:
    """act_quant's scales of the flattened batches [E_l * T, G] as [E_l, T, G]: fp32 row-major,
    or packed UE8M0 words MN-major per batch (each batch's word columns TMA-aligned, as DeepGEMM's
    masked GEMM reads them; the kernel packed the flattened rows as one)."""
    if scales.dtype != torch.int32:
        return scales.reshape(*batch, scales.shape[-1])
    e_l, t = batch
    words = scales.shape[-1]
    tma = round_up(t, 4)
    out = torch.empty_strided(
        (e_l, t, words), (words * tma, 1, tma), dtype=torch.int32, device=scales.device
    )
    out.copy_(scales.reshape(e_l, t, words))
    return out


def gemm_operands(upstream: Trace, stage: Stage) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations and their scales a GEMM stage multiplies: gemm1 the permuted rows (or
    the dispatched batches), gemm2 act_quant's."""
    if stage is Stage.GEMM2:
        act = upstream["act_quant"]
        return act["a2q"], act["a2q_scale"]
    if "dispatch" in upstream:
        d = upstream["dispatch"]
        return d["a_batched"], d["a_scale_batched"]
    perm = upstream["permute"]
    return perm["a_perm"], perm["a_scale_perm"]
