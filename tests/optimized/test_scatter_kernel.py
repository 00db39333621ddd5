"""The permute kernels (count_expert_tokens, ep_scatter) against the golden permute plan.

Row order inside an expert segment depends on atomic order, so rows are compared through the
kernel's own inv_perm, keyed by (token, k); m_indices, expert_start and counts are deterministic
and compared exactly. Every copy is compared bitwise (fp8 rows as bytes, fp32 scales as bits,
packed UE8M0 as int32 words).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from optimized.kernels.scatter import Scattered, ep_scatter
from optimized.kernels.slot_counts import (
    aligned_m_sum_exact,
    aligned_m_sum_upper_bound,
    count_expert_tokens,
)
from reference import formats
from reference.layout import m_indices_from_expert_ends, permute_plan

pytestmark = pytest.mark.cpu


@dataclass(frozen=True)
class Case:
    """One permute problem. `routing` names how topk_ids are drawn (see `_topk_ids`)."""

    tokens: int
    hidden: int
    topk: int
    experts: int  # local experts E_l
    alignment: int
    routing: str = "random"
    scale: str = "fp32"  # fp32 | fp32_colmajor | e8m0
    act_group: int = 128
    ep: str = "none"  # none | linear | round_robin: emulate rank 1 of a 2-rank expert_map
    exact_m_sum: bool = False  # the DeepEP HT path: m_sum from the exact counts
    ids_dtype: torch.dtype = torch.int32

    @property
    def id(self) -> str:
        parts = [f"T{self.tokens}", f"H{self.hidden}", f"k{self.topk}", f"E{self.experts}"]
        parts += [f"A{self.alignment}", self.routing, self.scale]
        if self.ep != "none":
            parts.append(f"ep-{self.ep}")
        if self.exact_m_sum:
            parts.append("exact")
        if self.ids_dtype == torch.int64:
            parts.append("i64")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        return sum(ord(c) * (i + 1) for i, c in enumerate(self.id)) % (2**31)

    @property
    def global_experts(self) -> int:
        return self.experts if self.ep == "none" else 2 * self.experts


CASES = [
    Case(1, 256, 2, 4, 32),  # T=1: one token, grid of one program
    Case(5, 256, 2, 8, 64),  # T < alignment: every segment is mostly padding
    Case(40, 256, 3, 6, 32, "empty_first"),  # expert 0 gets nothing: segment 0 has length 0
    Case(40, 256, 3, 6, 32, "empty_middle"),  # an empty segment between two full ones
    Case(40, 256, 3, 6, 32, "empty_last"),  # the tail after the last live segment
    Case(70, 128, 2, 4, 32, "one_expert"),  # all slots on one expert; 70 not a multiple of 32
    Case(33, 256, 4, 5, 32, "invalid"),  # -1 slots, some tokens with no live slot at all
    Case(24, 256, 4, 3, 32, "duplicates"),  # one token hits the same expert twice
    Case(30, 256, 4, 4, 32, "random"),  # topk == E_l
    Case(48, 256, 2, 4, 32, ep="linear"),  # expert_map: global 4..7 local, 0..3 remote (-1)
    Case(48, 256, 3, 4, 32, ep="round_robin"),  # odd global ids local, even ones remote
    Case(48, 256, 3, 4, 32, "invalid", ep="round_robin"),  # -1 ids with a map: never mapped
    Case(50, 256, 2, 5, 64),  # alignment 64
    Case(50, 256, 2, 5, 96),  # alignment 96 (not a power of two; DG 2.6.1 on SM100)
    Case(50, 256, 2, 5, 128),  # alignment 128 (the SM90 default)
    Case(20, 2880, 2, 4, 32, scale="e8m0"),  # H=2880 (GPT-OSS): 90 groups, last word half pad
    Case(20, 2880, 2, 4, 32, scale="fp32", act_group=32),  # H=2880 with 90 fp32 scales
    Case(36, 512, 2, 6, 64, scale="e8m0"),  # MXFP8 packed scales, 16 groups = 4 full words
    Case(36, 384, 3, 4, 32, scale="fp32_colmajor"),  # strided fp32 scales are honoured
    Case(30, 256, 2, 3, 6, scale="e8m0"),  # m_sum 78: TMA stride round_up(m_sum, 4) = 80 != m_sum
    Case(40, 256, 3, 6, 32, "skew", exact_m_sum=True),  # exact m_sum (DeepEP HT)
    Case(40, 256, 3, 6, 32, "skew", exact_m_sum=True, ids_dtype=torch.int64),  # int64 ids (HT)
    Case(0, 256, 2, 4, 32),  # M=0: nothing routed, no kernel faults
    Case(12, 256, 2, 4, 32, "all_invalid", exact_m_sum=True),  # m_sum == 0 with M > 0
]


def _topk_ids(case: Case, g: torch.Generator) -> torch.Tensor:
    m, k, e = case.tokens, case.topk, case.global_experts
    if case.routing == "duplicates":
        ids = torch.randint(0, e, (m, k), generator=g)
        ids[0, 1] = ids[0, 0]
    elif case.routing == "one_expert":
        ids = torch.full((m, k), -1, dtype=torch.int64)
        ids[:, 0] = e - 2
    elif case.routing == "all_invalid":
        ids = torch.full((m, k), -1, dtype=torch.int64)
    else:
        # k distinct experts per token, as top-k routing gives.
        ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k]
        if case.routing == "skew":
            # About 60% of tokens put their first slot on expert 1 (unless they already have it).
            hot = (torch.rand(m, generator=g) < 0.6) & ~(ids == 1).any(1)
            ids[hot, 0] = 1
        banned = {"empty_first": 0, "empty_middle": e // 2, "empty_last": e - 1}.get(case.routing)
        if banned is not None:
            # Move the banned expert's slots to one the token does not already have.
            spare = torch.tensor([x for x in range(e) if x != banned])
            for t, j in (ids == banned).nonzero().tolist():
                free = [x for x in spare.tolist() if x not in ids[t].tolist()]
                ids[t, j] = free[0]
        if case.routing == "invalid":
            ids[torch.rand(m, k, generator=g) < 0.3] = -1
            ids[: min(m, 2)] = -1
    return ids.to(case.ids_dtype)


def _expert_map(case: Case) -> torch.Tensor | None:
    if case.ep == "none":
        return None
    e_g, e_l = case.global_experts, case.experts
    emap = torch.full((e_g,), -1, dtype=torch.int32)
    if case.ep == "linear":
        emap[e_l:] = torch.arange(e_l, dtype=torch.int32)
    else:
        emap[1::2] = torch.arange(e_l, dtype=torch.int32)
    return emap


def _scales(case: Case, g: torch.Generator) -> torch.Tensor:
    m, h = case.tokens, case.hidden
    if case.scale == "e8m0":
        return torch.randint(0, 256, (m, h // 32), generator=g, dtype=torch.uint8)
    s = torch.rand(m, h // case.act_group, generator=g) + 0.01
    if case.scale == "fp32_colmajor":
        s = s.t().contiguous().t()
    return s


@dataclass
class Run:
    case: Case
    a1q: torch.Tensor
    a1q_scale: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor | None
    counts: torch.Tensor
    m_sum: int
    plan: object
    out: Scattered


@functools.cache
def _run(case: Case) -> Run:
    g = torch.Generator().manual_seed(case.seed)
    topk_ids = _topk_ids(case, g)
    emap = _expert_map(case)
    # Every byte pattern, NaN codes included: the copy must not interpret them.
    a1q = torch.randint(0, 256, (case.tokens, case.hidden), generator=g, dtype=torch.uint8)
    a1q = a1q.view(torch.float8_e4m3fn)
    a1q_scale = _scales(case, g)
    counts = count_expert_tokens(topk_ids, case.experts, emap)
    golden_counts = permute_plan(topk_ids, case.experts, case.alignment, emap).counts
    m_sum = (
        aligned_m_sum_exact(golden_counts, case.alignment)
        if case.exact_m_sum
        else aligned_m_sum_upper_bound(case.tokens, case.topk, case.experts, case.alignment)
    )
    plan = permute_plan(topk_ids, case.experts, case.alignment, emap, m_sum=m_sum)
    out = ep_scatter(a1q, a1q_scale, topk_ids, counts, case.experts, case.alignment, m_sum, emap)
    return Run(case, a1q, a1q_scale, topk_ids, emap, counts, m_sum, plan, out)


def _live(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, rows) of every live slot, through the kernel's inv_perm."""
    inv_perm = run.out.inv_perm
    live = run.plan.inv_perm >= 0
    tokens = torch.arange(run.case.tokens).unsqueeze(1).expand_as(inv_perm)[live]
    return tokens, inv_perm[live].long()


ids = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)


@ids
def test_counts_match_golden(case: Case) -> None:
    run = _run(case)
    assert run.counts.dtype == torch.int32
    assert torch.equal(run.counts, run.plan.counts), (run.counts, run.plan.counts)


@ids
def test_m_indices_and_starts_exact(case: Case) -> None:
    run = _run(case)
    m_indices, expert_start = run.out.m_indices, run.out.expert_start
    assert m_indices.dtype == torch.int32 and m_indices.shape == (run.m_sum,)
    assert torch.equal(expert_start, run.plan.expert_start), (expert_start, run.plan.expert_start)
    bad = (m_indices != run.plan.m_indices).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{case.id}: m_indices differs at {bad.numel()} rows, first row {int(bad[0])}: kernel "
        f"{int(m_indices[bad[0]])}, golden {int(run.plan.m_indices[bad[0]])}"
    )


@ids
def test_expert_ends_exact_and_one_plan_with_m_indices(case: Case) -> None:
    """The psum layout: start_e + count_e per expert, the rows m_indices gives each expert."""
    run = _run(case)
    ends = run.out.expert_ends
    assert ends.dtype == torch.int32 and ends.shape == (case.experts,)
    assert torch.equal(ends, run.plan.expert_ends), (ends, run.plan.expert_ends)
    from_ends = m_indices_from_expert_ends(ends, run.m_sum, case.alignment)
    assert torch.equal(from_ends, run.out.m_indices)


@ids
def test_inv_perm_places_each_slot_in_its_segment(case: Case) -> None:
    run = _run(case)
    inv_perm = run.out.inv_perm
    m_indices = run.plan.m_indices
    assert inv_perm.dtype == torch.int32 and inv_perm.shape == run.topk_ids.shape
    live = run.plan.inv_perm >= 0
    # Skipped slots are -1 (vLLM leaves them uninitialised; ours are defined).
    assert torch.equal(inv_perm[~live], torch.full_like(inv_perm[~live], -1))
    rows = inv_perm[live].long()
    # Live rows form a permutation of the golden's live rows: each expert's row set is exactly
    # [start_e, start_e + count_e), whatever order the atomics chose inside it.
    assert torch.equal(rows.sort().values, run.plan.inv_perm[live].long().sort().values)
    # And each slot landed in its own expert's segment.
    assert torch.equal(m_indices[rows], m_indices[run.plan.inv_perm[live].long()])


@ids
def test_rows_copied_bitwise(case: Case) -> None:
    run = _run(case)
    a_perm = run.out.a_perm
    assert a_perm.dtype == torch.float8_e4m3fn and a_perm.shape == (run.m_sum, case.hidden)
    tokens, rows = _live(run)
    got = a_perm.view(torch.uint8)[rows]
    want = run.a1q.view(torch.uint8)[tokens]
    bad = (got != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{case.id}: {bad.numel()} live rows differ; first: token {int(tokens[bad[0]])} -> row "
        f"{int(rows[bad[0]])}"
    )
    # Padding rows are zero (our guarantee: vLLM leaves garbage that DeepGEMM then multiplies).
    pad = run.plan.m_indices < 0
    assert not a_perm.view(torch.uint8)[pad].any()


@ids
def test_scales_copied_bitwise(case: Case) -> None:
    run = _run(case)
    scale_perm = run.out.a_scale_perm
    tokens, rows = _live(run)
    pad = run.plan.m_indices < 0
    if case.scale == "e8m0":
        groups = case.hidden // 32
        words = -(-groups // 4)
        lead = -(-run.m_sum // 4) * 4
        assert scale_perm.dtype == torch.int32 and scale_perm.shape == (run.m_sum, words)
        assert scale_perm.stride() == (1, lead)
        # Whole int32 words against the golden packer, pad bytes (groups >= H/32) included.
        want = formats.pack_ue8m0(run.a1q_scale)
        assert torch.equal(scale_perm[rows], want[tokens])
        assert not scale_perm[pad].any()
        # The TMA tail rows m_sum..lead-1 of the storage are defined (zero) too.
        storage = scale_perm.as_strided((words, lead), (lead, 1))
        assert not storage[:, run.m_sum :].any()
        assert torch.equal(formats.unpack_ue8m0(scale_perm, groups)[rows], run.a1q_scale[tokens])
    else:
        groups = case.hidden // case.act_group
        assert scale_perm.dtype == torch.float32 and scale_perm.shape == (run.m_sum, groups)
        bits = scale_perm.view(torch.int32)
        assert torch.equal(bits[rows], run.a1q_scale.contiguous().view(torch.int32)[tokens])
        assert not bits[pad].any(), "padding rows must be exactly +0.0"


def test_hand_computed_layout() -> None:
    """Three tokens, three experts, alignment 4, worked out by hand (independent of the golden)."""
    topk_ids = torch.tensor([[0, 2], [2, -1], [1, 2]], dtype=torch.int32)
    counts = count_expert_tokens(topk_ids, 3)
    assert counts.tolist() == [1, 1, 3]
    # Upper bound: round_up(6 + min(6, 3) * 3, 4) = 16; segments 0..3, 4..7, 8..11, tail 12..15.
    m_sum = aligned_m_sum_upper_bound(3, 2, 3, 4)
    assert m_sum == 16
    a1q = torch.arange(3 * 128, dtype=torch.uint8).view(3, 128).view(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0], [2.0], [3.0]])
    out = ep_scatter(a1q, scale, topk_ids, counts, 3, 4, 16)
    inv_perm = out.inv_perm
    assert out.expert_start.tolist() == [0, 4, 8]
    assert out.m_indices.tolist() == [0, -1, -1, -1, 1, -1, -1, -1, 2, 2, 2, -1, -1, -1, -1, -1]
    assert inv_perm[0, 0] == 0 and inv_perm[2, 0] == 4 and inv_perm[1, 1] == -1
    # Expert 2's three slots fill rows 8..10 in whatever order the atomics chose.
    assert sorted(int(inv_perm[t, j]) for t, j in ((0, 1), (1, 0), (2, 1))) == [8, 9, 10]
    assert out.a_scale_perm[:, 0].tolist()[:5] == [1.0, 0.0, 0.0, 0.0, 3.0]
    assert torch.equal(out.a_perm.view(torch.uint8)[inv_perm[2, 1]], a1q.view(torch.uint8)[2])


@pytest.mark.parametrize("scale", ["fp32", "e8m0"])
def test_every_output_is_written_over_garbage_memory(scale: str, monkeypatch) -> None:
    """ep_scatter allocates its outputs uninitialised (no prefill launch): every m_indices and
    inv_perm entry, every start and end, and the scales of every row, dead rows and the TMA tail
    rows of the storage included, must be written by its kernels. Fresh allocations are filled
    with 0xFF here so an unwritten element cannot pass as a zero."""
    real_empty = torch.empty

    def garbage_empty(*args, **kwargs) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        t.view(-1).view(torch.uint8).fill_(0xFF)  # NaN as fp32, -1 as int32
        return t

    topk_ids = torch.tensor([[0, 2], [2, -1], [1, 2]], dtype=torch.int32)
    counts = count_expert_tokens(topk_ids, 3)
    a1q = torch.arange(3 * 128, dtype=torch.uint8).view(3, 128).view(torch.float8_e4m3fn)
    if scale == "fp32":
        a1q_scale = torch.tensor([[1.0], [2.0], [3.0]])
    else:
        a1q_scale = torch.tensor([[127, 128, 129, 130]] * 3, dtype=torch.uint8)
    m_sum = 14  # not a multiple of 4: the storage has two TMA tail rows
    monkeypatch.setattr(torch, "empty", garbage_empty)
    out = ep_scatter(a1q, a1q_scale, topk_ids, counts, 3, 2, m_sum)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert out.m_indices.tolist() == [0, -1, 1, -1, 2, 2, 2, -1, -1, -1, -1, -1, -1, -1]
    assert out.expert_start.tolist() == [0, 2, 4] and out.expert_ends.tolist() == [1, 3, 7]
    live = out.inv_perm[[0, 0, 1, 2, 2], [0, 1, 0, 0, 1]]
    assert out.inv_perm[1, 1] == -1 and bool((live >= 0).all())
    words = out.a_scale_perm.view(torch.int32) if scale == "fp32" else out.a_scale_perm
    dead = out.m_indices < 0
    assert bool((words[dead] == 0).all()), "dead rows' scales must be 0"
    storage = torch.as_strided(words, (words.shape[1], 16), (16, 1))
    assert bool((storage[:, m_sum:] == 0).all()), "the TMA tail rows of the storage must be 0"
    assert bool((words[~dead] != 0).all()), "live rows carry their token's scales"


@pytest.mark.parametrize(
    "tokens,topk,experts,alignment",
    [
        (0, 8, 32, 128),  # no tokens: m_sum 0
        (1, 8, 256, 128),  # fewer slots than experts: min(M*k, E_l) bounds the padding
        (4096, 8, 32, 128),  # DeepSeek-V3 EP8-local shape
        (7, 3, 5, 96),  # odd sizes, alignment 96
    ],
    ids=lambda v: str(v),
)
def test_m_sum_upper_bound_covers_every_routing(
    tokens: int, topk: int, experts: int, alignment: int
) -> None:
    bound = aligned_m_sum_upper_bound(tokens, topk, experts, alignment)
    slots = tokens * topk
    assert bound % alignment == 0
    assert bound == -(-(slots + min(slots, experts) * (alignment - 1)) // alignment) * alignment
    # The worst routing for the bound: slots spread so that as many experts as possible hold a
    # count of 1 mod A (each wastes A - 1 rows).
    worst = [0] * experts
    for i in range(slots):
        worst[i % experts] += 1
    assert aligned_m_sum_exact(worst, alignment) <= bound
    assert aligned_m_sum_exact([slots] + [0] * (experts - 1), alignment) <= bound


def test_m_sum_exact_counts() -> None:
    assert (
        aligned_m_sum_exact(torch.tensor([0, 1, 32, 33], dtype=torch.int32), 32) == 0 + 32 + 32 + 64
    )
    assert aligned_m_sum_exact([], 128) == 0


@pytest.mark.parametrize("zero", [True, False], ids=["zero_padding", "padding_left"])
def test_padding_rows_zeroed_only_when_asked(zero: bool) -> None:
    """zero_padding=False (the psum layout) leaves a_perm's padding rows as they were; the live
    rows, m_indices, inv_perm and every scale row (padding scales zeroed either way) are the
    same as with zero_padding=True."""
    topk_ids = torch.tensor([[0, 1], [1, -1], [0, 1]], dtype=torch.int32)
    counts = torch.tensor([2, 3], dtype=torch.int32)
    a1q = torch.full((3, 128), 2.0).to(torch.float8_e4m3fn)
    scale = torch.full((3, 1), 0.5)
    buf = torch.full((64, 128), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = ep_scatter(a1q, scale, topk_ids, counts, 2, 32, 64, a_perm_out=buf, zero_padding=zero)
    live = out.m_indices >= 0
    assert live.tolist() == [True] * 2 + [False] * 30 + [True] * 3 + [False] * 29
    rows = out.a_perm.view(torch.uint8)
    assert bool((rows[live] == a1q.view(torch.uint8)[0]).all())
    assert bool((rows[~live] == (0 if zero else 0x55)).all())
    assert out.a_scale_perm[live].flatten().tolist() == [0.5] * 5
    assert out.a_scale_perm[~live].abs().sum() == 0


def test_unvalidated_out_of_range_ids_are_skipped_not_written() -> None:
    """validate=False (graph capture) must stay memory-safe: an id past E_l is skipped."""
    topk_ids = torch.tensor([[0, 7], [1, -3]], dtype=torch.int32)
    counts = torch.tensor([1, 1], dtype=torch.int32)
    a1q = torch.ones(2, 128).to(torch.float8_e4m3fn)
    out = ep_scatter(a1q, torch.ones(2, 1), topk_ids, counts, 2, 32, 64, validate=False)
    assert out.inv_perm.tolist() == [[0, -1], [32, -1]]
    assert count_expert_tokens(topk_ids, 2, validate=False).tolist() == [1, 1]


def test_unvalidated_count_overflow_is_dropped() -> None:
    """Counts smaller than the routed slots (validate=False): claims past the segment are dropped,
    never written into the padding, the next segment or past m_sum."""
    topk_ids = torch.tensor([[0], [0], [0], [1]], dtype=torch.int32)
    counts = torch.tensor([1, 1], dtype=torch.int32)
    a1q = torch.full((4, 128), 2.0).to(torch.float8_e4m3fn)
    out = ep_scatter(a1q, torch.ones(4, 1), topk_ids, counts, 2, 32, 64, validate=False)
    a_perm, m_indices, inv_perm = out.a_perm, out.m_indices, out.inv_perm
    assert sorted(inv_perm[:3, 0].tolist()) == [-1, -1, 0]
    assert inv_perm[3, 0] == 32
    written = a_perm.view(torch.uint8).any(1).nonzero().flatten().tolist()
    assert written == [0, 32]
    assert m_indices.tolist() == [0] + [-1] * 31 + [1] + [-1] * 31


def test_unvalidated_segments_past_m_sum_stay_in_bounds() -> None:
    """Counts whose segments do not fit m_sum (validate=False): nothing is written past m_sum."""
    topk_ids = torch.tensor([[0], [1], [1]], dtype=torch.int32)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    a1q = torch.full((3, 128), 2.0).to(torch.float8_e4m3fn)
    # The exact sum is 64; m_sum 32 fits expert 0's segment only.
    out = ep_scatter(a1q, torch.ones(3, 1), topk_ids, counts, 2, 32, 32, validate=False)
    m_indices, inv_perm = out.m_indices, out.inv_perm
    assert m_indices.shape == (32,) and m_indices.tolist() == [0] + [-1] * 31
    assert inv_perm.flatten().tolist() == [0, -1, -1]


# ---------------------------------------------------------------------------------------------
# Bad inputs: each is refused before launch with a message naming the argument.


def _good() -> dict:
    topk_ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)
    return dict(
        a1q=torch.zeros(2, 128).to(torch.float8_e4m3fn),
        a1q_scale=torch.ones(2, 1),
        topk_ids=topk_ids,
        counts=torch.tensor([1, 2], dtype=torch.int32),
        num_local_experts=2,
        alignment=32,
        m_sum=64,
    )


BAD = [
    (
        "id-past-local-experts",
        dict(topk_ids=torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)),
        "topk_ids",
    ),
    (
        "id-below-minus-one",
        dict(topk_ids=torch.tensor([[0, -2], [1, 1]], dtype=torch.int32)),
        "topk_ids",
    ),
    ("unsigned-ids", dict(topk_ids=torch.tensor([[0, 1], [1, 1]], dtype=torch.uint8)), "topk_ids"),
    ("m_sum-not-aligned", dict(m_sum=48), "m_sum"),
    ("m_sum-too-small", dict(m_sum=32), "m_sum"),
    ("counts-disagree", dict(counts=torch.tensor([1, 1], dtype=torch.int32)), "counts"),
    ("counts-int64", dict(counts=torch.tensor([1, 2])), "counts"),
    ("scale-wrong-dtype", dict(a1q_scale=torch.ones(2, 1, dtype=torch.float16)), "a1q_scale"),
    ("scale-groups-do-not-divide-H", dict(a1q_scale=torch.ones(2, 3)), "a1q_scale"),
    ("e8m0-scale-wrong-shape", dict(a1q_scale=torch.ones(2, 3, dtype=torch.uint8)), "a1q_scale"),
    ("a1q-bf16", dict(a1q=torch.zeros(2, 128, dtype=torch.bfloat16)), "a1q"),
    ("a1q-strided-rows", dict(a1q=torch.zeros(128, 2).to(torch.float8_e4m3fn).t()), "a1q"),
]


@pytest.mark.parametrize("name,change,arg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name: str, change: dict, arg: str) -> None:
    kwargs = {**_good(), **change}
    with pytest.raises(ValueError, match=arg):
        ep_scatter(**kwargs)


def test_id_below_minus_one_with_a_map_is_refused() -> None:
    # vLLM maps every id except exactly -1, so -2 would index expert_map[-2].
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    topk_ids = torch.tensor([[1, -2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = -2"):
        count_expert_tokens(topk_ids, 2, emap)
    with pytest.raises(ValueError, match="topk_ids"):
        count_expert_tokens(torch.tensor([[4, 1]], dtype=torch.int32), 2, emap)


def test_expert_map_past_local_experts_is_refused() -> None:
    emap = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_map"):
        count_expert_tokens(torch.tensor([[1]], dtype=torch.int32), 2, emap)


def test_zero_padding_must_be_a_bool() -> None:
    """A string such as "no" is truthy: it would silently mean zeroing."""
    with pytest.raises(TypeError, match="zero_padding"):
        ep_scatter(**_good(), zero_padding="no")
