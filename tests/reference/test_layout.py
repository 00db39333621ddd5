"""Properties of the golden layout over the mandatory routing edges, and its input validation."""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import MoEProblem, MSumRecipe, Routing, StageContext, Trace
from reference.layout import (
    aligned_m_sum_all_experts_bound,
    aligned_m_sum_exact,
    aligned_m_sum_recipes,
    aligned_m_sum_upper_bound,
    batched_plan,
    local_expert_ids,
    m_indices_from_expert_ends,
    permute_plan,
    permute_rows,
)
from reference.moe import ReferenceBackend

pytestmark = pytest.mark.cpu

# (tokens, experts, topk, alignment, routing): the edge each row exercises.
Case = tuple[int, int, int, int, Routing]
CASES: list[Case] = [
    (1, 4, 2, 128, Routing.SOFTMAX),  # T = 1
    (7, 8, 2, 128, Routing.SOFTMAX),  # T < alignment, counts not multiples of A
    (64, 8, 2, 128, Routing.EMPTY_FIRST),  # expert 0 empty
    (64, 8, 2, 128, Routing.EMPTY_MIDDLE),  # expert E/2 empty
    (64, 8, 2, 128, Routing.EMPTY_LAST),  # expert E-1 empty
    (64, 8, 2, 64, Routing.ONE_EXPERT),  # every token on one expert, other slots -1
    (40, 6, 6, 32, Routing.UNIFORM),  # topk == E
    (50, 8, 4, 96, Routing.INVALID_SLOTS),  # -1 slots, whole tokens empty; A not a power of two
    (33, 4, 3, 32, Routing.DUPLICATES),  # a token may pick one expert twice
    (129, 16, 4, 128, Routing.SKEW),  # one hot expert
]


def _ids(case: Case) -> torch.Tensor:
    t, e, k, a, routing = case
    p = MoEProblem(
        tokens=t, num_experts=e, topk=k, routing=routing, alignment=a, hidden=128, intermediate=128
    )
    return ReferenceBackend().route(StageContext(p, make_inputs(p, "cpu"), Trace("golden"), 0))[
        "topk_ids"
    ]


def _case_id(case: Case) -> str:
    t, e, k, a, routing = case
    return f"T{t}-E{e}-k{k}-A{a}-{routing}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_inv_perm_is_a_bijection_onto_live_rows(case: Case) -> None:
    ids = _ids(case)
    _, e, _, a, _ = case
    plan = permute_plan(ids, e, a)
    live = ids >= 0
    rows = plan.inv_perm[live].long()
    assert bool((plan.inv_perm[~live] == -1).all())
    assert rows.unique().numel() == rows.numel()  # injective
    assert torch.equal(torch.sort(rows).values, (plan.m_indices >= 0).nonzero().squeeze(1))  # onto
    assert torch.equal(plan.m_indices[rows].long(), ids[live].long())  # each row its own expert


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_segments_start_aligned_and_hold_their_counts(case: Case) -> None:
    ids = _ids(case)
    _, e, _, a, _ = case
    plan = permute_plan(ids, e, a)
    assert plan.m_sum % a == 0
    assert bool((plan.expert_start % a == 0).all())
    assert int(plan.counts.sum()) == int((ids >= 0).sum())
    for expert in range(e):
        start, count = int(plan.expert_start[expert]), int(plan.counts[expert])
        segment = plan.m_indices[start : start + count]
        assert bool((segment == expert).all())
        # every aligned block holds one expert then padding: DeepGEMM reads a block's first row
        block_end = start + (count + a - 1) // a * a
        assert bool((plan.m_indices[start + count : block_end] == -1).all())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_exact_m_sum_never_exceeds_the_upper_bound(case: Case) -> None:
    ids = _ids(case)
    t, e, k, a, _ = case
    plan = permute_plan(ids, e, a)
    assert aligned_m_sum_exact(plan.counts, a) <= aligned_m_sum_upper_bound(t, k, e, a)
    exact = permute_plan(ids, e, a, m_sum=aligned_m_sum_exact(plan.counts, a))
    assert torch.equal(exact.inv_perm, plan.inv_perm)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_m_sum_recipe_is_valid_and_bounds_are_ordered(case: Case) -> None:
    ids = _ids(case)
    t, e, k, a, _ = case
    counts = permute_plan(ids, e, a).counts
    recipes = aligned_m_sum_recipes(t, k, counts, a)
    exact = recipes[MSumRecipe.EXACT_COUNTS]
    assert set(recipes) == set(MSumRecipe)
    assert all(m % a == 0 and m >= exact for m in recipes.values()), recipes
    assert recipes[MSumRecipe.MIN_ACTIVE_BOUND] <= recipes[MSumRecipe.ALL_EXPERTS_BOUND]
    for m_sum in recipes.values():  # each one is a buffer the plan fits, same rows for slots
        assert torch.equal(
            permute_plan(ids, e, a, m_sum=m_sum).inv_perm, permute_plan(ids, e, a).inv_perm
        )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_expert_ends_are_the_psum_reading_of_m_indices(case: Case) -> None:
    """One plan, two layouts: rows [round_up(end_{e-1}, A), end_e) are expert e's, exactly the
    rows m_indices names; gap and tail rows belong to no expert in either."""
    ids = _ids(case)
    _, e, _, a, _ = case
    plan = permute_plan(ids, e, a)
    assert plan.expert_ends.dtype == torch.int32 and plan.expert_ends.shape == (e,)
    assert torch.equal(plan.expert_ends, plan.expert_start + plan.counts)
    assert torch.equal(m_indices_from_expert_ends(plan.expert_ends, plan.m_sum, a), plan.m_indices)


def test_psum_reading_by_hand() -> None:
    # counts [3, 0, 5] at A = 4: expert 0 rows 0..2, expert 1 empty (end 4 = its start), expert 2
    # rows 4..8; rows 3, 9..11 are gaps, 12..15 the tail.
    rows = m_indices_from_expert_ends(torch.tensor([3, 4, 9], dtype=torch.int32), 16, 4)
    assert rows.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1, -1, -1, -1, -1]


def test_upper_bound_formula_by_hand() -> None:
    # M*k = 6 slots, min(6, E=4) = 4 active at most: round_up(6 + 4*127, 128) = 514 -> 640
    assert aligned_m_sum_upper_bound(3, 2, 4, 128) == 640
    assert aligned_m_sum_upper_bound(0, 2, 4, 128) == 0
    # The older bound charges all E = 4 experts: round_up(6 + 4*127, 128) = 640 too; with E = 8
    # it is round_up(6 + 8*127, 128) = 1024 against round_up(6 + 6*127, 128) = 768.
    assert aligned_m_sum_all_experts_bound(3, 2, 4, 128) == 640
    assert aligned_m_sum_all_experts_bound(3, 2, 8, 128) == 1024
    assert aligned_m_sum_upper_bound(3, 2, 8, 128) == 768
    assert aligned_m_sum_exact(torch.tensor([130, 0, 5]), 64) == 192 + 0 + 64


def test_expert_map_sends_remote_and_minus_one_to_minus_one() -> None:
    ids = torch.tensor([[0, 3], [2, -1]], dtype=torch.int32)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # rank 1 of ep:2 over 4 experts
    assert local_expert_ids(ids, emap).tolist() == [[-1, 1], [0, -1]]
    plan = permute_plan(ids, 2, 32, emap)
    assert plan.counts.tolist() == [1, 1]
    assert plan.inv_perm.tolist() == [[-1, 32], [0, -1]]


def test_permute_rows_copies_fp8_bits() -> None:
    x = torch.tensor([[1.5, -448.0], [0.0, 2.0]]).to(torch.float8_e4m3fn)
    plan = permute_plan(torch.tensor([[1], [0]], dtype=torch.int32), 2, 4)
    out = permute_rows(x, plan)
    assert torch.equal(out[4].view(torch.uint8), x[0].view(torch.uint8))
    assert torch.equal(out[0].view(torch.uint8), x[1].view(torch.uint8))


def test_batched_plan_numbers_slots_per_expert() -> None:
    ids = torch.tensor([[0, 1], [1, 0], [1, -1]], dtype=torch.int32)
    plan = batched_plan(ids, 2, 4)
    assert plan.masked_m.tolist() == [2, 3]
    assert plan.slot.tolist() == [[0, 0], [1, 1], [2, -1]]


@pytest.mark.parametrize(
    ("ids", "experts", "emap", "message"),
    [
        (torch.tensor([[0, 4]], dtype=torch.int32), 4, None, "topk_ids: expected ids < 4"),
        (torch.tensor([[0, -2]], dtype=torch.int32), 4, None, "topk_ids: expected ids >= -1"),
        (torch.tensor([[0, 1]], dtype=torch.uint8), 4, None, "topk_ids: expected signed"),
        (torch.tensor([0, 1], dtype=torch.int32), 4, None, "topk_ids: expected a 2-D"),
        (
            torch.tensor([[0, 5]], dtype=torch.int32),
            2,
            torch.tensor([0, 1, -1, -1], dtype=torch.int32),
            "max id 5",
        ),
    ],
    ids=["id-ge-E", "id-minus-2", "unsigned", "1-D", "id-beyond-map"],
)
def test_bad_ids_are_rejected(
    ids: torch.Tensor, experts: int, emap: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        permute_plan(ids, experts, 128, emap)


def test_m_sum_below_the_exact_sum_is_rejected() -> None:
    ids = torch.tensor([[0], [0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="m_sum"):
        permute_plan(ids, 2, 2, m_sum=2)


def test_golden_gemms_read_either_layout_to_the_same_rows() -> None:
    p = MoEProblem(
        tokens=12, num_experts=4, topk=2, alignment=32, hidden=128, intermediate=128,
        routing=Routing.EMPTY_MIDDLE,
    )  # fmt: skip
    inputs = make_inputs(p, "cpu")
    traces = {
        layout: ReferenceBackend().run(p.replace(grouped_layout=layout), inputs)
        for layout in ("m_indices", "psum")
    }
    for stage, name in (("gemm1", "mm1"), ("gemm2", "mm2")):
        assert {t[stage]["layout"] for t in traces.values()} == {"m_indices", "psum"}
        a, b = (t[stage][name].view(torch.int16) for t in traces.values())
        assert torch.equal(a, b), stage
