"""The master-weight MoE (reference/master.py): a hand-computed case, then exact properties."""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import MoEInputs, MoEProblem, QuantizedWeight, Routing, StageContext, Trace
from reference.master import master_moe
from reference.moe import ReferenceBackend

pytestmark = pytest.mark.cpu

BF16 = torch.bfloat16


def _hand_inputs() -> tuple[MoEProblem, MoEInputs]:
    """H = 2, I = 1, two experts. Expert 0: gate = x0, up = x1, down = [1, -1]. Expert 1: gate =
    x1, up = x0, down = [2, 0]. The problem only supplies the activation (silu)."""
    problem = MoEProblem(tokens=3, hidden=128, intermediate=128, num_experts=2, topk=2)
    unused = QuantizedWeight(torch.zeros(2, 2, 2), torch.ones(2, 1, 1), (128, 128))
    inputs = MoEInputs(
        hidden_states=torch.tensor([[1.0, 2.0]] * 3, dtype=BF16),
        router_logits=torch.zeros(3, 2),
        score_bias=None,
        topk_ids=None,
        topk_weights=None,
        w13=torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]], dtype=BF16),
        w2=torch.tensor([[[1.0], [-1.0]], [[2.0], [0.0]]], dtype=BF16),
        w13_q=unused,
        w2_q=unused,
    )
    return problem, inputs


def test_a_hand_computed_case() -> None:
    problem, inputs = _hand_inputs()
    ids = torch.tensor([[0, 1], [1, -1], [-1, -1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [1.0, 1.0], [1.0, 1.0]])
    # Expert 0: y = bf16(2 * silu(1)) = bf16(1.46212) = 1.4609375 -> [1.4609375, -1.4609375].
    # Expert 1: y = bf16(1 * silu(2)) = bf16(1.76159) = 1.7578125 -> [3.515625, 0].
    expected = torch.tensor(
        [
            [0.5 * 1.4609375 + 0.25 * 3.515625, -0.5 * 1.4609375],
            [3.515625, 0.0],  # the -1 slot adds nothing
            [0.0, 0.0],  # no expert at all: a zero row
        ]
    )
    out = master_moe(problem, inputs, ids, weights)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected), out


# Seeded routing from the golden's route stage; each row names its edge.
CASES = [
    MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=4),  # k == E
    MoEProblem(tokens=7, hidden=256, intermediate=128, num_experts=8, topk=2, routing=Routing.SKEW),
    # ^ odd T, one hot expert, most experts empty
    MoEProblem(
        tokens=9, hidden=128, intermediate=128, num_experts=4, topk=2, routing=Routing.INVALID_SLOTS
    ),  # -1 slots, some tokens with none at all
]

Case = tuple[MoEProblem, MoEInputs, torch.Tensor, torch.Tensor]


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    problem: MoEProblem = request.param
    inputs = make_inputs(problem, "cpu")
    route = ReferenceBackend().route(StageContext(problem, inputs, Trace("golden"), 0))
    return problem, inputs, route["topk_ids"], route["topk_weights"]


def test_slot_order_within_a_token_does_not_matter(case: Case) -> None:
    """Experts are summed in id order, whatever slot k holds them: reversing k is bitwise equal."""
    problem, inputs, ids, weights = case
    out = master_moe(problem, inputs, ids, weights)
    assert torch.equal(master_moe(problem, inputs, ids.flip(1), weights.flip(1)), out)


def test_each_slot_is_weighted_by_its_topk_weight(case: Case) -> None:
    """Doubling every weight doubles the output exactly (a power of two), and zero weights give
    zero: the weights are applied, per slot, after the expert MLP."""
    problem, inputs, ids, weights = case
    out = master_moe(problem, inputs, ids, weights)
    assert torch.equal(master_moe(problem, inputs, ids, 2 * weights), 2 * out)
    assert not master_moe(problem, inputs, ids, torch.zeros_like(weights)).any()
    assert out.any()


def test_a_token_without_experts_is_zero(case: Case) -> None:
    problem, inputs, ids, weights = case
    ids = ids.clone()
    ids[0] = -1
    assert not master_moe(problem, inputs, ids, weights)[0].any()
