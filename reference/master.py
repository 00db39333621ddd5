"""The MoE of a bf16 model on its unquantized master weights: what every FP8 recipe approximates.

No fp8 anywhere, so the distance from a quantized output to this one is what the recipe and its
scales cost (calibrate's E8M0 cost table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_verify.spec import Activation, MoEInputs, MoEProblem
from reference.activation import swiglu


def expert_mlp(x: Tensor, w13: Tensor, w2: Tensor, activation: Activation) -> Tensor:
    """fp32 [N, H]: one expert's gated MLP on fp32 rows x [N, H] (unweighted).

    mm1 = bf16(x @ w13^T) with w13 [2I, H] (gate rows first), computed in fp32;
    y = swiglu(mm1), rounded to bf16 once; returns y @ w2^T with w2 [H, I], in fp32.
    """
    mm1 = (x @ w13.float().T).to(torch.bfloat16)
    y = swiglu(mm1, activation, "packed")
    return y @ w2.float().T


def master_moe(
    problem: MoEProblem, inputs: MoEInputs, topk_ids: Tensor, topk_weights: Tensor
) -> Tensor:
    """fp32 [T, H]: out[t] = Σ_k weight[t, k] · expert_mlp(x[t], w13[e], w2[e]), e = ids[t, k].

    One rank, no TP: ids = topk_ids [T, k] are logical expert ids (-1 = no expert, contributes
    nothing), weight = topk_weights fp32 [T, k]. inputs.hidden_states bf16 [T, H]; the master
    weights inputs.w13 bf16 [E, 2I, H] and inputs.w2 bf16 [E, H, I]. The weighted sum is
    accumulated in fp32, expert by expert in ascending id order.
    """
    x = inputs.hidden_states.float()
    out = torch.zeros(x.shape[0], inputs.w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp(x[tokens], inputs.w13[e], inputs.w2[e], problem.activation)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
    return out
