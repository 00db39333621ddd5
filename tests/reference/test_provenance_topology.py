"""Provenance tags survive quantization in every recipe; every topology's reduced golden output
equals the single-rank golden within the reduce policy (bf16 partials summed across ranks)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import MoEProblem, Recipe, ScaleFmt, Topology, Trace
from reference.moe import ReferenceBackend
from reference.topology import reduce_ranks
from tolerance.compare import StageResult, compare_stage
from tolerance.provenance import check_permuted_tokens, decode_permuted

pytestmark = pytest.mark.cpu

RECIPES = [
    (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32),
    (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32_CEIL_UE8M0),
    (Recipe.MXFP8, ScaleFmt.UE8M0_PACKED),
    (Recipe.MXFP4_W4A8, ScaleFmt.UE8M0_PACKED),
]


@pytest.mark.parametrize(("recipe", "fmt"), RECIPES, ids=lambda v: str(v))
def test_every_permuted_row_names_its_token(recipe: Recipe, fmt: ScaleFmt) -> None:
    p = MoEProblem(
        tokens=300,
        hidden=128,
        intermediate=128,
        num_experts=8,
        topk=3,
        recipe=recipe,
        scale_fmt=fmt,
        provenance=True,
    )
    t = ReferenceBackend().run(p, make_inputs(p, "cpu"))
    perm = t["permute"]
    assert check_permuted_tokens(t["route"]["topk_ids"], perm["inv_perm"], perm["a_perm"]) == []
    decoded = decode_permuted(perm["a_perm"])
    live_rows = perm["m_indices"] >= 0
    assert bool((decoded[live_rows] >= 0).all())


def test_a_swapped_row_is_named() -> None:
    p = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, provenance=True)
    t = ReferenceBackend().run(p, make_inputs(p, "cpu"))
    perm = t["permute"]
    a = perm["a_perm"].view(torch.uint8).clone()
    r0, r1 = int(perm["inv_perm"][0, 0]), int(perm["inv_perm"][5, 1])
    a[[r0, r1]] = a[[r1, r0]]
    wrong = check_permuted_tokens(
        t["route"]["topk_ids"], perm["inv_perm"], a.view(torch.float8_e4m3fn)
    )
    assert [(w[0], w[1], w[3]) for w in wrong] == [(0, 0, 5), (5, 1, 0)]


# (topology, experts): the EP placements and TP splits whose reduce must match one rank.
TOPOLOGIES = [
    ("tp:2", 4),
    ("tp:4", 4),
    ("ep:2", 5),  # remainder expert on rank 0
    ("ep:4", 8),
    ("ep:3:round_robin", 8),
    ("ep:2+ht", 6),  # tokens dispatched to owners, exact M_sum, int64 ids
    ("ep:8", 6),  # more ranks than experts: two ranks own nothing
]


def _reduced_vs_single_rank(p: MoEProblem) -> tuple[list[Trace], Trace, StageResult]:
    """Every rank's golden trace, the reduced output, and its comparison with one rank's run
    (the single rank goes through the same runner finish, shared experts included)."""
    inputs = make_inputs(p, "cpu")
    golden = ReferenceBackend()
    ranks = [golden.run(p, inputs, r) for r in range(p.topology.size)]
    single = p.replace(topology=Topology())
    reduced, one = Trace("ranks"), Trace("single")
    reduced.add("reduce", {"out": reduce_ranks(ranks, p)})
    one.add("reduce", {"out": reduce_ranks([golden.run(single, inputs)], single)})
    return ranks, reduced, compare_stage("reduce", one, reduced, p)


@pytest.mark.parametrize(("topology", "experts"), TOPOLOGIES, ids=[t for t, _ in TOPOLOGIES])
def test_reduced_output_matches_single_rank(topology: str, experts: int) -> None:
    p = MoEProblem(
        tokens=48,
        hidden=128,
        intermediate=512,
        num_experts=experts,
        topk=2,
        topology=topology,
        scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
    )
    _, _, result = _reduced_vs_single_rank(p)
    assert result.status == "pass", [c for c in result.checks if not c.passed]


def test_explicit_placement_with_replicas_matches_single_rank() -> None:
    topo = Topology.explicit_ep([[0, 1, 2], [2, 3, 0]])  # experts 0 and 2 replicated
    p = MoEProblem(tokens=40, hidden=128, intermediate=128, num_experts=4, topk=2, topology=topo)
    ranks, _, result = _reduced_vs_single_rank(p)
    assert int(ranks[0]["align"]["counts"].sum() + ranks[1]["align"]["counts"].sum()) == 80
    assert result.status == "pass"


@pytest.mark.parametrize("topology", ["tp:2", "ep:2", "ep:2+ht", "ep:2+ll"])
def test_shared_experts_reduce_matches_single_rank(topology: str) -> None:
    p = MoEProblem(
        tokens=24,
        hidden=128,
        intermediate=256,
        num_experts=4,
        topk=2,
        topology=topology,
        shared_experts=1,
    )
    ranks, reduced, result = _reduced_vs_single_rank(p)
    assert result.status == "pass"
    # the shared MLP really contributes: without it the output fails the same reduce check
    without = Trace("routed only")
    without.add("reduce", {"out": reduce_ranks(ranks, p.replace(shared_experts=0))})
    assert compare_stage("reduce", reduced, without, p).status == "fail"
