"""Triton `ep_gather` vs a plain fp32 loop written here and vs the golden `reference.gather.gather`.

Exact bf16 equality is expected, not a tolerance: both sides compute the same fp32 products and
sums in the same order (k ascending, dead slots skipped, each operation rounded in fp32: the
kernel is launched without FMA contraction) and round once to bf16 with RNE. Outputs compare as
int16 bit patterns, so even a -0 / +0 difference would fail.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from moe_verify.common.device import default_device
from optimized.kernels.gather import ep_gather
from reference.gather import gather as golden_gather

pytestmark = pytest.mark.cpu


@dataclass(frozen=True)
class GatherCase:
    """One gather problem; `remote` is the fraction of global experts not on this rank."""

    name: str
    tokens: int
    topk: int
    m_sum: int
    hidden: int
    num_experts: int
    ids_dtype: torch.dtype = torch.int32
    with_map: bool = False
    remote: float = 0.0
    dead_slots: float = 0.0
    dead_id: int = -1


CASES = [
    GatherCase("T1-k1", 1, 1, 128, 256, 4),  # one token, one slot
    GatherCase("T5-k2-H2880-dead", 5, 2, 256, 2880, 8, dead_slots=0.4),  # H = 2880: masked tail
    GatherCase("T17-k8-H1536", 17, 8, 384, 1536, 64),  # DeepSeek top-8; 1024 + a 512 tail
    GatherCase("T40-k4-ep-int64", 40, 4, 256, 512, 16, torch.int64, True, 0.5),  # remote experts
    GatherCase("T9-k6-ep-dead", 9, 6, 128, 384, 8, with_map=True, remote=0.25, dead_slots=0.3),
    # Without a map every negative id is a dead slot, not only -1 (as vLLM's count and gather).
    GatherCase("T6-k3-id-minus-7", 6, 3, 128, 256, 8, dead_slots=0.5, dead_id=-7),
    GatherCase("T0", 0, 4, 128, 256, 8),  # no tokens
]


def make_inputs(case: GatherCase) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    t, k = case.tokens, case.topk
    mm2 = (torch.randn(case.m_sum, case.hidden, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, case.num_experts, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < case.dead_slots] = case.dead_id
    if t >= 2 and case.dead_slots:
        ids[1] = case.dead_id  # a token with no live slot: its row must be exact zeros
    expert_map = None
    if case.with_map:
        remote = torch.rand(case.num_experts, generator=g) < case.remote
        local = torch.cumsum((~remote).int(), 0) - 1
        expert_map = torch.where(remote, torch.full_like(local, -1), local).int()
        if t >= 3:
            ids[2] = int(torch.nonzero(remote)[0]) if bool(remote.any()) else -1  # all remote
    weights = torch.randn(t, k, generator=g)  # signed, so cancellation happens too
    live = ids >= 0
    if expert_map is not None:
        live &= expert_map[ids.clamp(min=0)] >= 0
    # Live slots point at distinct rows; dead slots hold garbage (vLLM leaves them uninitialised).
    rows = torch.randperm(case.m_sum, generator=g)[: t * k].reshape(t, k) if t * k else ids
    inv_perm = torch.where(live, rows, torch.full_like(rows, 1 << 30)).to(torch.int32)
    return {
        "mm2": mm2,
        "topk_ids": ids.to(case.ids_dtype),
        "topk_weights": weights,
        "inv_perm": inv_perm,
        "expert_map": expert_map,
    }


def fp32_loop(mm2, topk_ids, topk_weights, inv_perm, expert_map) -> torch.Tensor:
    """The gather (fp32 weighted sum, one rounding), one token and one slot at a time."""
    out = torch.zeros(topk_ids.shape[0], mm2.shape[1], dtype=torch.bfloat16)
    for t in range(topk_ids.shape[0]):
        acc = torch.zeros(mm2.shape[1], dtype=torch.float32)
        for k in range(topk_ids.shape[1]):
            eid = int(topk_ids[t, k])
            if expert_map is not None and eid != -1:
                eid = int(expert_map[eid])
            if eid >= 0:
                acc = acc + mm2[int(inv_perm[t, k])].float() * topk_weights[t, k]
        out[t] = acc.to(torch.bfloat16)
    return out


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    differ = got.view(torch.int16) != expected.view(torch.int16)
    if bool(differ.any()):
        t, d = (int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.numel()} differ; first at (token {t}, column "
            f"{d}): kernel {got[t, d].item()}, expected {expected[t, d].item()}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ep_gather_matches_fp32_loop_and_golden(case: GatherCase) -> None:
    inputs = make_inputs(case)
    device = default_device()
    on_device = {n: (v.to(device) if v is not None else None) for n, v in inputs.items()}
    out = ep_gather(**on_device).cpu()
    assert out.shape == (case.tokens, case.hidden) and out.dtype == torch.bfloat16
    assert_same_bits(out, fp32_loop(**inputs), "vs the fp32 loop")
    golden_inputs = dict(inputs, inv_perm=inputs["inv_perm"].clamp(max=case.m_sum - 1))
    assert_same_bits(out, golden_gather(**golden_inputs), "vs reference.gather")
    ids, expert_map = inputs["topk_ids"], inputs["expert_map"]
    assert ids is not None
    live = ids >= 0
    if expert_map is not None:
        live &= expert_map[ids.clamp(min=0).long()] >= 0
    dead_tokens = ~live.any(dim=1)
    zeros = out[dead_tokens].view(torch.int16)
    assert bool((zeros == 0).all()), "a token with no live slot must be exact +0.0"
    if case.tokens >= 2 and case.dead_slots:
        assert bool(dead_tokens[1]), "the case must contain a token with every slot -1"


def test_ep_gather_validate_false_gives_the_same_output() -> None:
    # validate=False only skips the host-side range checks (no device sync, graph-capturable).
    inputs = make_inputs(CASES[4])
    on_device = {n: (v.to(default_device()) if v is not None else None) for n, v in inputs.items()}
    checked = ep_gather(**on_device)
    unchecked = ep_gather(**on_device, validate=False)
    assert torch.equal(checked.view(torch.int16), unchecked.view(torch.int16))


# vLLM test_expert_map_bounds: CUDA-graph padding rows hold arbitrary positive ids (these two are
# its bit patterns from torch.empty). Unvalidated, they must be skipped, never read past the
# expert table or, without a table, through the -1 inv_perm entry the permute leaves for them.
STALE_IDS = (123456789, 2071690107)


@pytest.mark.parametrize("with_map", [True, False], ids=["expert-map", "no-map"])
def test_ep_gather_skips_stale_positive_ids_unvalidated(with_map: bool) -> None:
    inputs = make_inputs(CASES[4] if with_map else CASES[2])
    ids, inv_perm = inputs["topk_ids"].clone(), inputs["inv_perm"].clone()
    stale = torch.zeros_like(ids, dtype=torch.bool)
    stale[-2:] = True  # two padding rows, every slot stale
    ids[stale] = torch.tensor(STALE_IDS * ids.shape[1], dtype=ids.dtype)
    inv_perm[stale] = -1
    device = default_device()
    on_device = {
        n: (v.to(device) if v is not None else None)
        for n, v in dict(inputs, topk_ids=ids, inv_perm=inv_perm).items()
    }
    out = ep_gather(**on_device, validate=False).cpu()
    skipped = dict(inputs, topk_ids=torch.where(stale, -1, ids), inv_perm=inv_perm)
    assert_same_bits(out, fp32_loop(**skipped), "stale ids skipped")
    assert bool((out[-2:].view(torch.int16) == 0).all()), "a row of stale slots must be +0.0"


# (case, mutation of the valid T9 inputs, what the message must say)
def _bad(mutate) -> dict[str, torch.Tensor | None]:
    inputs = make_inputs(CASES[4])
    mutate(inputs)
    return inputs


def _set(name: str, value) -> object:
    def mutate(inputs: dict) -> None:
        inputs[name] = value(inputs[name]) if callable(value) else value

    return mutate


def _poke(name: str, at: tuple[int, int], value: int) -> object:
    def mutate(inputs: dict) -> None:
        inputs[name] = inputs[name].clone()
        inputs[name][at] = value

    return mutate


def _live_slot_row(at: tuple[int, int], row: int) -> object:
    """Make slot `at` live (a local expert) and point it at mm2 row `row`."""

    def mutate(inputs: dict) -> None:
        inputs["topk_ids"] = inputs["topk_ids"].clone()
        inputs["topk_ids"][at] = int(torch.nonzero(inputs["expert_map"] >= 0)[0])
        inputs["inv_perm"] = inputs["inv_perm"].clone()
        inputs["inv_perm"][at] = row

    return mutate


BAD_INPUTS = [
    (
        "uint32-ids",
        _set("topk_ids", lambda t: t.clamp(min=0).to(torch.uint32)),
        r"topk_ids must be a signed integer dtype",
    ),
    ("id-below-minus-1-with-map", _poke("topk_ids", (3, 2), -2), r"topk_ids\[3, 2\] = -2"),
    (
        "id-beyond-the-map",
        _poke("topk_ids", (0, 5), 8),
        r"topk_ids\[0, 5\] = 8 is outside \[-1, 8\)",
    ),
    ("live-inv-perm-past-M_sum", _live_slot_row((4, 3), 128), r"inv_perm\[4, 3\] = 128"),
    ("live-inv-perm-negative", _live_slot_row((0, 0), -1), r"inv_perm\[0, 0\] = -1"),
    ("bf16-weights", _set("topk_weights", lambda t: t.bfloat16()), r"topk_weights must be float32"),
    ("int64-inv-perm", _set("inv_perm", lambda t: t.long()), r"inv_perm must be int32"),
    (
        "inv-perm-shape",
        _set("inv_perm", lambda t: t[:, :3]),
        r"inv_perm must have shape topk_ids\.shape \[M, k\] = \(9, 6\)",
    ),
    (
        "mm2-strided-columns",
        _set("mm2", lambda t: t.t().contiguous().t()),
        r"mm2 must have unit stride along its last dimension",
    ),
    ("int64-expert-map", _set("expert_map", lambda t: t.long()), r"expert_map must be int32"),
    ("fp32-mm2", _set("mm2", lambda t: t.float()), r"mm2 must be bfloat16"),
]


@pytest.mark.parametrize(
    ("mutate", "message"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_are_refused_before_launch(mutate, message: str) -> None:
    inputs = _bad(mutate)
    device = default_device()
    on_device = {n: (v.to(device) if v is not None else None) for n, v in inputs.items()}
    with pytest.raises(ValueError, match=message):
        ep_gather(**on_device)


def test_dead_slots_may_hold_any_inv_perm() -> None:
    # vLLM leaves inv_perm of skipped slots uninitialised: the validator must not reject them.
    inputs = make_inputs(CASES[4])
    ids = inputs["topk_ids"]
    assert ids is not None and bool((ids == -1).any())
    assert int(inputs["inv_perm"].max()) == 1 << 30  # garbage on dead slots
    on_device = {n: (v.to(default_device()) if v is not None else None) for n, v in inputs.items()}
    ep_gather(**on_device)
