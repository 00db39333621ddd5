"""One rank-0 call of the production op, torch.ops.moe_verify.fused_moe, built from the golden's
routing: what the CPU tier (tests/optimized/test_op.py, Triton engine) and the SM90 tier
(tests/gpu/test_sm90_production_op.py, DeepGEMM) call the op with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import reference
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import Engine, MoEProblem, Trace
from optimized import op
from optimized.production import ForwardConfig, RankWeights, prepare_rank_weights, workspace_bytes


@dataclass(frozen=True)
class OpCall:
    """Everything one op call takes; `golden` is the golden's trace of rank 0."""

    problem: MoEProblem
    cfg: ForwardConfig
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: RankWeights
    golden: Trace

    def workspace(self) -> torch.Tensor:
        """A fresh workspace of the size the op asks for."""
        return torch.empty(
            workspace_bytes(self.cfg, self.hidden_states.shape[0]),
            dtype=torch.uint8,
            device=self.hidden_states.device,
        )

    def args(self, workspace: torch.Tensor) -> tuple:
        """The op's tensor arguments, in schema order."""
        return op.tensor_args(
            self.hidden_states, self.topk_ids, self.topk_weights, self.weights, workspace
        )

    def run(
        self, backend: str = "optimized", workspace: torch.Tensor | None = None
    ) -> torch.Tensor:
        ws = self.workspace() if workspace is None else workspace
        return torch.ops.moe_verify.fused_moe(*self.args(ws), **op.op_args(self.cfg, backend))


def op_call(problem: MoEProblem, engine: Engine, device: str | None = None) -> OpCall:
    """Rank 0's call of `problem` on `engine`, inputs on `device` (the default device if None)."""
    x = make_inputs(problem, device)
    golden = reference.run(problem, x, 0)
    route = golden["route"]
    hidden = x.hidden_states
    if "token_index" in route:  # ep+ht: the rank receives only the tokens routed to it
        hidden = hidden[route["token_index"]]
    cfg = ForwardConfig.for_problem(problem, 0, hidden.shape[0], engine)
    weights = prepare_rank_weights(cfg, x.w13_q, x.w2_q)
    return OpCall(problem, cfg, hidden, route["topk_ids"], route["topk_weights"], weights, golden)
