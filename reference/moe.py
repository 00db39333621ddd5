"""The golden staged MoE forward for one rank: a `Backend` whose stages read like the math.

Each `_stage` method computes one stage of DESIGN.md's contract from the upstream stages' outputs
(its own when chained; in isolated mode the golden is the upstream for everyone else).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_verify.spec import (
    MoEInputs,
    MoEProblem,
    Recipe,
    Routing,
    TopologyKind,
    Trace,
    run_stages,
)
from reference import formats, routing
from reference.activation import act_quant
from reference.gather import gather
from reference.gemm import grouped_gemm
from reference.layout import (
    aligned_m_sum_exact,
    aligned_m_sum_upper_bound,
    batched_plan,
    expert_counts,
    local_expert_ids,
    permute_plan,
    permute_rows,
)
from reference.topology import RankView, dispatched_tokens, logical_to_physical, rank_view

Outputs = dict[str, object]


class ReferenceBackend:
    """The golden. `precision` is the GEMM accumulation dtype (float64 for calibration)."""

    name = "golden"

    def __init__(self, precision: torch.dtype = torch.float32) -> None:
        self.precision = precision
        # Rank views of the inputs object last seen (held, so its id cannot be reused).
        self._views_of: MoEInputs | None = None
        self._views: dict[tuple[MoEProblem, int], RankView] = {}

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
        return run_stages(self, problem, inputs, rank)

    def run_stage(
        self, stage: str, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        method: Callable[..., Outputs] | None = getattr(self, f"_{stage}", None)
        if method is None:
            raise ValueError(f"stage {stage!r} is not a stage of the golden MoE")
        return method(problem, inputs, upstream, self.view(problem, inputs, rank))

    def view(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> RankView:
        if inputs is not self._views_of:
            self._views_of, self._views = inputs, {}
        key = (problem, rank)
        if key not in self._views:
            self._views[key] = rank_view(problem, inputs.w13_q, inputs.w2_q, rank)
        return self._views[key]

    # -- stages ----------------------------------------------------------------------------------

    def _route(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        if x.topk_ids is not None and x.topk_weights is not None:
            ids, weights = x.topk_ids, x.topk_weights
        elif p.routing is Routing.GROUPED:
            ids, weights = routing.grouped_topk(
                x.router_logits,
                x.score_bias,
                p.topk,
                p.num_expert_group,
                p.topk_group,
                p.renormalize,
                p.routed_scaling_factor,
            )
        else:
            ids, weights = routing.softmax_topk(x.router_logits, p.topk, p.renormalize)
        ids = logical_to_physical(ids, p)
        if p.topology.kind is not TopologyKind.EP_HT:
            return {"topk_ids": ids, "topk_weights": weights}
        # DeepEP HT: this rank receives only tokens with a slot on it; ids travel as int64.
        token_index = dispatched_tokens(local_expert_ids(ids, view.expert_map))
        return {
            "topk_ids": ids[token_index].long(),
            "topk_weights": weights[token_index],
            "token_index": token_index,
        }

    def _quant_input(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        hidden = x.hidden_states
        if p.topology.kind is TopologyKind.EP_HT:
            hidden = hidden[up["route"]["token_index"]]
        if p.recipe is Recipe.MXFP8:
            q, s = formats.quantize_mxfp8(hidden, 32)
        else:
            q, s = formats.quantize_fp8_groups(hidden, 128, p.scale_fmt)
        return {"a1q": q, "a1q_scale": s}

    def _align(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        ids = up["route"]["topk_ids"]
        counts = expert_counts(local_expert_ids(ids, view.expert_map), view.num_local_experts)
        if p.topology.kind is TopologyKind.EP_HT:
            m_sum = aligned_m_sum_exact(counts, p.alignment)  # counts are known on the host
        else:
            m_sum = aligned_m_sum_upper_bound(
                ids.shape[0], ids.shape[1], view.num_local_experts, p.alignment
            )
        return {"M_sum": m_sum, "alignment": p.alignment, "counts": counts}

    def _permute(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        plan = permute_plan(
            up["route"]["topk_ids"],
            view.num_local_experts,
            up["align"]["alignment"],
            view.expert_map,
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
            "inv_perm": plan.inv_perm,
            "expert_start": plan.expert_start,
        }

    def _gemm1(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        perm = up["permute"]
        mm1 = grouped_gemm(
            perm["a_perm"],
            perm["a_scale_perm"],
            p.recipe.act_group,
            view.w13,
            perm["m_indices"],
            self.precision,
        )
        return {"mm1": mm1, "engine": "torch"}

    def _act_quant(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        activation = p.activation
        if p.recipe is Recipe.MXFP4_W4A8 and activation.kind != "silu":
            raise ValueError("mxfp4_w4a8: the FP4 experts support silu (with optional clamp) only")
        q, s = act_quant(up["gemm1"]["mm1"], activation, act_group(p), p.scale_fmt)
        return {"a2q": q, "a2q_scale": s}

    def _gemm2(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        act = up["act_quant"]
        mm2 = grouped_gemm(
            act["a2q"],
            act["a2q_scale"],
            act_group(p),
            view.w2,
            up["permute"]["m_indices"],
            self.precision,
        )
        return {"mm2": mm2, "engine": "torch"}

    def _gather(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        route = up["route"]
        out = gather(
            up["gemm2"]["mm2"],
            route["topk_ids"],
            route["topk_weights"],
            up["permute"]["inv_perm"],
            view.expert_map,
        )
        return {"out": out}

    def _dispatch(self, p: MoEProblem, x: MoEInputs, up: Trace, view: RankView) -> Outputs:
        ids = up["route"]["topk_ids"]
        max_tokens = ids.shape[0]  # one dispatcher: at most every token reaches an expert
        plan = batched_plan(ids, view.num_local_experts, max_tokens, view.expert_map)
        a1q, a1q_scale = up["quant_input"]["a1q"], up["quant_input"]["a1q_scale"]
        e_l = view.num_local_experts
        a_b = torch.zeros(e_l, max_tokens, a1q.shape[1], dtype=torch.uint8, device=a1q.device)
        s_b = torch.zeros(
            e_l, max_tokens, a1q_scale.shape[1], dtype=a1q_scale.dtype, device=a1q.device
        )
        live = plan.slot >= 0
        tok = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(plan.slot)
        a_b[plan.local_ids[live], plan.slot[live].long()] = a1q.view(torch.uint8)[tok[live]]
        s_b[plan.local_ids[live], plan.slot[live].long()] = a1q_scale[tok[live]]
        return {
            "a_batched": a_b.view(torch.float8_e4m3fn),
            "a_scale_batched": s_b,
            "masked_m": plan.masked_m,
            "slot": plan.slot,
            "expected_m": max(1, int(plan.masked_m.float().mean().ceil())) if e_l else 1,
        }


def act_group(problem: MoEProblem) -> int:
    """Group size of GEMM2's activation scales: 32 for MXFP8, else 128 (also for FP4 weights)."""
    return 32 if problem.recipe is Recipe.MXFP8 else 128


def run(problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
    """The golden trace of one rank (DESIGN.md: reference.run)."""
    return ReferenceBackend().run(problem, inputs, rank)
