"""The batched low-latency layout (ep:N+ll): golden vs itself, reordered slots, and misplaced rows.

Comparison flattens each expert's [max_tokens, H] batch into one contiguous buffer and keys rows
by (token, k) through slot_expert * max_tokens + slot, so slot order inside a batch is free while
a slot in the wrong expert's batch fails at `dispatch`.
"""

from __future__ import annotations

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.spec import MoEProblem, Trace
from reference.moe import ReferenceBackend
from tolerance.compare import compare

pytestmark = pytest.mark.cpu

PROBLEM = MoEProblem(
    tokens=24, hidden=128, intermediate=128, num_experts=6, topk=2, topology="ep:2+ll"
)


@pytest.fixture(scope="module")
def golden_rank1() -> Trace:
    return ReferenceBackend().run(PROBLEM, make_inputs(PROBLEM, "cpu"), 1)


def _copy(trace: Trace, **changes: dict[str, object]) -> Trace:
    out = Trace("candidate", trace.rank)
    for stage, outs in trace.items():
        out.add(stage, {**outs, **changes.get(stage, {})})
    return out


def test_golden_against_itself_passes(golden_rank1: Trace) -> None:
    results = compare(golden_rank1, _copy(golden_rank1), PROBLEM, mode="chained")
    assert [r.status for r in results] == ["pass"] * 7


def test_reordered_slots_inside_a_batch_pass(golden_rank1: Trace) -> None:
    d = golden_rank1["dispatch"]
    e = int(torch.argmax(d["masked_m"]))
    slot = d["slot"].clone()
    live = (d["slot_expert"] == e).nonzero()
    (t0, k0), (t1, k1) = live[0].tolist(), live[1].tolist()
    slot[t0, k0], slot[t1, k1] = slot[t1, k1].item(), slot[t0, k0].item()
    a = d["a_batched"].view(torch.uint8).clone()
    s0, s1 = int(d["slot"][t0, k0]), int(d["slot"][t1, k1])
    a[e, [s0, s1]] = a[e, [s1, s0]]
    sc = d["a_scale_batched"].clone()
    sc[e, [s0, s1]] = sc[e, [s1, s0]]
    moved = {"slot": slot, "a_batched": a.view(torch.float8_e4m3fn), "a_scale_batched": sc}
    other = _copy(golden_rank1, dispatch=moved)
    result = compare(golden_rank1, other, PROBLEM, ["dispatch"])[0]
    assert result.status == "pass", [c for c in result.checks if not c.passed]


def test_slot_in_the_wrong_expert_batch_fails_at_dispatch(golden_rank1: Trace) -> None:
    d = golden_rank1["dispatch"]
    expert = d["slot_expert"].clone()
    t, k = (expert >= 0).nonzero()[0].tolist()
    expert[t, k] = (expert[t, k] + 1) % d["masked_m"].numel()
    result = compare(
        golden_rank1, _copy(golden_rank1, dispatch={"slot_expert": expert}), PROBLEM, ["dispatch"]
    )[0]
    assert result.status == "fail"
    failed = {c.name for c in result.checks if not c.passed}
    assert failed & {"expert rows", "inv_perm", "a_perm rows"}


def test_ll_takes_packed_scales_and_rejects_other_recipes() -> None:
    """The batches carry packed UE8M0 words as the contiguous layout does
    (tests/run/test_masked_layout.py runs them); the masked GEMM is fp8_block only."""
    assert PROBLEM.replace(scale_fmt="ue8m0_packed").batched
    with pytest.raises(ValueError, match="ep\\+ll \\(topology .*\\) supports recipe fp8_block"):
        PROBLEM.replace(recipe="mxfp8", scale_fmt="ue8m0_packed")
