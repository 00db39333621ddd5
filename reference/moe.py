"""The golden staged MoE forward for one rank: a `Backend` whose stages read like the math.

Each public method named after a `Stage` (`route`, `quant_input`, ..., `gather`, `shared`)
computes that stage of the stage contract (docs/stage-contract.md) from the upstream stages'
outputs (its own when chained; in isolated mode the golden is the upstream for everyone else).
They have the stage protocol's one signature, `stage(ctx) -> outputs`, like every backend's, so
a subclass overrides one stage the same way on either side. The golden builds its rank shards
itself (reference/topology.py), never from the context: independence is the point.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    GEMM_OUTPUT,
    ActQuantRecipe,
    GemmRecipe,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    MSumRecipe,
    Outputs,  # noqa: E402 - the vocabulary names it once
    QuantizedWeight,
    Recipe,
    RoutedScalingRecipe,
    RouterWeight,
    Routing,
    Stage,
    StageContext,
    TopologyKind,
    Trace,
    run_stages,
)
from reference import formats, routing
from reference.activation import act_quant
from reference.gather import gather
from reference.gemm import grouped_gemm
from reference.hardware.tensor_core import tensor_core_grouped_gemm, tensor_core_masked_gemm
from reference.layout import (
    BatchedPlan,
    PermutePlan,
    aligned_m_sum_recipes,
    batched_plan,
    expert_counts,
    local_expert_ids,
    m_indices_from_expert_ends,
    permute_plan,
    permute_rows,
)
from reference.recipes import (
    act_quant_recipes,
    gather_reading_recipes,
    gather_recipes,
    input_quant_recipes,
    recipe_outputs,
    routed_scaling_recipes,
    router_weight_outputs,
)
from reference.topology import (
    Shard,
    dispatched_tokens,
    logical_to_physical,
    shard,
    shared_shard,
)


def _slots_in_order(
    trace: Trace,
    slots: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    reading: RoutedScalingRecipe | None = None,
) -> Trace:
    """`trace` with its per-slot outputs in the order `slots` gives (`Trace.in_slot_order`) and
    its route weights in `reading` (default: the plain ones, the route's own) replaced by
    `topk_weights`; `trace` itself when neither is given."""
    if slots is None and topk_weights is None:
        return trace
    result = trace.in_slot_order(slots) if slots is not None else trace.only(trace.stages)
    if topk_weights is not None:
        route = result[Stage.ROUTE]  # the copy's own dict (Trace.add copies)
        key = "topk_weights"
        if reading is not None:
            key = route["recipe_outputs"][reading]["topk_weights"]
        route[key] = topk_weights
    return result


class ReferenceBackend:
    """The golden. `precision` is the GEMM accumulation dtype (float64 for calibration).

    One public method per stage, `stage(ctx) -> outputs`; a subclass that overrides one of
    them changes that stage only.
    """

    name = "golden"

    def __init__(self, precision: torch.dtype = torch.float32) -> None:
        self.precision = precision
        # Rank shards of the inputs object last seen (held, so its id cannot be reused).
        self._shards_of: MoEInputs | None = None
        self._shards: dict[tuple[MoEProblem, int], Shard] = {}

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
        return run_stages(self, problem, inputs, rank)

    def shard(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Shard:
        """The weights and expert map `rank` holds, built once per inputs object."""
        if inputs is not self._shards_of:
            self._shards_of, self._shards = inputs, {}
        key = (problem, rank)
        if key not in self._shards:
            self._shards[key] = shard(problem, inputs.w13_q, inputs.w2_q, rank)
        return self._shards[key]

    # -- stages ----------------------------------------------------------------------------------

    def route(self, ctx: StageContext) -> Outputs:
        """The top-k ids and weights; under grouped routing with a routed_scaling_factor other
        than 1, the weights in both readings of the factor (`_scaling_readings`)."""
        p, x, rank = ctx.problem, ctx.inputs, ctx.rank
        local = self.shard(p, x, rank)
        if x.topk_ids is not None and x.topk_weights is not None:
            ids, weights = x.topk_ids, {"topk_weights": x.topk_weights}
        elif p.routing is Routing.GROUPED:
            ids, scaled = routing.grouped_topk(
                x.router_logits,
                x.score_bias,
                p.topk,
                p.num_expert_group,
                p.topk_group,
                p.renormalize,
                p.routed_scaling_factor,
            )
            weights = self._scaling_readings(p, x, scaled)
        else:
            ids, w = routing.softmax_topk(x.router_logits, p.topk, p.renormalize)
            weights = {"topk_weights": w}
        ids = logical_to_physical(ids, p)
        if p.topology.kind is not TopologyKind.EP_HT:
            return {"topk_ids": ids, **weights}
        # DeepEP HT: this rank receives only tokens with a slot on it; ids travel as int64.
        token_index = dispatched_tokens(local_expert_ids(ids, local.expert_map))
        received = {
            k: v[token_index] if isinstance(v, torch.Tensor) else v for k, v in weights.items()
        }
        return {"topk_ids": ids[token_index].long(), **received, "token_index": token_index}

    @staticmethod
    def _scaling_readings(p: MoEProblem, x: MoEInputs, scaled: torch.Tensor) -> Outputs:
        """Grouped routing's weights: `scaled` (routed_scaling_factor applied in routing), and
        where the factor is not 1 both readings of it (routed_scaling_recipes): the golden's own
        scaled weights under the plain name, the unscaled ones (the same routing with factor 1)
        under "topk_weights@scale_on_output", listed in "recipe_outputs"."""
        readings = routed_scaling_recipes(p)
        if not readings:
            return {"topk_weights": scaled}
        _, unscaled = routing.grouped_topk(
            x.router_logits, x.score_bias, p.topk, p.num_expert_group, p.topk_group, p.renormalize
        )
        by_recipe = dict(zip(readings, ((scaled,), (unscaled,)), strict=True))
        return recipe_outputs(by_recipe, ("topk_weights",))

    def quant_input(self, ctx: StageContext) -> Outputs:
        """The hidden states quantized, each row times its router weight first where the problem
        applies the weight on the input (`router_weighted_input`). For top-1 problems the other
        router-weight convention's outputs come beside (`router_weight_outputs`), so the
        comparison can say a quant_input applies the weight where the problem does not."""
        p, x, up = ctx.problem, ctx.inputs, ctx.upstream
        hidden = x.hidden_states
        if p.topology.kind is TopologyKind.EP_HT:
            hidden = hidden[up["route"]["token_index"]]
        if p.topk != 1:
            return self._quantized_input(p, hidden)
        weighted = routing.router_weighted_input(hidden, up["route"]["topk_weights"])
        on_input = p.router_weight is RouterWeight.INPUT
        own, other = (weighted, hidden) if on_input else (hidden, weighted)
        other_way = RouterWeight.GATHER if on_input else RouterWeight.INPUT
        outputs = self._quantized_input(p, own)
        return {**outputs, **router_weight_outputs(other_way, self._quantized_input(p, other))}

    @staticmethod
    def _quantized_input(p: MoEProblem, hidden: torch.Tensor) -> Outputs:
        """quant_input's outputs for `hidden` [M, H], once per legitimate recipe."""
        if p.recipe is Recipe.MXFP8:
            q, s = formats.quantize_mxfp8(hidden, 32)
            return {"a1q": q, "a1q_scale": s}
        # The recorded quotients hold bf16 amax values only: other input dtypes (no kernel they
        # model takes them) get the other recipes.
        recipes = [
            r
            for r in input_quant_recipes(p)
            if hidden.dtype == torch.bfloat16 or r not in formats.TABLE_QUOTIENT_RECIPES
        ]
        by_recipe = {
            r: formats.quantize_fp8_groups(hidden, 128, p.scale_fmt, recipe=r) for r in recipes
        }
        return recipe_outputs(by_recipe, ("a1q", "a1q_scale"))

    def align(self, ctx: StageContext) -> Outputs:
        """M_sum by vLLM's current formula: the exact sum where DeepEP HT puts the counts on the
        host, else the min-active bound. "M_sum_recipes" holds every legitimate M_sum (both
        upper bounds and the exact sum), which a tested align may equal instead."""
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        local = self.shard(p, x, rank)
        ids = up["route"]["topk_ids"]
        counts = expert_counts(local_expert_ids(ids, local.expert_map), local.num_local_experts)
        recipes = aligned_m_sum_recipes(ids.shape[0], ids.shape[1], counts, p.alignment)
        recipe = (
            MSumRecipe.EXACT_COUNTS
            if p.topology.kind is TopologyKind.EP_HT
            else MSumRecipe.MIN_ACTIVE_BOUND
        )
        return {
            "M_sum": recipes[recipe],
            "alignment": p.alignment,
            "counts": counts,
            "M_sum_recipes": {r.value: m for r, m in recipes.items()},
        }

    def permute(self, ctx: StageContext) -> Outputs:
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        local = self.shard(p, x, rank)
        plan = permute_plan(
            up["route"]["topk_ids"],
            local.num_local_experts,
            up["align"]["alignment"],
            local.expert_map,
            m_sum=up["align"]["M_sum"],
        )
        a1q, a1q_scale = up["quant_input"]["a1q"], up["quant_input"]["a1q_scale"]
        scale_perm = permute_rows(a1q_scale, plan)
        if a1q_scale.dtype == torch.uint8:  # MXFP8 E8M0 bytes travel packed four per int32
            scale_perm = formats.pack_ue8m0(scale_perm)
        return {
            "a_perm": permute_rows(a1q, plan),
            "a_scale_perm": scale_perm,
            "m_indices": plan.m_indices,
            "expert_ends": plan.expert_ends,
            "inv_perm": plan.inv_perm,
            "expert_start": plan.expert_start,
        }

    def _row_experts(self, p: MoEProblem, up: Trace) -> tuple[torch.Tensor, GroupedLayout]:
        """Each permuted row's local expert as the GEMMs read it, and the layout read: psum when
        the problem forces it (decoded from expert_ends), else m_indices. The golden has no GPU
        arch to choose by, and both layouts of one plan name the same expert on every live row.
        """
        perm = up["permute"]
        if p.grouped_layout is not GroupedLayout.PSUM:
            return perm["m_indices"], GroupedLayout.M_INDICES
        rows = m_indices_from_expert_ends(
            perm["expert_ends"], perm["m_indices"].numel(), up["align"]["alignment"]
        )
        return rows, GroupedLayout.PSUM

    def gemm1(self, ctx: StageContext) -> Outputs:
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        local = self.shard(p, x, rank)
        if "dispatch" in up:
            return self._gemm1_batched(p, up, local)
        perm = up["permute"]
        rows, layout = self._row_experts(p, up)
        mm1 = grouped_gemm(
            perm["a_perm"],
            perm["a_scale_perm"],
            p.recipe.act_group,
            local.w13,
            rows,
            precision=self.precision,
        )
        return {"mm1": mm1, "engine": "torch", "layout": layout.value}

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        return self._act_quant(p, up["gemm1"]["mm1"], act_quant_recipes(p))

    def _act_quant(self, p: MoEProblem, mm1: torch.Tensor, recipes: tuple) -> Outputs:
        """act_quant's outputs under each of `recipes`, the first one the stage's own."""
        activation = p.activation
        if p.recipe is Recipe.MXFP4_W4A8 and activation.kind != "silu":
            raise ValueError("mxfp4_w4a8: the FP4 experts support silu (with optional clamp) only")
        by_recipe = {}
        for r in recipes:
            # the masked layout's [E_l, M_max, 2I] too: packed scales then per batch, MN-major
            by_recipe[r] = act_quant(mm1, activation, p.recipe.act_group, p.scale_fmt, r)
        return recipe_outputs(by_recipe, ("a2q", "a2q_scale"))

    def gemm2(self, ctx: StageContext) -> Outputs:
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        local = self.shard(p, x, rank)
        if "dispatch" in up:
            return self._gemm2_batched(p, up, local)
        act = up["act_quant"]
        rows, layout = self._row_experts(p, up)
        mm2 = grouped_gemm(
            act["a2q"],
            act["a2q_scale"],
            p.recipe.act_group,
            local.w2,
            rows,
            precision=self.precision,
        )
        return {"mm2": mm2, "engine": "torch", "layout": layout.value}

    # -- the GEMMs' hardware recipe ----------------------------------------------------------------

    def with_tensor_core(self, p: MoEProblem, x: MoEInputs, trace: Trace, stage: str) -> Trace:
        """`trace` (this golden's, of rank trace.rank) with GEMM `stage` also carrying its
        tensor-core recipe: the outputs of DeepGEMM's SM90 kernel as the Hopper tensor core
        computes them (reference/hardware/tensor_core.py), on the same operands the stage read,
        under "mm1@tensor_core" / "mm2@tensor_core" with "recipe_outputs" {"fp32_dequant": {"mm1":
        "mm1"}, "tensor_core": {"mm1": "mm1@tensor_core"}} (reference/recipes.py). The stage's
        own outputs are unchanged, so every later stage still reads the fp32 golden.

        Not part of `run`: the model costs 10-100x the fp32 GEMM, so the harness asks for it only
        where a comparison will use it (moe_verify/run/sm90_chain.py `gemm_recipe_applies`). The
        SM90 fp8_block recipe only (fp32 or ceil-UE8M0 scales); anything else is refused.
        """
        name = {Stage.GEMM1: "mm1", Stage.GEMM2: "mm2"}.get(Stage(stage))
        if name is None:
            raise ValueError(
                f"the tensor-core recipe is a GEMM's: stage gemm1 or gemm2, got {stage}"
            )
        out = self._tensor_core(p, self.shard(p, x, trace.rank), trace.upto(stage), stage)
        outs = trace[stage]
        by_recipe = {GemmRecipe.FP32_DEQUANT: (outs[name],), GemmRecipe.TENSOR_CORE: (out,)}
        recipes = recipe_outputs(by_recipe, (name,))
        recipes.pop("recipe")  # the stage's own outputs are the fp32 golden's, as before
        result = Trace(trace.backend, trace.rank)
        for name_, outs_ in trace.items():
            result.add(name_, {**outs_, **recipes} if name_ == stage else outs_)
        return result

    def _tensor_core(self, p: MoEProblem, local: Shard, up: Trace, stage: str) -> torch.Tensor:
        """GEMM `stage`'s output by the tensor-core recipe, on the operands `up` gives it."""
        w = local.w13 if stage == Stage.GEMM1 else local.w2
        if stage == Stage.GEMM1:
            a, a_scale = (
                (up["dispatch"]["a_batched"], up["dispatch"]["a_scale_batched"])
                if "dispatch" in up
                else (up["permute"]["a_perm"], up["permute"]["a_scale_perm"])
            )
        else:
            a, a_scale = up["act_quant"]["a2q"], up["act_quant"]["a2q_scale"]
        if "dispatch" in up:
            return tensor_core_masked_gemm(a, a_scale, w, up["dispatch"]["masked_m"])
        rows, _ = self._row_experts(p, up)
        return tensor_core_grouped_gemm(a, a_scale, p.recipe.act_group, w, rows)

    def sm90_chain(
        self,
        p: MoEProblem,
        x: MoEInputs,
        trace: Trace,
        act_recipe: ActQuantRecipe | None = None,
        slots: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        shared: bool = False,
        reading: RoutedScalingRecipe | None = None,
    ) -> Trace:
        """`trace` (this golden's, of rank trace.rank) from gemm1 on as SM90 computes the chain:
        gemm1 and gemm2 by the tensor-core recipe (their fp32-dequant outputs beside, under
        "mm1@fp32_dequant" / "mm2@fp32_dequant"), act_quant on that mm1 with `act_recipe` as
        its own recipe (default: the problem's first; the other legitimate recipes beside), and
        the gather of that mm2; with `shared`, the shared experts the same way (their GEMMs by
        the tensor-core recipe, their act_quant by `act_recipe`). The stages before gemm1 (and
        the shared experts without `shared`) are the trace's.
        Chained mode on SM90 compares every stage bit for bit against it (docs/tolerance.md
        #zero-tolerance-on-sm90). A tensor-core mm1 the trace already carries (isolated mode's,
        on the same operands) is reused. The SM90 fp8_block recipe only, as `with_tensor_core`.

        The gather sums each token's slots in k order. `slots` (int64 [T, k]: slot i of the
        sum is the route's slot slots[t, i]) and `topk_weights` (the weights in that order) make
        it sum as a tested route that is a legitimately different rounding of the same routing
        does: the same experts listed in another order (a tie broken otherwise), weights a
        renormalization sum order apart. The harness passes them, so the gather is still held
        bit for bit (moe_verify/run/sm90_chain.py `with_sm90_chain`). `reading`: the
        routed-scaling reading `topk_weights` are in (a tested route's declared one; default the
        golden's own), whose gather outputs they then feed.
        """
        local = self.shard(p, x, trace.rank)
        recipes = act_quant_recipes(p)
        if act_recipe is not None:
            if act_recipe not in recipes:
                raise ValueError(
                    f"act_recipe {act_recipe} is not a legitimate act_quant recipe of {p.id} "
                    f"(legitimate: {', '.join(map(str, recipes))})"
                )
            recipes = (act_recipe, *(r for r in recipes if r != act_recipe))
        result = Trace(trace.backend, trace.rank)
        for stage, outs in trace.items():
            if stage in (Stage.GEMM1, Stage.GEMM2):
                name = GEMM_OUTPUT[Stage(stage)]
                if stage == Stage.GEMM1:
                    fp32 = outs["mm1"]
                    tc = outs.get("mm1@tensor_core")
                else:
                    fp32 = self.gemm2(StageContext(p, x, result, trace.rank))["mm2"]
                    tc = None
                if tc is None:
                    tc = self._tensor_core(p, local, result, stage)
                by_recipe = {GemmRecipe.TENSOR_CORE: (tc,), GemmRecipe.FP32_DEQUANT: (fp32,)}
                plain = {k: v for k, v in outs.items() if "@" not in k and k != "recipe_outputs"}
                outs = {**plain, **recipe_outputs(by_recipe, (name,))}
            elif stage == Stage.ACT_QUANT:
                outs = self._act_quant(p, result["gemm1"]["mm1"], recipes)
            elif stage == Stage.GATHER:
                route = _slots_in_order(result, slots, topk_weights, reading)
                outs = self.gather(StageContext(p, x, route, trace.rank))
            elif stage == Stage.SHARED and shared:
                outs = self._shared(p, x, trace.rank, recipes[0], tensor_core=True)
            result.add(stage, outs)
        return result

    def gather(self, ctx: StageContext) -> Outputs:
        """The weighted fp32 sum per token (weight 1 where the problem applies the router weight on
        the input), once per legitimate recipe (gather_recipes); with a
        routed_scaling_factor other than 1 once more per recipe in the scale_on_output reading
        (the route's unscaled weights, the sum times the factor), listed by reading in
        "routed_scaling_recipes" (reference/recipes.py gather_reading_recipes)."""
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        route = up["route"]
        weights = route["topk_weights"]
        if p.router_weight is RouterWeight.INPUT:  # already in the input: each row counts once
            weights = torch.ones_like(weights)
        if "dispatch" in up:  # LL combine: the same weighted fp32 sum over the batched rows
            mm2 = up["gemm2"]["mm2"]
            d = up["dispatch"]
            rows = torch.where(d["slot"] >= 0, d["slot_expert"] * mm2.shape[1] + d["slot"], -1)
            args = (mm2.reshape(-1, mm2.shape[-1]), d["slot_expert"], weights, rows)
        else:
            args = (
                up["gemm2"]["mm2"],
                route["topk_ids"],
                weights,
                up["permute"]["inv_perm"],
                self.shard(p, x, rank).expert_map,
            )
        by_recipe = {r: (gather(*args, recipe=r),) for r in gather_recipes(p)}
        names = gather_reading_recipes(p)
        if not names:
            return recipe_outputs(by_recipe, ("out",))
        # scale_on_output: the route's unscaled weights, the fp32 sum times the factor
        on_output = RoutedScalingRecipe.SCALE_ON_OUTPUT
        keys = (route.get("recipe_outputs") or {}).get(on_output)
        if keys is None:
            raise ValueError(
                f"gather of {p.id}: the route it reads has no {on_output} reading (the golden "
                "route's unscaled topk_weights, listed in its recipe_outputs)"
            )
        unscaled = route[keys["topk_weights"]]
        args = (args[0], args[1], unscaled, *args[3:])
        scale = p.routed_scaling_factor
        for r in gather_recipes(p):
            by_recipe[names[on_output][r]] = (gather(*args, recipe=r, scale=scale),)
        return {**recipe_outputs(by_recipe, ("out",)), "routed_scaling_recipes": names}

    def shared(self, ctx: StageContext) -> Outputs:
        """The shared experts: a dense gated MLP over every token (weight 1), this rank's shard
        of its intermediate dimension, quantized like the routed experts; vLLM
        all-reduces it with the routed output (MoERunner `_maybe_reduce_final_output`)."""
        p, x, rank = ctx.problem, ctx.inputs, ctx.rank
        return self._shared(p, x, rank)

    def _shared(
        self,
        p: MoEProblem,
        x: MoEInputs,
        rank: int,
        act_recipe: ActQuantRecipe | None = None,
        tensor_core: bool = False,
    ) -> Outputs:
        """The shared experts, their act_quant by `act_recipe` (default: the scale format's
        fused kernel), their GEMMs by the tensor-core recipe when `tensor_core` (SM90's chain)."""
        if x.shared_w13 is None or x.shared_w2 is None:
            raise ValueError("shared_experts > 0 needs inputs with shared_w13 / shared_w2")
        w13, w2 = shared_shard(p, x.shared_w13, x.shared_w2, rank)
        hidden = x.hidden_states
        if p.recipe is Recipe.MXFP8:
            a, a_scale = formats.quantize_mxfp8(hidden, 32)
            a_scale = formats.pack_ue8m0(a_scale)
        else:
            a, a_scale = formats.quantize_fp8_groups(hidden, 128, p.scale_fmt)
        every_row = torch.zeros(hidden.shape[0], dtype=torch.int32, device=hidden.device)
        group = p.recipe.act_group

        def gemm(a: torch.Tensor, a_scale: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
            if tensor_core:
                return tensor_core_grouped_gemm(a, a_scale, group, w, every_row)
            return grouped_gemm(a, a_scale, group, w, every_row, precision=self.precision)

        mm1 = gemm(a, a_scale, w13)
        a2, a2_scale = act_quant(mm1, p.activation, group, p.scale_fmt, act_recipe)
        out = gemm(a2, a2_scale, w2)
        return {"out": out, "recipe": GemmRecipe.TENSOR_CORE.value} if tensor_core else {"out": out}

    def dispatch(self, ctx: StageContext) -> Outputs:
        """DeepEP low-latency dispatch: each local expert's slots in a [max_tokens, H] batch."""
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        local = self.shard(p, x, rank)
        ids = up["route"]["topk_ids"]
        max_tokens = p.ll_max_tokens  # DeepEP's capacity: >= T, so every slot fits
        plan = batched_plan(ids, local.num_local_experts, max_tokens, local.expert_map)
        a1q, a1q_scale = up["quant_input"]["a1q"], up["quant_input"]["a1q_scale"]
        e_l = local.num_local_experts
        rows = batched_rows(plan)
        m_indices = batched_m_indices(plan.masked_m, max_tokens)
        # The batches as one contiguous buffer: expert e's batch starts at row e * max_tokens.
        starts = torch.arange(e_l, device=ids.device, dtype=torch.int32) * max_tokens
        flat = PermutePlan(
            m_indices,
            rows,
            starts,
            plan.masked_m,
            e_l * max_tokens,
            max_tokens,
            starts + plan.masked_m,
        )
        a_b = permute_rows(a1q, flat).view(e_l, max_tokens, a1q.shape[1])
        s_b = permute_rows(a1q_scale, flat).view(e_l, max_tokens, a1q_scale.shape[1])
        return {
            "a_batched": a_b,
            "a_scale_batched": s_b,
            "masked_m": plan.masked_m,
            "slot": plan.slot,
            "slot_expert": torch.where(plan.slot >= 0, plan.local_ids, -1).to(torch.int32),
            "expected_m": max(1, int(plan.masked_m.float().mean().ceil())) if e_l else 1,
        }

    def _gemm1_batched(self, p: MoEProblem, up: Trace, local: Shard) -> Outputs:
        d = up["dispatch"]
        e_l, t_max, h = d["a_batched"].shape
        mm1 = grouped_gemm(
            d["a_batched"].reshape(e_l * t_max, h),
            d["a_scale_batched"].reshape(e_l * t_max, d["a_scale_batched"].shape[-1]),
            p.recipe.act_group,
            local.w13,
            batched_m_indices(d["masked_m"], t_max),
            precision=self.precision,
        )
        return {"mm1": mm1.view(e_l, t_max, mm1.shape[-1]), "engine": "torch"}

    def _gemm2_batched(self, p: MoEProblem, up: Trace, local: Shard) -> Outputs:
        d, act = up["dispatch"], up["act_quant"]
        e_l, t_max, i = act["a2q"].shape
        mm2 = grouped_gemm(
            act["a2q"].reshape(e_l * t_max, i),
            act["a2q_scale"].reshape(e_l * t_max, act["a2q_scale"].shape[-1]),
            p.recipe.act_group,
            local.w2,
            batched_m_indices(d["masked_m"], t_max),
            precision=self.precision,
        )
        return {"mm2": mm2.view(e_l, t_max, mm2.shape[-1]), "engine": "torch"}


def batched_rows(plan: BatchedPlan) -> torch.Tensor:
    """int32 [M, k]: row of each slot in the flattened [E_l * max_tokens] batch, -1 if skipped."""
    rows = plan.local_ids * plan.max_tokens + plan.slot
    return torch.where(plan.slot >= 0, rows, -1).to(torch.int32)


def batched_m_indices(masked_m: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """int32 [E_l * max_tokens]: expert e for rows e*T .. e*T + masked_m[e] - 1, else -1."""
    e_l = masked_m.numel()
    t = torch.arange(max_tokens, device=masked_m.device).unsqueeze(0)
    experts = torch.arange(e_l, device=masked_m.device, dtype=torch.int32).unsqueeze(1)
    return torch.where(t < masked_m.unsqueeze(1), experts, -1).reshape(-1).to(torch.int32)


def run(problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
    """The golden trace of one rank."""
    return ReferenceBackend().run(problem, inputs, rank)
