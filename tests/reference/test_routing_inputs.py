"""Routers by hand, make_inputs determinism and routing modes, and MoEProblem validation."""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    Activation,
    MoEProblem,
    Recipe,
    Routing,
    ScaleFmt,
    StageContext,
    Topology,
    Trace,
)
from reference.moe import ReferenceBackend
from reference.routing import grouped_topk, softmax_topk

pytestmark = pytest.mark.cpu


def test_softmax_topk_by_hand() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    ids, w = softmax_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3]]  # tie 2.0 vs 2.0 goes to the lower id first
    assert w.tolist() == [[0.5, 0.5]]
    ids, w = softmax_topk(logits, 1, renormalize=False)
    p = torch.softmax(logits, -1)[0, 1].item()
    assert w.item() == pytest.approx(p, rel=0, abs=0)


def test_grouped_topk_keeps_best_groups_and_unbiased_weights() -> None:
    # 4 experts in 2 groups; the bias makes group 1 win although expert 0 has the top score.
    logits = torch.tensor([[3.0, -3.0, 0.0, 0.5]])
    bias = torch.tensor([0.0, 0.0, 1.0, 1.0])
    ids, w = grouped_topk(
        logits,
        bias,
        2,
        num_expert_group=2,
        topk_group=1,
        renormalize=False,
        routed_scaling_factor=2.5,
    )
    assert sorted(ids[0].tolist()) == [2, 3]
    expect = torch.sigmoid(logits)[0] * 2.5  # fp32, as the router computes: exact equality
    for i, wt in zip(ids[0].tolist(), w[0].tolist(), strict=True):
        assert wt == expect[i].item()


@pytest.mark.parametrize("routing", list(Routing), ids=str)
def test_make_inputs_is_deterministic_per_seed(routing: Routing) -> None:
    p = MoEProblem(
        tokens=24,
        hidden=128,
        intermediate=128,
        num_experts=8,
        topk=2,
        routing=routing,
        num_expert_group=4,
        topk_group=2,
    )
    a, b = make_inputs(p, "cpu"), make_inputs(p, "cpu")
    assert torch.equal(a.hidden_states, b.hidden_states)
    assert torch.equal(a.w13_q.q.view(torch.uint8), b.w13_q.q.view(torch.uint8))
    c = make_inputs(p.replace(seed=1), "cpu")
    assert not torch.equal(a.hidden_states, c.hidden_states)


def _route(p: MoEProblem) -> torch.Tensor:
    return ReferenceBackend().route(StageContext(p, make_inputs(p, "cpu"), Trace("golden"), 0))[
        "topk_ids"
    ]


@pytest.mark.parametrize(
    ("routing", "empty"),
    [(Routing.EMPTY_FIRST, 0), (Routing.EMPTY_MIDDLE, 4), (Routing.EMPTY_LAST, 7)],
    ids=str,
)
def test_empty_expert_modes_leave_that_expert_empty(routing: Routing, empty: int) -> None:
    ids = _route(MoEProblem(tokens=200, num_experts=8, topk=3, routing=routing))
    assert int((ids == empty).sum()) == 0
    assert len(set(ids.flatten().tolist())) == 7


def test_skew_has_one_hot_expert() -> None:
    ids = _route(MoEProblem(tokens=400, num_experts=16, topk=2, routing=Routing.SKEW))
    counts = torch.bincount(ids.flatten().long(), minlength=16)
    assert int(counts.max()) > 0.4 * 400


def test_invalid_slots_mode_has_empty_tokens() -> None:
    ids = _route(MoEProblem(tokens=64, num_experts=8, topk=4, routing=Routing.INVALID_SLOTS))
    assert bool((ids[::7] == -1).all())
    assert 0 < int((ids == -1).sum()) < ids.numel()


def test_grouped_routing_weights_carry_the_scaling_factor() -> None:
    p = MoEProblem(
        tokens=16,
        num_experts=16,
        topk=4,
        routing=Routing.GROUPED,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    route = ReferenceBackend().route(StageContext(p, make_inputs(p, "cpu"), Trace("golden"), 0))
    sums = route["topk_weights"].sum(-1)
    assert torch.allclose(sums, torch.full_like(sums, 2.5))


def test_ue8m0_formats_requantize_weights_to_powers_of_two() -> None:
    p = MoEProblem(tokens=4, hidden=256, intermediate=256, scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0)
    x = make_inputs(p, "cpu")
    s = x.w13_q.scale
    assert bool((s == torch.exp2(torch.log2(s).round())).all())
    assert x.w13_ckpt is not None and not torch.equal(x.w13_ckpt.scale, s)
    assert make_inputs(p.replace(scale_fmt=ScaleFmt.FLOAT32), "cpu").w13_ckpt is None


@pytest.mark.parametrize(
    ("recipe", "fmt"),
    [
        (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32),
        (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32_CEIL_UE8M0),
        (Recipe.MXFP8, ScaleFmt.UE8M0_PACKED),
        (Recipe.MXFP4_W4A8, ScaleFmt.FLOAT32_CEIL_UE8M0),
    ],
    ids=str,
)
def test_weights_quantized_in_chunks_are_bitwise_the_whole_stack(
    recipe: Recipe, fmt: ScaleFmt, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_verify.run import inputs

    problem = MoEProblem(hidden=256, intermediate=256, num_experts=5, recipe=recipe, scale_fmt=fmt)
    w = make_inputs(problem, "cpu").w13
    whole = inputs.quantize_weight(w, problem)
    monkeypatch.setattr(inputs, "_CHUNK_ELEMENTS", 2 * w[0].numel())  # chunks of 2, 2 and 1
    chunked = inputs.quantize_weight(w, problem)
    assert (whole[1] is None) == (chunked[1] is None)
    for a, b in zip(whole, chunked, strict=True):
        if a is not None and b is not None:
            assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 100}, "hidden=100 must be a multiple of 128"),
        ({"topk": 9}, "topk must be in"),
        ({"recipe": "mxfp8", "scale_fmt": "float32"}, "recipe mxfp8 takes scale_fmt"),
        ({"recipe": "bogus"}, "recipe must be one of"),
        ({"intermediate": 384, "topology": "tp:2"}, "intermediate per rank=192"),
        ({"topology": "ep:2+ht:x"}, "topology"),
    ],
    ids=["hidden", "topk", "mx-fmt", "recipe", "tp-split", "topology"],
)
def test_problem_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEProblem(**kwargs)


def test_problem_id_and_round_trip() -> None:
    p = MoEProblem(
        tokens=512,
        hidden=2048,
        intermediate=768,
        num_experts=64,
        topk=8,
        routing=Routing.SKEW,
        topology=Topology.parse("ep:4"),
        recipe=Recipe.FP8_BLOCK,
        activation=Activation("silu", limit=7.0),
    )
    assert p.id == "fp8_block-ep4-T512-H2048-I768-E64-k8-skew-silu-L7"
    assert MoEProblem.from_dict(p.to_dict()) == p
