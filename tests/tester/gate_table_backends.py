"""A backend whose act_quant computes the gate as the H200's Triton does: read from the recorded
table (reference/hardware/gate_table.py), the rest of the kernel's arithmetic as the
golden's recipe.

It is what a kernel developer with a tensor-core-exact or table-exact kernel looks like to the
suite on a CPU: the optimized path with act_quant replaced, declaring the hardware recipe.
"""

from __future__ import annotations

from moe_verify.spec import StageContext
from optimized.backend import OptimizedBackend
from reference.activation import act_quant, fused_act_quant_recipe, sm90_triton_recipe

Outputs = dict[str, object]


class TableGateActQuant(OptimizedBackend):
    """act_quant with the H200 table's gate (packed_sm90_triton / colmajor_sm90_triton),
    declared; contiguous layouts only (it quantizes every row of mm1 [M_sum, 2I])."""

    name = "table_gate_act_quant"
    declares = True

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
        recipe = sm90_triton_recipe(fused_act_quant_recipe(p.scale_fmt), p.activation)
        if recipe is None:
            raise ValueError(f"no H200 gate table applies to activation {p.activation.tag}")
        q, s = act_quant(up["gemm1"]["mm1"], p.activation, p.recipe.act_group, p.scale_fmt, recipe)
        out: Outputs = {"a2q": q, "a2q_scale": s}
        if self.declares:
            out["recipe"] = recipe.value
        return out
